"""How one command runs on one worker's connection: a frame on the agent's channel
(agent_protocol) or, for a one-shot command on a fresh connection, a plain exec channel
(oneshot)."""
