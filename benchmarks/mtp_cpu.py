"""MTP drafting against no speculation on CPU, with the tiny DeepSeek-V3 whose NextN layer
devtools/training/mtp_train.py trained.

Greedy, one process, one request at a time; each engine is built once and the methods are
interleaved prompt by prompt so changes in machine load hit them alike. Every output is checked
token for token against the engine's own output without speculation. Acceptance = accepted /
proposed drafts; accept length = tokens committed per target verify pass (accepted drafts + 1).

Run:  python devtools/training/mtp_train.py      # once: builds and trains the model into the cache
      python benchmarks/mtp_cpu.py [--max-new-tokens 48] [--prompts 6] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.training.mtp_train import PROMPT, model_dir, random_sequences  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.engine.request import SamplingParams  # noqa: E402

CONFIGS = [("none", "NONE", 1), ("MTP k=1", "MTP", 1), ("MTP k=2", "MTP", 2), ("MTP k=3", "MTP", 3)]


def engine(algorithm: str, k: int) -> Engine:
    eng = Engine(EngineArgs(str(model_dir()), None, algorithm, device_memory_bytes=4 << 30, runtime_bytes=0,
                            context_len=512, max_total_tokens=8192, max_running_requests=4, num_draft_tokens=k))
    eng.init_model_worker()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (model_dir() / "config.json").is_file():
        sys.exit(f"{model_dir()} is missing: run devtools/training/mtp_train.py first")
    prompts = random_sequences(args.prompts, 7)[:, :PROMPT].tolist()  # not the training contexts
    engines = {name: engine(alg, k) for name, alg, k in CONFIGS}
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    seconds = {name: 0.0 for name in engines}
    outputs: dict[str, list] = {name: [] for name in engines}
    for p in prompts:
        for name, eng in engines.items():
            start = time.perf_counter()
            outputs[name].append(eng.generate(list(p), params).output_ids)
            seconds[name] += time.perf_counter() - start
    rows = []
    for name, eng in engines.items():
        s = eng.stats
        tokens = sum(len(o) for o in outputs[name])
        rows.append({
            "method": name,
            "tokens_per_s": tokens / seconds[name],
            "acceptance": s.accepted_tokens / s.proposed_tokens if s.proposed_tokens else None,
            "accept_length": (s.accepted_tokens + s.verify_rounds) / s.verify_rounds if s.verify_rounds else None,
            "exact": outputs[name] == outputs["none"],
        })
    print(f"{'method':10} {'tok/s':>7} {'acceptance':>10} {'accept len':>10} exact")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        length = "-" if r["accept_length"] is None or r["method"] == "none" else f"{r['accept_length']:.2f}"
        print(f"{r['method']:10} {r['tokens_per_s']:7.1f} {acc:>10} {length:>10} {'yes' if r['exact'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
