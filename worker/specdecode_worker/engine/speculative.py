"""One decoding round for a batch of running requests: propose, verify once, report.

A speculator proposes and verifies; it returns each request's new tokens and draft counts, and
the engine commits them (the one place a request's output grows).

STANDALONE: the draft model proposes k tokens over its own KV pool (same slots as the target).
NGRAM: proposals come from the latest earlier match of the context's last n tokens; no draft
pool. NONE: no proposals, so a round is one ordinary decode step.

Slots for positions L..L+k are taken at the start of a round (L: the position of the request's
last committed token, the one not yet in any cache); the slots after the accepted prefix go
back to the allocator at the end of the round and serve the next one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import time
from dataclasses import dataclass

import torch

from ..contract import EAGLE_ALGORITHMS, SERVED_ALGORITHMS
from .batch import Segment, alloc_positions, chunk_segments, forward_segments, free_positions
from .model_runner import ModelRunner
from .request import Request
from .sampling import choose, verify

# EAGLE (and MTP, whose NextN layer drafts like an EAGLE head) have their own speculator.
ALGORITHMS = tuple(a for a in SERVED_ALGORITHMS if a not in EAGLE_ALGORITHMS and a != "MTP")


@dataclass(frozen=True)
class RoundResult:
    """One request's verified round: the accepted proposals then the target's own next token."""

    tokens: list[int]
    proposed: int  # draft tokens the target verified this round
    accepted: int  # how many of them it accepted


class Speculator(ABC):
    """Prefill and decode rounds of one speculative algorithm over the target's KV pool.

    Neither method touches a request's output or the engine's counters: the engine commits what
    they return. ``decode_round`` may read ``Request.all_ids`` and moves ``kv_len`` (and the
    draft's cache position) past the positions it verified.
    """

    algorithm: str
    target: ModelRunner

    @property
    @abstractmethod
    def slots_per_round(self) -> int:
        """KV slots a request may hold beyond its committed tokens during one round."""

    @abstractmethod
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[int | None]:
        """Cache prefill positions ``r.kv_len .. end - 1`` of each request in one target pass.

        Returns the first token of each request whose prompt this chunk finished, None for the
        others and for a request recomputed after a retraction (its tokens are committed already).
        """

    def release(self, r: Request) -> None:
        """Forget what is kept for ``r`` between rounds (it finished or was retracted)."""
        return None  # only EAGLE keeps per-request state (target features) between rounds

    @staticmethod
    def first_token(r: Request, end: int, logits: torch.Tensor) -> int | None:
        """Advance ``r`` past its chunk; sample its first token when the chunk ends a fresh prompt."""
        r.kv_len = end
        if end < len(r.prefill_ids) or r.output_ids:
            return None
        return choose(logits, r.params, r.generator)[0]

    # Whether requests of one round may draft different lengths (else the policy picks one k).
    per_request_draft_lengths: bool = True
    # The draft lengths a round may take when one k serves the whole batch (None: 0..K).
    draft_length_choices: tuple[int, ...] | None = None
    last_draft_seconds: float = 0.0  # time the last round spent drafting (the cost model's input)

    @abstractmethod
    def decode_round(self, reqs: list[Request], draft_lengths: list[int] | None = None) -> list[RoundResult]:
        """Advance every request by one verified round; request i drafts at most ``draft_lengths[i]``
        tokens (default: the speculator's K). A length of 0 is a plain decode step for it."""


@dataclass
class Proposal:
    tokens: list[int]
    probs: list[torch.Tensor | None] | None  # None: deterministic proposals


def ngram_propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class StandaloneSpeculator(Speculator):
    """NONE, STANDALONE (a draft model with its own K/V) and NGRAM (prompt lookup)."""

    def __init__(self, algorithm: str, target_runner: ModelRunner, draft_runner: ModelRunner | None = None,
                 num_draft_tokens: int = 4, ngram_max: int = 4):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm}")
        self.algorithm = algorithm
        self.target = target_runner
        self.draft = draft_runner
        self.k = 0 if algorithm == "NONE" else num_draft_tokens
        self.ngram_max = ngram_max

    @property
    def slots_per_round(self) -> int:
        return self.k + 1

    # prefill: each chunk goes through the target, and through the draft at the same slots, so the
    # draft's first round catches up one token, not a whole prompt in one pass.
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[int | None]:
        segments = chunk_segments(self.target, reqs, ends)
        logits = forward_segments(self.target, segments, last_only=True)
        if self.draft is not None:
            forward_segments(self.draft, segments, last_only=True)
        for r, end in zip(reqs, ends):
            r.draft_kv_len = end if self.draft is not None else 0
        return [self.first_token(r, end, row) for r, end, row in zip(reqs, ends, logits)]

    def decode_round(self, reqs: list[Request], draft_lengths: list[int] | None = None) -> list[RoundResult]:
        pool, alloc = self.target.req_to_token_pool, self.target.token_to_kv_pool_allocator
        ks = [self.k] * len(reqs) if draft_lengths is None else [min(k, self.k) for k in draft_lengths]
        for r, k in zip(reqs, ks):
            alloc_positions(pool, alloc, r.req_idx, r.kv_len, r.kv_len + k + 1)
        start_time = time.perf_counter()
        proposals = self._propose(reqs, ks)
        self.last_draft_seconds = time.perf_counter() - start_time
        segments = [Segment(r.req_idx, [r.all_ids[-1]] + p.tokens, r.kv_len) for r, p in zip(reqs, proposals)]
        logits = forward_segments(self.target, segments, last_only=False)
        results, start = [], 0
        for r, p, k in zip(reqs, proposals, ks):
            rows = logits[start : start + len(p.tokens) + 1]
            start += len(p.tokens) + 1
            n, nxt = verify(p.tokens, p.probs, rows, r.params, r.generator)
            last = r.kv_len
            r.kv_len = last + n + 1  # the last token and the n accepted proposals are now cached
            r.draft_kv_len = min(r.draft_kv_len, r.kv_len)
            free_positions(pool, alloc, r.req_idx, r.kv_len, last + k + 1)
            results.append(RoundResult(p.tokens[:n] + [nxt], proposed=len(p.tokens), accepted=n))
        return results

    def _propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        if self.algorithm == "NONE":
            return [Proposal([], None) for _ in reqs]
        if self.algorithm == "NGRAM":
            return [Proposal(ngram_propose(r.all_ids, k, self.ngram_max) if k else [], None) for r, k in zip(reqs, ks)]
        return self._draft_propose(reqs, ks)

    def _draft_propose(self, reqs: list[Request], ks: list[int]) -> list[Proposal]:
        # Step 1 catches the draft's cache up to the last committed token (prompt, or every token
        # committed since this request last drafted); steps 2..k feed back one proposal each.
        # A request drafting 0 tokens is left out: its draft cache catches up when it next drafts.
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list] = [[] for _ in reqs]
        segments = {i: Segment(r.req_idx, r.all_ids[r.draft_kv_len :], r.draft_kv_len)
                    for i, r in enumerate(reqs) if ks[i]}
        for step in range(max(ks, default=0)):
            drafting = list(segments)
            logits = forward_segments(self.draft, list(segments.values()), last_only=True)
            for i, row in zip(drafting, logits):
                token, p = choose(row, reqs[i].params, reqs[i].generator)
                tokens[i].append(token)
                probs[i].append(p)
            segments = {i: Segment(reqs[i].req_idx, [tokens[i][-1]], reqs[i].kv_len + step + 1)
                        for i in drafting if ks[i] > step + 1}
        for r, k in zip(reqs, ks):
            if k:
                r.draft_kv_len = r.kv_len + k  # positions up to L+k-1 now hold draft K/V
        return [Proposal(t, None if r.params.greedy else p) for r, t, p in zip(reqs, tokens, probs)]
