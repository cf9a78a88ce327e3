"""CUDA graphs for decode batches: static buffers per batch size, replayed with padding."""

from __future__ import annotations

import logging

import torch

from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model, backend, max_bs: int, context_len: int, device):
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        z = lambda: torch.zeros(max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices = z(), z(), z(), z()
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        # Logit rows of a decode batch: one per request. A graph reads every tensor at the address it
        # had at capture, so this must outlive the capture (a per-size temporary would be freed and
        # its memory reused, and replay would gather with whatever lies there).
        self.rows = torch.arange(max_bs, device=device)
        backend.decode_ctx = context_len  # fixed gather width so shapes are static
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its memory
            fb = self._batch(bs)
            rows = self.rows[:bs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model(fb, backend, rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = model(fb, backend, rows)
            self.graphs[bs] = graph
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            extend_lens=[1] * bs, seq_lens_cpu=[1] * bs,
        )

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        n = fb.batch_size
        bs = next(s for s in self.sizes if s >= n)
        # Padding rows write to KV slot 0, which no request owns.
        self.input_ids[:bs].zero_(); self.out_cache_loc[:bs].zero_(); self.positions[:bs].zero_()  # noqa: E702
        self.req_pool_indices[:bs].zero_(); self.seq_lens[:bs].fill_(1)  # noqa: E702
        self.input_ids[:n].copy_(fb.input_ids); self.positions[:n].copy_(fb.positions)  # noqa: E702
        self.out_cache_loc[:n].copy_(fb.out_cache_loc); self.req_pool_indices[:n].copy_(fb.req_pool_indices)  # noqa: E702
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
