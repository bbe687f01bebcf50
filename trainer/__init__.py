"""The training engine: model, MoE, kernels, precision, distributed buffers and optimizers, loop, data.

Importable without the CLI. The model code is written for one device; `trainer.distributed` wraps it.
"""
