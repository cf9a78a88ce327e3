"""The engine on one GPU at real sizes: start-up against the plan, decode speed against the HBM
roofline, and speculative speedup at controlled acceptance. One script, about 8 minutes or less
on an H100/H200.

Models are random bf16 weights made on the device (nothing downloaded): checkpoints are written
as sparse safetensors files (headers only, for the planner) and the engine's weight loader is
replaced by one that fills every parameter with seeded random values on the device. Geometries:
Llama-3.1-8B (target), an EAGLE3 head for it, a Llama-3.2-1B-shaped STANDALONE draft. Settings:
contextLength 8192 and every other size at the planner's default for the GPU found.

It reports
  - start-up of the example's settings (8B + EAGLE3, default cudaGraphMaxBs) without OOM;
  - planned against allocated KV tokens;
  - planned against measured dynamic peak, for every engine row (EAGLE3 chain, EAGLE3 tree, each
    STANDALONE draft, MTP): phase 3's warm-up (after every CUDA graph is captured, the longest
    prompt prefilled in chunks with the draft catching up over it, then one speculative round at
    the largest batch: draft steps, verify, sampling and acceptance) reads the allocator's peak of
    allocated bytes minus weights and pools; next to it the caching allocator's reserved peak
    after the EAGLE3 runs, minus the same;
  - decode tok/s at batch 1, 8, 64 (1k-token prompts, 256 new tokens) against the roofline
    (weights + live KV bytes per step over the measured device-to-device copy bandwidth);
  - decode step time at batch 64 with live length 1k against 7k;
  - speculative speedup (STANDALONE, k = 3) with a copy of the target as draft (acceptance 1) and a
    perturbed copy, and with the 1B draft, at batch 1 and 16;
  - load-aware speculation: MTP with no speculation, fixed k = 3 and the adaptive policy, at 1, 4,
    16 and 64 concurrent requests (64 new tokens each, same prompts, same outputs expected);
  - MTP (k = 3, the target's own NextN layer) against no speculation at batch 1, on a
    DeepSeek-V3-shaped model cut to one GPU: DeepSeek-V3's MLA, grouped MoE routing (8 of the
    routed experts per token, n_group 8, topk_group 4, 1 shared expert, first_k_dense_replace 3),
    YaRN rope, hidden 7168, 128 heads and vocabulary, but 4 layers (3 dense + 1 MoE) and 64 routed
    experts instead of 61 layers and 256, plus one NextN layer: about 20 GB of bf16 weights. The
    acceptance is controlled: every block's residual writes (o_proj, down_proj) are scaled by
    1/100, so target and NextN layer both pick nearly what the token's embedding alone picks, and
    eh_proj is [I | 0] (the NextN step reads the next token's embedding, not the hidden state).
    Such a near-bigram model's greedy chain soon cycles, so acceptance is high (RESIDUAL_SCALE 1
    gives about 0: a random NextN layer, the row then measures the draft's cost only).
    Target steps, verify passes and NextN steps replay CUDA graphs on the MLA Triton kernels; in a
    graph MoE reads only the chosen experts below 64 (token, expert) pairs (the Triton expert
    kernel: batch 1 and its k + 1 verify pass), all 64 experts above. Estimated cost: start-up,
    graph capture and random init about a minute per engine (three engines), 2 x 256 decode steps
    of a ~6.5 GB step (weights read), and the sweep's 3 x 4 x 64 rounds, about two to three minutes;
and prints a table (``--json`` writes the numbers too).

Run on a GPU box:  PYTHONPATH=worker:operator:. python benchmarks/gpu_serving.py [--json out.json]
CPU smoke run:     PYTHONPATH=worker:operator:. python benchmarks/gpu_serving.py --tiny
(``--tiny``: the same code path with a tiny geometry on CPU, in seconds; the tests run it.)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "worker", ROOT / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from specdecode_worker import serve_cli  # noqa: E402
from specdecode_worker.engine import model_runner, mtp_runner  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine, StartupError  # noqa: E402
from tests.checkpoints import CONFIGS, _decoder_tensors, _deepseek_tensors, model_tensors, write_checkpoint  # noqa: E402,E501

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
    noise: float  # perturbed copy: relative Gaussian noise on every weight
    cpu_budget_gib: float | None = None
    configs: dict = field(default_factory=dict)
    chunk: int = 0  # prompt tokens per step; set from the plan's chunkedPrefillSize
    sweep_batches: tuple[int, ...] = (1, 4, 16, 64)  # load-aware speculation: concurrency of the MTP sweep
    sweep_tokens: int = 64


FULL = Settings("cuda", 8192, 1024, 256, (1, 8, 64), 7168, 64, 16, (1, 16), 3, 0.1,
                configs={"target": CONFIGS["llama-3.1-8b-instruct"], "draft1b": LLAMA_1B,
                         "eagle3": CONFIGS["eagle3-llama-3.1-8b"], "deepseek": DEEPSEEK_CUT})
TINY = Settings("cpu", 256, 24, 6, (1, 2), 180, 2, 3, (2,), 3, 0.1, cpu_budget_gib=2.0, sweep_batches=(1, 2),
                sweep_tokens=6,
                configs={"target": TINY_TARGET, "draft1b": TINY_DRAFT, "eagle3": TINY_EAGLE3,
                         "deepseek": TINY_DEEPSEEK})


# ---- models -------------------------------------------------------------------------------------
def eagle3_tensors(cfg: dict):
    if cfg is CONFIGS["eagle3-llama-3.1-8b"]:
        return model_tensors("eagle3-llama-3.1-8b")
    from tests.checkpoints import _eagle3_tensors

    return _eagle3_tensors(cfg)


def write_models(root: Path, s: Settings) -> dict[str, Path]:
    """Sparse checkpoints (real headers, no data): what the planner reads."""
    c = s.configs
    out = {
        "target": write_checkpoint(root / "target", c["target"], _decoder_tensors(c["target"])),
        "copy": write_checkpoint(root / "copy", c["target"], _decoder_tensors(c["target"])),
        "perturbed": write_checkpoint(root / "perturbed", c["target"], _decoder_tensors(c["target"])),
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

    Residual writes (o_proj, down_proj) scaled by ``residual_scale``: each layer barely moves the
    hidden state, so the target's next token is nearly a function of the current token's embedding.
    The NextN layer gets eh_proj = [I | 0] (it reads the embedding of the token it continues) and
    the same small writes, so it picks what the target will pick; the router bias is zero.
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
        model.load_state_dict(state, strict=False, assign=True)
    return load


def dispatch_loader(loaders: dict):
    """One load_safetensors stand-in serving each model folder with its own loader."""
    def load(model, model_dir, device, dtype):
        loaders[str(Path(model_dir).resolve())](model, model_dir, device, dtype)
    return load


def random_loader(seeds: dict[str, tuple[int, float]]):
    """A stand-in for load_safetensors: seeded random weights made on the device.

    ``seeds[folder] = (seed, noise)``: the same seed gives the same weights (a copy of the
    target); noise > 0 adds noise x std Gaussian noise to every weight (a perturbed copy).
    """
    def load(model, model_dir, device, dtype):
        seed, noise = seeds[str(Path(model_dir).resolve())]
        gen = torch.Generator(device=device).manual_seed(seed)
        noise_gen = torch.Generator(device=device).manual_seed(seed + 1000)
        state = {}
        for name, p in model.named_parameters():
            if "norm" in name:
                t = torch.ones(p.shape, device=device, dtype=dtype)
            else:
                std = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02
                t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0, std, generator=gen)
                if noise:
                    t += torch.empty_like(t).normal_(0, std * noise, generator=noise_gen)
            state[name] = t
        model.load_state_dict(state, strict=False, assign=True)
    return load


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
    eng = Engine(engine_args)
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
def startup_phase(s: Settings, models, res: dict) -> None:
    """The example's settings (8B + EAGLE3, planner defaults), warmed up at the largest graph batch
    and the largest prefill chunk; the allocator's peak beyond weights and pools is the dynamic peak."""
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eng, plan = engine(s, models, "target", "EAGLE3", "eagle3")
    randomise_head(eng.draft_runner.model, 7)
    r = plan["reserve"]
    s.chunk = r["chunkedPrefillSize"]
    res["startup"] = "ok"
    res["planned_kv_tokens"] = plan["kvCache"]["maxTotalNumTokens"]
    res["allocated_kv_tokens"] = eng.target_runner.token_to_kv_pool_allocator.size
    res["planned_dynamic_bytes"] = r["dynamicBytes"]
    res["warmup"] = eng.dynamic_peak.as_dict()  # phase 3: allocated peak over the warm-up's workloads
    record_peak(res, "EAGLE3 chain", eng)
    res["cuda_graph_max_bs"], res["chunked_prefill_size"] = r["cudaGraphMaxBs"], r["chunkedPrefillSize"]
    generate(eng, s, min(r["cudaGraphMaxBs"], r["maxRunningRequests"]), 16, 4)  # largest graph batch
    generate(eng, s, 1, min(s.chunk, s.context - 8), 2)  # largest prefill chunk
    before = (eng.stats.accepted_tokens, eng.stats.verify_rounds)
    res["eagle3_b1"] = _strip(generate(eng, s, 1, s.prompt, s.new_tokens))
    rounds = eng.stats.verify_rounds - before[1]
    res["eagle3_b1"]["accept_len"] = (eng.stats.accepted_tokens - before[0]) / max(rounds, 1)
    if s.device == "cuda":  # the allocator's reserved peak since the warm-up, serving included
        res["serving_reserved_dynamic_bytes"] = torch.cuda.max_memory_reserved() - static_bytes(eng)


