"""The engine on one GPU at real sizes: start-up against the plan, decode speed against the HBM
roofline and against transformers on the same weights, and speculative speedup at controlled
acceptance. About 5 minutes on an H200, plus the peer's two compiles; benchmarks/device_check.sh
runs it with the CUDA tests. Results: docs/gpu-data-path.md.

Models are random bf16 weights made on the device (nothing downloaded): checkpoints are written as
sparse safetensors files (headers only, for the planner) and every engine is given a weight source
(``Engine(weights=...)``) that fills every parameter with seeded values on the device. Geometries: Llama-3.1-8B
(target), an EAGLE3 head for it, a Llama-3.2-1B-shaped STANDALONE draft, and DeepSeek-V3 cut to one
GPU (its MLA, grouped MoE routing, YaRN rope, hidden 7168, 128 heads and vocabulary, but 4 layers
and 64 routed experts, plus its NextN layer: about 20 GB). Settings: contextLength 8192 and every
other size at the planner's default for the GPU found.

The targets' weights are peaked (``peak_next_token``): random weights give nearly flat logits, and
a verify pass rounds them differently from a decode step in bf16, so greedy speculative output
would drift from the plain engine's by rounding alone. Every weight is still read and every pass
computed; the next token is a fixed function of the current one, with a wide margin.

Phases (``--phases``, each saved to ``--json`` as it ends; one that fails is reported and the
rest still run):
  decode      decode tok/s at batch 1, 8, 64 (1k-token prompts, 256 new tokens) against the
              roofline (weight bytes a step reads, the embedding table excepted, plus live KV, over
              a bandwidth: the measured device-to-device copy's, and the datasheet's where
              SPEC_BANDWIDTH knows the device), with the share of each; a profile of a batch-1 step
              (kernels per step, busy time, the kernels that take most); step time at batch 64 with
              live length 1k against 7k;
  peer        right after decode, so both are measured in one run on one device: transformers'
              LlamaForCausalLM with the decode target's config, dtype and weights (the same seeded
              loader) and a static KV cache, its decode step under torch.compile(mode=
              "reduce-overhead") in a plain greedy loop (transformers' documented recipe; tokens
              stay on the device, no generate() bookkeeping), at batch 1 and 8 on the decode rows'
              prompts and lengths, timed as ours after a warm-up run (compile and graph capture
              excluded): ours / peer per batch, how many of its greedy tokens equal ours, and its
              share of both rooflines (ours: the same bytes). Under --tiny the step is compiled
              with backend="eager" instead (dynamo still traces it whole, fullgraph): CUDA graphs do
              not exist on CPU, and inductor's C++ build would cost the test suite most of a minute;
  startup     the example's settings (8B + EAGLE3, planner defaults): planned against allocated KV
              tokens, planned against measured dynamic peak (phase 3's warm-up), then the EAGLE3
              chain at k = 3 with a controlled acceptance;
  standalone  the 1B draft at k = 3, controlled;
  mtp         MTP (k = 3) against no speculation at batch 1, and the load-aware sweep: no
              speculation, fixed k = 3 and the adaptive policy at 1, 4, 16 and 64 requests;
  longer      EAGLE3 and the 1B draft at k = 5, controlled;
  tree        an EAGLE3 tree (top-3, 3 steps, 6 nodes) with a random head: its graphs and cost;
  prefix      the prefix cache on a multi-turn chat workload (benchmarks/multi_turn.py: 8
              conversations of 4 turns under one 500-token system prompt), no speculation and the
              EAGLE3 chain, cache off and on: time to first token, tok/s, hit rate, same output.
Controlled rows (``controlled_draft.AcceptanceControl``): the draft's real forward passes, with each
proposal the target's own greedy token with probability 0.6, 0.8 or 0.9 (drawn per request, so
per run), at batch 1 (4 requests one after another) and 16, against the plain engine on the same
prompts; the output must stay the plain engine's. Each row reports the acceptance it realised
per token, and says so where that is more than 0.03 from nominal. Every engine row also reports
its planned against measured dynamic peak.

Run on a GPU box:  PYTHONPATH=worker:operator:. python benchmarks/gpu_serving.py [--json out.json]
CPU smoke run:     PYTHONPATH=worker:operator:. python benchmarks/gpu_serving.py --tiny
(``--tiny``: the same code path with a tiny geometry on CPU, in seconds; the tests run it.)
A saved run's table: python benchmarks/gpu_serving.py --table out.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "worker", ROOT / "operator", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from controlled_draft import AcceptanceControl  # noqa: E402
from multi_turn import random_workload, serve  # noqa: E402
from specdecode_worker.serving import serve_cli  # noqa: E402
from specdecode_worker.engine import model_runner  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine  # noqa: E402
from devtools.checkpoints import CONFIGS, _decoder_tensors, _deepseek_tensors, model_tensors, write_checkpoint  # noqa: E402,E501

LLAMA_1B = {  # meta-llama/Llama-3.2-1B-Instruct
    **CONFIGS["llama-3.1-8b-instruct"], "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
TINY_TARGET = {**CONFIGS["llama-3.1-8b-instruct"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
               "bos_token_id": 1, "eos_token_id": 2,
               "max_position_embeddings": 512, "torch_dtype": "float32"}
TINY_DRAFT = {**TINY_TARGET, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1}
# DeepSeek-V3 cut to one GPU: its geometry, 4 layers (3 dense + 1 MoE) and 64 routed experts, bf16.
DEEPSEEK_CUT = {
    **{k: v for k, v in CONFIGS["deepseek-v3"].items() if k != "quantization_config"},
    "num_hidden_layers": 4, "n_routed_experts": 64, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
TINY_DEEPSEEK = {
    **DEEPSEEK_CUT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16, "kv_lora_rank": 16,
    "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
RESIDUAL_SCALE = 0.01  # DeepSeek blocks' residual writes: small, so the next token follows the current one
TINY_EAGLE3 = {**CONFIGS["eagle3-llama-3.1-8b"], "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "draft_vocab_size": 256,
               "bos_token_id": 1, "eos_token_id": 2}


@dataclass
class Settings:
    device: str
    context: int
    prompt: int  # decode runs: prompt length
    new_tokens: int
    batches: tuple[int, ...]
    long_prompt: int  # step time at long live length
    step_batch: int
    step_tokens: int
    spec_batches: tuple[int, ...]
    k: int
    cpu_budget_gib: float | None = None
    configs: dict = field(default_factory=dict)
    chunk: int = 0  # prompt tokens per step; set from the plan's chunkedPrefillSize
    sweep_batches: tuple[int, ...] = (1, 4, 16, 64)  # load-aware speculation: concurrency of the MTP sweep
    sweep_tokens: int = 64
    acceptances: tuple[float, ...] = (0.6, 0.8, 0.9)  # controlled drafts: chance each proposal is the target's
    draft_ks: tuple[int, ...] = (3, 5)  # controlled drafts: proposals per round
    spec_tokens: int = 128  # new tokens per request in the speculative rows and their baseline
    # prefix cache: conversations, turns, system prompt and user message tokens, tokens per answer
    chat: tuple[int, int, int, int, int] = (8, 4, 500, 24, 64)
    peer_batches: tuple[int, ...] = (1, 8)  # the transformers peer's batch sizes, each one of ``batches``
    peer_backend: str = "inductor"  # its torch.compile backend ("eager" under --tiny: see the docstring)
    weights: Callable | None = None  # every engine's weight source (``run`` sets the seeded loaders)


FULL = Settings("cuda", 8192, 1024, 256, (1, 8, 64), 7168, 64, 16, (1, 16), 3,
                configs={"target": CONFIGS["llama-3.1-8b-instruct"], "draft1b": LLAMA_1B,
                         "eagle3": CONFIGS["eagle3-llama-3.1-8b"], "deepseek": DEEPSEEK_CUT})
TINY = Settings("cpu", 256, 24, 6, (1, 2), 180, 2, 3, (1, 2), 3, cpu_budget_gib=2.0, sweep_batches=(1, 2),
                sweep_tokens=6, acceptances=(0.5, 1.0), draft_ks=(2, 3), spec_tokens=8, chat=(2, 2, 40, 6, 6),
                peer_batches=(1, 2), peer_backend="eager",
                configs={"target": TINY_TARGET, "draft1b": TINY_DRAFT, "eagle3": TINY_EAGLE3,
                         "deepseek": TINY_DEEPSEEK})


# ---- models -------------------------------------------------------------------------------------
def eagle3_tensors(cfg: dict):
    if cfg is CONFIGS["eagle3-llama-3.1-8b"]:
        return model_tensors("eagle3-llama-3.1-8b")
    from devtools.checkpoints import _eagle3_tensors

    return _eagle3_tensors(cfg)


def write_models(root: Path, s: Settings) -> dict[str, Path]:
    """Sparse checkpoints (real headers, no data): what the planner reads."""
    c = s.configs
    out = {
        "target": write_checkpoint(root / "target", c["target"], _decoder_tensors(c["target"])),
        "draft1b": write_checkpoint(root / "draft1b", c["draft1b"], _decoder_tensors(c["draft1b"])),
        "eagle3": write_checkpoint(root / "eagle3", c["eagle3"], eagle3_tensors(c["eagle3"])),
        "deepseek": write_checkpoint(root / "deepseek", c["deepseek"], bf16_deepseek_tensors(c["deepseek"])),
    }
    return out


def bf16_deepseek_tensors(cfg: dict):
    """The published layout (NextN layer included) with every linear in bf16: no fp8 scales."""
    return [(name, "BF16" if dtype == "F8_E4M3" else dtype, shape) for name, dtype, shape in _deepseek_tensors(cfg)
            if not name.endswith("weight_scale_inv")]


def deepseek_loader(seed: int, residual_scale: float):
    """Random weights for the DeepSeek target and its NextN layer with a controlled acceptance.

    Residual writes (o_proj, down_proj) scaled by ``residual_scale`` and the embeddings and head
    peaked (``peak_next_token``): the target's next token is a function of the current token's
    embedding. The NextN layer gets eh_proj = [I | 0] (it reads the embedding of the token it
    continues) and the same small writes, so it picks what the target will pick (acceptance near
    1); the router bias is zero.
    """
    def load(model, model_dir, device, dtype):
        gen = torch.Generator(device=device).manual_seed(seed)
        state = {}
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                t = torch.zeros(p.shape, device=device, dtype=p.dtype)
            elif "norm" in name:
                t = torch.ones(p.shape, device=device, dtype=dtype)
            elif name.endswith("eh_proj.weight"):
                h = p.shape[0]
                t = torch.cat([torch.eye(h, device=device, dtype=dtype),
                               torch.zeros(h, h, device=device, dtype=dtype)], dim=1)
            else:
                std = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02
                t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0, std, generator=gen)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    t *= residual_scale
            state[name] = t
        peak_next_token(state, gen)
        model.load_state_dict(state, strict=False, assign=True)
    return load


def dispatch_loader(loaders: dict):
    """One weight source (``models.loader.WeightSource``) serving each model folder with its own loader."""
    def load(model, model_dir, device, dtype):
        loaders[str(Path(model_dir).resolve())](model, model_dir, device, dtype)
    return load


def random_loader(seeds: dict[str, tuple[int, bool]]):
    """A weight source in place of load_safetensors: seeded random weights made on the device. ``seeds[folder] =
    (seed, peaked)``; a peaked model (the target) gets ``peak_next_token``'s weights."""
    def load(model, model_dir, device, dtype):
        seed, peaked = seeds[str(Path(model_dir).resolve())]
        gen = torch.Generator(device=device).manual_seed(seed)
        state = {}
        for name, p in model.named_parameters():
            if "norm" in name:
                t = torch.ones(p.shape, device=device, dtype=dtype)
            else:
                std = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02
                t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0, std, generator=gen)
                if peaked and name.endswith(("o_proj.weight", "down_proj.weight")):
                    t *= RESIDUAL_SCALE
            state[name] = t
        if peaked:
            peak_next_token(state, gen)
        model.load_state_dict(state, strict=False, assign=True)
    return load


