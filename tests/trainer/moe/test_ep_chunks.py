"""The chunked all-to-all's joins (`ep_comm.join_chunks`, `split_chunks`): no copy when the chunks landed in one
buffer in order, a plain concatenation otherwise, and autograd through both.

The transfers themselves (`all_to_all_start` / `all_to_all_wait`, 2 gloo ranks, and NCCL on 2 GPUs inside a
CUDA graph) run in tests/trainer/distributed/test_dist_ep.py and tests/trainer/graphs/test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import torch

from trainer.moe.ep_comm import Landing, join_chunks, split_chunks

ROWS, D, N = 3, 4, 2


def _landed(landing: Landing) -> list[torch.Tensor]:
    like = torch.zeros(1, D)
    blocks = [landing.block(i, like, ROWS) for i in range(N)]
    for i, b in enumerate(blocks):
        b.copy_(torch.full((ROWS, D), float(i + 1)))
    return blocks


def test_landed_blocks_join_without_a_copy_and_split_their_grad() -> None:
    landing = Landing(N)
    blocks = [b.requires_grad_(True) for b in _landed(landing)]
    joined = join_chunks(blocks, landing)
    assert joined.data_ptr() == landing.buf.data_ptr()  # the buffer itself: no copy
    assert torch.equal(joined, torch.cat([b.detach() for b in blocks]))
    (joined * torch.arange(N * ROWS, dtype=torch.float32)[:, None]).sum().backward()
    assert torch.equal(blocks[1].grad[:, 0], torch.arange(ROWS, 2 * ROWS, dtype=torch.float32))


def test_blocks_elsewhere_or_out_of_order_are_concatenated() -> None:
    landing = Landing(N)
    blocks = _landed(landing)
    assert not landing.holds(blocks[::-1]) and not landing.holds(blocks[:1])
    swapped = join_chunks(blocks[::-1], landing)
    assert swapped.data_ptr() != landing.buf.data_ptr() and torch.equal(swapped[:ROWS], blocks[1])
    assert not Landing(N).holds(blocks)  # another landing's blocks


def test_split_backward_takes_landed_grads_whole_else_concatenates() -> None:
    x = torch.randn(N * ROWS, D, requires_grad=True)
    landing = Landing(N)
    grads = _landed(landing)
    parts = split_chunks(x, N, landing)
    assert [p.shape[0] for p in parts] == [ROWS] * N
    seen: list[int] = []
    x.register_hook(lambda g: seen.append(g.data_ptr()))  # the grad as it arrives, before x.grad takes it
    torch.autograd.backward(parts, grads)
    assert seen == [landing.buf.data_ptr()]  # the landing's buffer itself: no concatenation
    assert torch.equal(x.grad, torch.cat(grads))
    x.grad = None
    parts = split_chunks(x, N, Landing(N))  # grads not landed there: a concatenation, a missing one as zeros
    torch.autograd.backward(parts[1:], grads[1:])
    assert torch.equal(x.grad, torch.cat([torch.zeros(ROWS, D), grads[1]]))


def test_a_split_lets_its_landing_go_in_the_backward() -> None:
    """Autograd keeps a node's ctx until the graph dies: a landing held there would keep a buffer of every
    layer's rows alive through the whole backward (the tickets' release: tests/trainer/distributed/
    test_dist_ep.py, `chunk-buffers-alive`)."""
    x = torch.randn(N * ROWS, D, requires_grad=True)
    landing = Landing(N)
    parts = split_chunks(x, N, landing)
    assert parts[0].grad_fn.landing is landing
    torch.autograd.backward(parts, _landed(landing))
    assert parts[0].grad_fn.landing is None
