"""Triton kernels for multi-head latent attention (MLA) over the latent pool (``mla_pool.py``).

Queries arrive absorbed into latent space (``models/deepseek_v3.py``): per head ``kv_lora_rank``
latent values (q_nope @ W_UK) then ``qk_rope_head_dim`` rotated values. Every head attends over the
same single "KV head": the pool's row ``[c_kv | k_rope]`` is the key and its first
``kv_lora_rank`` columns the value. So a program serves a block of query heads (decode) or of
(query token, head) rows (extend), and each latent row is loaded once per program and used as key
and value from registers; fp8 rows are upcast after the load.

- Decode: split-KV over each request's live positions, read through ``req_to_token`` up to
  ``seq_lens`` (grid: batch x head blocks x splits), combined by log-sum-exp with the reduce
  kernel of ``triton_attention.py``. Slots are 64-bit, as there (slot x row stride passes 2**31).
- Extend: prefill over a prefix and chain verification (k + 1 tokens) for the whole batch in one
  launch, causally; a program takes a block of one request's (token, head) rows.

CUDA-graph rules, as in ``triton_attention.py``: the grid depends on the batch size (and, for
extend, on the tokens per request) only, loop bounds come from ``seq_lens`` inside the kernels,
and nothing syncs with the host. The torch-native backend (``attention.py``) is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..forward_batch import ForwardBatch
from ..memory.mla_pool import MLATokenToKVPool
from ..memory.pools import ReqToTokenPool
from .triton_attention import _NEG, _decode_reduce_kernel, _online_update, _p2, _precision, _upcast, decode_num_splits
from .triton_backend import BatchMeta, TritonAttnBackend, _sm_count

DECODE_BLOCK_H = 16  # query heads per decode program (the least tl.dot M on a GPU)


@triton.jit
def _mla_scores(q_c, q_r, KV, slot, valid, stride_kvn, offs_c, offs_r, scaling,
                C: tl.constexpr, R: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of a block of query rows against the latent rows at ``slot``, and those rows' values."""
    kv_c = _upcast(tl.load(KV + slot[:, None] * stride_kvn + offs_c[None, :],
                           mask=valid[:, None] & (offs_c[None, :] < C), other=0.0), q_c.dtype)
    k_r = _upcast(tl.load(KV + slot[:, None] * stride_kvn + C + offs_r[None, :],
                          mask=valid[:, None] & (offs_r[None, :] < R), other=0.0), q_c.dtype)
    qk = tl.dot(q_c, tl.trans(kv_c), input_precision=PRECISION)
    qk += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
    return qk * scaling, kv_c


@triton.jit
def _mla_decode_partial_kernel(
    Q, KV, ReqToToken, ReqIdx, SeqLens, PartO, PartLse,
    stride_qb, stride_qh, stride_kvn, stride_rt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    scaling,
    H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (batch, head blocks, splits): a block of query heads over one split of the request's keys."""
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqIdx + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=hmask[:, None] & (offs_c[None, :] < C), other=0.0)
    q_r = tl.load(q_row + C + offs_r[None, :], mask=hmask[:, None] & (offs_r[None, :] < R), other=0.0)
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for s in range(start, end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = tl.load(ReqToToken + req * stride_rt + pos, mask=valid, other=0).to(tl.int64)
        qk, v = _mla_scores(q_c, q_r, KV, slot, valid, stride_kvn, offs_c, offs_r, scaling, C, R, PRECISION)
        m_i, l_i, acc = _online_update(qk, valid[None, :], v, m_i, l_i, acc, PRECISION)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(PartO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :], o,
             mask=hmask[:, None] & (offs_c[None, :] < C))
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _mla_extend_kernel(
    Q, KV, Out, ReqToToken, ReqIdx, QStart, QLens, SeqLens, Positions,
    stride_qn, stride_qh, stride_kvn, stride_on, stride_oh, stride_rt,
    scaling,
    H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (batch, row blocks): rows are one request's (new token, head) pairs, token-major.

    Keys are the request's positions ``0 .. seq_lens[b] - 1`` through req_to_token, each row's
    causally (key position <= its token's position)."""
    b = tl.program_id(0)
    mblk = tl.program_id(1)
    q_len = tl.load(QLens + b)
    if mblk * BLOCK_M >= q_len * H:
        return
    q_start = tl.load(QStart + b)
    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqIdx + b)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len * H
    token = q_start + offs_m // H
    head = offs_m % H
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    qpos = tl.load(Positions + token, mask=mmask, other=0)
    q_row = Q + token[:, None] * stride_qn + head[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=mmask[:, None] & (offs_c[None, :] < C), other=0.0)
    q_r = tl.load(q_row + C + offs_r[None, :], mask=mmask[:, None] & (offs_r[None, :] < R), other=0.0)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)

    hi = tl.minimum(seq_len, tl.max(tl.where(mmask, qpos, 0), 0) + 1)  # keys some row of the block sees
    for s in range(0, hi, BLOCK_N):
        kpos = s + tl.arange(0, BLOCK_N)
        valid = kpos < hi
        slot = tl.load(ReqToToken + req * stride_rt + kpos, mask=valid, other=0).to(tl.int64)
        qk, v = _mla_scores(q_c, q_r, KV, slot, valid, stride_kvn, offs_c, offs_r, scaling, C, R, PRECISION)
        allowed = valid[None, :] & (kpos[None, :] <= qpos[:, None])
        m_i, l_i, acc = _online_update(qk, allowed, v, m_i, l_i, acc, PRECISION)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(Out + token[:, None] * stride_on + head[:, None] * stride_oh + offs_c[None, :],
             o.to(Out.dtype.element_ty), mask=mmask[:, None] & (offs_c[None, :] < C))


