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


@triton.jit
def _grouped_topk_kernel(
    Logits, Bias, Experts, Weights, stride_l, scale,
    GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALISE: tl.constexpr,
):
    """One token per program: sigmoid scores, the bias added for the choice only, groups ranked by
    the sum of their two best choices, the best TOPK_GROUP groups kept, the TOP_K best experts in
    them (best first), and their scores as weights (normalised to sum 1 with NORMALISE), times scale."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    real = (g < GROUPS) & (e < PER_GROUP)
    ids = g * PER_GROUP + e  # [BLOCK_G, BLOCK_E]: expert ids by group
    scores = tl.sigmoid(tl.load(Logits + row * stride_l + ids, mask=real, other=0.0).to(tl.float32))
    choice = tl.where(real, scores + tl.load(Bias + ids, mask=real, other=0.0).to(tl.float32), float("-inf"))
    # each group's two best: its best, then the best of the rest (a tie counts twice, as topk(2) does)
    first = tl.argmax(choice, 1)
    second = tl.max(tl.where(e == first[:, None], float("-inf"), choice), 1)
    group = tl.arange(0, BLOCK_G)
    group_score = tl.where(group < GROUPS, tl.max(choice, 1) + second, float("-inf"))
    keep = group < 0
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.argmax(group_score, 0)
        keep = keep | (group == top)
        group_score = tl.where(group == top, float("-inf"), group_score)
    left = tl.where(keep[:, None] & real, choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], tl.int64)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        flat = tl.argmax(tl.reshape(left, [BLOCK_G * BLOCK_E]), 0)
        at = ids == (flat // BLOCK_E) * PER_GROUP + flat % BLOCK_E
        chosen = tl.where(slot == k, ((flat // BLOCK_E) * PER_GROUP + flat % BLOCK_E).to(tl.int64), chosen)
        weights = tl.where(slot == k, tl.sum(tl.sum(tl.where(at & real, scores, 0.0), 1), 0), weights)
        left = tl.where(at, float("-inf"), left)
    if NORMALISE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    tl.store(Experts + row * TOP_K + slot, chosen, mask=slot < TOP_K)
    tl.store(Weights + row * TOP_K + slot, weights * scale, mask=slot < TOP_K)


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int, top_k: int,
                 normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing in one launch from the router's logits ``[n, E]``: the experts
    ``[n, top_k]`` (int64, best first) and their weights (float32). ``Router.route`` is the torch
    reference."""
    n, num_experts = logits.shape
    per_group = num_experts // groups
    experts = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    if n:
        _grouped_topk_kernel[(n,)](
            logits, bias, experts, weights, logits.stride(0), scale, GROUPS=groups, PER_GROUP=per_group,
            TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_E=triton.next_power_of_2(per_group), BLOCK_K=triton.next_power_of_2(top_k),
            NORMALISE=normalise)
    return experts, weights
