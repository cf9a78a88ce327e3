"""The engine: three-phase start-up, then continuous batching over the target (and a draft).

``init_model_worker`` is the one place the phases are ordered:
1. load: target weights, then draft weights (every model's config is read, and its runner
   created, before any weight is loaded);
2. alloc: profile memory with every weight resident, size the pools with the target + draft
   cell, allocate the target pools, then the draft pool adopting the target's req_to_token pool
   and allocator;
3. backends: attention backends and CUDA graphs, target then draft.
The speculator is built last, over the finished runners; the warm-up (``warmup``) then runs every
pass the plan prices at its maxima and measures the dynamic peak; then the speculation policy,
whose cost model a few timed passes seed (adaptive only). ``step`` is admit -> make room -> one prefill chunk
-> policy picks each request's draft length -> decode round -> commit, and ``_commit`` is the one
place a request's output grows.
Scheduling policy: prefill and decode alternate within a step. Each step runs at most one prefill
pass of at most ``chunked_prefill_size`` prompt tokens (oldest admitted requests first, a long
prompt split over steps), then one decode round for every request whose prefill is done, so a
long prompt delays running requests by one chunk per step, never by a whole prompt. Admission
counts the slots requests really hold plus an estimate of their growth (``new_token_ratio`` of the
tokens they may still generate); when the pool runs short, the newest requests are retracted
(slots freed in the shared target/draft allocator) and later recomputed from prompt + committed
tokens. Recompute samples nothing, so a request's generator continues where it stopped.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..contract import EAGLE_ALGORITHMS, SERVED_ALGORITHMS
from ..errors import InputError
from ..model_config import ModelShape, load_shape
from ..mtp_rule import check_standalone_draft
from ..vocabulary import check_vocabulary
from .batch import free_position_ranges
from .distributed import follow, get_tp, stop_followers
from .eagle_speculator import EagleRunner, EagleSpeculator, check_tree_args
from .memory import MemoryProfile, free_device_bytes, profile_memory
from .mtp_runner import MTPRunner, check_mtp_args
from .model_runner import ModelRunner
from .ngram_index import ContextGuesses
from .phases import Phase, PhaseError
from .pools import KV_CACHE_DTYPES, MemoryPoolConfig
from .request import Request, make_generator
from .spec_policy import FIXED, MODES, SpecPolicy
from .speculative import Lookup, RoundResult, Speculator, StandaloneSpeculator
from .step_cost import StepCost
from .step_timing import catch_up_seconds, draft_points, target_points
from .vocab_map import DraftVocabulary
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


@dataclass
class Stats:
    generated_tokens: int = 0
    prompt_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    finished_requests: int = 0
    retracted_requests: int = 0  # retractions under KV pressure (work recomputed later)
    accept_lengths: Counter[int] = field(default_factory=Counter)  # accepted drafts per request-round -> count
    draft_lengths: Counter[int] = field(default_factory=Counter)  # draft length chosen per request-round -> count
    decode_steps: int = 0
    steps_without_speculation: int = 0  # decode steps where no request drafted
    proposed_by_position: Counter[int] = field(default_factory=Counter)  # draft position (1-based) -> verified
    accepted_by_position: Counter[int] = field(default_factory=Counter)  # draft position (1-based) -> accepted
    decode_tokens: int = 0  # tokens the decode rounds produced (goodput's numerator)
    decode_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)


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
        self.policy: SpecPolicy | None = None
        self.guesses: ContextGuesses | None = None  # classes and free guesses where drafts cost a pass (adaptive)
        self.stats = Stats()
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._running: list[Request] = []  # admitted (prefilling or decoding), oldest first
        self._retracted: deque[Request] = deque()  # wait ahead of new requests
        self._ending: list[tuple[int, int]] | None = None  # (row, kv_len) of requests ending in a group
        self._finished: list[Request] = []  # finished in that group, told once their slots are back
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
        self._timed("measure_step_cost", self._make_policy)  # the warm-up that seeds the policy's cost model

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

    def _make_policy(self) -> None:
        args, spec = self.args, self.speculator
        k = 0 if args.algorithm == "NONE" else args.num_draft_tokens
        # Where the drafts cost a pass, the adaptive policy classes rounds by free guesses instead
        # of by the proposals (which NGRAM's lookups know before the round, and draft models do not).
        guessed = args.spec_policy != FIXED and k > 0 and not spec.draft_classes
        self.guesses = ContextGuesses(args.ngram_max) if guessed else None
        self.policy = SpecPolicy(args.spec_policy, args.algorithm, k, self._step_cost(k),
                                 per_request=spec.per_request_draft_lengths, choices=spec.draft_length_choices,
                                 verified_per_request=spec.verified_per_request,
                                 classes=self.guesses.classes if guessed else spec.draft_classes,
                                 classes_scored=not guessed)

    def _step_cost(self, k: int) -> StepCost:
        """Measured on one device (a few passes at batch 1 and full, width 1, 2 and k + 1); with
        tensor parallelism the ranks cannot time passes alone, so a guess refined online seeds it."""
        args = self.args
        if args.spec_policy == FIXED or k == 0:
            return StepCost({(1, 0): 1.0}, learn=False)
        catch_up = 0.0  # seconds per token a draft model caches when a request resumes drafting
        batch = args.max_running_requests
        curve = None  # plain rounds by batch size (None: the target's plain points)
        if self.target_runner.tp.size > 1:  # guess: verifying K per request at full batch doubles a plain step
            target = {(1, 0): 0.01, (batch, 0): 0.01, (1, k): 0.01 * (1 + 1 / batch),
                      (batch, batch): 0.01 * (1 + 1 / k), (batch, batch * k): 0.02}
        else:
            target, curve = target_points(self.target_runner, batch, k, args.context_len, self.speculator,
                                          chunk_tokens=args.chunked_prefill_size)
        plain = {1: target[(1, 0)], batch: target[(batch, 0)]}
        if args.algorithm == "STANDALONE" and self.draft_runner.tp.size > 1:
            # A sharded draft cannot be timed alone either: its decode cost scales with its weight bytes.
            share = self.draft_runner.weight_bytes / max(self.target_runner.weight_bytes, 1)
            draft = {j: s * share for j, s in plain.items()}
            catch_up = share * catch_up_seconds(target[(1, 0)], target[(1, k)], k + 1)
        elif args.algorithm == "STANDALONE":
            draft, catch_up = draft_points(self.draft_runner, batch, args.context_len,
                                           chunk_tokens=args.chunked_prefill_size)
        elif args.algorithm == "NGRAM":
            draft = None
        else:  # an EAGLE head or NextN layer: one layer against the target's many
            layers = max(self.target_shape.num_hidden_layers, 1)
            draft = {j: s / layers for j, s in plain.items()}
        return StepCost(target, draft, catch_up_per_token=catch_up, plain=curve)

    @property
    def ready(self) -> bool:
        return self.speculator is not None

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
        self._waiting.put(req)
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
            if not self._running and not self._retracted and self._waiting.empty():
                time.sleep(0.002)
                continue
            try:
                self.step()
            except Exception as exc:  # an engine bug: fail the running requests, keep serving
                log.exception("engine step failed")
                with self._ending_together():
                    for r in list(self._running):
                        self._finish(r, error=f"internal error: {type(exc).__name__}: {exc}")

    def _expected_slots(self, r: Request) -> int:
        """Slots ``r`` will take beyond those it holds: its prefill left, one round's, and a share of
        the tokens it may still generate (the whole of them once it has been retracted)."""
        if r.req_idx is None:  # waiting: the prompt, or prompt + committed tokens after a retraction
            prefill_left = len(r.all_ids) - (1 if r.output_ids else 0)
        else:
            prefill_left = len(r.prefill_ids) - r.kv_len if r.prefill_ids is not None else 0
        ratio = 1.0 if r.retractions else self.args.new_token_ratio
        growth = math.ceil(ratio * (r.params.max_tokens - len(r.output_ids)))
        return prefill_left + self.speculator.slots_per_round + growth

    def _next_waiting(self) -> Request | None:
        if self._retracted:
            return self._retracted[0]
        return None if self._waiting.empty() else self._waiting.queue[0]

    def _admit(self) -> list[Request]:
        admitted = []
        pool = self.target_runner.req_to_token_pool
        spare = self.target_runner.token_to_kv_pool_allocator.available_size()
        spare -= sum(self._expected_slots(r) for r in self._running)
        while pool.available_size() > 0 and (req := self._next_waiting()) is not None:
            need = self._expected_slots(req)
            if need > spare and self._running:
                break  # wait for running requests to finish or grow less than estimated
            (self._retracted.popleft if self._retracted else self._waiting.get)()
            if req.abort_requested:
                self._finish(req, reason="abort")
                continue
            req.req_idx = pool.alloc()
            req.prefill_ids = req.all_ids[:-1] if req.output_ids else list(req.prompt_ids)
            spare -= need
            self._running.append(req)
            admitted.append(req)
        return admitted

    def _retract(self, r: Request) -> None:
        """Free every slot of ``r`` (target and draft share them) and queue it for recompute."""
        self._release_slots(r)
        self.speculator.release(r)
        r.req_idx, r.kv_len, r.draft_kv_len, r.prefill_ids = None, 0, 0, None
        r.retractions += 1
        self.stats.retracted_requests += 1
        self._running.remove(r)
        self._retracted.appendleft(r)  # retracted newest first, so the older comes back first
        log.info("request %d retracted under KV pressure (%d tokens committed, recomputed later)", r.rid,
                 len(r.output_ids))

    def _chunk_budget(self) -> int:
        return self.args.chunked_prefill_size or self.memory_pool_config.max_total_num_tokens

    def _room_needed(self) -> int:
        """Slots this step takes: one round for every decoding request, and the first prefill chunk."""
        decoding = sum(1 for r in self._running if r.prefill_ids is None)
        first = next((r for r in self._running if r.prefill_ids is not None), None)
        chunk = min(self._chunk_budget(), len(first.prefill_ids) - first.kv_len) if first else 0
        return decoding * self.speculator.slots_per_round + chunk

    def _make_room(self) -> None:
        """Retract the newest requests until this step fits. The oldest is never retracted, and it
        always fits alone (``check_fits``), so every request finishes."""
        alloc = self.target_runner.token_to_kv_pool_allocator
        with self._ending_together():
            returning = 0  # slots of the requests retracted so far, back when the block ends
            while len(self._running) > 1 and alloc.available_size() + returning < self._room_needed():
                returning += self._running[-1].kv_len
                self._retract(self._running[-1])

    def _prefill_chunk(self) -> None:
        """One target pass over at most one chunk of prompt tokens, oldest requests first."""
        decoding = sum(1 for r in self._running if r.prefill_ids is None)
        room = self.target_runner.token_to_kv_pool_allocator.available_size()
        budget = min(self._chunk_budget(), room - decoding * self.speculator.slots_per_round)
        reqs, ends = [], []
        for r in self._running:
            if r.prefill_ids is None or budget <= 0:
                continue
            n = min(budget, len(r.prefill_ids) - r.kv_len)
            reqs.append(r)
            ends.append(r.kv_len + n)
            budget -= n
        if not reqs:
            return
        with self._ending_together():
            for r, token in zip(reqs, self.speculator.prefill(reqs, ends)):
                if r.kv_len < len(r.prefill_ids):
                    continue  # more chunks to come
                r.prefill_ids = None
                if token is not None:
                    self.stats.prompt_tokens += len(r.prompt_ids)
                    self._commit(r, [token])

    def abort(self, req: Request) -> None:
        """Ask the engine to end ``req`` (client gone, stop string seen); thread-safe."""
        req.abort_requested = True

    def step(self) -> None:
        """Admit, make room, one prefill chunk, then one speculative round for the decoding requests."""
        with self._ending_together():
            for r in [r for r in self._running if r.abort_requested]:
                self._finish(r, reason="abort")
        self._admit()
        self._make_room()
        self._prefill_chunk()
        room = self.target_runner.token_to_kv_pool_allocator.available_size() // self.speculator.slots_per_round
        reqs = [r for r in self._running if r.prefill_ids is None][:room]  # a just-prefilled one may wait a step
        if reqs:
            self._decode_round(reqs)

    def _decode_round(self, reqs: list[Request]) -> None:
        """One speculative round: what is known before it (NGRAM's lookups, or free guesses where
        drafts cost a pass; each draft's catch-up), the policy's draft lengths, the round, and what
        it tells the policy; then commit."""
        rids = [r.rid for r in reqs]
        caps = [self._draft_cap(r) for r in reqs]
        lookup = self.speculator.look_ahead(reqs, caps)  # NGRAM: the proposals, known before their lengths
        classes = guesses = None
        if lookup is not None:
            caps = [min(c, len(p)) for c, p in zip(caps, lookup.proposals)]
            classes = lookup.classes
        elif self.guesses is not None:
            guesses, classes = self.guesses.guess(reqs, caps)
        catch_up_tokens = getattr(self.speculator, "catch_up_tokens", None)
        catch_up = [catch_up_tokens(r) for r in reqs] if catch_up_tokens else None
        ks = self.policy.draft_lengths(rids, caps, catch_up=catch_up,
                                       remaining=[r.params.max_tokens - len(r.output_ids) for r in reqs],
                                       waiting=self.num_waiting, classes=classes)
        start = time.perf_counter()
        results = self.speculator.decode_round(reqs, ks, lookup)
        seconds = time.perf_counter() - start
        self.policy.record(rids, ks, [x.proposed for x in results], [x.accepted for x in results], seconds,
                           classes=classes, caught_up=sum(t for t, k in zip(catch_up, ks) if k) if catch_up else 0)
        if lookup is not None:
            self._score_undrafted(rids, ks, lookup, results)
        if guesses is not None:
            self._score_guesses(rids, ks, guesses, results)
        self._count_step(ks, results, seconds)
        with self._ending_together():
            for r, result in zip(reqs, results):
                self._count_round(r, result)
                self._commit(r, result.tokens)

    def _score_undrafted(self, rids: list[int], ks: list[int], lookup: Lookup, results: list[RoundResult]) -> None:
        """Each proposal the round did not draft, against the token the round committed instead."""
        undrafted = [i for i, (k, p) in enumerate(zip(ks, lookup.proposals)) if k == 0 and p]
        self.policy.score([rids[i] for i in undrafted],
                          [lookup.proposals[i][0] == results[i].tokens[0] for i in undrafted],
                          [lookup.classes[i] for i in undrafted])

    def _score_guesses(self, rids: list[int], ks: list[int], guesses: list[int | None],
                       results: list[RoundResult]) -> None:
        """Each free guess of a round that drafted nothing for its request, against the token committed."""
        scored = [i for i, (k, g) in enumerate(zip(ks, guesses)) if k == 0 and g is not None]
        self.policy.score_guesses([rids[i] for i in scored], [guesses[i] == results[i].tokens[0] for i in scored])

    def _draft_cap(self, r: Request) -> int:
        if not r.speculative:
            return 0
        k = self.policy.max_draft
        return k if r.max_draft_tokens is None else min(k, r.max_draft_tokens)

    def _count_step(self, ks: list[int], results: list[RoundResult], seconds: float) -> None:
        stats = self.stats
        stats.decode_steps += 1
        stats.steps_without_speculation += not any(x.proposed for x in results)
        stats.draft_lengths.update(ks)
        stats.decode_tokens += sum(len(x.tokens) for x in results)
        stats.decode_seconds += seconds
        for x in results:
            stats.proposed_by_position.update(range(1, x.proposed + 1))
            stats.accepted_by_position.update(range(1, x.accepted + 1))

    def _count_round(self, r: Request, result: RoundResult) -> None:
        r.proposed_draft_tokens += result.proposed
        r.accepted_draft_tokens += result.accepted
        r.verify_rounds += 1
        self.stats.proposed_tokens += result.proposed
        self.stats.accepted_tokens += result.accepted
        self.stats.verify_rounds += 1
        self.stats.accept_lengths[result.accepted] += 1

    def _commit(self, r: Request, tokens: list[int]) -> None:
        """Append new tokens up to EOS or max_tokens, the one place output grows; finish if done."""
        kept, reason = [], None
        for t in tokens:
            kept.append(t)
            if t in r.eos_token_ids and not r.params.ignore_eos:
                reason = "stop"
                break
            if len(r.output_ids) + len(kept) >= r.params.max_tokens:
                reason = "length"
                break
        r.output_ids.extend(kept)
        self.stats.generated_tokens += len(kept)
        if r.on_update and kept:
            r.on_update(r, kept)
        if reason:
            self._finish(r, reason=reason)

    def _finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        if r in self._running:
            self._running.remove(r)
        if self.policy is not None:
            self.policy.forget(r.rid)
        if self.guesses is not None:
            self.guesses.release(r.rid)
        if r.req_idx is not None:
            self._release_slots(r)
            r.req_idx = None
        self.speculator.release(r)
        r.finish_reason, r.error = reason, error
        self.stats.finished_requests += 1
        if self._ending is not None:
            self._finished.append(r)
        else:
            self._tell_done([r])

    @staticmethod
    def _tell_done(reqs: list[Request]) -> None:
        for r in reqs:
            if r.on_update:
                r.on_update(r, None)
            r.done.set()

    # ---- giving slots back -----------------------------------------------------------------
    def _release_slots(self, r: Request) -> None:
        """Give back ``r``'s row and the slots of its ``kv_len`` positions; inside ``_ending_together``
        they go back when the block ends, with the rest of the group."""
        if self._ending is not None:
            self._ending.append((r.req_idx, r.kv_len))
        else:
            self._release_rows([(r.req_idx, r.kv_len)])

    def _release_rows(self, rows: list[tuple[int, int]]) -> None:
        # Every runner shares the target's req_to_token pool and allocator: one free covers them all.
        pool, alloc = self.target_runner.req_to_token_pool, self.target_runner.token_to_kv_pool_allocator
        free_position_ranges(pool, alloc, [(row, 0, kv_len) for row, kv_len in rows])
        for row, _ in rows:
            pool.free(row)  # only after its slots are read: a freed row may be handed out again

    @contextmanager
    def _ending_together(self):
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
                self._release_rows(rows)
            self._tell_done(finished)

    # ---- observability --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._waiting.qsize() + len(self._retracted)

    def kv_usage(self) -> tuple[int, int]:
        alloc = self.target_runner.token_to_kv_pool_allocator
        return alloc.size - alloc.available_size(), alloc.size
