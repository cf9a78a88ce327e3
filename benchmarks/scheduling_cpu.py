"""Admission at a fixed KV pool on CPU: the worst-case reservation against held tokens + estimated growth.

One engine per setting, same requests, greedy, a small random Llama (nothing downloaded). Requests
declare max_tokens 96; in the "answers stop early" workload each answer ends at a stop (the client
aborts it, as the server does on a stop string) after a random 16..96 tokens, as chat answers do;
in the "answers run to max_tokens" workload none stops, so the estimate runs short and requests are
retracted and recomputed. Reported: requests admitted in the first step, the mean and peak number
running per step, retractions, and generated tokens per CPU second of the engine (one
thread, process time: on a shared machine wall time measures the neighbours).

Run:  PYTHONPATH=worker:operator:. python benchmarks/scheduling_cpu.py [--requests 16] [--pool 1024]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

MAX_TOKENS = 96


def run(model: Path, args, ratio: float, stops: bool) -> dict:
    eng = Engine(EngineArgs(str(model), device_memory_bytes=1 << 30, runtime_bytes=0, context_len=160,
                            max_total_tokens=args.pool, max_running_requests=args.requests,
                            chunked_prefill_size=args.chunk, new_token_ratio=ratio))
    eng.init_model_worker()
    rng = random.Random(0)
    reqs = []
    for _ in range(args.requests):
        stop_at = rng.randint(16, MAX_TOKENS) if stops else MAX_TOKENS

        def stop(r, new, stop_at=stop_at):
            if new and len(r.output_ids) >= stop_at:
                eng.abort(r)

        prompt = [rng.randrange(3, 150) for _ in range(args.prompt)]
        reqs.append(Request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), on_update=stop))
    start = time.process_time()
    for r in reqs:
        eng.submit(r)
    running = []
    while not all(r.done.is_set() for r in reqs):
        eng.step()
        running.append(eng.num_running)
    secs = time.process_time() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"first_step": running[0], "mean": sum(running) / len(running), "peak": max(running),
            "retracted": eng.stats.retracted_requests, "tokens": tokens, "tok_s": tokens / secs,
            "outputs": [r.output_ids for r in reqs]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "llama", "llama", seed=0, weight_scale=3.0, hidden_size=256,
                                 intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2)
        print(f"pool {args.pool} tokens, {args.requests} requests of {args.prompt} prompt tokens, "
              f"max_tokens {MAX_TOKENS}, chunk {args.chunk}")
        print("| workload | admission | admitted at once | mean / peak running | retractions | tok per CPU s |")
        print("|---|---|---|---|---|---|")
        for stops, name in ((True, "answers stop early"), (False, "answers run to max_tokens")):
            worst = run(model, args, 1.0, stops)
            est = run(model, args, 0.5, stops)
            if not stops:  # no stop: the same greedy tokens whatever the scheduling
                assert est["outputs"] == worst["outputs"], "retraction changed an output"
            for label, r in (("worst case (prompt + max_tokens)", worst), ("held + 0.5 x remaining", est)):
                print(f"| {name} | {label} | {r['first_step']} | {r['mean']:.1f} / {r['peak']} | "
                      f"{r['retracted']} | {r['tok_s']:.0f} |")


if __name__ == "__main__":
    main()
