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
from dataclasses import dataclass

import torch

from ..batch import (PaddedChains, Segment, chain_batch, chunk_segments, forward_segments, fresh_batch,
                     left_padded_batch, step_batch)
from ..batch_sampling import chain_rows, choose_tokens, to_host, uniforms, verify_chains
from ..cuda_graph import chain_graph_width
from ..forward_batch import ForwardBatch, to_device
from ..model_runner import ModelRunner
from ..logprobs import token_logprobs
from ..output_rules import DraftGrammars, ruled_chain, ruled_next
from ..request import Request, TokenLogprob
from .algorithms import Algorithm, Drafter, algorithm
from .ngram_index import RequestIndexes

@dataclass(frozen=True)
class RoundResult:
    """One request's verified round: the accepted proposals then the target's own next token."""

    tokens: list[int]
    proposed: int  # draft tokens the target verified this round
    accepted: int  # how many of them it accepted
    logprobs: list[TokenLogprob] | None = None  # one per token, where the request asked for them


@dataclass(frozen=True)
class Lookup:
    """A round's proposals, where a speculator knows them before their lengths are chosen (NGRAM:
    a lookup costs no pass), and what class of evidence each is: drafts of one class are alike in
    how often they are accepted, so the policy learns acceptance per class as well as per request."""

    proposals: list[list[int]]  # each request's proposal, at most K tokens (empty: nothing found)
    classes: list[int]  # each proposal's class, 0 .. Speculator.draft_classes - 1


class Speculator(ABC):
    """Prefill and decode rounds of one speculative algorithm over the target's KV pool.

    Neither method touches a request's output or the engine's counters: the engine commits what
    they return. ``decode_round`` may read ``Request.all_ids`` and moves ``kv_len`` (and the
    draft's cache position) past the positions it verified.
    """

    algorithm: str
    method: Algorithm  # the algorithm's declaration (speculation/algorithms.py)
    target: ModelRunner
    draft: ModelRunner | None = None  # the model that drafts, if any
    k: int = 0  # most tokens a request drafts in one round
    # An EAGLE tree's shape, where a round drafts a tree (the warm-up sizes its passes by it).
    tree: bool = False
    tree_shape = None
    ngram_max: int = 0  # longest suffix an n-gram lookup matches (0: no lookups)
    draft_tokens: int = 0  # tokens the draft model has processed (catch-up and proposals)

    @property
    @abstractmethod
    def slots_per_round(self) -> int:
        """KV slots a request may hold beyond its committed tokens during one round."""

    @abstractmethod
    def prefill(self, reqs: list[Request], ends: list[int]) -> list[RoundResult | None]:
        """Cache prefill positions ``r.kv_len .. end - 1`` of each request in one target pass.

        Returns the first token of each request whose prompt this chunk finished, None for the
        others and for a request recomputed after a retraction (its tokens are committed already).
        """

    def release(self, r: Request) -> None:
        """Forget what is kept for ``r`` between rounds (it finished or was retracted)."""
        return None  # only EAGLE keeps per-request state (target features) between rounds

    # Whether a draft model keeps a cache of its own that falls behind while a request does not
    # draft (``catch_up_tokens`` says by how much).
    catches_up: bool = False

    def catch_up_tokens(self, r: Request) -> int:
        """Committed tokens the draft must cache before ``r`` can draft, beyond the one every
        drafting round feeds it anyway."""
        return 0

    @staticmethod
    def first_tokens(reqs: list[Request], ends: list[int], logits: torch.Tensor) -> list[RoundResult | None]:
        """Advance each request past its chunk (``logits``: its last row); sample, in one batch
        and one transfer, the first token of each request whose chunk ends a fresh prompt."""
        fresh = []
        for i, (r, end) in enumerate(zip(reqs, ends)):
            r.kv_len = end
            if end >= len(r.prefill_ids) and not r.output_ids:  # a recompute samples nothing
                fresh.append(i)
        out: list[RoundResult | None] = [None] * len(reqs)
        if fresh:
            for i, result in zip(fresh, sample_next([reqs[i] for i in fresh], logits, fresh)):
                out[i] = result
        return out

    @property
    def chain_verify_graphs(self):
        """The graphs that take this speculator's chain verify passes (None: they run eagerly)."""
        return self.target.verify_graphs

    def target_pass(self, fb) -> None:
        """One target pass over every row of ``fb``, as a round runs it (the policy's warm-up times it)."""
        self.target.forward(fb, last_only=False)

    # Whether requests of one round may draft different lengths (else the policy picks one k).
    per_request_draft_lengths: bool = True
    # The draft lengths a round may take when one k serves the whole batch (None: 0..K).
    draft_length_choices: tuple[int, ...] | None = None
    # Draft tokens every request of a drafting round verifies, whatever its draft length (None: its
    # draft length). A tree verifies all its nodes: its shapes are static.
    verified_per_request: int | None = None
    # Classes of ``look_ahead``'s proposals (0: it has none).
    draft_classes: int = 0

    def look_ahead(self, reqs: list[Request], caps: list[int]) -> Lookup | None:
        """Each request's proposal before the round, where it costs no pass to know (None: the
        drafts are made in the round); a request capped at 0 tokens is not looked up."""
        return None

    @abstractmethod
    def decode_round(self, reqs: list[Request], draft_lengths: list[int] | None = None,
                     lookup: Lookup | None = None) -> list[RoundResult]:
        """Advance every request by one verified round; request i drafts at most ``draft_lengths[i]``
        tokens (default: the speculator's K). A length of 0 is a plain decode step for it.
        ``lookup``: this round's ``look_ahead``, whose proposals the round then drafts."""


