"""moectl: train mixture-of-experts transformers and manage their checkpoints."""

__version__ = "0.1.0"
