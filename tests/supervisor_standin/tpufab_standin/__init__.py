"""A stand-in supervisor service for tests (see ../pyproject.toml)."""
