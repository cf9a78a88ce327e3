"""What every speculator shares at the bottom: a round's result, its lookups, its rows on the
device, and the ``Speculator`` base the engine drives.

A speculator proposes and verifies; it returns each request's new tokens, draft counts and cached
lengths, and the scheduler commits them (the one place a request's output grows and its cached
lengths move).

Slots for positions L..L+k are taken at the start of a round (L: the position of the request's
last committed token, the one not yet in any cache); the slots after the accepted prefix go
back to the allocator at the end of the round and serve the next one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..batch import PaddedChains, chain_batch
from ..forward_batch import ForwardBatch
from ..model_runner import ModelRunner
from ..request import Request, TokenLogprob
from .algorithms import Algorithm


@dataclass(frozen=True)
class RoundResult:
    """One request's verified round: the accepted proposals then the target's own next token, and
    how far each model's cache of the request reaches after it (the scheduler writes both back)."""

    tokens: list[int]
    proposed: int  # draft tokens the target verified this round
    accepted: int  # how many of them it accepted
    kv_len: int  # the target's cached positions after the round (``Request.kv_len``)
    draft_kv_len: int | None = None  # the draft's after it (``Request.draft_kv_len``); None: unmoved
    logprobs: list[TokenLogprob] | None = None  # one per token, where the request asked for them


@dataclass(frozen=True)
class Lookup:
    """A round's proposals, where a speculator knows them before their lengths are chosen (NGRAM:
    a lookup costs no pass), and what class of evidence each is: drafts of one class are alike in
    how often they are accepted, so the policy learns acceptance per class as well as per request."""

    proposals: list[list[int]]  # each request's proposal, at most K tokens (empty: nothing found)
    classes: list[int]  # each proposal's class, 0 .. Speculator.draft_classes - 1


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


class Speculator(ABC):
    """Prefill and decode rounds of one speculative algorithm over the target's KV pool.

    Neither method touches a request's output, its cached lengths or the engine's counters: the
    scheduler commits what they return. ``prefill`` caches up to the ends it is given (the
    scheduler then moves ``kv_len`` there); ``decode_round`` may read ``Request.all_ids`` and
    reports in each ``RoundResult`` the ``kv_len`` (and draft cache position) past the positions
    it verified. Within a round, lengths a pass moves for a later one are the round's own values.
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


def prefilled_to(reqs: list[Request], ends: list[int]) -> None:
    """A prefill pass cached each request's positions up to ``ends[i]``."""
    for r, end in zip(reqs, ends):
        r.kv_len = end


def take_cached_lengths(reqs: list[Request], results: list[RoundResult]) -> None:
    """Each request's cached lengths after its decode round, as its result reports them. With
    ``prefilled_to``, the one place a pass moves them: the scheduler calls both at a pass's end,
    and so do the warm-up and round timing, which run passes without a scheduler."""
    for r, result in zip(reqs, results):
        r.kv_len = result.kv_len
        if result.draft_kv_len is not None:
            r.draft_kv_len = result.draft_kv_len