def _block_n(kv_lora_rank: int) -> int:
    # A [rows, kv_lora_rank] fp32 accumulator plus a key block must fit in registers at DeepSeek's 512.
    return 32 if kv_lora_rank >= 256 else 64


def _launch(kv_lora_rank: int) -> dict:
    """Warps and pipeline stages: a wide latent spreads its accumulator over more warps and keeps
    fewer key blocks in flight (shared memory). Ignored by the interpreter."""
    return dict(num_warps=8, num_stages=2) if kv_lora_rank >= 256 else {}


def head_blocks(num_heads: int) -> int:
    return triton.cdiv(num_heads, DECODE_BLOCK_H)


def mla_decode_workspace_bytes(batch_size: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> int:
    """fp32 partial latent outputs and log-sum-exps of the split-KV decode."""
    return batch_size * num_heads * num_splits * (kv_lora_rank + 1) * 4


def mla_decode(q, kv_buf, kv_lora_rank: int, req_to_token, req_pool_indices, seq_lens, scaling: float,
               num_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, kv_lora_rank + rope], one token per request at position seq_lens - 1;
    kv_buf: [slots, 1, kv_lora_rank + rope]. Returns the attended latents [B, H, kv_lora_rank]."""
    B, H, W = q.shape
    C, R = kv_lora_rank, W - kv_lora_rank
    part_o = torch.empty((B, H, num_splits, C), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, C), dtype=q.dtype, device=q.device) if out is None else out
    _mla_decode_partial_kernel[(B, head_blocks(H), num_splits)](
        q, kv_buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), kv_buf.stride(0), req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1), scaling,
        H=H, C=C, R=R, BLOCK_C=_p2(C), BLOCK_R=_p2(R), BLOCK_H=DECODE_BLOCK_H, BLOCK_N=_block_n(C),
        NUM_SPLITS=num_splits, PRECISION=_precision(q), **_launch(C),
    )
    _decode_reduce_kernel[(B, H)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        DV=C, BLOCK_DV=_p2(C), NUM_SPLITS=num_splits, BLOCK_S=_p2(num_splits, 2),
    )
    return out


def mla_extend(q, kv_buf, kv_lora_rank: int, req_to_token, req_pool_indices, q_start, q_lens, seq_lens, positions,
               max_q_len: int, scaling: float) -> torch.Tensor:
    """q: [N, H, kv_lora_rank + rope], the new tokens of B requests (request b's rows start at
    ``q_start[b]``, ``q_lens[b]`` of them, the last at position ``seq_lens[b] - 1``); returns
    [N, H, kv_lora_rank]."""
    N, H, W = q.shape
    C = kv_lora_rank
    out = torch.empty((N, H, C), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    rows = max_q_len * H
    block_m = 64 if rows > 32 and C < 256 else (32 if rows > 16 else 16)
    B = req_pool_indices.shape[0]
    _mla_extend_kernel[(B, triton.cdiv(rows, block_m))](
        q, kv_buf, out, req_to_token, req_pool_indices, q_start, q_lens, seq_lens, positions,
        q.stride(0), q.stride(1), kv_buf.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0), scaling,
        H=H, C=C, R=W - C, BLOCK_C=_p2(C), BLOCK_R=_p2(W - C), BLOCK_M=block_m, BLOCK_N=_block_n(C),
        PRECISION=_precision(q), **_launch(C),
    )
    return out


class TritonMLABackend:
    fixed_width_under_graphs = False  # lengths are read on the device
    """Same interface as TorchNativeAttnBackend over an MLA pool: decode and extend (prefill,
    chain verification). Draft trees are not drafted over MLA (MTP drafts chains)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MLATokenToKVPool):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.num_sms = _sm_count(self.req_to_token.device)
        # Every layer reuses a batch's metadata; a graph capture makes its own (``BatchMeta``).
        self._meta = BatchMeta(_extend_meta)

    def num_splits(self, batch_size: int, num_heads: int) -> int:
        return decode_num_splits(batch_size, head_blocks(num_heads), self.num_sms)

    def forward(self, q, k, v, layer_id: int, fb: ForwardBatch, scaling: float) -> torch.Tensor:
        """q: [N, H, kv_lora_rank + rope] absorbed queries; k: the new latent rows [N, 1, width]
        (``v`` is their first columns, stored with them); returns [N, H, kv_lora_rank]."""
        if fb.is_tree:
            raise NotImplementedError("tree-masked attention over an MLA pool: MTP drafts chains only")
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        kv_buf = self.kv_pool.k_buffer[layer_id]
        rank = self.kv_pool.kv_lora_rank
        if fb.is_decode:
            return mla_decode(q, kv_buf, rank, self.req_to_token, fb.req_pool_indices, fb.seq_lens, scaling,
                              self.num_splits(fb.batch_size, q.shape[1]))
        q_start, q_lens, max_q_len = self._meta(fb, q.device)
        return mla_extend(q, kv_buf, rank, self.req_to_token, fb.req_pool_indices, q_start, q_lens, fb.seq_lens,
                          fb.positions, max_q_len, scaling)


def _extend_meta(fb: ForwardBatch, device):
    q_start, q_lens = TritonAttnBackend._starts(fb.extend_lens, device)  # uniform lengths: no host copy
    return q_start, q_lens, max(fb.extend_lens)
