"""What the operator, the planner and the engine must agree on, each defined once.

Standard library only: the operator image, which has no torch, imports this module too. It holds
the algorithm and KV cache dtype names, the exit codes of ``specdecode-worker``, and the
MemoryPlan document: its kind, its typed shape, and the check that a plan states true numbers.
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
from dataclasses import dataclass, field, fields, is_dataclass
from enum import IntEnum
from typing import Any, Union, get_args, get_origin, get_type_hints

MIB = 1 << 20
GIB = 1 << 30

# What a MemoryPlan and the SpecDecodeDeployment's spec.draft.algorithm may name.
PLANNED_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "MTP", "NGRAM")
# A draft head that reads the target's hidden states (its own worker in the engine).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
# The engines a worker pod may run (spec.runtime.engine, plan --engine); specdecode is this project's.
ENGINES = ("specdecode", "vllm", "sglang")
DEFAULT_ENGINE = "specdecode"
# What ``specdecode-worker serve`` runs: NONE is the target alone; MTP drafts with the target's NextN layer.
SERVED_ALGORITHMS = ("NONE", "STANDALONE", "NGRAM", *EAGLE_ALGORITHMS, "MTP")

# Sizes the planner defaults to and the operator reads, defined here once.
# Auto t stops at one 8-GPU node unless gpu.maxPerReplica (--max-tp) allows more.
DEFAULT_MAX_TP = 8
DEFAULT_GPUS_PER_NODE = 8
# Tokens verified per request in one step (the draft proposals plus the bonus token), when the
# request does not say.
VERIFY_TOKENS = 4

# Engine shapes the planner prices: defined here so that the engine reads them without importing the
# planner.
# The Triton decode kernel splits each request's keys over at most this many programs; its fp32
# partial outputs (v_head_dim values and one log-sum-exp per head and split) are its workspace.
DECODE_MAX_KV_SPLITS = 16
# Verification and draft extends (a few new tokens per request) split the keys the same way. The
# splits aim at twice the GPU's SMs in programs; the SM count is capped here, so that the planner
# can bound those passes' partials without knowing the GPU.
KV_SPLIT_MAX_SMS = 160


def kv_splits(batch_size: int, kv_heads: int, num_sms: int) -> int:
    """KV splits per request of a split-KV pass: enough programs to fill the GPU twice over, at
    most ``DECODE_MAX_KV_SPLITS``. A function of the batch size only, so a CUDA graph captured for
    that size keeps its grid."""
    programs = 2 * min(num_sms, KV_SPLIT_MAX_SMS)
    return max(1, min(DECODE_MAX_KV_SPLITS, -(-programs // (batch_size * kv_heads))))


# Rows (new tokens per request x query heads of one KV head) up to which a pass runs the split-KV
# verify kernel; longer ones (prefill chunks, wide trees) run the extend kernel, which has no
# workspace.
VERIFY_MAX_ROWS = 64


def verify_fits(tokens_per_request: int, group: int) -> bool:
    return tokens_per_request * group <= VERIFY_MAX_ROWS
# Sampling and acceptance (batch_sampling.py, tree.accept_trees) run the requests that sample in
# blocks of whole requests. A block's scratch with temperature, top-k and top-p: fp32 and int64
# temporaries per row and vocabulary entry beyond the logits themselves (two sorts with their
# indices, the distributions, their cumulative sums, a copy of the block's logits when its requests
# are not consecutive in the batch), counted as live tensor bytes on CPU: 32, 36 with the copy
# (tests/engine/test_dynamic_reserve.py), and small per-request bookkeeping. A block holds as
# many requests as keep its scratch within SAMPLING_BLOCK_BYTES (at least one), so the scratch does
# not grow with the batch.
SAMPLING_BYTES_PER_LOGIT = 40
SAMPLING_BLOCK_BYTES = 256 * MIB


def sampling_block_rows(vocab_size: int, rows_per_request: int = 1) -> int:
    """Logit rows sampled at once: whole requests of ``rows_per_request`` rows, as many as keep the
    block's scratch within ``SAMPLING_BLOCK_BYTES``, and at least one request."""
    requests = SAMPLING_BLOCK_BYTES // (SAMPLING_BYTES_PER_LOGIT * rows_per_request * vocab_size)
    return max(1, requests) * rows_per_request


