"""Terminal primitives of the base band: the consoles, worker text made safe to show, tables
fitted to the terminal, lines folded by their fields. Pure of tpufab's steps: any band may use
them."""
