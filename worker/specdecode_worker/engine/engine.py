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
from dataclasses import dataclass
from typing import Callable

from .args import EngineArgs
from .model_worker import ModelWorker
from .models.loader import WeightSource
from .parallel.distributed import stop_followers
from .phases import PhaseError, StartupError  # noqa: F401  (StartupError: re-exported for callers)
from .request import Request, check_request, make_generator
from .scheduler import Scheduler
from .service import EngineReport, report_of
from .speculation import wiring
from .speculation.spec_policy import SpecPolicy
from .speculation.speculation_control import SpeculationController, build_controller, measure_round_cost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopHooks:
    """What the process that runs the loop does around each busy step, beside the engine's work."""

    before_step: Callable[[], None] | None = None  # on CPU: follow the load (cpus.ThreadGovernor.tick)
    after_step: Callable[[], None] | None = None  # an engine process sends the step's updates


class Engine(ModelWorker):
    """The engine serving asks for (``service.EngineService``)."""

    def __init__(self, args: EngineArgs, eos_token_ids: frozenset[int] = frozenset(),
                 weights: WeightSource | None = None, hooks: LoopHooks = LoopHooks()):
        super().__init__(args, weights)
        self.control: SpeculationController | None = None  # the policy and what feeds it
        self.scheduler: Scheduler | None = None  # built last: the engine is ready once it exists
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.eos_token_ids = eos_token_ids  # ends a request that names none of its own
        self.hooks = hooks

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
                                   chunk_tokens=args.chunked_prefill_size, new_token_ratio=args.new_token_ratio)

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
        before, after = self.hooks.before_step, self.hooks.after_step
        while not self._stop.is_set():
            if self.scheduler.idle:
                time.sleep(0.002)
                continue
            if before is not None:
                before()
            try:
                self.step()
            except Exception as exc:  # an engine bug: fail the running requests, keep serving
                log.exception("engine step failed")
                self.scheduler.fail_running(f"internal error: {type(exc).__name__}: {exc}")
            if after is not None:
                after()

    def step(self) -> None:
        """Admit, make room, one prefill chunk, then one speculative round for the decoding requests."""
        scheduler = self.scheduler
        scheduler.end_aborted()
        for r in scheduler.take_left():  # before anyone is admitted: a retracted request comes back clean
            self.speculator.release(r)
        scheduler.admit()
        scheduler.make_room()
        reqs, ends = scheduler.prefill_chunk()
        if reqs:
            scheduler.prefilled(reqs, ends, self.speculator.prefill(reqs, ends))
        reqs = scheduler.decoding()
        if reqs:
            self._decode_round(reqs)

    def _decode_round(self, reqs: list[Request]) -> None:
        """One speculative round: the draft lengths, the speculator's draft and verify, what the
        round teaches speculation control, then the scheduler's commit."""
        plan = self.control.plan_round(reqs)
        start = time.perf_counter()
        results = self.speculator.decode_round(reqs, plan.draft_lengths, plan.lookup)
        seconds = time.perf_counter() - start
        self.control.observe(plan, results, seconds)
        self.stats.count_round(plan.draft_lengths, results, seconds)
        self.scheduler.commit_round(reqs, results)

    # ---- observability --------------------------------------------------------------------
    def report(self) -> EngineReport:
        """What serving reads: readiness, load, KV usage, memory against the plan, the policy."""
        return report_of(self)

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