def decode_phase(s: Settings, models, res: dict, bw: float) -> dict:
    """Decode speed against the roofline, step time against live length; returns the plain
    engine's runs that the speculative phase compares with."""
    eng, _ = engine(s, models, "target")
    runner = eng.target_runner
    cell = runner.token_to_kv_pool.bytes_per_token()
    res["decode"] = []
    for b in s.batches:
        out = _strip(generate(eng, s, b, s.prompt, s.new_tokens))
        live = s.prompt + s.new_tokens / 2
        out["roofline_tok_s"] = b * bw / (runner.weight_bytes + b * live * cell)
        out["of_roofline"] = out["tok_s"] / out["roofline_tok_s"]
        res["decode"].append(out)
    res["step_ms"] = {}
    for length in (s.prompt, s.long_prompt):
        res["step_ms"][length] = generate(eng, s, s.step_batch, length, s.step_tokens)["step_ms"]
    return {b: generate(eng, s, b, s.prompt, s.new_tokens, seed=5) for b in s.spec_batches}


def spec_phase(s: Settings, models, res: dict, name: str, base: dict) -> None:
    """STANDALONE with draft ``name`` against the plain engine, on the same prompts."""
    eng, _ = engine(s, models, "target", "STANDALONE", name)
    record_peak(res, f"STANDALONE {name}", eng)
    for b in s.spec_batches:
        before = (eng.stats.accepted_tokens, eng.stats.proposed_tokens)
        out = generate(eng, s, b, s.prompt, s.new_tokens, seed=5)
        acc = eng.stats.accepted_tokens - before[0]
        prop = eng.stats.proposed_tokens - before[1]
        res["spec"].append({"draft": name, "batch": b, "acceptance": acc / max(prop, 1), "tok_s": out["tok_s"],
                            "baseline_tok_s": base[b]["tok_s"], "speedup": out["tok_s"] / base[b]["tok_s"],
                            "same_output": out["outputs"] == base[b]["outputs"]})


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
    out = generate(eng, s, b, s.prompt, s.new_tokens, seed=5)
    rounds = eng.stats.verify_rounds - before[1]
    res["eagle3_tree"] = {"batch": b, "accept_len": (eng.stats.accepted_tokens - before[0]) / max(rounds, 1),
                          "tok_s": out["tok_s"], "baseline_tok_s": base[b]["tok_s"],
                          "speedup": out["tok_s"] / base[b]["tok_s"],
                          "same_output": out["outputs"] == base[b]["outputs"],
                          "graphs": sorted(f"{name} x{width}" for name, width in eng.speculator._graphs),
                          "planned_dynamic_bytes": plan["reserve"]["dynamicBytes"]}


