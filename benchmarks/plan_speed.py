"""Plan time for Llama-3.1-70B-Instruct (sparse, 30 shards, real headers) next to building the same
model on transformers' meta device from the same config (what `accelerate estimate-memory` does).

Both run in this one process, warm (imports done, median of several runs), and cold (a fresh
interpreter per run, imports included: what a planner pod pays). The weight bytes both ways are
printed too, so the comparison is between two ways of getting the same number.

    .venv/bin/python benchmarks/plan_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.checkpoints import CONFIGS, write_model  # noqa: E402

MODEL = "llama-3.1-70b-instruct"


def plan_once(folder: Path) -> int:
    from specdecode_worker.planner.plan import PlanArgs
    from specdecode_worker.planner.plan_cli import make_plan

    plan = make_plan(PlanArgs(target=str(folder), algorithm="NGRAM", gpu_product="NVIDIA-H100-80GB-HBM3"))
    return plan["weights"]["targetBytes"]


def meta_once(folder: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def header_bytes(folder: Path) -> int:
    from specdecode_worker.model_rules.checkpoint import read_checkpoint, total_bytes

    return total_bytes(read_checkpoint(folder))


def timed(fn, folder: Path, repeats: int) -> tuple[float, int]:
    result = fn(folder)  # warm-up: imports, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn(folder)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def cold(code: str, repeats: int) -> float:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / MODEL, MODEL)
        apparent = sum(p.stat().st_size for p in folder.glob("*.safetensors"))

        plan_s, _ = timed(plan_once, folder, args.repeats)
        meta_s, meta_bytes = timed(meta_once, folder, args.repeats)
        hdr_bytes = header_bytes(folder)

        cold_plan = cold(
            "from benchmarks.plan_speed import plan_once; from pathlib import Path; "
            f"plan_once(Path({str(folder)!r}))", args.repeats)
        cold_meta = cold(
            "from benchmarks.plan_speed import meta_once; from pathlib import Path; "
            f"meta_once(Path({str(folder)!r}))", args.repeats)

    import transformers

    print(f"model: {MODEL} ({CONFIGS[MODEL]['num_hidden_layers']} layers), 30 sparse shards, "
          f"{apparent / 1e9:.1f} GB apparent size")
    print(f"weight bytes: headers {hdr_bytes:,}  meta-device model {meta_bytes:,}  "
          f"({'equal' if hdr_bytes == meta_bytes else 'DIFFERENT'})")
    print(f"transformers {transformers.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"median of {args.repeats}")
    print()
    print("| benchmark | specdecode plan | transformers meta-device build | ratio | command |")
    print("|---|---|---|---|---|")
    print(f"| Plan Llama-3.1-70B (30 shards), warm | {plan_s * 1000:.1f} ms | {meta_s * 1000:.0f} ms | "
          f"{meta_s / plan_s:.0f}x faster | `.venv/bin/python benchmarks/plan_speed.py` |")
    print(f"| Same, cold process (imports included) | {cold_plan * 1000:.0f} ms | {cold_meta * 1000:.0f} ms | "
          f"{cold_meta / cold_plan:.1f}x faster | `.venv/bin/python benchmarks/plan_speed.py` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