# --kv-cache-dtype: auto keeps K/V in the compute dtype; fp8 stores one byte per element, as the
# torch dtype named here.
FP8_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)


class ExitCode(IntEnum):
    """``specdecode-worker`` exit codes; the operator reads them off terminated containers."""

    OK = 0  # plan: the models fit; serve: stopped cleanly
    INTERNAL_ERROR = 1  # a bug: the traceback is in the log
    BAD_INPUT = 2  # a flag or model file to fix; one line says which
    DOES_NOT_FIT = 3  # plan: the models do not fit; serve: the memory found after loading is below the plan
    HUB_UNAVAILABLE = 4  # plan/fetch from a hub: unreachable or a server error; the same command may succeed later


# --- the MemoryPlan document ----------------------------------------------------------------------

PLAN_API_VERSION = "specdecode.io/v1alpha1"
PLAN_KIND = "MemoryPlan"
# Kubernetes keeps at most this many bytes of a termination message, where the planner writes its plan.
TERMINATION_LOG_LIMIT = 4096
_COMMIT = re.compile(r"[0-9a-f]{40}")


def kv_token_capacity(
    available_bytes: int,
    mem_fraction_static: float,
    target_weight_bytes: int,
    draft_weight_bytes: int,
    runtime_bytes: int,
    target_bytes_per_token: int,
    draft_bytes_per_token: int,
) -> int:
    """KV token slots shared by the target and draft pools; never negative.

    floor((available * f - W_target - W_draft - R_runtime) / (kv_target + kv_draft))
    """
    cell = target_bytes_per_token + draft_bytes_per_token
    if cell <= 0:
        raise ValueError(f"KV bytes per token must be positive, got {cell}")
    budget = available_bytes * mem_fraction_static - target_weight_bytes - draft_weight_bytes - runtime_bytes
    return max(0, math.floor(budget / cell))


def to_json(plan: dict[str, Any]) -> str:
    """Compact serialisation (what goes to the termination log)."""
    return json.dumps(plan, separators=(",", ":"), sort_keys=False)


# Field names are the JSON keys in snake case. A field that defaults to None may be missing or null;
# every other field is required. Integers are counts or bytes, never negative.

@dataclass(frozen=True)
class PlanGpu:
    name: str | None = None
    source: str | None = None
    total_bytes: int | None = None


@dataclass(frozen=True)
class PlanWeights:
    target_bytes: int
    draft_bytes: int


@dataclass(frozen=True)
class PlanKvCache:
    target_bytes_per_token: int
    draft_bytes_per_token: int
    draft_num_layers: int
    max_total_num_tokens: int
    dtype: str | None = None
    min_tokens: int | None = None
    context_length: int | None = None
    pool_bytes: int | None = None


@dataclass(frozen=True)
class PlanReserve:
    runtime_bytes: int
    dynamic_bytes: int
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    max_running_requests: int | None = None
    # The speculative shape the dynamic reserve was priced for (plans written before lack it).
    verify_tokens: int | None = None
    tree_topk: int | None = None
    tree_steps: int | None = None
    dtype_bytes: int | None = None
    dtype: str | None = None  # an explicit --dtype the plan was priced for
    blas_workspace_bytes: int | None = None  # cuBLAS's workspaces, a part of dynamic_bytes (older plans lack it)


@dataclass(frozen=True)
class PlanModel:
    """A model folder the plan was made for (``model_identity.py``)."""

    bytes: int  # every tensor of the checkpoint, from the safetensors headers
    config: str  # the first hex digits of config.json's sha256


@dataclass(frozen=True)
class PlanModels:
    """What ``serve --plan`` checks --target and --draft against; no draft when it has no folder of its own."""

    target: PlanModel
    draft: PlanModel | None = None


@dataclass(frozen=True)
class LegacyAccounting:
    """The target-only profile (what an engine that ignores the draft would size)."""

    max_total_num_tokens: int
    peak_bytes: int
    fits: bool | None = None


