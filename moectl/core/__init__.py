"""The torch-free base every layer stands on: the typed config and its loader, the rule catalogue, errors,
the hardware table and the facts several layers share. Imports nothing above it (no torch, trainer, ckpt,
Rich or Typer); PyYAML only in `config/load.py` (and lazily when a run writes its config)."""