MTP_METHODS = (("none", "NONE", "fixed"), ("fixed", "MTP", "fixed"), ("adaptive", "MTP", "adaptive"))


def mtp_phase(s: Settings, models, res: dict) -> None:
    """MTP (k drafts from the target's NextN layer) against the plain engine: at batch 1 with the
    fixed policy, and a sweep over concurrency of no speculation, fixed k and the adaptive policy
    (load-aware speculation), on the same prompts. One engine at a time: each plans the whole device."""
    runs, sweep = {}, []
    for method, algorithm, policy in MTP_METHODS:
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
        del eng
        release(s.device)
    base, mtp = runs["NONE"], runs["MTP"]
    res["mtp"] = {"batch": 1, "k": s.k, "acceptance": mtp["acceptance"], "tok_s": mtp["tok_s"],
                  "baseline_tok_s": base["tok_s"], "speedup": mtp["tok_s"] / base["tok_s"],
                  "same_output": mtp["outputs"] == base["outputs"], "decode_tokens": mtp["decode_tokens"]}
    plain = {r["concurrency"]: r["outputs"] for r in sweep if r["method"] == "none"}
    for r in sweep:
        r["same_output"] = r.pop("outputs") == plain[r["concurrency"]]
    res["mtp_sweep"] = sweep