@dataclass(frozen=True)
class LayerRatioAccounting:
    """The target's KV cell scaled by the draft/target layer ratio."""

    max_total_num_tokens: int
    bytes_per_token: int | None = None


@dataclass(frozen=True)
class PlanSource:
    """Where a hub model was read: the commit the revision pointed at, and its download parts."""

    repo: str
    revision: str
    commit: str
    bytes: int  # every file a worker loads (weights, configs, tokenizer)
    part_bytes: list[int]  # bytes of each download part (hub.partition of the files)

    def check(self) -> None:
        if not _COMMIT.fullmatch(self.commit):
            raise ValueError(f"MemoryPlan: sources commit of {self.repo} must be 40 hex digits, got {self.commit!r}")
        if not self.part_bytes or sum(self.part_bytes) != self.bytes:
            raise ValueError(f"MemoryPlan: sources partBytes of {self.repo} must be non-empty and add up to "
                             f"bytes {self.bytes}, got {self.part_bytes}")


@dataclass(frozen=True)
class PlanSources:
    """Only for models planned from a hub; no draft for NGRAM, nor for MTP from the target's own repo."""

    target: PlanSource
    draft: PlanSource | None = None


@dataclass(frozen=True)
class PlanRuntime:
    """How another engine is pinned to the plan (``runtimes/``); missing for specdecode's own engine.

    ``reported_tokens`` is what the engine itself reports at start-up; the operator holds each
    pod un-Ready until the engine reports at least that many.
    """

    engine: str  # vllm or sglang
    version: str  # the engine version whose sizing rules priced the plan
    reported_tokens: int
    extra_reserve_bytes: int  # the engine's own reserve beyond this project's dynamic reserve
    dtype: str | None = None  # the compute dtype priced, pinned with --dtype (engines resolve auto their own way)
    kv_cache_memory_bytes: int | None = None  # vLLM --kv-cache-memory-bytes
    block_size: int | None = None  # vLLM --block-size
    num_blocks: int | None = None
    mem_fraction_static: float | None = None  # SGLang --mem-fraction-static
    page_size: int | None = None  # SGLang --page-size