def wants_prompt_rows(reqs: list[Request]) -> bool:
    """Whether a prefill must keep every row: a request asked for its prompt's logprobs and has
    prompt positions left to score (a recompute after a retraction has none)."""
    return any(r.params.prompt_logprobs is not None and len(r.prompt_token_logprobs) < len(r.prompt_ids) - 1
               and r.kv_len < len(r.prompt_ids) - 1 for r in reqs)


def record_prompt_logprobs(reqs: list[Request], segments: list[Segment], logits: torch.Tensor) -> torch.Tensor:
    """``logits``: every row of a prefill chunk. Records the prompt tokens' logprobs each request
    asked for (the row at position p scores prompt token p + 1) and returns each segment's last row."""
    starts = [sum(len(s.tokens) for s in segments[:i]) for i in range(len(segments))]
    asking, rows, tokens = [], [], []
    for r, s, first in zip(reqs, segments, starts):
        if r.params.prompt_logprobs is None:
            continue
        begin, end = max(s.start, len(r.prompt_token_logprobs)), min(s.start + len(s.tokens), len(r.prompt_ids) - 1)
        if begin < end:
            asking.append(r)
            rows.append([first + p - s.start for p in range(begin, end)])
            tokens.append(r.prompt_ids[begin + 1 : end + 1])
    for r, found in zip(asking, token_logprobs(logits, rows, tokens, [r.params.prompt_logprobs for r in asking])):
        r.prompt_token_logprobs.extend(found)
    last = [first + len(s.tokens) - 1 for s, first in zip(segments, starts)]
    return logits.index_select(0, to_device(last, logits.device))


