"""EAGLE chain and tree drafting on CPU with SmolLM2-135M-Instruct and a head trained here.

Same held-out prompts (topics the head never saw), greedy, one process, each engine built once:
no speculation, EAGLE chains of k = 2, 3, 4 and EAGLE trees, one request at a time and a batch
of 4 concurrent requests. Every output is checked token for token against the engine's own
output without speculation. Acceptance length = tokens committed per target verify pass
(accepted drafts + 1).

Run:  python benchmarks/eagle_train.py            # once: trains the head into the cache (minutes)
      python benchmarks/eagle_cpu.py [--max-new-tokens 64] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.eagle_train import prompts  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.scheduler import EngineArgs, Scheduler  # noqa: E402
from tests.smollm2 import cache_dir, smollm2_dir  # noqa: E402

CONFIGS = [
    ("none", "NONE", {}),
    ("EAGLE chain k=2", "EAGLE", dict(num_draft_tokens=2)),
    ("EAGLE chain k=3", "EAGLE", dict(num_draft_tokens=3)),
    ("EAGLE chain k=4", "EAGLE", dict(num_draft_tokens=4)),
    ("EAGLE tree top-3, 3 steps, 6 nodes", "EAGLE", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
    ("EAGLE tree top-4, 4 steps, 10 nodes", "EAGLE", dict(num_draft_tokens=10, speculative_num_steps=4, speculative_eagle_topk=4)),
]


def engine(target, algorithm, head, kw) -> Scheduler:
    args = dict(device_memory_bytes=4 << 30, runtime_bytes=0, context_len=1024, max_total_tokens=8192,
                max_running_requests=8)
    args.update(kw)
    s = Scheduler(EngineArgs(str(target), str(head) if algorithm != "NONE" else None, algorithm, **args))
    s.init_model_worker()
    return s


def run(sched: Scheduler, prompt_ids: list[list[int]], max_new: int, concurrent: bool):
    """Tokens, seconds and spec counters for the prompts (one at a time, or all at once)."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    spec = sched.spec
    before = (spec.accepted_tokens, spec.rounds)
    start = time.perf_counter()
    outs = []
    groups = [prompt_ids] if concurrent else [[p] for p in prompt_ids]
    for group in groups:
        reqs = [sched.submit(Request(list(p), params)) for p in group]
        while not all(r.done.is_set() for r in reqs):
            sched.step()
        outs += [r.output_ids for r in reqs]
    secs = time.perf_counter() - start
    accepted, rounds = spec.accepted_tokens - before[0], spec.rounds - before[1]
    return outs, secs, accepted, rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", type=Path, default=cache_dir() / "SmolLM2-135M-Instruct-eagle")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target = smollm2_dir()
    if not (args.head / "model.safetensors").is_file():
        raise SystemExit(f"{args.head}: no head; run benchmarks/eagle_train.py first")
    tok = AutoTokenizer.from_pretrained(target)
    texts = prompts("bench")[: args.prompts]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False).input_ids for t in texts]
    rows, reference = [], None
    for name, algorithm, kw in CONFIGS:
        sched = engine(target, algorithm, args.head, kw)
        run(sched, ids[:1], 8, False)  # warm-up
        for concurrent in (False, True):
            outs, secs, accepted, rounds = run(sched, ids, args.max_new_tokens, concurrent)
            if reference is None:
                reference = outs
            row = dict(method=name, batch=len(ids) if concurrent else 1, tokens=sum(map(len, outs)),
                       seconds=round(secs, 2), tokens_per_s=round(sum(map(len, outs)) / secs, 1),
                       acceptance_length=round((accepted + rounds) / rounds, 2) if rounds else None,
                       same_as_no_spec=outs == reference)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| method | requests at once | tokens/s | acceptance length | output = no speculation |")
    print("|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance_length"] is None or r["method"] == "none" else f"{r['acceptance_length']:.2f}"
        print(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']} | {acc} | {'yes' if r['same_as_no_spec'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_as_no_spec"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
