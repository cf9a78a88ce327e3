"""Which requests run each step, and the one place a request's output grows or ends and its cached
lengths (``kv_len``, ``draft_kv_len``) move.

Prefill and decode alternate within a step. Each step runs at most one prefill pass of at most
``chunk_tokens`` prompt tokens (oldest admitted requests first, a long prompt split over steps),
then one decode round for every request whose prefill is done, so a long prompt delays running
requests by one chunk per step, never by a whole prompt.

Admission counts the slots requests really hold plus an estimate of their growth
(``new_token_ratio`` of the tokens they may still generate). When the pool runs short, the newest
requests are retracted (their slots freed; target and draft share them) and later recomputed from
prompt + committed tokens. Recompute samples nothing, so a request's generator continues where it
stopped. The oldest request is never retracted, and it always fits alone (the engine's admission
check), so every request finishes.

The scheduler decides who runs; the engine runs the passes and hands back what they produced.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .memory.kv_slots import Closing, Keep, KVSlots
from .memory.prefix_cache import common_prefix
from .request import Request, TokenLogprob
from .speculation.rounds import prefilled_to, take_cached_lengths
from .stats import Stats

if TYPE_CHECKING:
    from .speculation.rounds import RoundResult

log = logging.getLogger(__name__)

# A waiting prompt that shares this many positions with a prompt still prefilling waits for that
# prefill to reach the prefix cache, rather than computing them again beside it.
SHARED_PREFILL_MIN = 32


class Scheduler:
    def __init__(self, slots: KVSlots, slots_per_round: int, stats: Stats, *, chunk_tokens: int = 0,
                 new_token_ratio: float = 0.5):
        self.slots, self.slots_per_round, self.stats = slots, slots_per_round, stats
        self.chunk_tokens = chunk_tokens or slots.size
        self.new_token_ratio = new_token_ratio
        # Requests that left the batch (finished or retracted), oldest first: whoever keeps state
        # per request (the speculator) takes them from here and forgets it.
        self.left: list[Request] = []
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admitted (prefilling or decoding), oldest first
        self._ending: list[Closing] | None = None  # rows of requests ending in a group
        self._finished: list[Request] = []  # finished in that group, told once their slots are back

    # ---- the queue (thread-safe) --------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.add(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and self.num_waiting == 0

    # ---- one step's decisions -------------------------------------------------------------------
    def end_aborted(self) -> None:
        with self.ending_together():
            for r in [r for r in self.running if r.abort_requested]:
                self.finish(r, reason="abort")

    def admit(self) -> list[Request]:
        """Waiting requests, retracted ones first, while their expected slots fit beside the running
        requests' (the first always, when nothing runs). A request starts with the longest prefix
        the cache holds; one whose prompt shares a long prefix with a prompt still prefilling waits
        for that prefill, which then serves it from the cache."""
        admitted = []
        spare = self.slots.free_slots() - sum(self._expected_slots(r) for r in self.running)
        while self.slots.free_rows() > 0 and (req := self.waiting.peek()) is not None:
            if req.abort_requested:
                self.waiting.pop()
                self.finish(req, reason="abort")
                continue
            prefill_ids = req.all_ids[:-1] if req.output_ids else list(req.prompt_ids)
            if self._shares_a_prefill(req, prefill_ids):
                break
            free = self.slots.free_slots()
            # A request scoring its prompt (echo with logprobs) prefills every position.
            reuse = _caches(self.slots, req) and req.params.prompt_logprobs is None
            hit = self.slots.borrow(prefill_ids, len(prefill_ids) - 1) if reuse else None
            cached = hit.length if hit else 0
            need = self._expected_slots(req, cached) + free - self.slots.free_slots()  # held cache is not free
            if need > spare and self.running:
                if hit is not None:
                    self.slots.give_back_hit(hit)
                break  # wait for running requests to finish or grow less than estimated
            self.waiting.pop()
            req.req_idx = self.slots.open_row(hit)
            req.prefill_ids = prefill_ids
            req.cache_held = cached
            if not req.output_ids:
                req.cached_tokens = cached
            if hit is not None:
                req.kv_len, req.draft_kv_len, req.cache_node = hit.length, hit.draft_length, hit.node
            spare -= need
            self.running.append(req)
            admitted.append(req)
        return admitted

    def make_room(self) -> None:
        """Retract the newest requests until this step fits, then make its slots free (evicting
        cached positions no request holds)."""
        with self.ending_together():
            returning = 0  # slots the requests retracted so far free, once the block ends
            while len(self.running) > 1 and self.slots.free_slots() + returning < self._room_needed():
                r = self.running[-1]
                returning += self.slots.returned_by(r.kv_len, r.cache_node)
                self._retract(r)
        self.slots.make_free(self._room_needed())

    def prefill_chunk(self) -> tuple[list[Request], list[int]]:
        """The requests of this step's prefill pass, oldest first, and the position each reaches."""
        room = self.slots.free_slots() - _decoding_count(self.running) * self.slots_per_round
        budget = min(self.chunk_tokens, room)
        reqs, ends = [], []
        for r in self.running:
            if r.prefill_ids is None or budget <= 0:
                continue
            n = min(budget, len(r.prefill_ids) - r.kv_len)
            reqs.append(r)
            ends.append(r.kv_len + n)
            budget -= n
        return reqs, ends

    def prefilled(self, reqs: list[Request], ends: list[int], firsts: list[RoundResult | None]) -> None:
        """After the prefill pass that cached ``reqs`` up to ``ends``: a request whose prompt is cached
        decodes from the next step (and leaves its prompt in the prefix cache for later prompts); a
        fresh one commits its first token (a recompute has its tokens already)."""
        prefilled_to(reqs, ends)
        done = [(r, first) for r, first in zip(reqs, firsts) if r.kv_len >= len(r.prefill_ids)]
        for r, _ in done:
            r.prefill_ids = None
        self.keep_prefixes([r for r, _ in done])
        with self.ending_together():
            for r, first in done:
                if first is not None:
                    self.stats.prompt_tokens += len(r.prompt_ids)
                    self.stats.cached_prompt_tokens += r.cached_tokens
                    self.commit(r, first.tokens, first.logprobs)

    def decoding(self) -> list[Request]:
        """The requests of this step's decode round: those prefilled, as many as the free slots
        hold a round for (a just-prefilled one may wait a step)."""
        room = self.slots.free_slots() // self.slots_per_round
        return [r for r in self.running if r.prefill_ids is None][:room]

    # ---- output ------------------------------------------------------------------------------
    def commit_round(self, reqs: list[Request], results: list[RoundResult]) -> None:
        """A decode round's end: prompts kept for reuse, each request's tokens committed and its
        round counted, and the requests it finished ending together."""
        take_cached_lengths(reqs, results)  # first: what is kept and closed below reads them
        self.keep_prefixes(reqs)  # a head's first drafting round makes a prompt reusable
        with self.ending_together():
            for r, result in zip(reqs, results):
                kept = self.commit(r, result.tokens, result.logprobs)
                self.stats.count_verified(r, result, kept)

    def take_left(self) -> list[Request]:
        """The requests that left the batch since the last call."""
        left, self.left = self.left, []
        return left

    def commit(self, r: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Append new tokens (and their log-probabilities) up to EOS or max_tokens, the one place
        output grows; finish if done. Returns how many of ``tokens`` were kept."""
        kept, reason = [], None
        for t in tokens:
            kept.append(t)
            if r.grammar is not None:
                r.grammar.commit([t])
            if t in r.eos_token_ids and not r.params.ignore_eos or r.grammar is not None and r.grammar.complete:
                reason = "stop"
                break
            if len(r.output_ids) + len(kept) >= r.params.max_tokens:
                reason = "length"
                break
        if logprobs is not None:
            r.output_logprobs.extend(logprobs[: len(kept)])
        r.output_ids.extend(kept)
        self.stats.generated_tokens += len(kept)
        if r.on_update and kept:
            r.on_update(r, kept)
        if reason:
            self.finish(r, reason=reason)
        return len(kept)

    def finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.req_idx is not None:
            self._close_row(r)
            r.req_idx = None
        self.left.append(r)
        r.finish_reason, r.error = reason, error
        self.stats.finished_requests += 1
        if self._ending is not None:
            self._finished.append(r)
        else:
            _tell_done([r])

    def fail_running(self, error: str) -> None:
        """End every running request with ``error`` (an engine bug: the server keeps serving)."""
        with self.ending_together():
            for r in list(self.running):
                self.finish(r, error=error)

    @contextmanager
    def ending_together(self):
        """Requests that finish or are retracted in the block give their slots back together when it
        ends: reading slots back from the device waits for the GPU, so a step whose round ends many
        requests must pay one wait, not one per request. Slots counted inside the block are those
        not yet returned; a finished request is told it is done once its slots are back."""
        if self._ending is not None:  # nested: the outer block returns them
            yield
            return
        self._ending = []
        try:
            yield
        finally:
            rows, self._ending = self._ending, None
            finished, self._finished = self._finished, []
            if rows:
                self.slots.close_rows(rows)
            _tell_done(finished)

    # ---- internals ---------------------------------------------------------------------------
    def _expected_slots(self, r: Request, cached: int = 0) -> int:
        """Slots ``r`` will take beyond those it holds: its prefill left, one round's, and a share of
        the tokens it may still generate (the whole of them once it has been retracted).
        ``cached``: for a waiting request, the positions the prefix cache will serve."""
        if r.req_idx is None:  # waiting: the prompt, or prompt + committed tokens after a retraction
            prefill_left = len(r.all_ids) - (1 if r.output_ids else 0) - cached
        else:
            prefill_left = len(r.prefill_ids) - r.kv_len if r.prefill_ids is not None else 0
        ratio = 1.0 if r.retractions else self.new_token_ratio
        growth = math.ceil(ratio * (r.params.max_tokens - len(r.output_ids)))
        return prefill_left + self.slots_per_round + growth

    def _room_needed(self) -> int:
        """Slots this step takes: one round for every decoding request, and the first prefill chunk."""
        first = next((r for r in self.running if r.prefill_ids is not None), None)
        chunk = min(self.chunk_tokens, len(first.prefill_ids) - first.kv_len) if first else 0
        return _decoding_count(self.running) * self.slots_per_round + chunk

    def _retract(self, r: Request) -> None:
        """Free every slot of ``r`` (its committed positions stay in the prefix cache, if on, until
        evicted) and queue it for recompute."""
        self._close_row(r)
        self.left.append(r)
        r.req_idx, r.kv_len, r.draft_kv_len, r.prefill_ids = None, 0, 0, None
        r.retractions += 1
        self.stats.retracted_requests += 1
        self.running.remove(r)
        self.waiting.put_back(r)
        log.info("request %d retracted under KV pressure (%d tokens committed, recomputed later)", r.rid,
                 len(r.output_ids))

    def _close_row(self, r: Request) -> None:
        """Give back ``r``'s row and the slots of its ``kv_len`` positions (into the prefix cache,
        if on); inside ``ending_together`` they go back when the block ends, with the rest of the group."""
        closing = Closing(r.req_idx, r.kv_len, _keep(r) if _caches(self.slots, r) else None)
        r.cache_node, r.cache_held = None, 0
        if self._ending is not None:
            self._ending.append(closing)
        else:
            self.slots.close_rows([closing])

    # ---- the prefix cache ------------------------------------------------------------------------
    def keep_prefixes(self, reqs: list[Request]) -> None:
        """Leave the prompts of running requests in the cache, once their KV can be reused (after
        the prefill; for a draft that reads the next token, after its first drafting round)."""
        keeping = [(r, _keep(r)) for r in reqs if _caches(self.slots, r) and r.prefill_ids is None
                   and r.cache_held < len(r.prompt_ids) - 1]
        keeping = [(r, keep) for r, keep in keeping if self.slots.keepable(keep) > r.cache_held]
        if keeping:
            for (r, keep), node in zip(keeping, self.slots.keep_rows([(r.req_idx, k) for r, k in keeping])):
                r.cache_node, r.cache_held = node, self.slots.keepable(keep)

    def _shares_a_prefill(self, req: Request, ids: list[int]) -> bool:
        """Whether a running request is prefilling at least ``SHARED_PREFILL_MIN`` positions of
        ``ids`` that the cache does not hold yet: admitting ``req`` now would compute them twice."""
        if not _caches(self.slots, req):
            return False
        return any(r.prefill_ids is not None and _caches(self.slots, r)
                   and common_prefix(r.prefill_ids, ids) - r.cache_held >= SHARED_PREFILL_MIN for r in self.running)


class WaitingQueue:
    """Requests waiting to run: new ones, added from the server's threads, and retracted ones, which
    wait ahead of them (newest retracted first, so the older comes back first)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new: deque[Request] = deque()
        self._retracted: deque[Request] = deque()  # only the engine's thread touches these

    def add(self, req: Request) -> None:
        with self._lock:
            self._new.append(req)

    def put_back(self, req: Request) -> None:
        self._retracted.appendleft(req)

    def __len__(self) -> int:
        with self._lock:
            return len(self._new) + len(self._retracted)

    def peek(self) -> Request | None:
        if self._retracted:
            return self._retracted[0]
        with self._lock:
            return self._new[0] if self._new else None

    def pop(self) -> None:
        if self._retracted:
            self._retracted.popleft()
        else:
            with self._lock:
                self._new.popleft()


def _keep(r: Request) -> Keep:
    """What ``r``'s row leaves in the cache: its cached positions' tokens, how far its draft's
    K/V is valid, and the token after them where it is known."""
    ids = r.all_ids
    return Keep(ids[: r.kv_len], min(r.draft_kv_len, r.kv_len), ids[r.kv_len] if r.kv_len < len(ids) else None,
                r.cache_node)


def _tell_done(reqs: list[Request]) -> None:
    for r in reqs:
        if r.on_update:
            r.on_update(r, None)
        r.done.set()



def _decoding_count(running: list[Request]) -> int:
    return sum(1 for r in running if r.prefill_ids is None)


def _caches(slots: KVSlots, r: Request) -> bool:
    """Whether ``r``'s prompt goes into the prefix cache (it is on, and the request allows it)."""
    return slots.cache is not None and r.cache_prompt