def generate_counting(eng, s: Settings, batch: int, new_tokens: int, seed: int) -> dict:
    """``generate`` at the standard prompt length, with the acceptance of its rounds."""
    before = (eng.stats.accepted_tokens, eng.stats.proposed_tokens)
    out = generate(eng, s, batch, s.prompt, new_tokens, seed=seed)
    out["acceptance"] = (eng.stats.accepted_tokens - before[0]) / max(eng.stats.proposed_tokens - before[1], 1)
    return out


def run(s: Settings, root: Path, log=print) -> dict:
    models = write_models(root, s)
    seeds = {str(models["target"].resolve()): (0, 0.0), str(models["copy"].resolve()): (0, 0.0),
             str(models["perturbed"].resolve()): (0, s.noise), str(models["draft1b"].resolve()): (1, 0.0)}
    loaders = {folder: random_loader(seeds) for folder in seeds}
    loaders[str(models["deepseek"].resolve())] = deepseek_loader(3, RESIDUAL_SCALE)
    model_runner.load_safetensors = mtp_runner.load_safetensors = dispatch_loader(loaders)
    res: dict = {"device": torch.cuda.get_device_name() if s.device == "cuda" else "cpu"}
    bw = copy_bandwidth(s.device)
    release(s.device)
    res["bandwidth_GBps"] = bw / 1e9
    log(f"device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s")
    try:
        startup_phase(s, models, res)
    except (torch.cuda.OutOfMemoryError, StartupError) as exc:  # StartupError: phase 3's warm-up ran out
        res["startup"] = f"OOM: {exc}"
        log(res["startup"])
        return res
    release(s.device)
    log(f"start-up ok: planned {res['planned_kv_tokens']} KV tokens, allocated {res['allocated_kv_tokens']}")
    base = decode_phase(s, models, res, bw)
    release(s.device)
    for d in res["decode"]:
        log(f"decode batch {d['batch']}: {d['tok_s']:.0f} tok/s, {100 * d['of_roofline']:.0f}% of roofline")
    log(f"batch {s.step_batch} step ms by live length: {res['step_ms']}")
    try:
        tree_phase(s, models, res, base)
    except (torch.cuda.OutOfMemoryError, StartupError) as exc:  # the other rows still run
        res["eagle3_tree_error"] = f"{type(exc).__name__}: {exc}"
    release(s.device)
    t = res.get("eagle3_tree")
    log(res["eagle3_tree_error"] if t is None else
        f"EAGLE3 tree batch {t['batch']}: accept length {t['accept_len']:.2f}, {t['tok_s']:.1f} tok/s, same output "
        f"{t['same_output']}, graphs {t['graphs']}")
    res["spec"] = []
    for name in ("copy", "perturbed", "draft1b"):
        spec_phase(s, models, res, name, base)
        release(s.device)
        for r in res["spec"][-len(s.spec_batches):]:
            log(f"STANDALONE {name} batch {r['batch']}: acceptance {r['acceptance']:.2f}, speedup {r['speedup']:.2f}x")
    try:
        mtp_phase(s, models, res)
    except (torch.cuda.OutOfMemoryError, StartupError) as exc:  # the rows above stand; say why MTP has none
        res["mtp_error"] = f"{type(exc).__name__}: {exc}"
        log(res["mtp_error"])
        return res
    m = res["mtp"]
    log(f"MTP batch 1: acceptance {m['acceptance']:.2f}, speedup {m['speedup']:.2f}x, same output {m['same_output']}")
    for r in res["mtp_sweep"]:
        log(f"MTP sweep {r['method']} concurrency {r['concurrency']}: {r['tok_s']:.1f} tok/s, drafting in "
            f"{r['drafting_rounds']:.0%} of rounds, same output {r['same_output']}")
    return res


