"""trajectory-replay: capture one async RL training step into a verifiable bundle and replay it offline."""

__version__ = "0.1.0"
