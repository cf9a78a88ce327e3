"""What the Triton kernel tests share: on a GPU the kernels run compiled; without one they run under
Triton's interpreter, which must be on before triton is first imported (tests/conftest.py turns it
on for the whole session; this covers a file run without it)."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the Triton kernel tests could turn on its interpreter; "
                           "run them in their own pytest process")
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
# fp8 e4m3 has a Triton type from sm_89 on (the interpreter has it everywhere)
E4M3_ON_DEVICE = not CUDA or torch.cuda.get_device_capability() >= (8, 9)


def paged_batch(req_pool, seq_lens: list[int], extend_lens: list[int], reqs: list[int]):
    """A ForwardBatch of ``extend_lens[i]`` new tokens ending at ``seq_lens[i]`` for request ``reqs[i]``,
    its K/V written to the slots ``req_pool`` maps those positions to."""
    from specdecode_worker.engine.forward_batch import ForwardBatch

    positions, locs = [], []
    for r, s, n in zip(reqs, seq_lens, extend_lens):
        positions += list(range(s - n, s))
        locs.append(req_pool.req_to_token[r, s - n : s])
    return ForwardBatch(
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE), out_cache_loc=torch.cat(locs),
        req_pool_indices=torch.tensor(reqs, device=DEVICE), seq_lens=torch.tensor(seq_lens, device=DEVICE),
        extend_lens=extend_lens, seq_lens_cpu=seq_lens,
    )


def poison_dead_slots(req_pool, reqs: list[int], seq_lens: list[int], *buffers) -> None:
    """NaN in every row of ``buffers`` (K/V pools by slot) outside request ``reqs[i]``'s first
    ``seq_lens[i]`` positions: a kernel that reads a dead slot shows NaN."""
    live = torch.cat([req_pool.req_to_token[r, :s] for r, s in zip(reqs, seq_lens)])
    dead = torch.ones(buffers[0].shape[0], dtype=torch.bool, device=DEVICE)
    dead[live] = False
    for buf in buffers:
        buf[dead] = float("nan")


def assert_capture_makes_its_own_metadata(monkeypatch, kernels, kernel: str, q_start_arg: int, backend,
                                          q, k, v, fb, scale: float) -> None:
    """A graph runner warms its static batch up, then captures it: the capture must not reuse the
    warm-up's metadata tensors (freed once another batch replaces them, while the graph reads their
    addresses at every replay). ``kernels.<kernel>`` is spied on for its ``q_start`` argument
    (position ``q_start_arg``); the capture is simulated: the stream reports capturing."""
    from specdecode_worker.engine.kernels import triton_backend as tb

    seen, real = [], getattr(kernels, kernel)
    monkeypatch.setattr(kernels, kernel, lambda *a, **kw: seen.append(a[q_start_arg]) or real(*a, **kw))
    warm = backend.forward(q, k, v, 0, fb, scale)
    backend.forward(q, k, v, 0, fb, scale)  # every layer of one pass reuses the batch's metadata
    monkeypatch.setattr(tb, "stream_capturing", lambda device: True)
    captured = backend.forward(q, k, v, 0, fb, scale)
    assert seen[0] is seen[1]
    assert seen[2] is not seen[0], "the capture read the warm-up's metadata tensors"
    torch.testing.assert_close(captured, warm)
