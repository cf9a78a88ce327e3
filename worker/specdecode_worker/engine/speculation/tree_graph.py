"""Static buffers for tree passes (EAGLE draft-tree steps and tree verification) under CUDA graphs.

A deployment's tree shape is fixed, so a tree batch of ``bs`` requests has static shapes: n new
tokens and E extra KV slots per request, an ``[bs, n, E]`` mask. ``TreeGraphInputs`` adds those
buffers to ``GraphInputs``; staging copies a batch's prefix lengths, slots, positions and mask
into them on the device before a replay, and the kernels read them from there.
"""

from __future__ import annotations

import torch

from ..cuda_graph import GraphInputs
from ..forward_batch import ForwardBatch
from ..kernels.tree_attention import TreeForwardBatch


class TreeGraphInputs(GraphInputs):
    """``GraphInputs`` for up to ``max_bs`` requests of ``tokens_per_req`` tree tokens that see
    ``key_width`` extra slots each."""

    def __init__(self, max_bs: int, tokens_per_req: int, key_width: int, device):
        super().__init__(max_bs, tokens_per_req, device)
        self.key_width = key_width
        z = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        self.prefix_lens, self.key_slots = z(max_bs), z(max_bs, key_width)
        # A padding request has no prefix and its token i (at position i) sees only key i, in KV
        # slot 0 at position i, so its rows stay finite on every backend and under any window.
        self._pad_key_positions = torch.arange(key_width, device=device).repeat(max_bs, 1)
        self.key_positions = self._pad_key_positions.clone()
        n = min(tokens_per_req, key_width)
        self._pad_mask = torch.zeros(max_bs, tokens_per_req, key_width, dtype=torch.int8, device=device)
        self._pad_mask[:, torch.arange(n), torch.arange(n)] = 1
        self.mask = self._pad_mask.clone()

    def _make_batch(self, bs: int) -> TreeForwardBatch:
        base = super()._make_batch(bs)
        return TreeForwardBatch(
            **{name: getattr(base, name) for name in ForwardBatch.__dataclass_fields__},
            prefix_lens=self.prefix_lens[:bs], key_slots=self.key_slots[:bs],
            key_positions=self.key_positions[:bs], mask=self.mask[:bs], prefix_lens_cpu=[0] * bs,
        )

    def accepts(self, fb: ForwardBatch) -> bool:
        return (isinstance(fb, TreeForwardBatch) and fb.batch_size <= self.max_bs
                and tuple(fb.mask.shape[1:]) == (self.tokens_per_req, self.key_width))

    def stage(self, fb: TreeForwardBatch, bs: int) -> None:
        super().stage(fb, bs)
        real = fb.batch_size
        self.prefix_lens[:real].copy_(fb.prefix_lens)
        self.key_slots[:real].copy_(fb.key_slots)
        self.key_positions[:real].copy_(fb.key_positions)
        self.mask[:real].copy_(fb.mask)
        self.prefix_lens[real:bs].zero_()
        self.key_slots[real:bs].zero_()
        self.key_positions[real:bs].copy_(self._pad_key_positions[real:bs])
        self.mask[real:bs].copy_(self._pad_mask[real:bs])
        if bs in self._batches:
            self._batches[bs].prefix_lens_cpu[:] = list(fb.prefix_lens_cpu) + [0] * (bs - real)
