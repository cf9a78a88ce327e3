"""The engine: three-phase start-up, then continuous batching over the target (and a draft).

``init_model_worker`` is the one place the phases are ordered:
1. load: target weights, then draft weights (every model's config is read, and its runner
   created, before any weight is loaded);
2. alloc: profile memory with every weight resident, size the pools with the target + draft
   cell, allocate the target pools, then the draft pool adopting the target's req_to_token pool
   and allocator;
3. backends: attention backends and CUDA graphs, target then draft.
The speculator is built last, over the finished runners; the warm-up (``warmup``) then runs every
pass the plan prices at its maxima and measures the dynamic peak; then speculation control,
whose cost model a few timed passes seed (adaptive only), and the scheduler.

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

import torch

from ..contract import EAGLE_ALGORITHMS, SERVED_ALGORITHMS
from ..errors import InputError
from ..model_rules.model_config import ModelShape, load_shape
from ..model_rules.mtp_rule import check_standalone_draft
from ..model_rules.vocabulary import check_vocabulary
from .memory.kv_budget import MemoryProfile, free_device_bytes, profile_memory
from .memory.pools import KV_CACHE_DTYPES, MemoryPoolConfig
from .model_runner import ModelRunner
from .parallel.distributed import follow, get_tp, stop_followers
from .phases import Phase, PhaseError
from .request import Request, make_generator
from .scheduler import Scheduler
from .speculation.eagle_speculator import EagleRunner, EagleSpeculator, check_tree_args
from .speculation.mtp_runner import MTPRunner, check_mtp_args
from .speculation.spec_policy import FIXED, MODES, SpecPolicy
from .speculation.speculation_control import SpeculationController, build_controller, measure_step_cost
from .speculation.speculative import Speculator, StandaloneSpeculator
from .speculation.vocab_map import DraftVocabulary
from .stats import Stats
from .warmup import DynamicPeak, WarmUpOutOfMemory, measurable, warm_up

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The worker cannot serve what was planned (for example fewer KV tokens than the floor)."""


@dataclass
class EngineArgs:
    target: str
    draft: str | None = None
    algorithm: str = "NONE"
    device: str = "cpu"
    dtype: str | None = None
    device_memory_bytes: int | None = None  # CPU budget; on CUDA measured
    mem_fraction_static: float = 0.9
    runtime_bytes: int = 0
    context_len: int = 2048
    min_kv_tokens: int = 0  # floor: below it the worker refuses to start
    max_total_tokens: int | None = None  # cap from the plan's pinned numbers
    max_running_requests: int = 8
    cuda_graph_max_bs: int = 0
    num_draft_tokens: int = 4
    speculative_num_steps: int | None = None  # EAGLE draft steps per round (default: num_draft_tokens)
    speculative_eagle_topk: int = 1  # EAGLE: 1 drafts a chain, more a tree of num_draft_tokens nodes
    ngram_max: int = 4
    planned_tokens: int | None = None
    draft_quantization: str | None = None  # "int8": dynamic int8 draft linears (cpu)
    kv_cache_dtype: str = "auto"  # auto (the compute dtype), fp8_e4m3 or fp8_e5m2: every model's K/V pool
    spec_policy: str = FIXED  # fixed: K drafts every round; adaptive: the draft length that maximises goodput
    chunked_prefill_size: int = 0  # most prompt tokens per prefill pass (the plan's chunkedPrefillSize); 0: no cap
    # Admission reserves this share of the tokens a request may still generate (1.0: the worst case,
    # prompt + max_tokens up front); an estimate that proves short is paid for by retraction.
    new_token_ratio: float = 0.5
    planned_dynamic_bytes: int | None = None  # the plan's reserve.dynamicBytes, checked by phase 3's warm-up