def peak_next_token(state: dict, gen: torch.Generator) -> None:
    """Random weights give nearly flat logits, whose argmax a verify pass (k + 1 rows per request)
    and a decode step (one row) round differently in bf16: greedy speculative output would then
    drift from the plain engine's by rounding, not by a fault. So: embeddings of RMS 1, residual
    writes scaled by RESIDUAL_SCALE (the caller's), and an LM head whose rows are the embeddings in
    a shuffled order. The last hidden state stays close to the current token's embedding, so the
    next token is a fixed function of the current one, ahead of the runner-up by about
    sqrt(hidden) standard deviations; every weight is still read and every pass still computed."""
    if "model.embed_tokens.weight" not in state or "lm_head.weight" not in state:
        return  # a NextN layer: it reads the target's embedding and head
    embed = state["model.embed_tokens.weight"]
    embed.normal_(0, 1, generator=gen)
    order = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
    state["lm_head.weight"] = embed[order].clone()


def randomise_head(module: torch.nn.Module, seed: int) -> None:
    """The EAGLE3 head is read from its sparse file (zeros): give it random values in place."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                continue
            if "norm" in name:
                p.fill_(1)
            else:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02, generator=gen)


# ---- engine runs ------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine(s: Settings, models, target: str, algorithm: str = "NONE", draft: str | None = None,
           policy: str = "fixed", extra: tuple[str, ...] = ()):
    """An engine planned in-process with the planner's defaults, as `serve` would be (``extra``:
    more serve flags, later ones winning)."""
    # fixed (unless asked): every round drafts k, so the rows measure speculation at a controlled acceptance
    argv = ["--target", str(models[target]), "--algorithm", algorithm, "--device", s.device,
            "--context-length", str(s.context), "--num-draft-tokens", str(s.k), "--spec-policy", policy]
    if draft:
        argv += ["--draft", str(models[draft])]
    argv += list(extra)
    if s.cpu_budget_gib:
        argv += ["--device-memory-gib", str(s.cpu_budget_gib)]
    engine_args, plan = serve_cli.resolve(serve_cli.parser().parse_args(argv))
    eng = Engine(engine_args, weights=s.weights)
    eng.init_model_worker()
    return eng, plan


def release(device: str) -> None:
    """After a phase function returned (its engine unreferenced): give the memory back."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def generate(eng, s: Settings, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    """Requests admitted in waves of at most one prefill chunk of prompt tokens per step (the engine
    prefills whatever it admits in one pass), then the decode steps timed on their own."""
    vocab = eng.target_shape.vocab_size
    reqs = [Request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            for p in prompts(batch, prompt_len, vocab, seed)]
    wave = max(1, s.chunk // prompt_len)
    sync(s.device)
    t0 = time.perf_counter()
    for start in range(0, batch, wave):
        for r in reqs[start : start + wave]:
            eng.submit(r)
        eng.step()
    sync(s.device)
    t1 = time.perf_counter()
    after_admission = sum(len(r.output_ids) for r in reqs)
    steps = 0
    while not all(r.done.is_set() for r in reqs):
        eng.step()
        steps += 1
    sync(s.device)
    t2 = time.perf_counter()
    decoded = sum(len(r.output_ids) for r in reqs) - after_admission
    return {"batch": batch, "admission_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens": decoded, "steps": steps,
            "tok_s": decoded / max(t2 - t1, 1e-9), "step_ms": 1e3 * (t2 - t1) / max(steps, 1),
            "outputs": [r.output_ids for r in reqs]}


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    n = (2 << 30) if device == "cuda" else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    secs = time.perf_counter() - t0
    del x, y
    return 2 * n * reps / secs


# Datasheet memory bandwidth (bytes/s) by device name: (words the name must hold, label, B/s), the
# first match wins, so a variant comes before its family. Whole words: "GH200" is not an H200.
SPEC_BANDWIDTH = (
    (("H100", "PCIE"), "H100 PCIe", 2.0e12),
    (("H100", "NVL"), "H100 NVL", 3.9e12),
    (("H100",), "H100 SXM", 3.35e12),  # "NVIDIA H100 80GB HBM3"
    (("H200",), "H200", 4.8e12),  # SXM and NVL alike
    (("A100", "80GB", "PCIE"), "A100 80GB PCIe", 1.935e12),
    (("A100", "80GB"), "A100 80GB SXM", 2.039e12),
    (("A100",), "A100 40GB", 1.555e12),
    (("L40S",), "L40S", 0.864e12),
)


def spec_bandwidth(device_name: str) -> tuple[str | None, float | None]:
    """The datasheet's bandwidth for ``device_name`` and the entry's label; (None, None) where the
    table has none (CPU, an unlisted GPU)."""
    words = set(re.split(r"[\s_-]+", device_name.upper()))
    for needed, label, bps in SPEC_BANDWIDTH:
        if words.issuperset(needed):
            return label, bps
    return None, None


def static_bytes(eng) -> int:
    """Weights, KV pools and the req_to_token map the engine holds (what the plan calls static)."""
    target = eng.target_runner
    total = target.req_to_token_pool.nbytes()
    for runner in (target, eng.draft_runner):
        if runner is not None:
            total += runner.weight_bytes + runner.token_to_kv_pool.nbytes()
    return total


def record_peak(res: dict, row: str, eng) -> None:
    """Phase 3's planned against measured dynamic peak of the engine serving ``row``."""
    peak = eng.dynamic_peak
    res.setdefault("peaks", []).append({"row": row, "planned": peak.planned, "measured": peak.measured,
                                        "passes": list(peak.passes), "note": peak.note})


