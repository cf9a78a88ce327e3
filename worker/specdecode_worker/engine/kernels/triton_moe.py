"""A Triton kernel for MoE at small batches: each (token, chosen expert) pair multiplies by that
expert's weight, read from the experts' stacked weights by an expert id held on the device.

Running each chosen expert over its tokens needs the routing read back to the host: a host sync
per MoE layer, and a graph cannot do it at all. With few tokens, ``tokens x top_k`` matrix-vector
products read only the chosen experts' weights (once per pair) and read nothing back, so a decode
round's passes, graphed or eager, never wait on the host. The grid depends on the number of pairs
only, so a graph captured for a batch size replays for any routing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_to_f32(b):
    """fp8 e4m3fn bytes (uint8) to float32 with integer ops, for GPUs whose Triton has no e4m3 type
    (before sm_89). Sign, exponent and mantissa move into an fp16's bits (exponent bias 15 instead
    of 7, so times 2**8), which also gives e4m3's subnormals exactly; NaN (0x7f) is not kept."""
    b = b.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _expert_gemv_kernel(
    X, W, Scale, Experts, Y, K, OUT, stride_x, stride_we, stride_wo, stride_se, stride_so, stride_y,
    ROWS_PER_X: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E4M3_BITS: tl.constexpr,
):
    """Grid (pairs, output blocks): Y[p] = W[Experts[p]] @ X[p // ROWS_PER_X], accumulated in fp32;
    with ``HAS_SCALE`` each weight is multiplied by its block's scale (fp8 block quantization);
    with ``E4M3_BITS`` W holds the bytes of fp8 e4m3 weights, decoded here (``_e4m3_to_f32``)."""
    p = tl.program_id(0)
    oblk = tl.program_id(1)
    # 64-bit: expert x expert stride passes 2**31 (256 experts x 4096 x 7168 gate/up weights).
    e = tl.load(Experts + p).to(tl.int64)
    offs_o = oblk * BLOCK_O + tl.arange(0, BLOCK_O)
    omask = offs_o < OUT
    acc = tl.zeros([BLOCK_O], tl.float32)
    x_row = X + (p // ROWS_PER_X) * stride_x
    w_rows = W + e * stride_we + offs_o[:, None] * stride_wo
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_row + offs_k, mask=kmask, other=0.0).to(tl.float32)
        wmask = omask[:, None] & kmask[None, :]
        if E4M3_BITS:
            w = _e4m3_to_f32(tl.load(w_rows + offs_k[None, :], mask=wmask, other=0))
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=wmask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            w *= tl.load(Scale + e * stride_se + (offs_o // SCALE_ROWS)[:, None] * stride_so
                         + (offs_k // SCALE_COLS)[None, :], mask=wmask, other=0.0)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(Y + p * stride_y + offs_o, acc.to(Y.dtype.element_ty), mask=omask)


def native_e4m3(device: torch.device) -> bool:
    """Whether Triton converts fp8 e4m3 on this device: sm_89 and later (the interpreter too)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def expert_gemv(x: torch.Tensor, stacked: torch.Tensor, experts: torch.Tensor, rows_per_x: int,
                scales: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """x: [P / rows_per_x, K]; stacked: [E, OUT, K]; experts: [P] expert ids. Returns [P, OUT] where
    row p is ``stacked[experts[p]] @ x[p // rows_per_x]``. ``scales`` [E, OUT / rows, K / cols]: the
    fp8 block scales of ``block`` (rows, cols), applied to the weights as they are loaded."""
    pairs = experts.numel()
    _, out_features, K = stacked.shape
    y = torch.empty((pairs, out_features), dtype=x.dtype, device=x.device)
    block_o, block_k = 32, min(128, triton.next_power_of_2(K))
    e4m3_bits = stacked.dtype == torch.float8_e4m3fn and not native_e4m3(stacked.device)
    weights = stacked.view(torch.uint8) if e4m3_bits else stacked
    has_scale = scales is not None
    scale = scales if has_scale else weights  # unread placeholder
    _expert_gemv_kernel[(pairs, triton.cdiv(out_features, block_o))](
        x, weights, scale, experts, y, K, out_features, x.stride(0), stacked.stride(0), stacked.stride(1),
        scale.stride(0), scale.stride(1), y.stride(0),
        ROWS_PER_X=rows_per_x, BLOCK_O=block_o, BLOCK_K=block_k, HAS_SCALE=has_scale, SCALE_ROWS=block[0],
        SCALE_COLS=block[1], E4M3_BITS=e4m3_bits,
    )
    return y
