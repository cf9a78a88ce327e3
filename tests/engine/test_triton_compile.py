"""Every Triton kernel of the engine compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100).

The interpreter tests (test_triton_attention.py, test_triton_mla.py) check what the kernels
compute; the interpreter accepts programs the compiler rejects (``tl.dot`` shapes below 16,
mismatched dot dtypes, fp8 conversions an architecture lacks, shared memory above the device's
limit). Triton compiles for a GPU target without a GPU, with the ptxas it ships, so this file
compiles each kernel to a cubin at real model sizes and checks the shared memory it asks for.

Each case calls the engine's own launch function (``decode_attention``, ``extend_attention``,
``mla_decode``, ``mla_extend``, ``expert_gemv``) on ``meta`` tensors of the real shapes (a 4.4M
token KV pool, 256 stacked experts: no memory behind them), with the launch intercepted: the
kernel's arguments, constexprs, warps and stages are the ones a GPU would get, specialised by
Triton's own argument binder (pointers count as 16-byte aligned, as torch allocates them), and the
choice of blocks and splits stays in the engine's code.

This is a compile, not a run: it says nothing of numerics or speed. It also checks, in the
kernels' TTIR, that the offsets into the KV pools and the stacked experts are 64-bit where slot
times row stride (or expert times expert stride) passes 2**31 at these sizes.

The compiles run in one child process: the test session turns on ``TRITON_INTERPRET=1`` before
triton is imported (tests/conftest.py), and kernels decorated under it cannot be compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Usable shared memory per block (opt-in maximum): sm_90 227 KB, sm_80 163 KB.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
NUM_SMS = {90: 132, 80: 108}  # H100 SXM, A100: the decode split count depends on it
POOL_TOKENS = 4_400_000  # an 8B model's pool on an H200: slot * row stride passes 2**31
REQS, CONTEXT = 257, 8192

# (id, arch): the kernels and shapes each case launches; see _launch_case.
LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128)
LLAMA_70B = dict(heads=64, kv_heads=8, head_dim=128)
GQA_1 = dict(heads=32, kv_heads=32, head_dim=128)
LLAMA_1B = dict(heads=32, kv_heads=8, head_dim=64)  # the 1B-shaped STANDALONE draft
SMOLLM2 = dict(heads=9, kv_heads=3, head_dim=64)  # a group of 3: a partial head block
ATTENTION_CASES = [
    # name, geometry, kv dtype, mode (decode batch / extend kind)
    ("llama8b-bf16-decode-b1", LLAMA_8B, "bfloat16", ("decode", 1)),
    ("llama8b-bf16-decode-b256", LLAMA_8B, "bfloat16", ("decode", 256)),
    ("llama8b-bf16-prefill", LLAMA_8B, "bfloat16", ("prefill", 8192)),
    ("llama8b-bf16-verify", LLAMA_8B, "bfloat16", ("verify", 5)),
    ("llama8b-bf16-tree", LLAMA_8B, "bfloat16", ("tree", 60)),
    ("llama8b-e4m3-decode-b1", LLAMA_8B, "float8_e4m3fn", ("decode", 1)),
    ("llama8b-e4m3-prefill", LLAMA_8B, "float8_e4m3fn", ("prefill", 8192)),
    ("llama8b-e4m3-tree", LLAMA_8B, "float8_e4m3fn", ("tree", 60)),
    ("llama8b-e5m2-decode-b1", LLAMA_8B, "float8_e5m2", ("decode", 1)),
    ("llama8b-e5m2-prefill", LLAMA_8B, "float8_e5m2", ("prefill", 8192)),
    ("llama70b-bf16-decode-b1", LLAMA_70B, "bfloat16", ("decode", 1)),
    ("llama70b-bf16-prefill", LLAMA_70B, "bfloat16", ("prefill", 8192)),
    ("llama70b-bf16-tree", LLAMA_70B, "bfloat16", ("tree", 60)),
    ("gqa1-bf16-decode-b1", GQA_1, "bfloat16", ("decode", 1)),
    ("gqa1-bf16-prefill", GQA_1, "bfloat16", ("prefill", 8192)),
    ("gqa1-bf16-tree", GQA_1, "bfloat16", ("tree", 60)),
    ("llama8b-bf16-window-decode-b8", LLAMA_8B, "bfloat16", ("decode", 8, 4096)),
    ("llama8b-bf16-window-prefill", LLAMA_8B, "bfloat16", ("prefill", 8192, 4096)),
    ("llama1b-bf16-decode-b1", LLAMA_1B, "bfloat16", ("decode", 1)),
    ("llama1b-bf16-prefill", LLAMA_1B, "bfloat16", ("prefill", 8192)),
    ("smollm2-bf16-decode-b1", SMOLLM2, "bfloat16", ("decode", 1)),
    ("smollm2-bf16-tree", SMOLLM2, "bfloat16", ("tree", 60)),
    # split-KV verification: k + 1 rows per request (or a tree's nodes) x the query heads of a KV head
    ("llama8b-bf16-split-verify-b1", LLAMA_8B, "bfloat16", ("split-verify", 5, 1)),
    ("llama8b-bf16-split-verify-b64", LLAMA_8B, "bfloat16", ("split-verify", 5, 64)),
    ("llama8b-bf16-split-tree", LLAMA_8B, "bfloat16", ("split-tree", 8, 1)),
    ("llama8b-e4m3-split-verify-b1", LLAMA_8B, "float8_e4m3fn", ("split-verify", 5, 1)),
    ("llama8b-e5m2-split-verify-b1", LLAMA_8B, "float8_e5m2", ("split-verify", 5, 1)),
    ("llama70b-bf16-split-verify-b1", LLAMA_70B, "bfloat16", ("split-verify", 8, 1)),
    ("gqa1-bf16-split-verify-b1", GQA_1, "bfloat16", ("split-verify", 5, 1)),
    ("llama1b-bf16-split-verify-b1", LLAMA_1B, "bfloat16", ("split-verify", 2, 1)),
    ("smollm2-bf16-split-tree", SMOLLM2, "bfloat16", ("split-tree", 8, 4)),
]
DEEPSEEK_MLA = dict(kv_lora_rank=512, rope=64)
MLA_CASES = [
    # name, query heads (128; 16 per rank at t = 8), kv dtype, mode
    ("mla-h128-bf16-decode-b1", 128, "bfloat16", ("decode", 1)),
    ("mla-h128-bf16-decode-b256", 128, "bfloat16", ("decode", 256)),
    ("mla-h128-bf16-prefill", 128, "bfloat16", ("prefill", 8192)),
    ("mla-h128-bf16-verify", 128, "bfloat16", ("verify", 2)),
    ("mla-h16-bf16-decode-b1", 16, "bfloat16", ("decode", 1)),
    ("mla-h16-bf16-prefill", 16, "bfloat16", ("prefill", 8192)),
    ("mla-h16-bf16-verify", 16, "bfloat16", ("verify", 2)),
    ("mla-h16-e4m3-decode-b1", 16, "float8_e4m3fn", ("decode", 1)),
    ("mla-h16-e4m3-prefill", 16, "float8_e4m3fn", ("prefill", 8192)),
    ("mla-h16-e5m2-decode-b1", 16, "float8_e5m2", ("decode", 1)),
    ("mla-h16-e5m2-prefill", 16, "float8_e5m2", ("prefill", 8192)),
]
DEEPSEEK_MOE = dict(experts=256, top_k=8, hidden=7168, intermediate=2048, block=(128, 128))
MOE_CASES = [
    # name, tensor-parallel size, weight dtype, tokens in the graph batch
    ("moe-t1-fp8", 1, "float8_e4m3fn", 8),
    ("moe-t8-fp8", 8, "float8_e4m3fn", 8),
    ("moe-t1-bf16", 1, "bfloat16", 8),
    ("moe-t8-bf16", 8, "bfloat16", 8),
]
# The layer's fused kernels (engine/kernels/layer_kernels.py) over a graph batch of 256 tokens: RMSNorm with
# and without the residual add, rotary q and k, SiLU x up, at Llama-3.1-8B's and DeepSeek-V3's widths.
LAYER_CASES = [
    # name, hidden, (heads, kv heads, head dim) or None, intermediate
    ("layers-llama8b-b256", 4096, (32, 8, 128), 14336),
    ("layers-deepseek-b256", 7168, None, 2048),
]
FP8_KV = ("float8_e4m3fn", "float8_e5m2")


def _cases() -> list[tuple[str, int]]:
    names = [c[0] for c in ATTENTION_CASES + MLA_CASES + MOE_CASES + LAYER_CASES]
    return [(n, arch) for arch in (90, 80) for n in names if _served(n, arch)]


def _served(name: str, arch: int) -> bool:
    """Cases the engine runs on Triton at this arch, by the engine's own rule for KV pools
    (engine/kernels/attention.py ``triton_serves_kv``); fp8 expert weights are served at every arch."""
    if name.startswith(("moe", "layers")) or "e4m3" not in name:
        return True
    import torch

    from specdecode_worker.engine.kernels.attention import triton_serves_kv

    return triton_serves_kv(torch.float8_e4m3fn, divmod(arch, 10))


# --- the child process: launch each case on meta tensors, compile what it launches ---------------


def _capture(kernels):
    """Replace each kernel's launch by a recorder of (kernel, args, kwargs, grid)."""
    launches = []

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            launches.append((kernel, args, kwargs, grid))
        return run

    for k in kernels:
        k.run = recorder(k)
    return launches


