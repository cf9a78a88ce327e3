"""Paged attention kernels in Triton: split-KV decode, split-KV verification (a few new tokens
per request: chain and tree verification, draft extends), and one extend kernel for prefill;
``triton_backend`` chooses among them per batch.

Verification splits the keys as decode does (a batch-1 verify pass of an 8B model has only 8 KV
heads): a program takes every new token of a request for the query heads of one KV head over one
split of the keys; a reduce combines the splits by their log-sum-exp.

Every kernel reads K/V through ``req_to_token`` (the request's live positions only), indexes the
KV head of each query head (no repeated K/V), and upcasts the pool's dtype (bf16/fp16/fp32 or fp8
e4m3/e5m2, scale 1.0) to the query's after the load. Slots are widened to 64 bits as they are
loaded: slot x row stride passes 2**31 in a pool of millions of tokens.

CUDA-graph rules the kernels keep: no host sync, a grid fixed by the batch size, and per-request
loop bounds read from ``seq_lens`` inside the kernel, so one captured graph serves every context
length. The torch-native backend (attention.py, tree_attention.py) is their reference in tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import kv_splits

NO_WINDOW = 1 << 30  # a sliding window wider than any context: plain causal attention
# Finite "minus infinity" for running maxima, so fully-masked blocks give exp(...) = 0; a constexpr,
# the only kind of global a compiled kernel may read (the interpreter reads any).
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _upcast(x, dtype: tl.constexpr):
    """K/V as loaded to the query's dtype. An e5m2 byte is the high byte of the fp16 of the same
    value, so it is widened by a shift (exact): Triton 3.6 converts e5m2 on sm_80 with instructions
    of sm_89/sm_90 that ptxas refuses there. e4m3 is served by Triton from sm_89 only (attention.py)."""
    if x.dtype == tl.float8e5:
        x = (x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _online_update(qk, allowed, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One flash-attention step: fold a block of scores (masked by ``allowed``) and values in."""
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv(K, V, slot, valid, kvh, stride_kn, stride_kh, stride_vn, stride_vh, offs_d, offs_dv,
             D: tl.constexpr, DV: tl.constexpr, dtype: tl.constexpr):
    """A block of keys and values (``slot``: their KV slots) of one KV head, in the query's dtype."""
    k = _upcast(tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                        mask=valid[:, None] & (offs_d[None, :] < D), other=0.0), dtype)
    v = _upcast(tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                        mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0), dtype)
    return k, v


