"""CUDA graphs in training (`train.cuda_graph`): one micro-batch's forward and backward captured once and
replayed for every later micro-batch (`capture.py`), over quantized weights pinned at fixed addresses and
refreshed outside the graph before each step (`static_weights.py`)."""

from trainer.graphs.capture import GraphCaptureError, MicroBatchGraph, wants_cuda_graph
from trainer.graphs.static_weights import StaticWeights

__all__ = ["GraphCaptureError", "MicroBatchGraph", "StaticWeights", "wants_cuda_graph"]