# ---- the report ---------------------------------------------------------------------------------
# One function per engine: its locals (engine, runners) die when it returns, so the next engine is
# planned against a GPU the last one has left.
def startup_phase(s: Settings, models, res: dict, base: dict) -> None:
    """The example's settings (8B + EAGLE3, planner defaults), warmed up at the largest graph batch
    and the largest prefill chunk; the allocator's peak beyond weights and pools is the dynamic peak.
    Then the same engine's controlled-acceptance rows at k = its default."""
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eng, plan = engine(s, models, "target", "EAGLE3", "eagle3")
    randomise_head(eng.draft_runner.model, 7)
    r = plan.reserve
    res["startup"] = "ok"
    res["planned_kv_tokens"] = plan.kv_cache.max_total_num_tokens
    res["allocated_kv_tokens"] = eng.target_runner.token_to_kv_pool_allocator.size
    res["planned_dynamic_bytes"] = r.dynamic_bytes
    res["warmup"] = eng.dynamic_peak.as_dict()  # phase 3: allocated peak over the warm-up's workloads
    record_peak(res, "EAGLE3 chain", eng)
    res["cuda_graph_max_bs"], res["chunked_prefill_size"] = r.cuda_graph_max_bs, r.chunked_prefill_size
    generate(eng, s, min(r.cuda_graph_max_bs, r.max_running_requests), 16, 4)  # largest graph batch
    generate(eng, s, 1, min(s.chunk, s.context - 8), 2)  # largest prefill chunk
    controlled_rows(s, eng, res, "eagle3", s.k, base)
    if s.device == "cuda":  # the allocator's reserved peak since the warm-up, serving included
        res["serving_reserved_dynamic_bytes"] = torch.cuda.max_memory_reserved() - static_bytes(eng)


