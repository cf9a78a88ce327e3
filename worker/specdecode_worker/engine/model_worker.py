"""The models on one device, started in three phases, with the speculator over them.

``init_model_worker`` is the one place the phases are ordered:
1. load: target weights, then draft weights (every model's config is read, and its runner
   created, before any weight is loaded);
2. alloc: profile memory with every weight resident, size the pools with the target + draft
   cell, allocate the target pools, then the draft pool adopting the target's req_to_token pool
   and allocator;
3. backends: attention backends and CUDA graphs, target then draft.
The speculator is built last, over the finished runners; the warm-up (``warmup``) then runs every
pass the plan prices at its maxima and measures the dynamic peak. The engine (``engine``) serves
requests over a started worker.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..errors import InputError
from ..model_rules.model_config import ModelShape
from .args import MODES, EngineArgs
from .memory.kv_budget import MemoryProfile, free_device_bytes, profile_memory
from .memory.pools import KV_CACHE_DTYPES, MemoryPoolConfig
from .model_runner import ModelRunner
from .models.loader import WeightSource
from .parallel.distributed import follow, get_tp
from .phases import Phase, PhaseError, StartupError
from .speculation import wiring
from .speculation.algorithms import algorithm
from .speculation.rounds import Speculator
from .stats import Stats
from .warmup import DynamicPeak, WarmUpOutOfMemory, measurable, warm_up

log = logging.getLogger(__name__)


class ModelWorker:
    def __init__(self, args: EngineArgs, weights: WeightSource | None = None):
        """``weights``: where the target, a STANDALONE draft and the NextN layer read their weights
        (default: their safetensors files)."""
        self.method = algorithm(args.algorithm)  # what drafts, declared once (speculation/algorithms.py)
        wiring.check_args(self.method, args)
        if args.spec_policy not in MODES:
            raise InputError(f"--spec-policy {args.spec_policy}: use one of {', '.join(MODES)}")
        if args.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InputError(f"--kv-cache-dtype {args.kv_cache_dtype}: use one of {', '.join(KV_CACHE_DTYPES)}")
        self.args = args
        self.weights = weights
        self.device = torch.device(args.device)
        self.target_shape: ModelShape | None = None
        self.target_runner: ModelRunner | None = None
        self.draft_runner: ModelRunner | None = None
        self.free_before_weights: int | None = None  # cuda: the budget, measured before any weight
        self.memory_profile: MemoryProfile | None = None
        self.memory_pool_config: MemoryPoolConfig | None = None
        self.dynamic_peak: DynamicPeak | None = None  # phase 3's warm-up: planned vs measured
        self.speculator: Speculator | None = None
        self.stats = Stats()  # start-up records each phase's seconds here

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
        self._timed("warm_up", self.warm_up)  # after every CUDA graph, the speculator's included

    def _make_speculator(self) -> Speculator:
        return wiring.create_speculator(self.method, self.args, self.target_runner, self.draft_runner)

    def _timed(self, name: str, phase: Callable[[], None]) -> None:
        start = time.perf_counter()
        phase()
        self.stats.phase_seconds[name] = time.perf_counter() - start

    def create_runners(self) -> None:
        """Read every config and create the runners; refuse a draft this engine cannot serve."""
        self.target_shape, self.target_runner, self.draft_runner = wiring.create_runners(self.method, self.args)
        for runner in self.model_runners() if self.weights else ():
            runner.weights = self.weights

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
        k = args.num_draft_tokens if self.method.drafts else 0
        self.memory_pool_config = MemoryPoolConfig(tokens, args.max_running_requests, args.context_len + k + 1)
        target.alloc_memory_pool(self.memory_pool_config)
        if draft:
            draft.alloc_memory_pool(self.memory_pool_config, *target.get_memory_pool(), slots=target.slots)

    def init_backends(self) -> None:
        if self.phase < Phase.POOLS_ALLOCATED:
            raise PhaseError("phase 3 (init attention backends and CUDA graphs) needs phase 2 "
                             "(allocate KV pools) first")
        wiring.init_backends(self.method, self.args, self.target_runner, self.draft_runner)

    def warm_up(self) -> None:
        """The longest prompt in chunks (the draft catching up over it), then one speculative round
        at the largest batch, through the speculator as serving runs them; the peak is read where
        it can be (``warmup``). Under tensor parallelism rank 0 runs it, announcing every pass as a
        round does, while the other ranks replay them on their shards until it releases them."""
        args = self.args
        tp = self.target_runner.tp
        together = tp.size > 1 and measurable(self.device)
        if together and not tp.is_leader:
            follow({r.name: r for r in self.model_runners() if r.tp.size > 1}, self.speculator)
            self.dynamic_peak = DynamicPeak(args.planned_dynamic_bytes, None,
                                            note="warm-up replayed from rank 0, which measures the peak")
            return
        try:
            self.dynamic_peak = warm_up(self.speculator, self.model_runners(), args.planned_dynamic_bytes,
                                        args.chunked_prefill_size or args.context_len,
                                        max(args.cuda_graph_max_bs, args.max_running_requests),
                                        self.free_before_weights, self.memory_profile.runtime_bytes)
        except WarmUpOutOfMemory as exc:
            raise StartupError(str(exc)) from None
        finally:
            if together:
                tp.broadcast(("stop",))  # the followers leave the warm-up's replay loop