def _launch_case(name: str, arch: int):
    import torch
    from triton.runtime.jit import JITFunction

    from specdecode_worker.engine.kernels import layer_kernels as lk
    from specdecode_worker.engine.kernels import triton_attention as ta
    from specdecode_worker.engine.kernels import triton_backend as tb
    from specdecode_worker.engine.kernels import triton_mla as tm
    from specdecode_worker.engine.kernels import triton_moe as tmoe

    meta = dict(device="meta")
    idx = dict(dtype=torch.int64, **meta)
    tmoe.native_e4m3 = lambda device: arch >= 89  # what the GPU of this arch would answer
    lk.use_triton = lambda x: True  # meta tensors stand for a GPU's
    kernels = {id(v): v for m in (ta, tm, tmoe, lk) for v in vars(m).values() if isinstance(v, JITFunction)}
    launches = _capture(kernels.values())
    req_to_token = torch.empty((REQS, CONTEXT), **idx)
    for case in ATTENTION_CASES:
        if case[0] != name:
            continue
        _, geo, kv_dtype, mode = case
        H, Hkv, D = geo["heads"], geo["kv_heads"], geo["head_dim"]
        kv = dict(dtype=getattr(torch, kv_dtype), **meta)
        k_buf, v_buf = torch.empty((POOL_TOKENS + 1, Hkv, D), **kv), torch.empty((POOL_TOKENS + 1, Hkv, D), **kv)
        window = mode[2] if len(mode) > 2 else None
        if mode[0] == "decode":
            B = mode[1]
            q = torch.empty((B, H, D), dtype=torch.bfloat16, **meta)
            splits = ta.decode_num_splits(B, Hkv, NUM_SMS[arch])
            ta.decode_attention(q, k_buf, v_buf, req_to_token, torch.empty(B, **idx), torch.empty(B, **idx),
                                D ** -0.5, window, splits)
        elif mode[0].startswith("split"):
            _, n, B = mode
            assert tb.verify_fits(n, H // Hkv)  # the backend takes this pass to the split kernel
            q = torch.empty((B * n, H, D), dtype=torch.bfloat16, **meta)
            extra = None
            if mode[0] == "split-tree":
                extra = (torch.empty(B + 1, **idx), torch.empty(B * n, **idx), torch.empty(B * n, **idx),
                         torch.empty(B, **idx), torch.empty(B * n * n, dtype=torch.int8, **meta))
            vec = torch.empty(B, **idx)
            ta.verify_attention(q, k_buf, v_buf, req_to_token, vec, vec, vec, vec, torch.empty(B * n, **idx), n,
                                D ** -0.5, window, ta.decode_num_splits(B, Hkv, NUM_SMS[arch]), extra)
        else:
            n = mode[1]
            B = 1 if mode[0] == "prefill" else 64
            q = torch.empty((B * n, H, D), dtype=torch.bfloat16, **meta)
            extra = None
            if mode[0] == "tree":
                extra = (torch.empty(B + 1, **idx), torch.empty(B * n, **idx), torch.empty(B * n, **idx),
                         torch.empty(B, **idx), torch.empty(B * n * n, dtype=torch.int8, **meta))
            vec = torch.empty(B, **idx)
            ta.extend_attention(q, k_buf, v_buf, req_to_token, vec, vec, vec, vec, torch.empty(B * n, **idx), n,
                                D ** -0.5, window, extra)
    for case in MLA_CASES:
        if case[0] != name:
            continue
        _, H, kv_dtype, mode = case
        C, R = DEEPSEEK_MLA["kv_lora_rank"], DEEPSEEK_MLA["rope"]
        kv_buf = torch.empty((POOL_TOKENS + 1, 1, C + R), dtype=getattr(torch, kv_dtype), **meta)
        scale = (128 + R) ** -0.5
        if mode[0] == "decode":
            B = mode[1]
            q = torch.empty((B, H, C + R), dtype=torch.bfloat16, **meta)
            splits = ta.decode_num_splits(B, tm.head_blocks(H), NUM_SMS[arch])
            tm.mla_decode(q, kv_buf, C, req_to_token, torch.empty(B, **idx), torch.empty(B, **idx), scale, splits)
        else:
            n = mode[1]
            B = 1 if mode[0] == "prefill" else 64
            q = torch.empty((B * n, H, C + R), dtype=torch.bfloat16, **meta)
            vec = torch.empty(B, **idx)
            tm.mla_extend(q, kv_buf, C, req_to_token, vec, vec, vec, vec, torch.empty(B * n, **idx), n, scale)
    for case in MOE_CASES:
        if case[0] != name:
            continue
        _, t, w_dtype, tokens = case
        E, k, h, m = (DEEPSEEK_MOE[key] for key in ("experts", "top_k", "hidden", "intermediate"))
        m //= t
        w = dict(dtype=getattr(torch, w_dtype), **meta)
        fp8 = w_dtype.startswith("float8")
        block = DEEPSEEK_MOE["block"] if fp8 else (1, 1)
        f32 = dict(dtype=torch.float32, **meta)
        gate_up, down = torch.empty((E, 2 * m, h), **w), torch.empty((E, h, m), **w)
        gate_up_scales = torch.empty((E, 2 * m // block[0], h // block[1]), **f32) if fp8 else None
        down_scales = torch.empty((E, h // block[0], m // block[1]), **f32) if fp8 else None
        ids = torch.empty(tokens * k, **idx)
        x = torch.empty((tokens, h), dtype=torch.bfloat16, **meta)
        tmoe.expert_gemv(x, gate_up, ids, k, gate_up_scales, block)
        # the router: DeepSeek-V3's 8 groups, 4 kept (bias in the checkpoint's dtype)
        tmoe.grouped_topk(torch.empty((tokens, E), **f32), torch.empty(E, **f32), 8, 4, k, True, 2.5)
        tmoe.expert_gemv(torch.empty((tokens * k, m), dtype=torch.bfloat16, **meta), down, ids, 1, down_scales, block)
    for case in LAYER_CASES:
        if case[0] != name:
            continue
        _, h, attention, inter = case
        bf16 = dict(dtype=torch.bfloat16, **meta)
        x, weight = torch.empty((256, h), **bf16), torch.empty(h, **bf16)
        lk.rms_norm(x, weight, 1e-6)
        lk.rms_norm(x, weight, 1e-6, residual=torch.empty((256, h), **bf16))
        if attention is not None:
            heads, kv_heads, d = attention
            lk.apply_rotary(torch.empty((256, heads, d), **bf16), torch.empty((256, kv_heads, d), **bf16),
                            torch.empty((256, d), **bf16), torch.empty((256, d), **bf16))
        else:  # MLA's rope part: 128 heads of 192 (nope 128 + rope 64), the latent's shared key, interleaved
            q = torch.empty((256, 128, 192), **bf16)[..., 128:]
            k = torch.empty((256, 576), **bf16)[:, None, 512:]
            lk.apply_rotary(q, k, torch.empty((256, 64), **bf16), torch.empty((256, 64), **bf16), True)
        lk.silu_mul(torch.empty((256, inter), **bf16), torch.empty((256, inter), **bf16))
    return launches


def _compile(kernel, args, kwargs, arch: int) -> dict:
    """Compile one launch for ``arch`` with the specialisation Triton's binder gives its arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    names = [p.name for p in kernel.params]
    signature = {n: s[0] for n, s in zip(names, specialization)}
    values = list(bound.values())
    constexprs = {(i,): values[i] for i, s in enumerate(specialization) if s[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(specialization)
             if s[0] != "constexpr" and isinstance(s[1], str)}
    opts = backend.parse_options(options)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=opts.__dict__)
    assert compiled.asm["cubin"], "no cubin"
    md = compiled.metadata
    return dict(kernel=kernel.__name__, shared=md.shared, num_warps=md.num_warps, num_stages=md.num_stages,
                constexprs={names[i[0]]: v for i, v in constexprs.items() if isinstance(v, (int, str))},
                wide_offsets=_wide_offsets(compiled.asm["ttir"], kernel))


# Pointer arguments whose first offset (slot or expert id times a row or expert stride) passes
# 2**31 elements at real sizes: only a 64-bit product keeps it right.
WIDE_POINTERS = {
    "_decode_partial_kernel": ("K", "V"),
    "_extend_kernel": ("K", "V"),
    "_verify_partial_kernel": ("K", "V"),
    "_mla_decode_partial_kernel": ("KV",),
    "_mla_extend_kernel": ("KV",),
    "_expert_gemv_kernel": ("W", "Scale"),
}


def _wide_offsets(ttir: str, kernel) -> dict[str, bool]:
    """For each large pointer argument: whether the first offset added to it (slot or expert times
    its stride, the large part) is 64-bit in the kernel's TTIR."""
    out = {}
    names = [p.name for p in kernel.params]
    header = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", ttir, re.S).group(1)
    arg_ssa = {}
    for m in re.finditer(r"(%[\w]+): [^,]*?loc\(\"(\w+)\"", header):
        arg_ssa[m.group(2)] = m.group(1)
    if not arg_ssa:  # no names in the locations: arguments in order
        arg_ssa = {n: f"%arg{i}" for i, n in enumerate(names)}
    for name in WIDE_POINTERS.get(kernel.__name__, ()):
        ssa = arg_ssa.get(name)
        if ssa is None:
            continue  # a pointer specialised away (an unused placeholder)
        derived = {ssa}
        widths = []
        for line in ttir.splitlines():
            m = re.match(r"\s*(%[\w#]+) = (tt\.splat|tt\.addptr|tt\.broadcast|tt\.expand_dims) (%[\w#]+)(.*)", line)
            if not m or m.group(3) not in derived:
                continue
            derived.add(m.group(1))
            if m.group(2) == "tt.addptr":
                offset_type = m.group(4).split(" loc(")[0].split(":")[-1].split(",")[-1].strip()
                widths.append(offset_type == "i64" or offset_type.endswith("xi64>"))
        if widths:  # none: the pointer is an unread placeholder here
            out[name] = widths[0]
    return out


def _child(cases: list[tuple[str, int]], results: Path) -> None:
    """Compile every case; one JSON line per launch in ``results`` (Triton prints ptxas errors)."""
    import time

    for name, arch in cases:
        try:
            launches = _launch_case(name, arch)
        except Exception as e:  # noqa: BLE001 — reported as the case's failure
            _write(results, dict(case=name, arch=arch, error=f"launch: {type(e).__name__}: {e}"))
            continue
        for kernel, args, kwargs, grid in launches:
            t0 = time.perf_counter()
            try:
                res = _compile(kernel, args, kwargs, arch)
            except Exception as e:  # noqa: BLE001
                res = dict(kernel=kernel.__name__, error=f"{type(e).__name__}: {str(e)[-2000:]}")
            res.update(case=name, arch=arch, grid=[int(g) for g in grid], seconds=round(time.perf_counter() - t0, 2))
            _write(results, res)


def _write(results: Path, record: dict) -> None:
    with results.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _ptxas_missing() -> str | None:
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    path = os.environ.get("TRITON_PTXAS_PATH") or str(Path(triton.__file__).parent / "backends/nvidia/bin/ptxas")
    return None if os.path.exists(path) else f"no ptxas at {path}: Triton cannot compile for CUDA here"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, int], list[dict]]:
    missing = _ptxas_missing()
    if missing:
        pytest.skip(missing)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = tmp_path_factory.mktemp("triton-aot") / "compiled.jsonl"
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=Path(__file__).parents[2])
    results: dict[tuple[str, int], list[dict]] = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        r = json.loads(line)
        results.setdefault((r["case"], r["arch"]), []).append(r)
    assert proc.returncode == 0 and results, proc.stderr[-4000:]
    for (name, arch), rs in sorted(results.items()):  # the table, with -s
        for r in rs:
            print(f"sm_{arch} {name:32} {r.get('kernel', ''):28} shared {r.get('shared', '-'):>7} "
                  f"warps {r.get('num_warps', '-')} stages {r.get('num_stages', '-')} {r.get('seconds', '')}s")
    return results


@pytest.mark.parametrize("name,arch", _cases(), ids=[f"sm{a}-{n}" for n, a in _cases()])
def test_kernel_compiles_within_shared_memory(compiled, name, arch):
    results = compiled.get((name, arch))
    assert results, f"{name} launched no kernel"
    for r in results:
        assert "error" not in r, f"{r.get('kernel')} for sm_{arch}: {r['error']}"
        assert r["shared"] <= SHARED_LIMIT[arch], (
            f"{r['kernel']} needs {r['shared']} B of shared memory; sm_{arch} allows {SHARED_LIMIT[arch]}")


@pytest.mark.parametrize("name,arch", _cases(), ids=[f"sm{a}-{n}" for n, a in _cases()])
def test_pool_offsets_are_64_bit(compiled, name, arch):
    """Slot x row stride of a 4.4M-token pool, expert x stride of 256 stacked experts: past 2**31."""
    for r in compiled.get((name, arch), []):
        if r.get("kernel") in WIDE_POINTERS and "error" not in r:
            assert r["wide_offsets"], f"{r['kernel']}: no offset into its pools found in the TTIR"
        for pointer, wide in r.get("wide_offsets", {}).items():
            assert wide, f"{r['kernel']}: the offset into {pointer} is computed in 32 bits"


def test_every_kernel_is_compiled(compiled):
    """Each kernel of the engine is launched by some case on each arch (a new kernel needs one)."""
    import ast

    engine = Path(__file__).parents[2] / "worker/specdecode_worker/engine/kernels"
    kernels = set()
    for f in ("triton_attention.py", "triton_mla.py", "triton_moe.py", "layer_kernels.py"):
        for node in ast.walk(ast.parse((engine / f).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                kernels.add(node.name)
    for arch in SHARED_LIMIT:
        launched = {r["kernel"] for (_, a), rs in compiled.items() if a == arch for r in rs}
        assert kernels <= launched, f"sm_{arch}: no case launches {sorted(kernels - launched)}"


if __name__ == "__main__":
    _child(_cases(), Path(sys.argv[1]))