def decode_read_bytes(runner) -> int:
    """Weight bytes a decode step reads: all but the embedding table (a step looks up one row per
    request), unless the table is also the LM head."""
    model = runner.model
    if getattr(model, "tie_word_embeddings", True):
        return runner.weight_bytes
    table = model.model.embed_tokens.weight
    return runner.weight_bytes - table.numel() * table.element_size()


def add_roofline(row: dict, s: Settings, res: dict) -> dict:
    """``row``'s roofline at each bandwidth source and its share of each: a step reads the weights
    (``decode_read_bytes``) and every request's live KV (at the run's mean live length); over the
    measured copy bandwidth (``roofline_tok_s``, ``of_roofline``) and the datasheet's
    (``spec_roofline_tok_s``, ``of_spec_roofline``: None where SPEC_BANDWIDTH has no entry)."""
    b = row["batch"]
    step_bytes = res["decode_read_weight_bytes"] + b * (s.prompt + s.new_tokens / 2) * res["kv_bytes_per_token"]
    for prefix, gbps in (("", res["bandwidth_GBps"]), ("spec_", res["spec_bandwidth_GBps"])):
        roofline = None if gbps is None else b * gbps * 1e9 / step_bytes
        row[f"{prefix}roofline_tok_s"] = roofline
        row[f"of_{prefix}roofline"] = None if roofline is None else row["tok_s"] / roofline
    return row


def decode_phase(s: Settings, models, res: dict, batches: tuple[int, ...], extras: bool, ours: dict) -> dict:
    """Decode speed against the roofline at ``batches`` (each one's greedy outputs kept in ``ours``,
    for the peer), and with ``extras`` the profile and step time against live length; returns the
    plain engine's runs on the speculative rows' prompts, which they are compared with."""
    eng, plan = engine(s, models, "target")
    s.chunk = plan.reserve.chunked_prefill_size  # every later prompt is admitted in waves of one chunk
    runner = eng.target_runner
    res["decode_read_weight_bytes"] = decode_read_bytes(runner)
    res["kv_bytes_per_token"] = runner.token_to_kv_pool.bytes_per_token()
    for b in batches:
        out = generate(eng, s, b, s.prompt, s.new_tokens)
        ours[b] = out.pop("outputs")
        res.setdefault("decode", []).append(add_roofline(out, s, res))
    if extras:
        res["decode_profile"] = profile_decode(eng, s)
        res["step_ms"] = {length: generate(eng, s, s.step_batch, length, s.step_tokens)["step_ms"]
                          for length in (s.prompt, s.long_prompt)}
    generate(eng, s, max(s.spec_batches), s.prompt, 4, seed=1)  # untimed: the first run pays one-time costs
    return {b: spec_baseline(eng, s, b) for b in s.spec_batches}


def peer_phase(s: Settings, models, res: dict, load, ours: dict) -> None:
    """transformers on the decode rows' target, weights, prompts and lengths, right after them: per
    batch its decode tok/s, ours / peer, its greedy tokens that equal ours and its roofline shares.
    The roofline is ours, the same work: its attention reads the whole static cache (prompt + new
    tokens, masked), at most new_tokens / 2 positions per request more than the mean live length."""
    model = hf_target(s, models["target"], load)
    step = compiled_step(s.peer_backend)
    ours_tok_s = {d["batch"]: d["tok_s"] for d in res.get("decode", [])}
    try:
        for b in s.peer_batches:
            row, outputs = peer_row(model, step, s, b)
            row["ratio"] = ours_tok_s[b] / row["tok_s"] if b in ours_tok_s else None
            row["same_tokens"] = sum(x == y for mine, theirs in zip(ours.get(b, []), outputs)
                                     for x, y in zip(mine, theirs))
            row["tokens"] = sum(map(len, outputs))
            res.setdefault("peer", []).append(add_roofline(row, s, res))
    finally:
        torch._dynamo.reset()  # frees the compiled step's CUDA graphs before the next engine plans the device


def hf_target(s: Settings, folder: Path, load):
    """transformers' Llama with the target's config and the engine's dtype, filled by the engine's
    own loader: it draws each parameter by name in module order, and transformers' names, order and
    shapes are the engine's before it fuses q/k/v and gate/up, so the values are the same."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = s.configs["target"]
    dtype = model_runner.resolve_dtype(None, cfg.get("torch_dtype"), torch.device(s.device).type)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=dtype)
    load(model, folder, s.device, dtype)
    return model.eval()


def greedy_step(model, tokens: torch.Tensor, cache_args: dict) -> torch.Tensor:
    """transformers' forward over ``tokens`` and each row's greedy next token."""
    logits = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **cache_args).logits
    return logits[:, -1].argmax(-1, keepdim=True)


def compiled_step(backend: str):
    """The decode step as transformers documents it for a static cache: one graph (fullgraph), fixed
    shapes per batch (dynamic=False), CUDA graphs (mode="reduce-overhead")."""
    options = {"mode": "reduce-overhead"} if backend == "inductor" else {"backend": backend}
    return torch.compile(greedy_step, fullgraph=True, dynamic=False, **options)


def static_cache_args(model, cache, positions: torch.Tensor) -> dict:
    """How this transformers takes a static cache: ``cache=`` where the cache counts its own
    positions (recent 5.x), else ``past_key_values=`` with the positions it writes."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": cache}
    return {"past_key_values": cache, "cache_position": positions}


