"""The engine: continuous batching over a started model worker (target and draft).

Start-up is the model worker's (``model_worker``: three phases, the speculator, the warm-up);
then speculation control, whose cost model timed rounds seed (adaptive only), and the scheduler,
which makes the engine ready.

``step`` is admit -> make room -> one prefill chunk -> one speculative round for the decoding
requests. Who runs is the scheduler's (``scheduler``: admission, chunked prefill, retraction, and
the one place a request's output grows); the draft lengths are speculation control's
(``speculation_control``); the passes are the speculator's; KV slots are ``KVSlots``'.
"""

from __future__ import annotations

import logging
import threading
import time

from .args import EngineArgs
from .model_worker import ModelWorker
from .parallel.distributed import stop_followers
from .phases import PhaseError, StartupError  # noqa: F401  (StartupError: re-exported for callers)
from .request import Request, check_request, make_generator
from .scheduler import Scheduler
from .service import EngineReport, KVUsage
from .speculation import wiring
from .speculation.spec_policy import SpecPolicy
from .speculation.speculation_control import SpeculationController, build_controller, measure_round_cost

log = logging.getLogger(__name__)


class Engine(ModelWorker):
    """The engine serving asks for (``service.EngineService``)."""

    def __init__(self, args: EngineArgs, eos_token_ids: frozenset[int] = frozenset()):
        super().__init__(args)
        self.control: SpeculationController | None = None  # the policy and what feeds it
        self.scheduler: Scheduler | None = None  # built last: the engine is ready once it exists
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.eos_token_ids = eos_token_ids  # ends a request that names none of its own

    def init_model_worker(self) -> None:
        """The model worker's start-up, then speculation control and the scheduler over it."""
        super().init_model_worker()
        self._timed("time_rounds", self._make_scheduler)  # timed rounds seed the policy's cost model

    def _make_scheduler(self) -> None:
        args, spec = self.args, self.speculator
        k = args.num_draft_tokens if self.method.drafts else 0
        cost = measure_round_cost(args.spec_policy, k, spec, args.max_running_requests, args.context_len,
                                  args.chunked_prefill_size)
        self.control = build_controller(args.spec_policy, self.method.name, k, spec, cost)
        if args.prefix_cache:  # after the warm-up and the timed passes: they leave no trace
            self.target_runner.slots.cache = wiring.create_prefix_cache(self.method)
        self.scheduler = Scheduler(self.target_runner.slots, spec.slots_per_round, self.stats,
                                   chunk_tokens=args.chunked_prefill_size, new_token_ratio=args.new_token_ratio,
                                   release=spec.release)

    @property
    def policy(self) -> SpecPolicy | None:
        return self.control.policy if self.control else None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    # ---- requests -------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if not self.ready:
            raise PhaseError("the engine is still initialising")
        check_request(req, self.args.context_len, self.memory_pool_config.max_total_num_tokens,
                      self.speculator.slots_per_round, self.target_shape.vocab_size)
        if req.generator is None:
            req.generator = make_generator(req.params.seed)
        req.eos_token_ids = req.eos_token_ids or self.eos_token_ids
        self.scheduler.add(req)
        return req

    def generate(self, prompt_ids: list[int], params) -> Request:
        """Blocking helper: run one request to the end (the loop must be running, or steps run here)."""
        req = self.submit(Request(list(prompt_ids), params))
        if self._thread is None:
            while not req.done.is_set():
                self.step()
        req.done.wait()
        if req.error:
            raise RuntimeError(req.error)
        return req

    def abort(self, req: Request) -> None:
        """Ask the engine to end ``req`` (client gone, stop string seen); thread-safe."""
        req.abort_requested = True

    @property
    def vocab_size(self) -> int:
        return self.target_shape.vocab_size

    # ---- the loop -------------------------------------------------------------------------
    def start_up(self) -> None:
        """The three phases, speculation control and the scheduler, then the loop."""
        self.init_model_worker()
        self.start()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        stop_followers()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.scheduler.idle:
                time.sleep(0.002)
                continue
            try:
                self.step()
            except Exception as exc:  # an engine bug: fail the running requests, keep serving
                log.exception("engine step failed")
                self.scheduler.fail_running(f"internal error: {type(exc).__name__}: {exc}")

    def step(self) -> None:
        """Admit, make room, one prefill chunk, then one speculative round for the decoding requests."""
        scheduler = self.scheduler
        scheduler.end_aborted()
        scheduler.admit()
        scheduler.make_room()
        reqs, ends = scheduler.prefill_chunk()
        if reqs:
            scheduler.prefilled(reqs, self.speculator.prefill(reqs, ends))
        reqs = scheduler.decoding()
        if reqs:
            self._decode_round(reqs)

    def _decode_round(self, reqs: list[Request]) -> None:
        """One speculative round: the draft lengths, the speculator's draft and verify, what the
        round teaches speculation control, then the commit."""
        plan = self.control.plan_round(reqs)
        start = time.perf_counter()
        results = self.speculator.decode_round(reqs, plan.draft_lengths, plan.lookup)
        seconds = time.perf_counter() - start
        self.control.observe(plan, results, seconds)
        self.stats.count_round(plan.draft_lengths, results, seconds)
        self.scheduler.keep_prefixes(reqs)  # a head's first drafting round makes a prompt reusable
        with self.scheduler.ending_together():
            for r, result in zip(reqs, results):
                kept = self.scheduler.commit(r, result.tokens, result.logprobs)
                self.stats.count_verified(r, result, kept)

    # ---- observability --------------------------------------------------------------------
    def report(self) -> EngineReport:
        """What serving reads: readiness, load, KV usage, memory against the plan, the policy."""
        profile, pool = self.memory_profile, self.memory_pool_config
        memory = None
        if profile is not None:
            memory = {**profile.as_dict(), "phaseSeconds": self.stats.phase_seconds,
                      "poolTokens": pool.max_total_num_tokens if pool else None}
        ready = self.ready
        return EngineReport(
            ready=ready, phase=self.phase.name, stats=self.stats, running=self.num_running, waiting=self.num_waiting,
            kv=KVUsage(*self.kv_usage()) if ready else None, prefix_cache=self.prefix_cache_usage() if ready else None,
            memory=memory, kv_tokens_actual=profile.max_total_num_tokens if profile else None,
            dynamic=self.dynamic_peak.as_dict() if self.dynamic_peak else {},
            allocator_peak_bytes=self._allocator_peak_bytes(), policy=_policy_view(self.policy))

    def _allocator_peak_bytes(self) -> int | None:
        """Peak device bytes beyond the static part (weights and KV pools): the measured counterpart
        of R_dynamic. Only CUDA keeps an allocator peak; elsewhere there is nothing to report."""
        profile, pools = self.memory_profile, self.memory_pool_config
        if profile is None or pools is None or self.device.type != "cuda":
            return None
        import torch

        cell = profile.target_bytes_per_token + profile.draft_bytes_per_token
        static = profile.target_weight_bytes + profile.draft_weight_bytes + pools.max_total_num_tokens * cell
        return max(0, torch.cuda.max_memory_allocated(self.device) - static)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) if self.scheduler else 0

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting if self.scheduler else 0

    def kv_usage(self) -> tuple[int, int]:
        """Slots running requests hold (cached ones they share included; cached positions no
        request holds are free capacity), and the pool's size."""
        slots = self.target_runner.slots
        return slots.size - slots.free_slots(), slots.size

    def prefix_cache_usage(self) -> dict[str, int] | None:
        """The prefix cache's share of the pool now (None: it is off)."""
        slots = self.target_runner.slots if self.target_runner else None
        if slots is None or slots.cache is None:
            return None
        cache = slots.cache
        return {"cachedTokens": cache.size, "evictableTokens": cache.evictable, "evictedTokens": cache.evicted,
                "poolTokens": slots.size}


def _policy_view(policy: SpecPolicy | None) -> dict | None:
    """What the speculation policy timed at start-up and has measured since (None: not adaptive)."""
    if policy is None:
        return None
    return {"mode": policy.mode, "timedRounds": policy.cost.table() if policy.cost is not None else None,
            "measuredSpeedup": policy.speedups(), "probeRounds": policy.probes}