class Engine:
    def __init__(self, args: EngineArgs):
        if args.algorithm not in SERVED_ALGORITHMS:
            raise InputError(f"--algorithm {args.algorithm}: this engine serves {', '.join(SERVED_ALGORITHMS)}")
        needs_draft = args.algorithm == "STANDALONE" or args.algorithm in EAGLE_ALGORITHMS
        if needs_draft and not args.draft:
            raise InputError(f"--draft: {args.algorithm} needs a draft model folder")
        if args.algorithm in EAGLE_ALGORITHMS:
            check_tree_args(args.speculative_eagle_topk, args.speculative_num_steps or args.num_draft_tokens,
                            args.num_draft_tokens)
        if args.algorithm == "MTP":
            check_mtp_args(args.speculative_eagle_topk, args.speculative_num_steps, args.num_draft_tokens)
        if args.spec_policy not in MODES:
            raise InputError(f"--spec-policy {args.spec_policy}: use one of {', '.join(MODES)}")
        if args.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InputError(f"--kv-cache-dtype {args.kv_cache_dtype}: use one of {', '.join(KV_CACHE_DTYPES)}")
        # MTP's draft is the target's own NextN layer; --draft may name another folder holding it.
        if not needs_draft and args.draft and args.algorithm != "MTP":
            raise InputError(f"--draft: {args.algorithm} takes no draft model; drop --draft")
        self.args = args
        self.device = torch.device(args.device)
        self.target_shape: ModelShape | None = None
        self.target_runner: ModelRunner | None = None
        self.draft_runner: ModelRunner | None = None
        self.free_before_weights: int | None = None  # cuda: the budget, measured before any weight
        self.memory_profile: MemoryProfile | None = None
        self.memory_pool_config: MemoryPoolConfig | None = None
        self.dynamic_peak: DynamicPeak | None = None  # phase 3's warm-up: planned vs measured
        self.speculator: Speculator | None = None
        self.control: SpeculationController | None = None  # the policy, guesses and their scoring
        self.scheduler: Scheduler | None = None  # built last: the engine is ready once it exists
        self.stats = Stats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.eos_token_ids: frozenset[int] = frozenset()

    # ---- initialisation -------------------------------------------------------------------
    def init_model_worker(self) -> None:
        """The three phases, each one call, then the speculator over the finished runners."""
        self.create_runners()  # config.json only: shapes, dtypes, sharding; no weight yet
        self._timed("load_weights", self.load_weights)  # phase 1
        # The MTP draft is the NextN layer with its own one-layer latent pool, not a frozen-KV
        # draft reading the target's cache: its phase 2 follows the target's like any draft's,
        # adopting the target's req_to_token pool and allocator (init_memory_pools), and it reads
        # the target's hidden states per round, so nothing of the target's pool is needed earlier.
        self._timed("alloc_memory_pool", self.init_memory_pools)  # phase 2
        self._timed("init_backends", self.init_backends)  # phase 3
        self.speculator = self._make_speculator()
        self._timed("warm_up", self._warm_up)  # after every CUDA graph, the speculator's included
        self._timed("measure_step_cost", self._make_scheduler)  # timed passes seed the policy's cost model

    def _timed(self, name: str, phase: Callable[[], None]) -> None:
        start = time.perf_counter()
        phase()
        self.stats.phase_seconds[name] = time.perf_counter() - start

    def create_runners(self) -> None:
        """Read every config and create the runners; refuse a draft this engine cannot serve."""
        args = self.args
        self.target_shape = load_shape(args.target)
        draft_shape = load_shape(args.draft) if args.draft else None
        if args.algorithm == "STANDALONE":  # the planner's rule: NextN models draft for themselves (MTP)
            check_standalone_draft(draft_shape, f"{args.draft}/config.json")
        # The planner's rule: the tokenizers agree; padded vocab sizes may differ.
        vocabulary = check_vocabulary(args.target, args.draft, self.target_shape, draft_shape) \
            if args.algorithm == "STANDALONE" else None
        kv = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        self.target_runner = ModelRunner(args.target, args.device, args.dtype, name="target", kv_cache_dtype=kv)
        if args.algorithm in EAGLE_ALGORITHMS:
            self.draft_runner = EagleRunner(args.draft, self.target_runner, args.algorithm)
        elif args.algorithm == "MTP":
            self.draft_runner = MTPRunner(args.draft or args.target, self.target_runner)
        elif args.draft:
            self.draft_runner = ModelRunner(args.draft, args.device, args.dtype, name="draft",
                                            quantization=args.draft_quantization,
                                            kv_cache_dtype=kv)
            if vocabulary is not None and not DraftVocabulary(vocabulary).is_identity:
                self.draft_runner.vocabulary = DraftVocabulary(vocabulary)

    def model_runners(self) -> list[ModelRunner]:
        """The target's runner, then the draft's when there is one."""
        return [r for r in (self.target_runner, self.draft_runner) if r is not None]

    @property
    def phase(self) -> Phase:
        """The last phase every model has finished (the runners track their own steps)."""
        return min((r.phase for r in self.model_runners()), default=Phase.CREATED)

    def load_weights(self) -> None:
        if self.device.type == "cuda":
            from ..devices import nvml_memory

            seen = nvml_memory()
            self.free_before_weights = seen.free_bytes if seen else free_device_bytes(self.device)
        for runner in self.model_runners():
            runner.load_weights()

    def init_memory_pools(self) -> None:
        args = self.args
        missing = [r.name for r in self.model_runners() if r.phase < Phase.WEIGHTS_LOADED]
        if self.target_runner is None or missing:
            raise PhaseError("phase 2 (allocate KV pools) needs every weight resident: "
                             f"{', '.join(missing) or 'no model'} has not finished phase 1 (load weights)")
        target, draft = self.target_runner, self.draft_runner
        if self.device.type == "cuda":
            budget = self.free_before_weights
            free_after = free_device_bytes(self.device)
        else:
            if args.device_memory_bytes is None:
                raise InputError("--device-memory-gib: on cpu the KV pools are sized from this budget; give it")
            budget, free_after = args.device_memory_bytes, None
        self.memory_profile = profile_memory(
            self.device, budget, args.mem_fraction_static, target.weight_bytes, draft.weight_bytes if draft else 0,
            args.runtime_bytes, target.kv_cell_bytes, draft.kv_cell_bytes if draft else 0, free_after,
            kv_dtype=str(target.kv_dtype).replace("torch.", ""),
        )
        # Every tensor-parallel rank allocates the same slots: the fewest any rank can hold.
        tokens = get_tp().min_int(self.memory_profile.max_total_num_tokens)
        planned = args.planned_tokens
        log.info("KV tokens: planned %s, actual %d (floor %d), KV cache dtype %s", planned, tokens, args.min_kv_tokens,
                 str(target.kv_dtype).replace("torch.", ""))
        if tokens < max(args.min_kv_tokens, 1):
            raise StartupError(
                f"only {tokens} KV token slots fit (planned {planned}, floor {args.min_kv_tokens}): weights "
                f"{target.weight_bytes + (draft.weight_bytes if draft else 0)} bytes and runtime "
                f"{self.memory_profile.runtime_bytes} bytes leave too little of {budget} bytes x "
                f"{args.mem_fraction_static}; "
                "give more device memory, a larger --mem-fraction-static, or a lower --context-length/--min-kv-tokens"
            )
        if args.max_total_tokens is not None:
            tokens = min(tokens, args.max_total_tokens)
        k = 0 if args.algorithm == "NONE" else args.num_draft_tokens
        self.memory_pool_config = MemoryPoolConfig(tokens, args.max_running_requests, args.context_len + k + 1)
        target.alloc_memory_pool(self.memory_pool_config)
        if draft:
            draft.alloc_memory_pool(self.memory_pool_config, *target.get_memory_pool())

    def init_backends(self) -> None:
        if self.phase < Phase.POOLS_ALLOCATED:
            raise PhaseError("phase 3 (init attention backends and CUDA graphs) needs phase 2 "
                             "(allocate KV pools) first")
        args = self.args
        for runner in self.model_runners():
            if runner is self.target_runner and args.algorithm in ("STANDALONE", "NGRAM"):
                runner.init_backends(args.cuda_graph_max_bs, verify_tokens=args.num_draft_tokens + 1)
            elif runner is self.target_runner and args.algorithm in (*EAGLE_ALGORITHMS, "MTP"):
                runner.init_backends(0)  # its passes return features too: the speculator graphs them
            else:
                runner.init_backends(args.cuda_graph_max_bs)

    def _warm_up(self) -> None:
        """The longest prompt in chunks (the draft catching up over it), then one speculative round
        at the largest batch, through the speculator as serving runs them; the peak is read where
        it can be (``warmup``). Under tensor parallelism rank 0 runs it, announcing every pass as a
        round does, while the other ranks replay them on their shards until it releases them."""
        self.dynamic_peak = self._dynamic_peak()

    def _dynamic_peak(self) -> DynamicPeak:
        args = self.args
        tp = self.target_runner.tp
        together = tp.size > 1 and measurable(self.device)
        if together and not tp.is_leader:
            follow({r.name: r for r in self.model_runners() if r.tp.size > 1})
            return DynamicPeak(args.planned_dynamic_bytes, None,
                               note="warm-up replayed from rank 0, which measures the peak")
        try:
            return warm_up(self.speculator, self.model_runners(), args.planned_dynamic_bytes,
                           args.chunked_prefill_size or args.context_len,
                           max(args.cuda_graph_max_bs, args.max_running_requests))
        except WarmUpOutOfMemory as exc:
            raise StartupError(str(exc)) from None
        finally:
            if together:
                tp.broadcast(("stop",))  # the followers leave the warm-up's replay loop

    def _make_speculator(self) -> Speculator:
        args = self.args
        if args.algorithm in EAGLE_ALGORITHMS or args.algorithm == "MTP":
            spec = self._make_eagle_speculator()
            if self.device.type == "cuda" and args.cuda_graph_max_bs > 0:
                spec.capture_graphs(min(args.cuda_graph_max_bs, args.max_running_requests))
            return spec
        return StandaloneSpeculator(args.algorithm, self.target_runner, self.draft_runner, args.num_draft_tokens,
                                    args.ngram_max, chunk_tokens=args.chunked_prefill_size)

    def _make_eagle_speculator(self) -> EagleSpeculator:
        args = self.args
        if args.algorithm in EAGLE_ALGORITHMS:
            return EagleSpeculator(args.algorithm, self.target_runner, self.draft_runner,
                                   args.speculative_num_steps or args.num_draft_tokens, args.speculative_eagle_topk,
                                   args.num_draft_tokens, chunk_tokens=args.chunked_prefill_size)
        # MTP: the NextN layer drafts chains from the target's hidden states, as EAGLE does
        return EagleSpeculator(args.algorithm, self.target_runner, self.draft_runner, args.num_draft_tokens,
                               chunk_tokens=args.chunked_prefill_size)

    def _make_scheduler(self) -> None:
        """Speculation control over the finished speculator, then the scheduler that feeds it."""
        args, spec = self.args, self.speculator
        k = 0 if args.algorithm == "NONE" else args.num_draft_tokens
        cost = measure_step_cost(args.spec_policy, args.algorithm, k, spec, self.draft_runner,
                                 args.max_running_requests, args.context_len, args.chunked_prefill_size,
                                 self.target_shape.num_hidden_layers)
        self.control = build_controller(args.spec_policy, args.algorithm, k, spec, cost, args.ngram_max,
                                        waiting=lambda: self.num_waiting)
        self.scheduler = Scheduler(self.target_runner.slots, spec.slots_per_round, self.stats,
                                   chunk_tokens=args.chunked_prefill_size, new_token_ratio=args.new_token_ratio,
                                   release=spec.release, forget=self.control.forget)

    @property
    def policy(self) -> SpecPolicy | None:
        return self.control.policy if self.control else None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    # ---- requests -------------------------------------------------------------------------
    def slots_needed(self, req: Request) -> int:
        return len(req.prompt_ids) + req.params.max_tokens + self.speculator.slots_per_round

    def check_fits(self, req: Request) -> None:
        """Refuse a request that could never run, whatever else is running."""
        req.params.validate()
        if not req.prompt_ids:
            raise InputError("the prompt is empty")
        cap = req.max_draft_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise InputError(f"max_draft_tokens must be a non-negative integer (0 turns drafting off), got {cap!r}")
        ctx = self.args.context_len
        if len(req.prompt_ids) + req.params.max_tokens > ctx:
            raise InputError(f"prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.params.max_tokens}) "
                             f"exceeds the context length {ctx}; shorten the prompt or lower max_tokens")
        cap = self.memory_pool_config.max_total_num_tokens
        if self.slots_needed(req) > cap:
            raise InputError(f"the request needs {self.slots_needed(req)} KV slots but the pool holds {cap}; "
                             "shorten the prompt or lower max_tokens")
        vocab = self.target_shape.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise InputError(f"prompt token ids must be in [0, {vocab})")

    def submit(self, req: Request) -> Request:
        if not self.ready:
            raise PhaseError("the engine is still initialising")
        self.check_fits(req)
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

    # ---- the loop -------------------------------------------------------------------------
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
        with self.scheduler.ending_together():
            for r, result in zip(reqs, results):
                self.stats.count_verified(r, result)
                self.scheduler.commit(r, result.tokens)

    # ---- observability --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) if self.scheduler else 0

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting if self.scheduler else 0

    def kv_usage(self) -> tuple[int, int]:
        slots = self.target_runner.slots
        return slots.used(), slots.size