def peer_row(model, step, s: Settings, b: int) -> tuple[dict, list[list[int]]]:
    """A warm-up run (compile, CUDA graph capture), then the timed one, on the decode rows' prompts."""
    from transformers import StaticCache

    from torch._dynamo.utils import counters

    ids = torch.tensor(prompts(b, s.prompt, model.config.vocab_size, 0), device=s.device)
    cache = StaticCache(config=model.config, max_cache_len=s.prompt + s.new_tokens)
    skips = counters["inductor"]["cudagraph_skips"]
    start = time.perf_counter()
    peer_generate(model, step, cache, ids, s.new_tokens)
    warmup = time.perf_counter() - start
    row, outputs = peer_generate(model, step, cache, ids, s.new_tokens)
    # Inductor falls back silently where it cannot use CUDA graphs (always on CPU): a slower peer, so counted.
    skips = counters["inductor"]["cudagraph_skips"] - skips
    return {"batch": b, **row, "warmup_s": warmup, "backend": s.peer_backend, "cudagraph_skips": skips,
            "generated": [len(o) for o in outputs]}, outputs


# Tokens per request that our admission step yields, untimed: Engine.step prefills a chunk, then runs
# a decode round for every decoding request, the just-prefilled ones included.
ADMITTED_TOKENS = 2


def peer_generate(model, step, cache, ids: torch.Tensor, new_tokens: int) -> tuple[dict, list[list[int]]]:
    """Greedy decoding timed as ``generate`` times ours: the prompt's pass and the decode steps up to
    ``ADMITTED_TOKENS`` untimed, then the steps yielding every later token, synced before and after
    (decode tok/s without prefill, over the same tokens as ours)."""
    b, n = ids.shape
    cache.reset()  # in place: the captured graphs keep reading the same buffers
    with torch.no_grad():
        out = [greedy_step(model, ids, static_cache_args(model, cache, torch.arange(n, device=ids.device)))]
        args = static_cache_args(model, cache, torch.tensor([n], device=ids.device))
        decode_steps(model, step, args, out, ADMITTED_TOKENS - 1)
        sync(ids.device.type)
        t1 = time.perf_counter()
        decode_steps(model, step, args, out, new_tokens - ADMITTED_TOKENS)
        sync(ids.device.type)
        secs = time.perf_counter() - t1
    steps = new_tokens - ADMITTED_TOKENS
    row = {"decode_s": secs, "decode_tokens": b * steps, "steps": steps, "tok_s": b * steps / max(secs, 1e-9),
           "step_ms": 1e3 * secs / max(steps, 1)}
    return row, torch.cat(out, dim=1).tolist()


def decode_steps(model, step, args: dict, out: list, count: int) -> None:
    """``count`` decode steps, each from the last token in ``out``, appending the next; on the device
    throughout (no sync)."""
    for _ in range(count):
        out.append(step(model, out[-1], args).clone())  # the next graph replay overwrites its output
        if "cache_position" in args:  # the older API: its positions, advanced in place
            args["cache_position"] += 1


SEQUENCE = 4  # requests the controlled rows run one after another at batch 1
REALISED_WITHIN = 0.03  # a controlled row whose realised acceptance is further from nominal says so


def spec_baseline(eng, s: Settings, b: int) -> dict:
    """The plain engine on the speculative rows' prompts: at batch 1, ``SEQUENCE`` requests one
    after another (prompt seeds 5, 6, ...), at a larger batch one wave (seed 5); and, untimed, the
    target's continuation of each prompt past the rows' end by the longest chain, which controlled
    drafts propose from (a round that verifies past a request's end is judged on real tokens)."""
    seeds = list(range(5, 5 + (SEQUENCE if b == 1 else 1)))
    runs = [generate(eng, s, b, s.prompt, s.spec_tokens, seed=seed) for seed in seeds]
    longer = s.spec_tokens + max(s.draft_ks) + 1
    vocab = eng.target_shape.vocab_size
    continuations = {}
    for seed in seeds:
        longer_run = generate(eng, s, b, s.prompt, longer, seed=seed)["outputs"]
        continuations.update(zip(map(tuple, prompts(b, s.prompt, vocab, seed)), longer_run))
    return {"seeds": seeds, "tok_s": combined_tok_s(runs), "outputs": runs[0]["outputs"],
            "runs": [r["outputs"] for r in runs], "continuations": continuations}


def combined_tok_s(runs: list[dict]) -> float:
    return sum(r["decode_tokens"] for r in runs) / max(sum(r["decode_s"] for r in runs), 1e-9)


