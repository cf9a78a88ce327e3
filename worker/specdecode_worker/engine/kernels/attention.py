"""Torch-native attention over the paged KV pool (CPU and CUDA).

Each layer stores the new tokens' K/V at their slots, then attends over the request's slots read
through ``req_to_token``. Extend batches (prefill, verification) loop over requests; pure decode
batches gather a padded ``[B, ctx]`` block so the same code can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..forward_batch import ForwardBatch, pack_to_device
from ..memory.mla_pool import MLATokenToKVPool
from ..memory.pools import MHATokenToKVPool, ReqToTokenPool

log = logging.getLogger(__name__)

# auto: Triton kernels on CUDA devices, torch-native on CPU. torch_native forces the reference path
# (also on CUDA); triton on CPU needs TRITON_INTERPRET=1 (exact but very slow: for tests only).
ATTENTION_BACKEND_ENV = "SPECDECODE_ATTENTION_BACKEND"
ATTENTION_BACKENDS = ("auto", "triton", "torch_native")


def attention_backend_name(device: torch.device | str) -> str:
    """The backend this process uses on ``device``: 'triton' or 'torch_native'."""
    device = torch.device(device)
    choice = os.environ.get(ATTENTION_BACKEND_ENV, "auto") or "auto"
    if choice not in ATTENTION_BACKENDS:
        raise InputError(f"{ATTENTION_BACKEND_ENV}={choice!r} is not supported; "
                         f"use one of {', '.join(ATTENTION_BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InputError(f"{ATTENTION_BACKEND_ENV}=triton on {device.type} needs TRITON_INTERPRET=1 (slow, for "
                         "tests); unset it to serve with the torch-native backend")
    return choice


def triton_serves_kv(kv_dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Can the Triton kernels read a KV pool of this dtype on a GPU of this compute capability?
    Not e4m3 before sm_89: Triton has no e4m3 type there (e5m2 is widened by a byte shift)."""
    return not (kv_dtype == torch.float8_e4m3fn and capability < (8, 9))


def use_triton(req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool) -> bool:
    """The Triton backend for these pools? Not for a pool the kernels cannot read on this GPU
    (``triton_serves_kv``): those keep the torch-native path, with a log line."""
    device = req_to_token_pool.req_to_token.device
    if attention_backend_name(device) != "triton":
        return False
    if device.type == "cuda" and not triton_serves_kv(kv_pool.dtype, torch.cuda.get_device_capability(device)):
        log.warning("fp8_e4m3 KV cache on a GPU before sm_89: attention runs on the torch-native backend")
        return False
    return True


def make_attn_backend(req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, sliding_window: int | None):
    """Decode and extend attention over these pools, on the backend chosen for their device (an MLA
    latent pool gets the MLA kernels; the torch-native path reads it as one shared KV head)."""
    if use_triton(req_to_token_pool, kv_pool):
        if isinstance(kv_pool, MLATokenToKVPool):
            from .triton_mla import TritonMLABackend

            return TritonMLABackend(req_to_token_pool, kv_pool)
        from .triton_backend import TritonAttnBackend  # imports triton: only where it runs

        return TritonAttnBackend(req_to_token_pool, kv_pool, sliding_window)
    return TorchNativeAttnBackend(req_to_token_pool, kv_pool, sliding_window)


# Score elements (requests x heads x queries x keys) up to which a half-precision CPU batch attends
# as two matrix products: 8 MiB of half-precision scores at most, however long the prompts.
GROUPED_PRODUCTS_MAX_SCORES = 4 << 20


def grouped_products_serve(q: torch.Tensor, batch: int, queries: int, keys: int) -> bool:
    """Two or more requests in half precision on CPU, where torch's fused attention kernel is slow
    per request and head (at 8 requests of 64 to 2048 keys in bf16, 3-4x the two products' time,
    docs/benchmarks.md). One request, float32 and CUDA keep ``scaled_dot_product_attention``, which
    measured faster there."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and batch >= 2
            and batch * q.shape[-2] * queries * keys <= GROUPED_PRODUCTS_MAX_SCORES)


def grouped_products(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, blocked: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Attention as two batched matrix products: q [B, n, H, D] over keys, vals [B, S, Hkv, D],
    with ``blocked`` [B, 1, 1, n, S] True where a query may not see a key (``GroupedBatch``);
    returns [B, n, H, Dv]. Each KV head's group of query heads is one product, so no KV head is
    repeated. Scores and probabilities stay in q's dtype, as the products round them anyway; the
    softmax accumulates in float32 inside."""
    b, n, h, d = q.shape
    kv_heads, s = keys.shape[2], keys.shape[1]
    group = h // kv_heads
    rows = (q * scaling).view(b, n, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * n, d)
    keys, vals = keys.transpose(1, 2).contiguous(), vals.transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    scores = torch.matmul(rows, keys.transpose(-1, -2))  # [B, Hkv, G*n, S]
    scores = scores.view(b, kv_heads, group, n, s).masked_fill_(blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * n, s)
    out = torch.matmul(probs, vals)  # [B, Hkv, G*n, Dv]
    return out.view(b, kv_heads, group, n, -1).permute(0, 3, 1, 2, 4).reshape(b, n, h, -1)


def gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]`` through ``index_select``: the same rows, 4x faster than advanced indexing on CPU."""
    return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])


def attend_slots(q: torch.Tensor, k_buf, v_buf, slots: torch.Tensor, mask: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """One request's queries [n, H, D] over the K/V stored at ``slots``; returns [n, H, Dv].

    K/V are upcast to q's dtype (the pool may be fp8); grouped queries read their KV head in place
    (``enable_gqa``), with no repeated copy of it.
    """
    keys = gather(k_buf, slots).to(q.dtype)  # [S, Hkv, D]
    vals = gather(v_buf, slots).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask, scale=scaling,
        enable_gqa=True,
    )
    return o.transpose(0, 1)


@dataclass(frozen=True)
class GroupedBatch:
    """A batch laid out for ``grouped_products``, made once and read by every layer: queries in a
    ``[B, queries]`` block (a request with fewer repeats its last one; those rows are dropped),
    keys in a ``[B, keys]`` block of slots (slot 0 pads), and what each query may not see."""

    queries: int  # the most new tokens of any request
    slots: torch.Tensor  # [B, keys]
    blocked: torch.Tensor  # [B, 1, 1, queries, keys]
    padded_rows: torch.Tensor | None  # [B * queries] the flattened token each block row reads; None: decode
    real_rows: torch.Tensor | None  # [N] the block row of each flattened token, in order

    @staticmethod
    def of(fb: ForwardBatch, req_to_token: torch.Tensor, sliding_window: int | None) -> "GroupedBatch":
        n, keys = max(fb.extend_lens), max(fb.seq_lens_cpu)
        padded_rows = real_rows = None
        if fb.is_decode:
            q_pos = (fb.seq_lens - 1)[:, None]  # [B, 1]
        else:
            padded, real, start = [], [], 0
            for b, count in enumerate(fb.extend_lens):
                padded += [start + min(j, count - 1) for j in range(n)]
                real += [b * n + j for j in range(count)]
                start += count
            padded_rows, real_rows = pack_to_device([padded, real], fb.positions.device)
            q_pos = fb.positions.index_select(0, padded_rows).view(len(fb.extend_lens), n)
        k_pos = torch.arange(keys, device=q_pos.device)
        blocked = k_pos[None, None, :] > q_pos[:, :, None]  # causal, and so below each request's length
        if sliding_window is not None:
            blocked |= k_pos[None, None, :] <= q_pos[:, :, None] - sliding_window
        slots = req_to_token[fb.req_pool_indices, :keys]
        return GroupedBatch(n, slots, blocked[:, None, None], padded_rows, real_rows)


class TorchNativeAttnBackend:
    # Decode gathers a [batch, width] block of K/V: under a CUDA graph the width is fixed at the
    # context length (``decode_ctx``), so a graph of varying-length verify passes cannot take it.
    fixed_width_under_graphs = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, sliding_window: int | None):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.sliding_window = sliding_window
        # Decode gathers this many positions per request; a CUDA graph fixes it at context_len.
        self.decode_ctx: int | None = None
        self._grouped, self._grouped_for = None, None  # the batch's GroupedBatch, made once per batch

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] for the new tokens; returns [N, H, Dv]."""
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)  # cast to the pool's dtype (fp8: scale 1.0)
        # Buffers may be fp8: the gathered K/V are upcast to q's dtype before any arithmetic.
        k_buf = self.kv_pool.k_buffer[layer_id]
        v_buf = self.kv_pool.v_buffer[layer_id]
        if self.decode_ctx is None and grouped_products_serve(q, fb.batch_size, max(fb.extend_lens),
                                                              max(fb.seq_lens_cpu)):
            return self._grouped_pass(q, k_buf, v_buf, fb, scaling)
        if fb.is_decode:
            return self._decode(q, k_buf, v_buf, fb, scaling)
        return self._extend(q, k_buf, v_buf, fb, scaling)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        allowed = k_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return allowed

    def _extend(self, q, k_buf, v_buf, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1], v_buf.shape[-1], dtype=q.dtype, device=q.device)
        start = 0
        for i, n in enumerate(fb.extend_lens):
            seq_len = fb.seq_lens_cpu[i]
            slots = self.req_to_token[fb.req_pool_indices[i], :seq_len]
            mask = self._mask(fb.positions[start : start + n], torch.arange(seq_len, device=q.device))
            out[start : start + n] = attend_slots(q[start : start + n], k_buf, v_buf, slots, mask, scaling)
            start += n
        return out

    def _grouped_pass(self, q, k_buf, v_buf, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        """Every request of the batch in one pass of ``grouped_products``."""
        if self._grouped_for is not fb:
            self._grouped, self._grouped_for = GroupedBatch.of(fb, self.req_to_token, self.sliding_window), fb
        g = self._grouped
        keys = gather(k_buf, g.slots).to(q.dtype)  # [B, S, Hkv, D]
        vals = gather(v_buf, g.slots).to(q.dtype)
        if g.padded_rows is None:  # decode: one row per request
            return grouped_products(q[:, None], keys, vals, g.blocked, scaling)[:, 0]
        rows = q.index_select(0, g.padded_rows).view(fb.batch_size, g.queries, *q.shape[1:])
        out = grouped_products(rows, keys, vals, g.blocked, scaling)  # [B, n, H, Dv]
        return out.reshape(-1, *out.shape[2:]).index_select(0, g.real_rows)

    def _decode(self, q, k_buf, v_buf, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        ctx = self.decode_ctx or max(fb.seq_lens_cpu)
        slots = self.req_to_token[fb.req_pool_indices, :ctx]  # [B, ctx]; slot 0 pads
        keys = gather(k_buf, slots).to(q.dtype)  # [B, ctx, Hkv, D]: grouped queries read them in place
        vals = gather(v_buf, slots).to(q.dtype)
        k_pos = torch.arange(ctx, device=q.device)
        allowed = k_pos[None, :] < fb.seq_lens[:, None]  # [B, ctx]
        if self.sliding_window is not None:
            allowed &= k_pos[None, :] > (fb.seq_lens[:, None] - 1 - self.sliding_window)
        o = F.scaled_dot_product_attention(
            q[:, None].transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=allowed[:, None, None, :], scale=scaling, enable_gqa=True,
        )  # [B, H, 1, Dv]
        return o[:, :, 0]
