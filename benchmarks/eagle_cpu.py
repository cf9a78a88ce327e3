"""EAGLE chain and tree drafting on CPU with SmolLM2-135M-Instruct and a head trained here.

Two prompt sets: prompts from the head's training topics and prompts on topics it never saw.
Greedy, one process, each engine built once: no speculation, an EAGLE chain and EAGLE trees, one
request at a time and the set's requests at once; methods are interleaved prompt by prompt so
changes in machine load hit them alike. Every output is checked token for token against the
engine's own output without speculation. Acceptance length = tokens committed per target verify
pass (accepted drafts + 1).

Run:  python devtools/training/eagle_train.py            # once: trains the head into the cache (minutes)
      python benchmarks/eagle_cpu.py [--max-new-tokens 48] [--prompts 2] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.training.eagle_train import prompts  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from devtools.smollm2 import cache_dir, smollm2_dir  # noqa: E402

CONFIGS = [
    ("none", "NONE", {}),
    ("EAGLE chain k=3", "EAGLE", dict(num_draft_tokens=3)),
    ("EAGLE tree top-3, 3 steps, 6 nodes", "EAGLE",
     dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
    ("EAGLE tree top-4, 4 steps, 10 nodes", "EAGLE",
     dict(num_draft_tokens=10, speculative_num_steps=4, speculative_eagle_topk=4)),
]


def engine(target, algorithm, head, kw) -> Engine:
    args = dict(device_memory_bytes=4 << 30, runtime_bytes=0, context_len=1024, max_total_tokens=8192,
                max_running_requests=8)
    args.update(kw)
    s = Engine(EngineArgs(str(target), str(head) if algorithm != "NONE" else None, algorithm, **args))
    s.init_model_worker()
    return s


def run(eng: Engine, prompt_ids: list[list[int]], max_new: int, concurrent: bool):
    """Tokens, seconds and spec counters for the prompts (one at a time, or all at once)."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    stats = eng.stats
    before = (stats.accepted_tokens, stats.verify_rounds)
    start = time.perf_counter()
    outs = []
    groups = [prompt_ids] if concurrent else [[p] for p in prompt_ids]
    for group in groups:
        reqs = [eng.submit(Request(list(p), params)) for p in group]
        while not all(r.done.is_set() for r in reqs):
            eng.step()
        outs += [r.output_ids for r in reqs]
    secs = time.perf_counter() - start
    accepted, rounds = stats.accepted_tokens - before[0], stats.verify_rounds - before[1]
    return outs, secs, accepted, rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=2, help="prompts per set (seen topics, held-out topics)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", type=Path, default=cache_dir() / "SmolLM2-135M-Instruct-eagle")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target = smollm2_dir()
    if not (args.head / "model.safetensors").is_file():
        raise SystemExit(f"{args.head}: no head; run devtools/training/eagle_train.py first")
    tok = AutoTokenizer.from_pretrained(target)

    def encode(t):
        rendered = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        return tok(rendered, add_special_tokens=False).input_ids

    sets = {"seen topics": [encode(t) for t in prompts("train")[: args.prompts]],
            "held-out topics": [encode(t) for t in prompts("bench")[: args.prompts]]}
    engines = {name: engine(target, algorithm, args.head, kw) for name, algorithm, kw in CONFIGS}
    for eng in engines.values():
        run(eng, list(sets.values())[0][:1], 4, False)  # warm-up
    # Methods interleaved prompt by prompt, so a change in machine load hits them alike.
    totals = {}
    for set_name, ids in sets.items():
        for concurrent in (False, True):
            groups = [ids] if concurrent else [[x] for x in ids]
            for group in groups:
                for name, eng in engines.items():
                    outs, secs, accepted, rounds = run(eng, group, args.max_new_tokens, concurrent)
                    t = totals.setdefault((set_name, concurrent, name), dict(outs=[], secs=0.0, accepted=0, rounds=0))
                    t["outs"] += outs
                    t["secs"] += secs
                    t["accepted"] += accepted
                    t["rounds"] += rounds
    rows = []
    for (set_name, concurrent, name), t in totals.items():
        ref = totals[(set_name, concurrent, "none")]["outs"]
        tokens = sum(map(len, t["outs"]))
        row = dict(prompts=set_name, method=name, batch=len(sets[set_name]) if concurrent else 1, tokens=tokens,
                   seconds=round(t["secs"], 2), tokens_per_s=round(tokens / t["secs"], 2),
                   acceptance_length=round((t["accepted"] + t["rounds"]) / t["rounds"], 2),
                   same_as_no_spec=t["outs"] == ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("| prompts | method | requests at once | tokens/s | acceptance length | output = no speculation |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["method"] == "none" else f"{r['acceptance_length']:.2f}"
        print(f"| {r['prompts']} | {r['method']} | {r['batch']} | {r['tokens_per_s']} | {acc} | "
              f"{'yes' if r['same_as_no_spec'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same_as_no_spec"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
