"""Torch-native attention over the paged KV pool (CPU and CUDA).

Each layer stores the new tokens' K/V at their slots, then attends over the request's slots read
through ``req_to_token``. Extend batches (prefill, verification) loop over requests; pure decode
batches gather a padded ``[B, ctx]`` block so the same code can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..forward_batch import ForwardBatch
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


def attend_slots(q: torch.Tensor, k_buf, v_buf, slots: torch.Tensor, mask: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """One request's queries [n, H, D] over the K/V stored at ``slots``; returns [n, H, Dv].

    K/V are upcast to q's dtype (the pool may be fp8); grouped queries read their KV head in place
    (``enable_gqa``), with no repeated copy of it.
    """
    keys = k_buf[slots].to(q.dtype)  # [S, Hkv, D]
    vals = v_buf[slots].to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask, scale=scaling,
        enable_gqa=True,
    )
    return o.transpose(0, 1)


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

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] for the new tokens; returns [N, H, Dv]."""
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)  # cast to the pool's dtype (fp8: scale 1.0)
        # Buffers may be fp8: the gathered K/V are upcast to q's dtype before any arithmetic.
        k_buf = self.kv_pool.k_buffer[layer_id]
        v_buf = self.kv_pool.v_buffer[layer_id]
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

    def _decode(self, q, k_buf, v_buf, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        ctx = self.decode_ctx or max(fb.seq_lens_cpu)
        slots = self.req_to_token[fb.req_pool_indices, :ctx]  # [B, ctx]; slot 0 pads
        keys = k_buf[slots].to(q.dtype)  # [B, ctx, Hkv, D]: grouped queries read them in place
        vals = v_buf[slots].to(q.dtype)
        k_pos = torch.arange(ctx, device=q.device)
        allowed = k_pos[None, :] < fb.seq_lens[:, None]  # [B, ctx]
        if self.sliding_window is not None:
            allowed &= k_pos[None, :] > (fb.seq_lens[:, None] - 1 - self.sliding_window)
        o = F.scaled_dot_product_attention(
            q[:, None].transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=allowed[:, None, None, :], scale=scaling, enable_gqa=True,
        )  # [B, H, 1, Dv]
        return o[:, :, 0]