@triton.jit
def _attend_causal(q, qpos, m_i, l_i, acc, K, V, ReqToToken, req, start, end, kvh,
                   stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, scaling, window, offs_d, offs_dv,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Fold in the request's positions ``start .. end - 1`` (read through req_to_token) under the
    causal rule and the sliding window."""
    for s in range(start, end, BLOCK_N):
        kpos = s + tl.arange(0, BLOCK_N)
        valid = kpos < end
        slot = tl.load(ReqToToken + req * stride_rt + kpos, mask=valid, other=0).to(tl.int64)
        k, v = _load_kv(K, V, slot, valid, kvh, stride_kn, stride_kh, stride_vn, stride_vh, offs_d, offs_dv,
                        D, DV, q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        allowed = valid[None, :] & (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = _online_update(qk, allowed, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_tree(q, qpos, tok, tmask, m_i, l_i, acc, K, V, ExtraStart, ExtraSlots, ExtraPos, MaskStart, Mask,
                 b, kvh, stride_kn, stride_kh, stride_vn, stride_vh, scaling, window, offs_d, offs_dv,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Fold in request b's extra slots (draft-tree nodes) under its ``[q_len, E]`` mask; row i of
    the block is the request's new token ``tok[i]`` (``tmask``: a real one)."""
    e_start = tl.load(ExtraStart + b)
    e_len = tl.load(ExtraStart + b + 1) - e_start
    mask_start = tl.load(MaskStart + b)
    for s in range(0, e_len, BLOCK_N):
        offs_e = s + tl.arange(0, BLOCK_N)
        valid = offs_e < e_len
        slot = tl.load(ExtraSlots + e_start + offs_e, mask=valid, other=0).to(tl.int64)
        kpos = tl.load(ExtraPos + e_start + offs_e, mask=valid, other=0)
        k, v = _load_kv(K, V, slot, valid, kvh, stride_kn, stride_kh, stride_vn, stride_vh, offs_d, offs_dv,
                        D, DV, q.dtype)
        tree = tl.load(Mask + mask_start + tok[:, None] * e_len + offs_e[None, :],
                       mask=tmask[:, None] & valid[None, :], other=0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        allowed = (tree != 0) & valid[None, :] & (kpos[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = _online_update(qk, allowed, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_partial_kernel(
    Q, K, V, ReqToToken, ReqIdx, SeqLens, PartO, PartLse,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    scaling, window,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (batch, kv_heads, splits): the query heads of one KV head over one split of the keys."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqIdx + b)
    lo = tl.maximum(seq_len - window, 0)  # the query sits at position seq_len - 1
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for s in range(start, end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = tl.load(ReqToToken + req * stride_rt + pos, mask=valid, other=0).to(tl.int64)
        k = _upcast(tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
                            mask=valid[:, None] & (offs_d[None, :] < D), other=0.0), q.dtype)
        v = _upcast(tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                            mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0), q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
        m_i, l_i, acc = _online_update(qk, valid[None, :], v, m_i, l_i, acc, PRECISION)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(PartO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :], o,
             mask=hmask[:, None] & (offs_dv[None, :] < DV))
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(
    PartO, PartLse, Out,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (batch, heads): combine the splits' partial outputs by their log-sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    smask = offs_s < NUM_SPLITS
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row that saw no key at all: zeros, not NaN
    w = tl.exp(lse - m)  # empty splits have lse -inf: weight 0
    o = tl.load(PartO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_dv[None, :],
                mask=smask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + b * stride_outb + h * stride_outh + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < DV)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqIdx, QStart, QLens, LinearLens, Positions,
    ExtraStart, ExtraSlots, ExtraPos, MaskStart, Mask,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_rt,
    scaling, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_EXTRA: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (batch, heads, query blocks): a block of one request's new tokens for one head.

    Keys are the request's positions ``0 .. LinearLens[b] - 1`` read through req_to_token, under
    the causal rule (key position <= query position) and the sliding window; with ``HAS_EXTRA``
    also the request's extra slots (draft-tree nodes) under its ``[q_len, E]`` mask.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_len = tl.load(QLens + b)
    if mblk * BLOCK_M >= q_len:
        return
    q_start = tl.load(QStart + b)
    linear_len = tl.load(LinearLens + b)
    req = tl.load(ReqIdx + b)
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qpos = tl.load(Positions + q_start + offs_m, mask=mmask, other=0)
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Causal part: only keys some query of this block can see.
    hi = tl.minimum(linear_len, tl.max(tl.where(mmask, qpos, 0), 0) + 1)
    lo = tl.maximum(tl.min(tl.where(mmask, qpos, 1 << 62), 0) - window + 1, 0)
    m_i, l_i, acc = _attend_causal(q, qpos, m_i, l_i, acc, K, V, ReqToToken, req, lo, hi, kvh,
                                   stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, scaling, window,
                                   offs_d, offs_dv, D, DV, BLOCK_N, PRECISION)
    if HAS_EXTRA:
        m_i, l_i, acc = _attend_tree(q, qpos, offs_m, mmask, m_i, l_i, acc, K, V, ExtraStart, ExtraSlots, ExtraPos,
                                     MaskStart, Mask, b, kvh, stride_kn, stride_kh, stride_vn, stride_vh, scaling,
                                     window, offs_d, offs_dv, D, DV, BLOCK_N, PRECISION)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_on + h * stride_oh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=mmask[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _verify_partial_kernel(
    Q, K, V, ReqToToken, ReqIdx, QStart, QLens, LinearLens, Positions,
    ExtraStart, ExtraSlots, ExtraPos, MaskStart, Mask, PartO, PartLse, Out,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_outn, stride_outh,
    scaling, window,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_EXTRA: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (batch, kv_heads, NUM_SPLITS + HAS_EXTRA): rows are request b's new tokens times the
    query heads of KV head ``kvh`` (row r: token r // GROUP, head r % GROUP). Splits 0..NUM_SPLITS-1
    share the causal keys ``0 .. LinearLens[b] - 1``; with ``HAS_EXTRA`` one more program reads
    the request's extra slots (draft-tree nodes) under its ``[q_len, E]`` mask. ``DIRECT``: one
    program per row block holds every key (one split, no tree), so it writes the output itself."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_len = tl.load(QLens + b)
    q_start = tl.load(QStart + b)
    linear_len = tl.load(LinearLens + b)
    req = tl.load(ReqIdx + b)

    offs_r = tl.arange(0, BLOCK_R)
    tok = offs_r // GROUP
    rmask = tok < q_len
    heads = kvh * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qpos = tl.load(Positions + q_start + tok, mask=rmask, other=0)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_R], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)

    if split < NUM_SPLITS:  # this split of the keys some row can see
        hi = tl.minimum(linear_len, tl.max(tl.where(rmask, qpos, 0), 0) + 1)
        lo = tl.maximum(tl.min(tl.where(rmask, qpos, 1 << 62), 0) - window + 1, 0)
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
        m_i, l_i, acc = _attend_causal(q, qpos, m_i, l_i, acc, K, V, ReqToToken, req, start, end, kvh,
                                       stride_kn, stride_kh, stride_vn, stride_vh, stride_rt, scaling, window,
                                       offs_d, offs_dv, D, DV, BLOCK_N, PRECISION)
    elif HAS_EXTRA:  # the draft tree's nodes
        m_i, l_i, acc = _attend_tree(q, qpos, tok, rmask, m_i, l_i, acc, K, V, ExtraStart, ExtraSlots, ExtraPos,
                                     MaskStart, Mask, b, kvh, stride_kn, stride_kh, stride_vn, stride_vh, scaling,
                                     window, offs_d, offs_dv, D, DV, BLOCK_N, PRECISION)

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    omask = rmask[:, None] & (offs_dv[None, :] < DV)
    if DIRECT:
        rows = (q_start + tok) * stride_outn + heads * stride_outh
        tl.store(Out + rows[:, None] + offs_dv[None, :], o.to(Out.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        rows = (q_start + tok) * stride_on + heads * stride_oh + split * stride_os
        tl.store(PartO + rows[:, None] + offs_dv[None, :], o, mask=omask)
        tl.store(PartLse + (q_start + tok) * stride_ln + heads * stride_lh + split, lse, mask=rmask)


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 models: exact against fp32 references


def _p2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def decode_num_splits(batch_size: int, kv_heads: int, num_sms: int) -> int:
    """KV splits per request (``contract.kv_splits``): a function of the batch size only."""
    return kv_splits(batch_size, kv_heads, num_sms)


def decode_workspace_bytes(batch_size: int, num_heads: int, v_head_dim: int, num_splits: int) -> int:
    """fp32 partial outputs and log-sum-exps of the split-KV decode."""
    return batch_size * num_heads * num_splits * (v_head_dim + 1) * 4


def decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scaling: float,
                     window: int | None, num_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D], one token per request at position seq_lens - 1; returns [B, H, Dv]."""
    B, H, D = q.shape
    kv_heads, dv = k_buf.shape[1], v_buf.shape[-1]
    group = H // kv_heads
    part_o = torch.empty((B, H, num_splits, dv), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, dv), dtype=q.dtype, device=q.device) if out is None else out
    _decode_partial_kernel[(B, kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), scaling, window or NO_WINDOW,
        GROUP=group, BLOCK_H=_p2(group), BLOCK_N=64, D=D, DV=dv, BLOCK_D=_p2(D), BLOCK_DV=_p2(dv),
        NUM_SPLITS=num_splits, PRECISION=_precision(q),
    )
    _decode_reduce_kernel[(B, H)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=_p2(dv), NUM_SPLITS=num_splits, BLOCK_S=_p2(num_splits, 2),
    )
    return out


def extend_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, q_start, q_lens, linear_lens, positions,
                     max_q_len: int, scaling: float, window: int | None, extra=None) -> torch.Tensor:
    """q: [N, H, D] new tokens of B requests; returns [N, H, Dv].

    Request b's queries are rows ``q_start[b] .. q_start[b] + q_lens[b] - 1`` and see its
    positions below ``linear_lens[b]`` causally. ``extra``: (extra_start [B+1], slots [E],
    positions [E], mask_start [B], mask int8 flat [sum q_len_b * E_b]) for draft trees.
    """
    N, H, D = q.shape
    kv_heads, dv = k_buf.shape[1], v_buf.shape[-1]
    out = torch.empty((N, H, dv), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    block_m = 64 if max_q_len > 32 else (32 if max_q_len > 16 else 16)
    has_extra = extra is not None
    e_start, e_slots, e_pos, m_start, mask = extra if has_extra else (q_start,) * 5  # unused placeholders
    B = req_pool_indices.shape[0]
    _extend_kernel[(B, H, triton.cdiv(max_q_len, block_m))](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, q_start, q_lens, linear_lens, positions,
        e_start, e_slots, e_pos, m_start, mask,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0), scaling, window or NO_WINDOW,
        GROUP=H // kv_heads, BLOCK_M=block_m, BLOCK_N=64, D=D, DV=dv, BLOCK_D=_p2(D), BLOCK_DV=_p2(dv),
        HAS_EXTRA=has_extra, PRECISION=_precision(q),
    )
    return out


def verify_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, q_start, q_lens, linear_lens, positions,
                     max_q_len: int, scaling: float, window: int | None, num_splits: int, extra=None) -> torch.Tensor:
    """``extend_attention`` for passes of at most ``VERIFY_MAX_ROWS // group`` new tokens per
    request, its keys split ``num_splits`` ways (plus one program for a tree's nodes)."""
    N, H, D = q.shape
    kv_heads, dv = k_buf.shape[1], v_buf.shape[-1]
    group = H // kv_heads
    out = torch.empty((N, H, dv), dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    has_extra = extra is not None
    splits = num_splits + has_extra
    direct = splits == 1  # no partials and no reduce: the one program per rows writes them
    part_o = out[:, :, None] if direct else torch.empty((N, H, splits, dv), dtype=torch.float32, device=q.device)
    part_lse = out[:, :, 0] if direct else torch.empty((N, H, splits), dtype=torch.float32, device=q.device)
    e_start, e_slots, e_pos, m_start, mask = extra if has_extra else (q_start,) * 5  # unused placeholders
    B = req_pool_indices.shape[0]
    _verify_partial_kernel[(B, kv_heads, splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, q_start, q_lens, linear_lens, positions,
        e_start, e_slots, e_pos, m_start, mask, part_o, part_lse, out,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), scaling, window or NO_WINDOW,
        GROUP=group, BLOCK_R=_p2(max_q_len * group), BLOCK_N=64, D=D, DV=dv, BLOCK_D=_p2(D), BLOCK_DV=_p2(dv),
        NUM_SPLITS=num_splits, HAS_EXTRA=has_extra, DIRECT=direct, PRECISION=_precision(q),
    )
    if direct:
        return out
    _decode_reduce_kernel[(N, H)](
        part_o, part_lse, out, part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=_p2(dv), NUM_SPLITS=splits, BLOCK_S=_p2(splits, 2),
    )
    return out