@dataclass(frozen=True)
class MemoryPlan:
    """The plan the planner writes and the worker serves against (see ``plan.py`` for its terms)."""

    api_version: str
    kind: str
    fits: bool
    algorithm: str
    target: str
    tensor_parallel_size: int
    gpu_memory_bytes: int
    mem_fraction_static: float
    weights: PlanWeights
    kv_cache: PlanKvCache
    reserve: PlanReserve
    shortfall_bytes: int
    legacy: LegacyAccounting
    layer_ratio: LayerRatioAccounting
    min_mem_fraction_static: float
    message: str
    draft: str | None = None
    gpu: PlanGpu | None = None
    min_tensor_parallel_size: int | None = None
    nodes_per_replica: int | None = None  # pods (one per node) one replica spans; missing: 1
    sources: PlanSources | None = None  # models planned from a hub: the commits to load
    models: PlanModels | None = None  # the model folders it was made for (plans written before lack it)
    runtime: PlanRuntime | None = None  # another engine's flags; missing: specdecode's own engine
    # The JSON object as given, passed on unchanged (to the SDD status and the worker's --plan).
    document: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, obj: Any) -> MemoryPlan:
        """Read a parsed MemoryPlan; raise ValueError saying which key breaks the contract and how."""
        if not isinstance(obj, dict):
            raise ValueError(f"MemoryPlan: expected a JSON object, got {type(obj).__name__}")
        plan = _read(cls, obj, "", document=obj)
        plan._check()
        return plan

    def _check(self) -> None:
        if self.api_version != PLAN_API_VERSION:
            raise ValueError(f"MemoryPlan: apiVersion must be '{PLAN_API_VERSION}', got {self.api_version!r}")
        if self.kind != PLAN_KIND:
            raise ValueError(f"MemoryPlan: kind must be '{PLAN_KIND}', got {self.kind!r}")
        if self.algorithm not in PLANNED_ALGORITHMS:
            raise ValueError(f"MemoryPlan: algorithm must be one of {', '.join(PLANNED_ALGORITHMS)}, "
                             f"got {self.algorithm!r}")
        if self.tensor_parallel_size < 1 or self.gpu_memory_bytes < 1:
            raise ValueError("MemoryPlan: tensorParallelSize and gpuMemoryBytes must be positive")
        nodes = self.nodes_per_replica or 1
        if self.tensor_parallel_size % nodes:
            raise ValueError(f"MemoryPlan: nodesPerReplica {nodes} must divide tensorParallelSize "
                             f"{self.tensor_parallel_size}")
        if not self.mem_fraction_static > 0:
            raise ValueError(f"MemoryPlan: memFractionStatic must be positive, got {self.mem_fraction_static}")
        kv = self.kv_cache
        if kv.target_bytes_per_token < 1:
            raise ValueError("MemoryPlan: kvCache.targetBytesPerToken must be positive")
        expected = kv_token_capacity(
            self.gpu_memory_bytes, self.mem_fraction_static, self.weights.target_bytes, self.weights.draft_bytes,
            self.reserve.runtime_bytes, kv.target_bytes_per_token, kv.draft_bytes_per_token,
        )
        if abs(expected - kv.max_total_num_tokens) > 1:
            raise ValueError(
                f"MemoryPlan: kvCache.maxTotalNumTokens is {kv.max_total_num_tokens} but gpuMemoryBytes x "
                f"memFractionStatic - weights - reserve.runtimeBytes over the KV bytes per token gives {expected}"
            )
        if self.runtime is not None and self.runtime.engine not in ENGINES[1:]:
            raise ValueError(f"MemoryPlan: runtime.engine must be one of {', '.join(ENGINES[1:])}, "
                             f"got {self.runtime.engine!r}")
        for source in (self.sources.target, self.sources.draft) if self.sources else ():
            if source is not None:
                source.check()
        size = len(to_json(self.document).encode())
        if size >= TERMINATION_LOG_LIMIT:
            raise ValueError(f"MemoryPlan: compact JSON is {size} bytes, over the {TERMINATION_LOG_LIMIT}-byte limit")


def validate_plan(obj: Any) -> dict[str, Any]:
    """Check a parsed MemoryPlan against the contract; return it, or raise ValueError saying what is wrong."""
    return MemoryPlan.from_dict(obj).document


def _json_key(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


_TYPE_NAMES = {bool: "bool", int: "int", float: "int/float", str: "str"}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _read(cls: type, obj: dict[str, Any], prefix: str, **extra: Any) -> Any:
    """Build dataclass ``cls`` from ``obj``, checking each key's presence and JSON type."""
    hints = _field_types(cls)
    values: dict[str, Any] = dict(extra)
    for f in fields(cls):
        if f.name in extra:
            continue
        key = _json_key(f.name)
        path = prefix + key
        kind, optional = _unwrap_optional(hints[f.name])
        value = obj.get(key)
        if is_dataclass(kind):
            if optional and value is None:
                values[f.name] = None
            else:  # a missing section reports its first missing key
                values[f.name] = _read(kind, value if isinstance(value, dict) else {}, path + ".")
        elif key not in obj or (optional and value is None):
            if not optional:
                raise ValueError(f"MemoryPlan: missing required key '{path}'")
            values[f.name] = None
        elif get_origin(kind) is list:
            if not isinstance(value, list):
                raise ValueError(f"MemoryPlan: key '{path}' must be a list, got {value!r}")
            item = get_args(kind)[0]
            values[f.name] = [_checked(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
        else:
            values[f.name] = _checked(path, value, kind)
    return cls(**values)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def _checked(path: str, value: Any, kind: type) -> Any:
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, accepted):
        raise ValueError(f"MemoryPlan: key '{path}' must be {_TYPE_NAMES[kind]}, got {value!r}")
    if kind is int and value < 0:
        raise ValueError(f"MemoryPlan: key '{path}' must be a non-negative integer, got {value}")
    return value