def _strip(out: dict) -> dict:
    return {k: v for k, v in out.items() if k != "outputs"}


def table(res: dict) -> str:
    gib = 1 << 30
    rows = [("device", res["device"]), ("copy bandwidth", f"{res['bandwidth_GBps']:.0f} GB/s"),
            ("start-up (8B + EAGLE3, planner defaults)", res["startup"])]
    if res["startup"] == "ok":
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
        e = res["eagle3_b1"]
        rows.append(("EAGLE3 (random head) batch 1", f"{e['tok_s']:.1f} tok/s, accept length {e['accept_len']:.2f}"))
        t = res.get("eagle3_tree")
        rows.append(("EAGLE3 tree top-3, 3 steps, 6 nodes" + (f" batch {t['batch']}" if t else ""),
                     res.get("eagle3_tree_error", "not run") if t is None else
                     f"{t['tok_s']:.1f} vs {t['baseline_tok_s']:.1f} tok/s = {t['speedup']:.2f}x, accept length "
                     f"{t['accept_len']:.2f}, same output: {t['same_output']}, graphs: {len(t['graphs'])}"))
        for d in res["decode"]:
            rows.append((f"decode batch {d['batch']}", f"{d['tok_s']:.1f} tok/s = {100 * d['of_roofline']:.0f}% of "
                         f"roofline {d['roofline_tok_s']:.1f} tok/s"))
        (short, s_ms), (long, l_ms) = sorted(res["step_ms"].items())
        rows.append(("step time at live length", f"{short}: {s_ms:.2f} ms, {long}: {l_ms:.2f} ms"))
        for r in res["spec"]:
            rows.append((f"STANDALONE {r['draft']} k=3 batch {r['batch']}",
                         f"acceptance {r['acceptance']:.2f}, {r['tok_s']:.1f} vs {r['baseline_tok_s']:.1f} tok/s = "
                         f"{r['speedup']:.2f}x, same output: {r['same_output']}"))
        if "mtp" not in res:
            return _render(rows + [("MTP (DeepSeek-V3 cut)", res.get("mtp_error", "not run"))] + peak_rows(res))
        m = res["mtp"]
        rows.append((f"MTP (DeepSeek-V3 cut) k={m['k']} batch 1",
                     f"acceptance {m['acceptance']:.2f}, {m['tok_s']:.1f} vs {m['baseline_tok_s']:.1f} tok/s = "
                     f"{m['speedup']:.2f}x, same output: {m['same_output']}"))
        for c, best, adaptive, cells in sweep_rows(res["mtp_sweep"]):
            rows.append((f"MTP k={m['k']} sweep, {c} requests", f"{cells}; adaptive / best of none, fixed = "
                         f"{adaptive / best:.2f}"))
    rows += peak_rows(res)
    return _render(rows)


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
    """Per concurrency: the better of none and fixed, adaptive, and every method's tok/s in words."""
    by = {(r["method"], r["concurrency"]): r for r in sweep}
    for c in sorted({r["concurrency"] for r in sweep}):
        cells = ", ".join(f"{m} {by[(m, c)]['tok_s']:.1f}" + (f" ({by[(m, c)]['drafting_rounds']:.0%} drafting)"
                                                             if m == "adaptive" else "")
                          for m, _, _ in MTP_METHODS)
        best = max(by[("none", c)]["tok_s"], by[("fixed", c)]["tok_s"])
        yield c, best, by[("adaptive", c)]["tok_s"], cells + " tok/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny geometry on CPU: checks the script, measures nothing")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    s = copy.deepcopy(TINY if args.tiny else FULL)
    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    start = time.perf_counter()
    originals = model_runner.load_safetensors, mtp_runner.load_safetensors
    try:
        with tempfile.TemporaryDirectory() as root:
            res = run(s, Path(root), log=lambda m: print(m, flush=True))
    finally:
        model_runner.load_safetensors, mtp_runner.load_safetensors = originals
    res["wall_s"] = time.perf_counter() - start
    print(table(res))
    print(f"wall time {res['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0 if res["startup"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
