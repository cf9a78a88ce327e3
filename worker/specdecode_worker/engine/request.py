"""A generation request and its sampling parameters, as the engine tracks them."""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import InputError

_ids = itertools.count()


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator. User seeds are hashed first: generators seeded with consecutive
    integers give visibly correlated first draws (measured: chi-square 21.7 on 7 degrees of
    freedom over 12,000 seeds), and clients often number their seeds 0, 1, 2..."""
    if seed is None:
        return torch.Generator().manual_seed(torch.seed() % (1 << 63))
    digest = hashlib.sha256(str(seed).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (1 << 63))


MAX_LOGIT_BIAS = 300  # entries, as OpenAI caps logit_bias
MAX_TOP_LOGPROBS = 20  # as vLLM and the OpenAI API cap top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the likeliest tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    ignore_eos: bool = False
    # Log-probabilities of the emitted tokens with this many of the likeliest tokens at each
    # position (None: none are computed).
    logprobs: int | None = None
    # The same for the prompt's tokens (echo): each one after the first, under the prefill's rows.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to the target's logit of each (token, bias) before any other rule, as OpenAI defines it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS may not be emitted before this many output tokens

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise InputError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer (0 turns it off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise InputError(f"{name} must be a number in [-2, 2], got {value!r}")
        value = self.repetition_penalty
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 10:
            raise InputError(f"repetition_penalty must be a number in (0, 10] (1 turns it off), got {value!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 or isinstance(b, bool)
                or not isinstance(b, (int, float)) or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise InputError(f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for value in (self.logprobs, self.prompt_logprobs):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise InputError(f"the number of top logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Called from the engine thread with each batch of newly committed token ids, then once with
    # ``None`` when the request ends (finish_reason or error set).
    on_update: Callable[["Request", list[int] | None], None] | None = None
    rid: int = field(default_factory=lambda: next(_ids))
    speculative: bool = True  # False: this request never drafts (plain decoding)
    max_draft_tokens: int | None = None  # a cap on its draft length per round (None: the engine's)
    grammar: Any = None  # a TokenGrammar: the tokens its output may take (structured outputs)
    cache_prompt: bool = True  # False: neither reuse cached KV nor leave this request's KV in the cache
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., if asked
    finish_reason: str | None = None
    error: str | None = None
    # Engine state: request row, tokens in the target's KV pool, tokens in the draft's.
    req_idx: int | None = None
    kv_len: int = 0
    draft_kv_len: int = 0
    # While prefilling: the tokens to cache before decoding, ``kv_len`` of them done. The prompt, or
    # after a retraction the prompt plus every committed token but the last (recomputed, not resampled).
    prefill_ids: list[int] | None = None
    retractions: int = 0
    cached_tokens: int = 0  # prompt positions the prefix cache served (usage's cached_tokens)
    cache_node: Any = None  # the prefix cache's node this request's row holds (its first positions)
    cache_held: int = 0  # how many positions that is
    accepted_draft_tokens: int = 0
    proposed_draft_tokens: int = 0
    kept_draft_tokens: int = 0  # accepted drafts that are in the output (not cut by EOS or max_tokens)
    verify_rounds: int = 0
    abort_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def check_request(req: Request, context_len: int, pool_tokens: int, slots_per_round: int, vocab_size: int) -> None:
    """Refuse a request that could never run, whatever else is running."""
    req.params.validate()
    if not req.prompt_ids:
        raise InputError("the prompt is empty")
    cap = req.max_draft_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise InputError(f"max_draft_tokens must be a non-negative integer (0 turns drafting off), got {cap!r}")
    if len(req.prompt_ids) + req.params.max_tokens > context_len:
        raise InputError(f"prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.params.max_tokens}) "
                         f"exceeds the context length {context_len}; shorten the prompt or lower max_tokens")
    needed = len(req.prompt_ids) + req.params.max_tokens + slots_per_round
    if needed > pool_tokens:
        raise InputError(f"the request needs {needed} KV slots but the pool holds {pool_tokens}; "
                         "shorten the prompt or lower max_tokens")
    if any(not 0 <= t < vocab_size for t in req.prompt_ids):
        raise InputError(f"prompt token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t, _ in req.params.logit_bias):
        raise InputError(f"logit_bias token ids must be in [0, {vocab_size})")
