"""A plan that fits is a worker that starts, on the device: for each geometry, context length and
algorithm below, the planner's plan for this GPU (its defaults: graph batch, prefill chunk, memory
fraction), then the worker started under it with random weights. Phase 3's warm-up measures the
dynamic memory three ways (allocated, the allocator's reserved bytes, the driver's view), each
printed against the plan's dynamic reserve, with the KV tokens planned and allocated.

Exits non-zero if any start fails or any measured view is above its plan. Run it where there is a
GPU; ``--tiny`` runs tiny geometries on CPU, to check the script (no measurement there).

Run on a GPU:  PYTHONPATH=worker:operator:. python benchmarks/plan_sweep.py [--json out.json] [--only NAME]
CPU check:     PYTHONPATH=worker:operator:. python benchmarks/plan_sweep.py --tiny
A saved run:   python benchmarks/plan_sweep.py --table out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serving as gs  # noqa: E402  (its paths, models and random loaders)
from devtools.checkpoints import CONFIGS, write_checkpoint  # noqa: E402
from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from specdecode_worker.engine.engine import Engine  # noqa: E402
from specdecode_worker.engine.models.loader import load_safetensors as real_load  # noqa: E402
from specdecode_worker.engine.request import SamplingParams  # noqa: E402
from specdecode_worker.serving import serve_cli  # noqa: E402

GIB = 1 << 30
# The 4-layer, hidden-512 model that ran out of memory at contextLength 8192 on the H200.
SMALL_LLAMA = {**CONFIGS["llama-3.1-8b-instruct"], "hidden_size": 512, "intermediate_size": 1024,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 4096,
               "max_position_embeddings": 32768, "rope_scaling": None}
LLAMA_8B = {**CONFIGS["llama-3.1-8b-instruct"]}
TREE = ("--speculative-eagle-topk", "3", "--speculative-num-steps", "3", "--num-draft-tokens", "6")


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # a key of the models written for the run
    algorithm: str
    context: int
    draft: str | None = None
    extra: tuple[str, ...] = ()


# Most wanted first (a run cut at its budget keeps the rows it finished): the two starts that broke
# the plan on the H200, then the example's sizes, then the rest.
FULL_CASES = [
    Case("4-layer h512", "small", "NONE", 8192),
    Case("tiny DeepSeek-V3 + NextN", "tiny_deepseek", "MTP", 8192),
    Case("Llama-3.1-8B + EAGLE3 head", "llama_8b", "EAGLE3", 8192, "eagle3_8b", ("--num-draft-tokens", "3")),
    Case("Llama-3.1-8B + 1B draft", "llama_8b", "STANDALONE", 2048, "llama_1b", ("--num-draft-tokens", "3")),
    Case("DeepSeek-V3 cut (4 layers, 64 experts) + NextN", "deepseek_cut", "MTP", 8192),
    Case("4-layer h512", "small", "NGRAM", 32768),
    Case("4-layer h512 + EAGLE head", "small", "EAGLE", 8192, "small_eagle"),
    Case("Qwen2.5-0.5B", "qwen_0_5b", "NGRAM", 32768),
    Case("Llama-3.2-1B", "llama_1b", "NONE", 32768),
    Case("Qwen2.5-7B + Qwen2.5-0.5B", "qwen_7b", "STANDALONE", 8192, "qwen_0_5b"),
    Case("Llama-3.1-8B + EAGLE3 tree", "llama_8b", "EAGLE3", 2048, "eagle3_8b", TREE),
    Case("Llama-3.1-8B + EAGLE head", "llama_8b", "EAGLE", 2048, "eagle_8b"),
]
TINY_CASES = [
    Case("tiny Llama", "tiny", "NONE", 256),
    Case("tiny Llama + tiny draft", "tiny", "STANDALONE", 256, "tiny_draft"),
    Case("tiny Llama + EAGLE head", "tiny", "EAGLE", 256, "tiny_eagle"),
    Case("tiny Llama + EAGLE3 head", "tiny", "EAGLE3", 128, "tiny_eagle3"),
    Case("tiny DeepSeek-V3 + NextN", "tiny_deepseek", "MTP", 256),
]


def eagle_head_tensors(target: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """An EAGLE-1 head for ``target``'s geometry: fc over [embedding, feature] and one decoder layer
    without its input norm (the target's embedding and head are shared)."""
    h = target["hidden_size"]
    layer = gs._decoder_tensors({**target, "num_hidden_layers": 1}, prefix="")
    return [("fc.weight", "BF16", (h, 2 * h))] + [t for t in layer if t[0].startswith("layers.0.")
                                                    and "input_layernorm" not in t[0]]


def write_models(root: Path, tiny: bool) -> dict[str, Path]:
    """Sparse checkpoints (real headers, no data; random weights are made on the device), and the
    tiny DeepSeek-V3 with its NextN layer, which is small enough to write whole."""
    decoder = lambda name, cfg: write_checkpoint(root / name, cfg, gs._decoder_tensors(cfg))  # noqa: E731
    deepseek = write_tiny_deepseek(root / "tiny_deepseek", mtp=True, max_position_embeddings=8192)
    if tiny:
        return {"tiny": decoder("tiny", gs.TINY_TARGET), "tiny_draft": decoder("tiny_draft", gs.TINY_DRAFT),
                "tiny_eagle": write_checkpoint(root / "tiny_eagle", {**gs.TINY_TARGET, "num_hidden_layers": 1},
                                               eagle_head_tensors(gs.TINY_TARGET)),
                "tiny_eagle3": write_checkpoint(root / "tiny_eagle3", gs.TINY_EAGLE3,
                                                gs.eagle3_tensors(gs.TINY_EAGLE3)),
                "tiny_deepseek": deepseek}
    return {
        "small": decoder("small", SMALL_LLAMA),
        "small_eagle": write_checkpoint(root / "small_eagle", {**SMALL_LLAMA, "num_hidden_layers": 1},
                                        eagle_head_tensors(SMALL_LLAMA)),
        "tiny_deepseek": deepseek,
        "qwen_0_5b": decoder("qwen_0_5b", CONFIGS["qwen2.5-0.5b-instruct"]),
        "qwen_7b": decoder("qwen_7b", CONFIGS["qwen2.5-7b-instruct"]),
        "llama_1b": decoder("llama_1b", gs.LLAMA_1B),
        "llama_8b": decoder("llama_8b", LLAMA_8B),
        "eagle3_8b": write_checkpoint(root / "eagle3_8b", CONFIGS["eagle3-llama-3.1-8b"],
                                      gs.eagle3_tensors(CONFIGS["eagle3-llama-3.1-8b"])),
        "eagle_8b": write_checkpoint(root / "eagle_8b", {**LLAMA_8B, "num_hidden_layers": 1},
                                     eagle_head_tensors(LLAMA_8B)),
        "deepseek_cut": write_checkpoint(root / "deepseek_cut", gs.DEEPSEEK_CUT,
                                         gs.bf16_deepseek_tensors(gs.DEEPSEEK_CUT)),
    }


def weight_source(models: dict[str, Path]):
    """The engines' weight source: random weights made on the device for every sparse checkpoint
    (its data would read as zeros, slowly); a checkpoint written whole loads as it is."""
    decoders = {str(p.resolve()): (i, False) for i, (name, p) in enumerate(models.items())
                if name not in ("tiny_deepseek", "deepseek_cut") and "eagle" not in name}
    loaders = {folder: gs.random_loader(decoders) for folder in decoders}
    if "deepseek_cut" in models:
        loaders[str(models["deepseek_cut"].resolve())] = gs.deepseek_loader(3, gs.RESIDUAL_SCALE)

    def load(model, model_dir, device, dtype):
        loader = loaders.get(str(Path(model_dir).resolve()))
        return loader(model, model_dir, device, dtype) if loader else real_load(model, model_dir, device, dtype)

    return load


def start(case: Case, models: dict[str, Path], device: str, cpu_gib: float | None, weights=None) -> dict:
    """Plan ``case`` as `serve` would, start the worker under the plan, serve one request, and
    report the plan's numbers beside what the warm-up measured."""
    argv = ["--target", str(models[case.target]), "--algorithm", case.algorithm, "--device", device,
            "--context-length", str(case.context), "--spec-policy", "fixed", *case.extra]
    if case.draft:
        argv += ["--draft", str(models[case.draft])]
    if cpu_gib:
        argv += ["--device-memory-gib", str(cpu_gib)]
    row = {"case": case.name, "algorithm": case.algorithm, "context": case.context}
    began = time.perf_counter()
    try:
        engine_args, plan = serve_cli.resolve(serve_cli.parser().parse_args(argv))
        row.update(planned=plan.reserve.dynamic_bytes, graph_bs=plan.reserve.cuda_graph_max_bs,
                   chunk=plan.reserve.chunked_prefill_size, tokens_planned=plan.kv_cache.max_total_num_tokens)
        eng = Engine(engine_args, weights=weights)
        eng.init_model_worker()
        peak = eng.dynamic_peak
        row.update(tokens_allocated=eng.memory_profile.max_total_num_tokens, allocated=peak.measured,
                   reserved=peak.reserved, driver=peak.driver, over=peak.over())
        out = eng.generate(list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
        row["started"] = len(out.output_ids) == 4
    except Exception as exc:  # noqa: BLE001 - a failed start is this sweep's finding
        row.update(started=False, error=gs.error_text(exc))
    row["seconds"] = time.perf_counter() - began
    return row


def failed(row: dict) -> bool:
    return not row.get("started") or bool(row.get("over"))


def table(rows: list[dict]) -> str:
    def gib(v):
        return "-" if v is None else f"{v / GIB:.2f}"

    lines = ["| case | algorithm | context | graph bs | dynamic planned GiB | allocated | reserved | driver | "
             "reserved / planned | KV tokens planned / allocated | result |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ratio = f"{r['reserved'] / r['planned']:.2f}" if r.get("reserved") is not None and r.get("planned") else "-"
        result = (f"**failed**: {r['error']}" if "error" in r else
                  f"**above plan** ({', '.join(r['over'])})" if r.get("over") else "ok")
        lines.append(f"| {r['case']} | {r['algorithm']} | {r['context']} | {r.get('graph_bs', '-')} | "
                     f"{gib(r.get('planned'))} | {gib(r.get('allocated'))} | {gib(r.get('reserved'))} | "
                     f"{gib(r.get('driver'))} | {ratio} | {r.get('tokens_planned', '-')} / "
                     f"{r.get('tokens_allocated', '-')} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny geometries on CPU: checks the script, measures nothing")
    p.add_argument("--json", help="write the rows here (after every start)")
    p.add_argument("--only", action="append", help="run only the cases with this name (repeatable)")
    p.add_argument("--table", metavar="JSON", help="print the table of a saved run and exit")
    args = p.parse_args(argv)
    if args.table:
        rows = json.loads(Path(args.table).read_text())["rows"]
        print(table(rows))
        return 1 if any(failed(r) for r in rows) else 0
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU check", file=sys.stderr)
        return 2
    cases = [c for c in (TINY_CASES if args.tiny else FULL_CASES) if not args.only or c.name in args.only]
    rows: list[dict] = []
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as root:
        models = write_models(Path(root), args.tiny)
        weights = weight_source(models)
        for case in cases:
            row = start(case, models, device, 2.0 if args.tiny else None, weights)
            rows.append(row)
            print(f"{row['case']} {row['algorithm']} @ {row['context']}: "
                  f"{'ok' if not failed(row) else row.get('error') or 'above plan: ' + ', '.join(row['over'])} "
                  f"({row['seconds']:.0f} s)", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=1))
            gs.release(device)
    print(table(rows))
    return 1 if any(failed(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
