"""The decoder layer's elementwise work in one launch each: RMSNorm (with the residual add before
it), rotary embedding of q and k, and SiLU(gate) x up.

Written as torch ops these are about 30 small kernels per layer on a GPU (RMSNorm alone is eight),
and on an H200 a batch-1 step of the 8B target spent as long in them and the gaps between them as
in its matrix products. On CUDA each op here is one Triton kernel; on CPU, and wherever
``SPECDECODE_LAYER_KERNELS=torch`` asks for it, the torch ops, which are the reference. Each kernel
rounds where the torch ops round (to the activation dtype after each step), so the two agree
within a rounding step (a reduction's order, an exp's last bit); tests run the kernels under
``TRITON_INTERPRET=1`` against the reference.
"""

from __future__ import annotations

import os

import torch

LAYER_KERNELS_ENV = "SPECDECODE_LAYER_KERNELS"  # "triton" or "torch"; default: triton on CUDA


def use_triton(x: torch.Tensor) -> bool:
    choice = os.environ.get(LAYER_KERNELS_ENV, "")
    if choice == "torch":
        return False
    return x.is_cuda or (choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1")


# ---- the reference ------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary_reference(q, k, cos, sin):
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0, x1), (x2, x3), ...; the output lists first, then second members (as
    transformers' DeepSeek-V3 does). q and k get the same permutation, so their dot products are
    those of the interleaved layout."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_interleaved_reference(q, k, cos, sin):
    return rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


# ---- the ops ------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` (rows over the last dimension); with ``residual``, of ``x + residual``, and
    that sum is returned too: ``(normed, x + residual)``."""
    if not use_triton(x) or weight.dtype != x.dtype:  # a mixed-dtype product promotes: the reference's
        if residual is None:
            return rms_norm_reference(x, weight, eps)
        x = x + residual
        return rms_norm_reference(x, weight, eps), x
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, shape[-1]).contiguous() if residual is not None else x2
    rows, n = x2.shape
    if rows:
        block = _pow2(n)  # a row per program, in registers: more warps for wide rows
        _rms_norm_kernel[(rows,)](x2, res2, weight, out, summed, n, eps, HAS_RESIDUAL=residual is not None,
                                  BLOCK=block, num_warps=8 if block >= 4096 else 4)
    if residual is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[n, heads, d]`` and ``k`` ``[n, kv_heads, d]`` rotated by ``cos``/``sin`` ``[n, d]``:
    the half-split layout (the first half pairs with the second), or with ``interleaved`` pairs of
    neighbours, written out as halves (``rotate_interleaved``). ``q`` and ``k`` may be views of a
    projection's output (rows and heads further apart than their width)."""
    if not use_triton(q):
        return (rotary_interleaved_reference if interleaved else rotary_reference)(q, k, cos, sin)
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    q, k = _unit_stride(q), _unit_stride(k)
    q_out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, kv_heads, d), dtype=k.dtype, device=k.device)
    if n:
        _rotary_kernel[(n, heads + kv_heads)](q, k, cos.contiguous(), sin.contiguous(), q_out, k_out, q.stride(0),
                                              k.stride(0), q.stride(1), k.stride(1), heads, kv_heads, D=d,
                                              HALF=d // 2, BLOCK=_pow2(d // 2), INTERLEAVED=interleaved)
    return q_out, k_out


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel reads it: each head's ``d`` values contiguous (rows and heads may be apart)."""
    return x if x.stride(2) == 1 else x.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up, elementwise. 2-D ``gate`` and ``up`` may be the two halves of a fused
    gate-up projection's output (rows further apart than their width)."""
    if not use_triton(gate):
        return silu_mul_reference(gate, up)
    shape = gate.shape
    if gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.reshape(-1, gate.shape[-1]).contiguous(), up.reshape(-1, up.shape[-1]).contiguous()
    rows, cols = gate.shape
    out = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    if rows * cols:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                           BLOCK=block)
    return out.view(shape)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---- the kernels --------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the reference serves
    triton = None

if triton is not None:
    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, SUM, N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum rounds to the activation dtype, as x + residual does
            r = tl.load(R + row * N + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(SUM + row * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * N + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(Q, K, COS, SIN, Q_OUT, K_OUT, Q_ROW, K_ROW, Q_HEAD, K_HEAD, HEADS, KV_HEADS,
                       D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < HALF
        if head < HEADS:
            src = Q + token * Q_ROW + head * Q_HEAD
            dst = Q_OUT + (token * HEADS + head) * D
        else:
            src = K + token * K_ROW + (head - HEADS) * K_HEAD
            dst = K_OUT + (token * KV_HEADS + head - HEADS) * D
        dtype = Q_OUT.dtype.element_ty
        c1 = tl.load(COS + token * D + cols, mask=mask, other=0.0)
        s1 = tl.load(SIN + token * D + cols, mask=mask, other=0.0)
        if INTERLEAVED:  # pairs of neighbours, each rotated by the first half's angles
            x1 = tl.load(src + 2 * cols, mask=mask, other=0.0)
            x2 = tl.load(src + 2 * cols + 1, mask=mask, other=0.0)
            c2, s2 = c1, s1
        else:
            x1 = tl.load(src + cols, mask=mask, other=0.0)
            x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
            c2 = tl.load(COS + token * D + HALF + cols, mask=mask, other=0.0)
            s2 = tl.load(SIN + token * D + HALF + cols, mask=mask, other=0.0)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as the torch ops round them
        a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dtype).to(tl.float32)
        b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dtype).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(dst + cols, (a1 + b1).to(dtype), mask=mask)
        tl.store(dst + HALF + cols, (a2 + b2).to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(G, U, OUT, COLS, G_ROW, U_ROW, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < COLS
        g = tl.load(G + row * G_ROW + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * U_ROW + cols, mask=mask, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * COLS + cols, (s * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)