def profile_decode(eng, s: Settings, steps: int = 8) -> dict:
    """Where a batch-1 decode step's device time goes: kernels per step and the kernels that take
    the most, from the profiler over ``steps`` steps (on CPU: operators, to exercise the code)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    req = Request(prompts(1, s.prompt, eng.target_shape.vocab_size, 3)[0],
                  SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    eng.submit(req)
    while len(req.output_ids) < 2:  # prefilled and one step decoded: what follows is decode only
        eng.step()
    sync(s.device)
    cuda = s.device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
        sync(s.device)
    while not req.done.is_set():
        eng.step()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and (cuda or e.cpu_parent is None)]

    def us(e) -> float:
        return e.device_time if cuda else e.cpu_time

    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(us(e))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"unit": "device kernels" if cuda else "CPU operators", "per_step": len(events) / steps,
            "busy_us_per_step": sum(us(e) for e in events) / steps,
            "top": [{"name": n[:90], "per_step": len(t) / steps, "us_per_step": sum(t) / steps} for n, t in top]}


def controlled_rows(s: Settings, eng, res: dict, draft: str, k: int, base: dict) -> None:
    """The engine's draft at each controlled acceptance rate and batch, against the plain engine on
    the same prompts (at batch 1, ``SEQUENCE`` requests one after another): its real forward
    passes, the target's continuation as its proposals. Each row reports the acceptance it
    realised per token, the rate r at which each proposal is kept given the ones before it were:
    accepted tokens over accepted tokens plus rounds that rejected one (every round drafts k)."""
    continuations = {p: out for b in s.spec_batches for p, out in base[b]["continuations"].items()}
    control = AcceptanceControl(eng.speculator, continuations, eng.target_shape.vocab_size)
    stats = eng.stats
    for rate in s.acceptances:
        control.rate = rate
        for b in s.spec_batches:
            before = (stats.accepted_tokens, stats.proposed_tokens, stats.verify_rounds, stats.accept_lengths[k])
            runs = [generate(eng, s, b, s.prompt, s.spec_tokens, seed=seed) for seed in base[b]["seeds"]]
            accepted, proposed, rounds, whole = (now - was for now, was in zip(
                (stats.accepted_tokens, stats.proposed_tokens, stats.verify_rounds, stats.accept_lengths[k]), before))
            tok_s = combined_tok_s(runs)
            res.setdefault("spec", []).append({
                "draft": draft, "k": k, "rate": rate, "batch": b, "requests": b * len(runs), "tok_s": tok_s,
                "realised": accepted / max(accepted + rounds - whole, 1),
                "acceptance": accepted / max(proposed, 1), "accept_len": accepted / max(rounds, 1),
                "baseline_tok_s": base[b]["tok_s"], "speedup": tok_s / base[b]["tok_s"],
                "same_output": [r["outputs"] for r in runs] == base[b]["runs"]})


def spec_phase(s: Settings, models, res: dict, algorithm: str, draft: str, k: int, base: dict) -> None:
    """A draft at ``k`` proposals per round, at the controlled rates, against the plain engine."""
    eng, _ = engine(s, models, "target", algorithm, draft, extra=("--num-draft-tokens", str(k)))
    if algorithm == "EAGLE3":
        randomise_head(eng.draft_runner.model, 7)
    record_peak(res, f"{algorithm} {draft} k={k}", eng)
    controlled_rows(s, eng, res, draft, k, base)


# The EAGLE3 tree row: top-3 expansions over 3 steps, 6 nodes verified per round.
TREE = ("--speculative-eagle-topk", "3", "--speculative-num-steps", "3", "--num-draft-tokens", "6")


def tree_phase(s: Settings, models, res: dict, base: dict) -> None:
    """EAGLE3 drafting trees with the random head against the plain engine, on the same prompts, at
    the first speculative batch: on a GPU its draft-tree steps and tree verify passes replay graphs
    (the graph batch sizes the plan priced for the tree)."""
    eng, plan = engine(s, models, "target", "EAGLE3", "eagle3", extra=TREE)
    randomise_head(eng.draft_runner.model, 7)
    record_peak(res, "EAGLE3 tree", eng)
    b = s.spec_batches[0]
    before = (eng.stats.accepted_tokens, eng.stats.verify_rounds)
    out = generate(eng, s, b, s.prompt, s.spec_tokens, seed=5)
    rounds = eng.stats.verify_rounds - before[1]
    res["eagle3_tree"] = {"batch": b, "accept_len": (eng.stats.accepted_tokens - before[0]) / max(rounds, 1),
                          "tok_s": out["tok_s"], "baseline_tok_s": base[b]["tok_s"],
                          "speedup": out["tok_s"] / base[b]["tok_s"],
                          "same_output": out["outputs"] == base[b]["outputs"],
                          "graphs": sorted(f"{name} x{width}" for name, width in eng.speculator.passes.graphs),
                          "planned_dynamic_bytes": plan.reserve.dynamic_bytes}


MTP_METHODS = (("none", "NONE", "fixed"), ("fixed", "MTP", "fixed"), ("adaptive", "MTP", "adaptive"))


def mtp_phase(s: Settings, models, res: dict) -> None:
    """MTP (k drafts from the target's NextN layer) against the plain engine: at batch 1 with the
    fixed policy, and a sweep over concurrency of no speculation, fixed k and the adaptive policy
    (load-aware speculation), on the same prompts. One engine at a time: each plans the whole
    device; an engine that fails is reported and the others still run."""
    runs, sweep = {}, []
    for method, algorithm, policy in MTP_METHODS:
        try:
            mtp_engine_runs(s, models, res, method, algorithm, policy, runs, sweep)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the next engine still runs
            res.setdefault("errors", {})[f"MTP {method}"] = error_text(exc)
        release(s.device)
    res["mtp_sweep"] = sweep
    if "NONE" in runs and "MTP" in runs:
        base, mtp = runs["NONE"], runs["MTP"]
        res["mtp"] = {"batch": 1, "k": s.k, "acceptance": mtp["acceptance"], "tok_s": mtp["tok_s"],
                      "baseline_tok_s": base["tok_s"], "speedup": mtp["tok_s"] / base["tok_s"],
                      "same_output": mtp["outputs"] == base["outputs"], "decode_tokens": mtp["decode_tokens"]}
    plain = {r["concurrency"]: r["outputs"] for r in sweep if r["method"] == "none"}
    for r in sweep:
        outputs = r.pop("outputs")
        r["same_output"] = outputs == plain[r["concurrency"]] if r["concurrency"] in plain else None


def mtp_engine_runs(s: Settings, models, res: dict, method: str, algorithm: str, policy: str,
                    runs: dict, sweep: list) -> None:
    eng, _ = engine(s, models, "deepseek", algorithm, policy=policy)
    if method == "fixed":
        record_peak(res, "MTP", eng)
    if policy == "fixed":
        runs[algorithm] = generate_counting(eng, s, 1, s.new_tokens, seed=9)
    for c in s.sweep_batches:
        plain_before = (eng.stats.steps_without_speculation, eng.stats.decode_steps)
        out = generate_counting(eng, s, c, s.sweep_tokens, seed=11)
        steps = eng.stats.decode_steps - plain_before[1]
        drafting = 1 - (eng.stats.steps_without_speculation - plain_before[0]) / max(steps, 1)
        sweep.append({"method": method, "concurrency": c, "tok_s": out["tok_s"], "acceptance": out["acceptance"],
                      "drafting_rounds": drafting if algorithm != "NONE" else 0.0, "outputs": out["outputs"]})


def prefix_phase(s: Settings, models, res: dict) -> None:
    """The multi-turn workload with the prefix cache off and on, for no speculation and the EAGLE3
    chain (random head), one engine at a time; outputs must not change with the cache."""
    conversations, turns, system, user, new = s.chat
    rows = res["prefix"] = []
    for algorithm, draft in (("NONE", None), ("EAGLE3", "eagle3")):
        outputs = {}
        for cache in (False, True):
            flags = () if cache else ("--disable-prefix-cache",)
            eng, _ = engine(s, models, "target", algorithm, draft, extra=flags)
            firsts, follow_ups = random_workload(eng.target_shape.vocab_size, conversations, turns, system, user)
            name = f"{algorithm}, cache {'on' if cache else 'off'}"
            result = serve(eng, name, firsts, follow_ups, new, eos=None, sync=lambda: sync(s.device))
            outputs[cache] = result.outputs
            rows.append(result.summary())
            del eng
            release(s.device)
        rows[-1]["same_output"] = outputs[True] == outputs[False]


def generate_counting(eng, s: Settings, batch: int, new_tokens: int, seed: int) -> dict:
    """``generate`` at the standard prompt length, with the acceptance of its rounds."""
    before = (eng.stats.accepted_tokens, eng.stats.proposed_tokens)
    out = generate(eng, s, batch, s.prompt, new_tokens, seed=seed)
    out["acceptance"] = (eng.stats.accepted_tokens - before[0]) / max(eng.stats.proposed_tokens - before[1], 1)
    return out


def error_text(exc: BaseException) -> str:
    """An error in one line: its type, message and the innermost frame of this project that raised it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "specdecode" in f.filename or
              "benchmarks" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"[:600]


PHASES = ("decode", "peer", "startup", "standalone", "mtp", "longer", "tree", "prefix")


def run(s: Settings, root: Path, log=print, save=lambda res: None, phases=PHASES) -> dict:
    """The phases asked for, in turn (the plain engine's baseline always runs); a phase that fails
    is recorded under ``errors`` and the next one still runs. ``save(res)`` after each phase, so a
    run cut short keeps what it measured."""
    models = write_models(root, s)
    seeds = {str(models["target"].resolve()): (0, True), str(models["draft1b"].resolve()): (1, False)}
    loaders = {folder: random_loader(seeds) for folder in seeds}
    loaders[str(models["deepseek"].resolve())] = deepseek_loader(3, RESIDUAL_SCALE)
    s.weights = dispatch_loader(loaders)
    res: dict = {"device": torch.cuda.get_device_name() if s.device == "cuda" else "cpu", "errors": {}}
    bw = copy_bandwidth(s.device)
    release(s.device)
    res["bandwidth_GBps"] = bw / 1e9
    res["spec_device"], spec = spec_bandwidth(res["device"])
    res["spec_bandwidth_GBps"] = None if spec is None else spec / 1e9
    log(f"device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s; datasheet: "
        + (f"{spec / 1e9:.0f} GB/s ({res['spec_device']})" if spec else "unknown"))
    base: dict = {}
    ours: dict = {}  # the decode rows' greedy outputs by batch, which the peer's are compared with

    def phase(name: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - an OOM or a crash is a finding: recorded, the rest runs
            res["errors"][name] = error_text(exc)
            log(f"{name}: {res['errors'][name]}")
        release(s.device)
        res.setdefault("phase_s", {})[name] = time.perf_counter() - start
        log(f"{name}: {res['phase_s'][name]:.0f} s")
        save(res)

    # The peer alone still needs ours at its batch sizes, from the same run.
    rows = s.batches if "decode" in phases else s.peer_batches if "peer" in phases else ()
    phase("decode", lambda: base.update(decode_phase(s, models, res, rows, "decode" in phases, ours)))
    if not base:
        return res
    if "peer" in phases:  # right after ours: the same device in the same run
        phase("peer", peer_phase, s, models, res, loaders[str(models["target"].resolve())], ours)
    if "startup" in phases:
        phase("startup", startup_phase, s, models, res, base)
        res.setdefault("startup", "failed: " + res["errors"].get("startup", "not run"))
    # Most wanted first (a run cut at its time budget loses the last): the default k for both
    # drafts, the MTP sweep, then the longer chains and the tree.
    if "standalone" in phases:
        phase(f"STANDALONE k={s.k}", spec_phase, s, models, res, "STANDALONE", "draft1b", s.k, base)
    if "mtp" in phases:
        phase("MTP", mtp_phase, s, models, res)
    for k in (k for k in s.draft_ks if k != s.k and "longer" in phases):
        phase(f"EAGLE3 k={k}", spec_phase, s, models, res, "EAGLE3", "eagle3", k, base)
        phase(f"STANDALONE k={k}", spec_phase, s, models, res, "STANDALONE", "draft1b", k, base)
    if "tree" in phases:
        phase("EAGLE3 tree", tree_phase, s, models, res, base)
    if "prefix" in phases:
        phase("prefix cache", prefix_phase, s, models, res)
    return res


def table(res: dict) -> str:
    """Every row the run measured, and one row per phase that failed."""
    gib = 1 << 30
    spec = res.get("spec_bandwidth_GBps")
    rows = [("device", res["device"]), ("copy bandwidth", f"{res['bandwidth_GBps']:.0f} GB/s (measured)"),
            ("datasheet bandwidth", f"{spec:.0f} GB/s ({res['spec_device']})" if spec else "unknown")]
    for d in res.get("decode", []):
        rows.append((f"decode batch {d['batch']}",
                     f"{d['tok_s']:.1f} tok/s ({d['step_ms']:.2f} ms per step) = {roofline_text(d)}"))
    prof = res.get("decode_profile")
    if prof:
        top = ", ".join(f"{t['name'][:40]} {t['us_per_step']:.0f}" for t in prof["top"][:5])
        rows.append(("decode batch 1, one step", f"{prof['per_step']:.0f} {prof['unit']}, busy "
                     f"{prof['busy_us_per_step']:.0f} us; most time (us): {top}"))
    if res.get("step_ms"):
        (short, s_ms), (long, l_ms) = sorted((int(k), v) for k, v in res["step_ms"].items())
        rows.append(("step time at live length", f"{short}: {s_ms:.2f} ms, {long}: {l_ms:.2f} ms"))
    for p in res.get("peer", []):
        ratio = "n/a" if p["ratio"] is None else f"{p['ratio']:.2f}x"
        rows.append((f"transformers peer batch {p['batch']}",
                     f"{p['tok_s']:.1f} tok/s ({p['step_ms']:.2f} ms per step) = {roofline_text(p)}; ours / peer "
                     f"{ratio}; greedy tokens equal to ours {p['same_tokens']} / {p['tokens']}; warm-up "
                     f"(compile, capture; backend {p['backend']}) {p['warmup_s']:.0f} s"
                     + (f"; CUDA graphs skipped {p['cudagraph_skips']} times" if p.get("cudagraph_skips") else "")))
    rows.append(("start-up (8B + EAGLE3, planner defaults)", res.get("startup", "not run")))
    if res.get("startup") == "ok":
        rows += [("KV tokens planned / allocated", f"{res['planned_kv_tokens']} / {res['allocated_kv_tokens']}"),
                 ("graph batch / prefill chunk", f"{res['cuda_graph_max_bs']} / {res['chunked_prefill_size']}")]
        warm = res["warmup"]
        measured = warm["measured"]
        rows.append(("dynamic bytes planned / measured", f"{res['planned_dynamic_bytes'] / gib:.2f} GiB / "
                     + (f"{measured / gib:.2f} GiB (warm-up: a {warm['prompt_tokens']}-token prompt in "
                        f"{warm['chunk_tokens']}-token chunks, a round of {warm['batch']} x {warm['width']} tokens)"
                        if measured is not None else f"not measured ({warm['note']})")))
        reserved = res.get("serving_reserved_dynamic_bytes")
        if reserved is not None:
            rows.append(("reserved beyond static after serving", f"{reserved / gib:.2f} GiB"))
    for r in res.get("spec", []):
        off = "" if abs(r["realised"] - r["rate"]) <= REALISED_WITHIN else f" (more than {REALISED_WITHIN} off nominal)"
        rows.append((f"{r['draft']} k={r['k']} rate {r['rate']:.1f} batch {r['batch']}",
                     f"{r['tok_s']:.1f} vs {r['baseline_tok_s']:.1f} tok/s = {r['speedup']:.2f}x, realised "
                     f"acceptance {r['realised']:.3f}{off}, {r['accept_len']:.2f} accepted per round over "
                     f"{r['requests']} requests, same output: {r['same_output']}"))
    t = res.get("eagle3_tree")
    if t:
        rows.append((f"EAGLE3 tree top-3, 3 steps, 6 nodes batch {t['batch']}",
                     f"{t['tok_s']:.1f} vs {t['baseline_tok_s']:.1f} tok/s = {t['speedup']:.2f}x, accept length "
                     f"{t['accept_len']:.2f}, same output: {t['same_output']}, graphs: {len(t['graphs'])}"))
    m = res.get("mtp")
    if m:
        rows.append((f"MTP (DeepSeek-V3 cut) k={m['k']} batch 1",
                     f"acceptance {m['acceptance']:.2f}, {m['tok_s']:.1f} vs {m['baseline_tok_s']:.1f} tok/s = "
                     f"{m['speedup']:.2f}x, same output: {m['same_output']}"))
    for c, best, adaptive, cells in sweep_rows(res.get("mtp_sweep", [])):
        ratio = "" if adaptive is None else f"; adaptive / best of none, fixed = {adaptive / best:.2f}"
        rows.append((f"MTP k=3 sweep, {c} requests", cells + ratio))
    for r in res.get("prefix", []):
        same = f", same output: {r['same_output']}" if "same_output" in r else ""
        rows.append((f"multi-turn chat, {r['config']}",
                     f"TTFT first / later turns {1e3 * r['ttft_first_turn_s']:.0f} / "
                     f"{1e3 * r['ttft_later_turns_s']:.0f} ms, {r['tokens_per_s']:.1f} tok/s, "
                     f"hit rate {r['hit_rate']:.1%}{same}"))
    rows += peak_rows(res)
    rows += [(f"FAILED {name}", err) for name, err in res.get("errors", {}).items()]
    return _render(rows)


def roofline_text(row: dict) -> str:
    """A row's share of its roofline at the copy bandwidth and at the datasheet's."""
    text = f"{100 * row['of_roofline']:.0f}% of roofline {row['roofline_tok_s']:.1f} tok/s at the copy bandwidth"
    if row.get("of_spec_roofline") is None:  # a CPU, an unlisted GPU, or a run saved before the column
        return text + ", no datasheet roofline"
    return text + f", {100 * row['of_spec_roofline']:.0f}% of {row['spec_roofline_tok_s']:.1f} tok/s at the datasheet's"


def peak_rows(res: dict) -> list[tuple[str, str]]:
    """Planned against measured dynamic peak, one row per engine the report started."""
    gib, rows = 1 << 30, []
    for p in res.get("peaks", []):
        planned = "no plan" if p["planned"] is None else f"{p['planned'] / gib:.2f} GiB"
        measured = "not measured" if p["measured"] is None else f"measured {p['measured'] / gib:.2f} GiB"
        verdict = "" if None in (p["planned"], p["measured"]) else \
            (", within plan" if p["measured"] <= p["planned"] else ", ABOVE PLAN")
        rows.append((f"dynamic peak {p['row']}", f"planned {planned} / {measured}{verdict}"))
    return rows


def _render(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)


def sweep_rows(sweep: list[dict]):
    """Per concurrency: the better of none and fixed (None when one is missing), adaptive (None when
    missing), and every method's tok/s in words."""
    by = {(r["method"], r["concurrency"]): r for r in sweep}
    for c in sorted({r["concurrency"] for r in sweep}):
        cells = ", ".join(f"{m} {by[(m, c)]['tok_s']:.1f}" + (f" ({by[(m, c)]['drafting_rounds']:.0%} drafting)"
                                                             if m == "adaptive" else "")
                          for m, _, _ in MTP_METHODS if (m, c) in by)
        pair = [by[(m, c)]["tok_s"] for m in ("none", "fixed") if (m, c) in by]
        best = max(pair) if len(pair) == 2 else None
        adaptive = by[("adaptive", c)]["tok_s"] if ("adaptive", c) in by and best else None
        yield c, best, adaptive, cells + " tok/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny geometry on CPU: checks the script, measures nothing")
    p.add_argument("--json", help="write the numbers here (after every phase)")
    p.add_argument("--table", metavar="JSON", help="print the table of a saved run and exit")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated, from {','.join(PHASES)} (default: all; the baseline always runs)")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    phases = [x for x in args.phases.split(",") if x]
    if unknown := sorted(set(phases) - set(PHASES)):
        p.error(f"--phases: unknown {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    s = copy.deepcopy(TINY if args.tiny else FULL)
    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    start = time.perf_counter()

    def save(res: dict) -> None:
        res["wall_s"] = time.perf_counter() - start
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2, default=str))

    with tempfile.TemporaryDirectory() as root:
        res = run(s, Path(root), log=lambda m: print(m, flush=True), save=save, phases=phases)
    save(res)
    print(table(res))
    print(f"wall time {res['wall_s']:.0f} s")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
