"""The Typer CLI: thin commands over the `trainer` and `ckpt` libraries."""
