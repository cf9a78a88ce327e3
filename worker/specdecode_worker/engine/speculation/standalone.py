"""The speculator of the algorithms that do not read the target's features: NONE, STANDALONE and
NGRAM.

STANDALONE: the draft model proposes k tokens over its own KV pool (same slots as the target).
NGRAM: proposals come from the latest earlier match of the context's last n tokens; no draft
pool. NONE: no proposals, so a round is one ordinary decode step.
"""

from __future__ import annotations

import torch

from ..batch import Segment, chunk_segments, forward_segments, fresh_batch, left_padded_batch, step_batch
from ..sampler import DraftGrammars, choose_tokens
from ..forward_batch import to_device
from ..model_runner import ModelRunner
from ..request import Request
from .algorithms import Drafter, algorithm
from .ngram_index import RequestIndexes
from .rounds import Lookup, RoundResult, RoundRows, Speculator
from .verify import (accept_chains, chain_segments, first_tokens, first_uniforms, ragged_ids, record_prompt_logprobs,
                     reserve_round, sample_next, verify_width, wants_prompt_rows)


class StandaloneSpeculator(Speculator):
    """NONE, STANDALONE (a draft model with its own K/V) and NGRAM (prompt lookup)."""

    catches_up = True  # a STANDALONE draft's cache; 0 tokens without a draft model

    def __init__(self, algorithm_name: str, target_runner: ModelRunner, draft_runner: ModelRunner | None = None,
                 num_draft_tokens: int = 4, ngram_max: int = 4, chunk_tokens: int = 0, ngram_min: int = 1):
        self.method = algorithm(algorithm_name)
        if self.method.reads_target_features:
            raise ValueError(f"{algorithm_name} drafts from the target's features: HeadSpeculator runs it")
        self.algorithm = algorithm_name
        self.target = target_runner
        self.draft = draft_runner
        self.k = num_draft_tokens if self.method.drafts else 0
        self.ngram_max = ngram_max
        self.chunk_tokens = chunk_tokens  # most tokens of one draft catch-up pass (0: no cap)
        self.draft_tokens = 0  # tokens the draft model has processed (catch-up and proposals)
        # An n-gram proposal's class is its matched suffix's length: a one-token match (a common
        # word seen before) is rarely what follows, a four-token one in copied text nearly always.
        self.draft_classes = ngram_max + 1 if self.method.drafter is Drafter.LOOKUP else 0
        # A lookup drafts only from a suffix of ngram_min tokens or more that occurred before.
        self._ngram_indexes = RequestIndexes(ngram_max, ngram_min)  # while each request runs

    def look_ahead(self, reqs: list[Request], caps: list[int]) -> Lookup | None:
        if self.method.drafter is not Drafter.LOOKUP:
            return None
        matches = [self._ngram_indexes.match(r, min(c, self.k)) if c > 0 else ([], 0) for r, c in zip(reqs, caps)]
        # A proposal is cut before the first token its request's grammar refuses: verification would reject it.
        proposals = [m[0][: r.grammar.matcher.validate_tokens(m[0])] if r.grammar is not None and m[0] else m[0]
                     for r, m in zip(reqs, matches)]
        return Lookup(proposals, [m[1] for m in matches])

    def release(self, r: Request) -> None:
        self._ngram_indexes.release(r.rid)

    def catch_up_tokens(self, r: Request) -> int:
        """Committed tokens the draft must cache before ``r`` can draft, beyond the one every
        drafting round feeds it anyway (the whole prompt for a request that never drafted)."""
        if self.draft is None:
            return 0
        return max(0, len(r.all_ids) - r.draft_kv_len - 1)

    @property
    def slots_per_round(self) -> int:
        return self.k + 1

    # prefill: the target only. The draft's cache of a request is built when the request first
    # drafts (the catch-up of ``_draft_propose``, in chunks), so a request that never drafts costs
    # no draft prefill.
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[RoundResult | None]:
        segments = chunk_segments(reqs, ends)
        every_row = wants_prompt_rows(reqs)
        logits = self.target.forward(fresh_batch(self.target.slots, segments, self.target.device),
                                     last_only=not every_row)
        if every_row:
            logits = record_prompt_logprobs(reqs, segments, logits)
        return first_tokens(reqs, ends, logits)

    def decode_round(self, reqs: list[Request], draft_lengths: list[int] | None = None,
                     lookup: Lookup | None = None) -> list[RoundResult]:
        slots = self.target.slots
        ks = [self.k] * len(reqs) if draft_lengths is None else [min(k, self.k) for k in draft_lengths]
        if self.method.drafter is not Drafter.LOOKUP:
            lookup = None
        elif any(ks):  # proposals known before any pass
            lookup = lookup or self.look_ahead(reqs, ks)
            ks = [min(len(p), k) for p, k in zip(lookup.proposals, ks)]
        if not any(ks):
            return self._plain_step(reqs)
        # A lookup's proposals ride with the round's metadata: [B, max(ks)], request i's first ks[i].
        width = max(ks)
        looked_up = [t for p, k in zip(lookup.proposals, ks) for t in p[:k] + [0] * (width - k)] if lookup else []
        rows, (proposals,) = reserve_round(slots, reqs, [k + 1 for k in ks], ks, looked_up)
        if lookup:  # point masses; no draft pass moves a draft cache
            draft, draft_probs, drafted_to = proposals.view(len(reqs), width), None, [r.draft_kv_len for r in reqs]
        else:
            draft, draft_probs, drafted_to = self._draft_propose(reqs, ks, rows)
        # The verify pass's tokens stay on the device: each request's last token, then its proposals.
        chains = torch.cat([rows.last[:, None], draft], dim=1)
        width = verify_width(self.chain_verify_graphs, ks)
        if width:  # a graph's width for any mix of lengths, or chains all of one length
            fb, padded = rows.verify_batch(slots.req_to_token, reqs, ks, chains, width)
            logits = self.target.forward(fb, last_only=False)
        else:  # the ragged batch as it is (no graph takes it)
            padded = None
            logits = forward_segments(self.target, chain_segments(reqs, ks), last_only=False,
                                      input_ids=ragged_ids(chains, ks))
        accepted, nexts, drafted, logprobs = accept_chains(reqs, draft, draft_probs, logits, ks, padded)
        results, rejected = [], []
        for r, k, n, nxt, tokens, lp, d in zip(reqs, ks, accepted, nexts, drafted, logprobs, drafted_to):
            last = r.kv_len
            kv_len = last + n + 1  # the last token and the n accepted proposals are now cached
            rejected.append((r.req_idx, kv_len, last + k + 1))
            results.append(RoundResult(tokens[:n] + [nxt], proposed=k, accepted=n, kv_len=kv_len,
                                       draft_kv_len=min(d, kv_len), logprobs=lp))
        slots.release(rejected)
        return results

    def _plain_step(self, reqs: list[Request]) -> list[RoundResult]:
        """A step where nobody drafts: each request's last token over a fresh slot, the batch sent
        in one copy, then its next token."""
        segments = [Segment(r.req_idx, [r.all_ids[-1]], r.kv_len) for r in reqs]
        # One row per request: "every row" is each request's last, as a verify pass reads them.
        logits = self.target.forward(fresh_batch(self.target.slots, segments, self.target.device), last_only=False)
        return sample_next(reqs, logits, list(range(len(reqs))), [r.kv_len + 1 for r in reqs])

    def _draft_propose(self, reqs: list[Request], ks: list[int], rows: RoundRows
                       ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """The draft model's proposals ``[B, max(ks)]`` on the target's device, request i's first
        ``ks[i]``, the distributions they were drawn from (None: greedy), and each request's draft
        cache length after them."""
        # Step 1 catches the draft's cache up to the last committed token (the prompt on a request's
        # first drafting round, or every token committed since it last drafted); steps 2..k feed
        # back one proposal each, from the device (nothing is read back until the verify pass's
        # results). A request drafting 0 tokens is left out: its draft cache catches up when it next drafts.
        device, width = self.target.device, max(ks, default=0)
        tokens = torch.zeros(len(reqs), width, dtype=torch.int64, device=device)
        probs = None
        first = [i for i, k in enumerate(ks) if k]  # the requests of step 1
        cached = dict(zip(first, self._catch_up([reqs[i] for i in first])))
        grammars = DraftGrammars(reqs)
        for step in range(width):
            drafting = [i for i, k in enumerate(ks) if k > step]
            every = len(drafting) == len(reqs)  # then no index to send: rows are the batch's
            index = None if every else to_device(drafting, device)
            if step:  # built on the device from the round's rows and lengths: nothing sent
                fb = step_batch(self.draft.req_to_token_pool.req_to_token, _rows(rows.req_idx, index),
                                _rows(rows.kv, index) + step, [reqs[i].kv_len + step for i in drafting],
                                _rows(tokens[:, step - 1], index))
                logits = self.draft.forward(fb, last_only=True)
                self.draft_tokens += len(drafting)
            else:  # each request's tokens since its draft cache ends
                segments = [Segment(reqs[i].req_idx, reqs[i].all_ids[cached[i] :], cached[i]) for i in drafting]
                logits = self._first_step(segments)
                self.draft_tokens += sum(len(s.tokens) for s in segments)
            picked = [reqs[i] for i in drafting]
            token, p = choose_tokens(grammars.masked(logits, drafting), [r.params for r in picked],
                                     first_uniforms(picked, 1, logits.device))
            grammars.advance(token, drafting)
            if every:
                tokens[:, step] = token.to(device)
            else:
                tokens[:, step].index_copy_(0, index, token.to(device))
            if p is not None:
                if probs is None:
                    probs = torch.zeros(len(reqs), width, p.shape[-1], device=device)
                if every:
                    probs[:, step] = p.to(device)
                else:
                    probs[:, step].index_copy_(0, index, p.to(device))
        # A drafting request's draft cache now holds positions up to L+k-1; the others' did not move.
        return tokens, probs, [r.kv_len + k if k else r.draft_kv_len for r, k in zip(reqs, ks)]

    def _first_step(self, segments: list[Segment]) -> torch.Tensor:
        """The draft's first step over each request's uncached tokens: 1 after a round that
        rejected a proposal, 2 after one that accepted all, so a mix of both is left-padded to
        the draft's extend graphs where they take it; anything longer runs as it is."""
        width, longest = self.draft.extend_width(len(segments)), max(len(s.tokens) for s in segments)
        if 1 < longest <= width:
            return self.draft.forward(left_padded_batch(self.draft.req_to_token_pool, segments, width,
                                                        self.draft.device)[0], last_only=True)
        return forward_segments(self.draft, segments, last_only=True)

    def _catch_up(self, reqs: list[Request]) -> list[int]:
        """Cache committed tokens in the draft, at most ``chunk_tokens`` per pass, until the first
        proposal pass over what is left fits one chunk (each request keeps its last token for it).
        Returns each request's draft cache length after."""
        cached = [r.draft_kv_len for r in reqs]
        budget = self.chunk_tokens
        while budget:
            pending = [len(r.all_ids) - d for r, d in zip(reqs, cached)]
            if sum(pending) <= budget or all(n <= 1 for n in pending):
                break
            segments, left = [], budget
            for i, (r, n) in enumerate(zip(reqs, pending)):
                take = min(left, n - 1)
                if take > 0:
                    segments.append(Segment(r.req_idx, r.all_ids[cached[i] : cached[i] + take], cached[i]))
                    cached[i] += take
                    left -= take
            forward_segments(self.draft, segments, last_only=True)
            self.draft_tokens += budget - left
        return cached


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` of ``t`` (None: every row)."""
    return t if index is None else t.index_select(0, index)
