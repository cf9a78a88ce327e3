"""Attention with an explicit mask over paged pools, for draft trees.

Each request's new tokens see its committed prefix (positions ``0 .. prefix_len - 1`` read through
``req_to_token``) and a row of extra KV slots (tree nodes, including the new tokens themselves)
under a mask. Tree nodes live in slots outside the request's linear position map until a path is
accepted, so several branches can share a depth.

A deployment's tree has one shape, so every request of a batch brings the same number of new
tokens and of extra slots: the batch's tree fields are ``[B, ...]`` device tensors that a CUDA
graph's static buffers hold as they are (``tree_graph.TreeGraphInputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..forward_batch import ForwardBatch
from ..memory.pools import MHATokenToKVPool, ReqToTokenPool
from .attention import attend_slots, use_triton


@dataclass
class TreeForwardBatch(ForwardBatch):
    """``extend_lens`` are all n; E extra slots per request."""


    prefix_lens: torch.Tensor | None = None  # [B] committed positions each request sees causally
    key_slots: torch.Tensor | None = None  # [B, E] KV slots beyond the prefix
    key_positions: torch.Tensor | None = None  # [B, E] their positions
    mask: torch.Tensor | None = None  # [B, n, E] int8, nonzero: the token sees the slot
    prefix_lens_cpu: list[int] = field(default_factory=list)  # for the torch-native loop

    @property
    def is_tree(self) -> bool:
        return True


class TreeAttnBackend:
    fixed_width_under_graphs = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, sliding_window: int | None):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.sliding_window = sliding_window

    def forward(self, q, k, v, layer_id: int, fb: TreeForwardBatch, scaling: float) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        out = torch.empty(q.shape[0], q.shape[1], v_buf.shape[-1], dtype=q.dtype, device=q.device)
        start = 0
        for i, n in enumerate(fb.extend_lens):
            p = fb.prefix_lens_cpu[i]
            slots = torch.cat([self.req_to_token[fb.req_pool_indices[i], :p], fb.key_slots[i]])
            mask = torch.cat([torch.ones((n, p), dtype=torch.bool, device=q.device), fb.mask[i] != 0], dim=1)
            if self.sliding_window is not None:
                k_pos = torch.cat([torch.arange(p, device=q.device), fb.key_positions[i]])
                q_pos = fb.positions[start : start + n]
                mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
            out[start : start + n] = attend_slots(q[start : start + n], k_buf, v_buf, slots, mask, scaling)
            start += n
        return out


def make_tree_attn_backend(req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, sliding_window: int | None):
    """Tree-masked attention on the backend chosen for the pools' device (Triton serves both kinds)."""
    if use_triton(req_to_token_pool, kv_pool):
        from .triton_backend import TritonAttnBackend

        return TritonAttnBackend(req_to_token_pool, kv_pool, sliding_window)
    return TreeAttnBackend(req_to_token_pool, kv_pool, sliding_window)