def sample_next(reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> list[RoundResult]:
    """One token per request from its row ``rows[i]`` of ``logits``, under its output rules and
    sampler, with its log-probability where asked for, read back once: a prompt's first token, or
    a step where nobody drafts (what a verify pass draws after no proposal)."""
    every = rows == list(range(logits.shape[0]))
    picked = logits if every else logits.index_select(0, to_device(rows, logits.device))
    tokens, _ = choose_tokens(ruled_next(reqs, picked), [r.params for r in reqs],
                              first_uniforms(reqs, 1, logits.device))
    tokens = to_host(tokens)[0]
    logprobs = emitted_logprobs(reqs, logits, [[i] for i in rows], [[t] for t in tokens])
    return [RoundResult([t], proposed=0, accepted=0, logprobs=lp) for t, lp in zip(tokens, logprobs)]


def first_uniforms(reqs: list[Request], counts, device) -> torch.Tensor | None:
    """Uniforms for a sampling pass over ``reqs``, ``[B]`` for one draw each."""
    u = uniforms([r.params for r in reqs], [r.generator for r in reqs], counts, device)
    return None if u is None else u[:, 0]


def accept_chains(reqs: list[Request], draft: torch.Tensor, draft_probs: torch.Tensor | None,
                  logits: torch.Tensor, ks: list[int], padded: PaddedChains | None = None
                  ) -> tuple[list[int], list[int], list[list[int]], list[list[TokenLogprob] | None]]:
    """Verify every request's chain on the device and read the results back once: accepted counts,
    next tokens, the proposals, and the emitted tokens' log-probabilities where asked for.
    ``logits``: the verify pass's rows, ``ks[i] + 1`` per request, or ``padded.width`` per request
    (its first ``ks[i] + 1`` real) for a padded batch."""
    width = max(ks, default=0)
    draft = draft[:, :width]
    draft_probs = None if draft_probs is None else draft_probs[:, :width]
    if padded is None:
        rows = to_device(chain_rows(ks), logits.device)
        target = logits.index_select(0, rows).view(len(reqs), width + 1, -1)
        lengths = ks
    else:  # rows already laid out per request; the lengths are on the device with the batch
        target = logits.view(len(reqs), padded.width, -1)[:, : width + 1]
        lengths = padded.lengths - 1
    target = ruled_chain(reqs, target, draft, ks)  # a ruled copy: logprobs read the raw rows
    params = [r.params for r in reqs]
    u = uniforms(params, [r.generator for r in reqs], [k + 1 for k in ks], logits.device)
    n, nxt = verify_chains(draft, draft_probs, target, lengths, params, u)
    n, nxt, drafted = to_host(n, nxt, draft)
    widths = [padded.width] * len(reqs) if padded else [k + 1 for k in ks]
    starts = [sum(widths[:i]) for i in range(len(reqs))]  # each request's first row in ``logits``
    logprobs = emitted_logprobs(reqs, logits, [range(s, s + a + 1) for s, a in zip(starts, n)],
                                [d[:a] + [t] for d, a, t in zip(drafted, n, nxt)])
    return n, nxt, drafted, logprobs


def emitted_logprobs(reqs: list[Request], logits: torch.Tensor, rows: list, tokens: list[list[int]]
                     ) -> list[list[TokenLogprob] | None]:
    """Per request, its emitted ``tokens``' log-probabilities under its verifying ``rows`` of
    ``logits``, or None where it did not ask (nothing is computed when none did)."""
    asking = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(reqs)
    if asking:
        found = token_logprobs(logits, [list(rows[i]) for i in asking], [tokens[i] for i in asking],
                               [reqs[i].params.logprobs for i in asking])
        for i, lp in zip(asking, found):
            out[i] = lp
    return out


@dataclass(frozen=True)
class RoundRows:
    """A round's per-request metadata on the device, sent with its slots in one copy
    (``reserve_round``): draft steps and the verify batch are built from it there."""

    last: torch.Tensor  # [B] each request's last committed token
    req_idx: torch.Tensor  # [B] its request row
    kv: torch.Tensor  # [B] its cached length, L
    lengths: torch.Tensor  # [B] rows it verifies: its draft length + 1

    def verify_batch(self, req_to_token: torch.Tensor, reqs: list[Request], ks: list[int], chains: torch.Tensor,
                     width: int) -> tuple[ForwardBatch, PaddedChains]:
        """The chain verify batch, ``width`` rows per request (``batch.chain_batch``)."""
        return chain_batch(req_to_token, self.req_idx, self.kv, self.lengths,
                           [r.kv_len + k + 1 for r, k in zip(reqs, ks)], chains, width)


def reserve_round(slots, reqs: list[Request], widths: list[int], ks: list[int], *also: list[int]
                  ) -> tuple[RoundRows, list[torch.Tensor]]:
    """Slots for positions L .. L + widths[i] - 1 of each request (``KVSlots``), its ``RoundRows``
    for draft lengths ``ks``, and the host lists ``also``, all in one copy to the device."""
    last, req_idx, kv, lengths, *rest = slots.reserve(
        [(r.req_idx, r.kv_len, r.kv_len + w) for r, w in zip(reqs, widths)],
        also=([r.all_ids[-1] for r in reqs], [r.req_idx for r in reqs], [r.kv_len for r in reqs],
              [k + 1 for k in ks], *also))
    return RoundRows(last, req_idx, kv, lengths), rest


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` of ``t`` (None: every row)."""
    return t if index is None else t.index_select(0, index)


def verify_width(graphs, ks: list[int]) -> int:
    """Rows per request of a chain verify pass laid out on the device (``batch.chain_batch``): the
    verify graphs' width (``chain_graph_width``), else every chain's length when they are all one
    length (no padding), else 0: the ragged batch."""
    return chain_graph_width(graphs, len(ks), max(ks, default=0)) or (ks[0] + 1 if len(set(ks)) == 1 else 0)


def chain_segments(reqs: list[Request], ks: list[int]) -> list[Segment]:
    """A ragged verify batch: request i's last token and ``ks[i]`` proposals (ids set on the device)."""
    return [Segment(r.req_idx, [0] * (k + 1), r.kv_len) for r, k in zip(reqs, ks)]


def ragged_ids(chains: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """The first ``ks[i] + 1`` tokens of each row of ``chains``, concatenated."""
    width = chains.shape[1]
    flat = [i * width + j for i, k in enumerate(ks) for j in range(k + 1)]
    return chains.reshape(-1).index_select(0, to_device(flat, chains.device))


def ngram_match(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix,
    and that suffix's length (0: no suffix of ``min_n`` tokens or more occurs earlier)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k], n
    return [], 0


def ngram_propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    return ngram_match(tokens, k, max_n, min_n)[0]


class StandaloneSpeculator(Speculator):
    """NONE, STANDALONE (a draft model with its own K/V) and NGRAM (prompt lookup)."""

    catches_up = True  # a STANDALONE draft's cache; 0 tokens without a draft model

    def __init__(self, algorithm_name: str, target_runner: ModelRunner, draft_runner: ModelRunner | None = None,
                 num_draft_tokens: int = 4, ngram_max: int = 4, chunk_tokens: int = 0, ngram_min: int = 1):
        self.method = algorithm(algorithm_name)
        if self.method.reads_target_features:
            raise ValueError(f"{algorithm_name} drafts from the target's features: EagleSpeculator runs it")
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
        return self.first_tokens(reqs, ends, logits)

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
        if lookup:
            draft, draft_probs = proposals.view(len(reqs), width), None  # point masses
        else:
            draft, draft_probs = self._draft_propose(reqs, ks, rows)
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
        for r, k, n, nxt, tokens, lp in zip(reqs, ks, accepted, nexts, drafted, logprobs):
            last = r.kv_len
            r.kv_len = last + n + 1  # the last token and the n accepted proposals are now cached
            r.draft_kv_len = min(r.draft_kv_len, r.kv_len)
            rejected.append((r.req_idx, r.kv_len, last + k + 1))
            results.append(RoundResult(tokens[:n] + [nxt], proposed=k, accepted=n, logprobs=lp))
        slots.release(rejected)
        return results

    def _plain_step(self, reqs: list[Request]) -> list[RoundResult]:
        """A step where nobody drafts: each request's last token over a fresh slot, the batch sent
        in one copy, then its next token."""
        segments = [Segment(r.req_idx, [r.all_ids[-1]], r.kv_len) for r in reqs]
        # One row per request: "every row" is each request's last, as a verify pass reads them.
        logits = self.target.forward(fresh_batch(self.target.slots, segments, self.target.device), last_only=False)
        for r in reqs:
            r.kv_len += 1
        return sample_next(reqs, logits, list(range(len(reqs))))

    def _draft_propose(self, reqs: list[Request], ks: list[int], rows: RoundRows
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft model's proposals ``[B, max(ks)]`` on the target's device, request i's first
        ``ks[i]``, and the distributions they were drawn from (None: greedy)."""
        # Step 1 catches the draft's cache up to the last committed token (the prompt on a request's
        # first drafting round, or every token committed since it last drafted); steps 2..k feed
        # back one proposal each, from the device (nothing is read back until the verify pass's
        # results). A request drafting 0 tokens is left out: its draft cache catches up when it next drafts.
        device, width = self.target.device, max(ks, default=0)
        tokens = torch.zeros(len(reqs), width, dtype=torch.int64, device=device)
        probs = None
        self._catch_up([r for r, k in zip(reqs, ks) if k])
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
                segments = [Segment(reqs[i].req_idx, reqs[i].all_ids[reqs[i].draft_kv_len :], reqs[i].draft_kv_len)
                            for i in drafting]
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
        for r, k in zip(reqs, ks):
            if k:
                r.draft_kv_len = r.kv_len + k  # positions up to L+k-1 now hold draft K/V
        return tokens, probs

    def _first_step(self, segments: list[Segment]) -> torch.Tensor:
        """The draft's first step over each request's uncached tokens: 1 after a round that
        rejected a proposal, 2 after one that accepted all, so a mix of both is left-padded to
        the draft's extend graphs where they take it; anything longer runs as it is."""
        width, longest = self.draft.extend_width(len(segments)), max(len(s.tokens) for s in segments)
        if 1 < longest <= width:
            return self.draft.forward(left_padded_batch(self.draft.req_to_token_pool, segments, width,
                                                        self.draft.device)[0], last_only=True)
        return forward_segments(self.draft, segments, last_only=True)

    def _catch_up(self, reqs: list[Request]) -> None:
        """Cache committed tokens in the draft, at most ``chunk_tokens`` per pass, until the first
        proposal pass over what is left fits one chunk (each request keeps its last token for it)."""
        budget = self.chunk_tokens
        while budget:
            pending = [len(r.all_ids) - r.draft_kv_len for r in reqs]
            if sum(pending) <= budget or all(n <= 1 for n in pending):
                return
            segments, left = [], budget
            for r, n in zip(reqs, pending):
                take = min(left, n - 1)
                if take > 0:
                    ids = r.all_ids[r.draft_kv_len : r.draft_kv_len + take]
                    segments.append(Segment(r.req_idx, ids, r.draft_kv_len))
                    r.draft_kv_len += take
                    left -= take
            forward_segments(self.draft, segments, last_only=True)
            self.draft_tokens += budget - left
