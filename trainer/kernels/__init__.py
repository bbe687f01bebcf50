"""Kernels of the expert MLP: Triton on CUDA, each with a pure-torch reference used on CPU and in tests.

Nothing here imports Triton at import time: `glu_triton` is imported lazily on CUDA only.
"""
