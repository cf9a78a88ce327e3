"""The memory plan: pure arithmetic over shapes, weight bytes and device memory.

No torch here. The MemoryPlan document it builds, and the formula every plan must satisfy
(``kv_token_capacity``), are the contract in ``contract``, which the operator reads too.

All terms are bytes per GPU under tensor-parallel size t:

    max_total_num_tokens = floor((G * f - W_target - W_draft - R_runtime) / (kv_target + kv_draft))

- ``G`` (``gpuMemoryBytes``): memory free on one GPU before this process creates its CUDA context
  or loads a weight: pynvml's free bytes on the planner's GPU, else ``--gpu-memory-gib`` as given,
  else the product catalogue's usable bytes (total minus the driver's reservation).
- ``R_runtime`` (``reserve.runtimeBytes``), taken out of the static share:
  1 GiB for the CUDA context, the libraries' kernel images and allocator fragmentation (on an H200 the
  context took 621 MiB and a first bf16 matmul 719 MiB in all), plus, when t > 1, t x 128 MiB of
  NCCL communicator buffers (SGLang's ``tp/8 GiB`` rule), plus, when the t GPUs span several nodes
  (``nodesPerReplica`` > 1), 512 MiB for NCCL's network transport: per channel a send and a
  receive buffer (NCCL_BUFFSIZE, 4 MiB) towards each network peer of ring and tree, up to 32
  channels. An estimate from NCCL's defaults; no multi-node GPU run has measured it yet.
- ``R_dynamic`` (``reserve.dynamicBytes``), what the static share must leave free: this engine's
  activations, derived from the models' tensor shapes (``dynamic_reserve_bytes`` says how), and
  cuBLAS's workspaces (``reserve.blasWorkspaceBytes``, ``blas_workspace_bytes``). Unset sizes
  follow SGLang's GPU tiers (``default_serving_limits``).
- ``f`` (``memFractionStatic``): by default 1 - R_dynamic / G rounded down to 3 decimals. With
  ``--kv-cache-memory-gib K`` the KV budget is K and f is derived from it; with
  ``--max-total-tokens N`` below the capacity, f shrinks to what N tokens need, so the identity
  above always holds for the numbers the plan states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .. import devices
from ..contract import (  # noqa: F401 - DEFAULT_* and VERIFY_TOKENS are read through this module too
    DECODE_MAX_KV_SPLITS,
    DEFAULT_ENGINE,
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_MAX_TP,
    GIB,
    KV_SPLIT_MAX_SMS,
    MIB,
    PLAN_API_VERSION,
    PLAN_KIND,
    SAMPLING_BYTES_PER_LOGIT,
    TERMINATION_LOG_LIMIT,
    VERIFY_MAX_ROWS,
    VERIFY_TOKENS,
    kv_splits,
    kv_token_capacity,
    sampling_block_rows,
    to_json,
    verify_fits,
)

TP_CANDIDATES = (1, 2, 4, 8, 16, 32)

RUNTIME_BASE_BYTES = GIB
NCCL_BYTES_PER_RANK = 128 * MIB
NCCL_INTER_NODE_BYTES = 512 * MIB
# --- the dynamic reserve ------------------------------------------------------------------------
# Every constant below is read off the tensors this engine allocates (models/llama.py, sampling,
# triton_attention.py), not measured: no GPU measurement backs them yet. Phase 3's warm-up on a GPU
# (and benchmarks/gpu_serving.py, which prints planned against measured) must confirm them.
#
# Logit row bytes per vocabulary entry on top of the compute dtype's: the lm_head output in the
# compute dtype, then the fp32 copy the sampler and acceptance read.
LOGIT_FP32_BYTES = 4
PARTIAL_BYTES = 4
# Hidden states an EAGLE head takes from the target per token, in units of hidden_size, held from
# the target's pass until the head's: EAGLE3 concatenates three layers, EAGLE-1/2 and MTP one.
FEATURE_HIDDENS = {"EAGLE3": 3, "EAGLE": 1, "MTP": 1}
# EAGLE tree graphs stage, per request, an int8 mask over the pass's extra keys and the keys' int64
# KV slots and positions (plus the request's int64 prefix length).
TREE_INDEX_BYTES = 8
# The fp32 distributions sampled rows drew from, returned with their tokens (a chain's drafts hold
# theirs through the verify pass): one per row, not per block.
DISTRIBUTION_BYTES_PER_LOGIT = 4
# PyTorch's caching allocator rounds blocks up (512 B, 2 MiB segments for large ones) and cannot
# always reuse a freed block for a differently sized one: a quarter on top of the live bytes.
ALLOCATOR_SLACK = 1.25
# cuBLAS's workspaces: PyTorch binds one to each (cuBLAS handle, stream) pair a matmul runs on and
# takes it from the caching allocator, which holds it until exit (its size per GPU:
# devices.blas_workspace_bytes). The worker's matmuls run on up to four pairs: phase 3's thread on
# the default stream, on the side stream that warms each CUDA graph up and on torch.cuda.graph's
# capture stream, then the loop's thread on the default stream (each thread takes its own handle).
BLAS_WORKSPACES = 4


def sampling_bytes(vocab_size: int, verify_rows: int, verify_tokens: int) -> tuple[int, int]:
    """(scratch, held) of sampling and acceptance. Scratch: the largest block's, a verify pass's
    (whole requests of ``verify_tokens`` rows) or a decode step's (one row a request), never more
    rows than the pass has. Held: the fp32 distributions sampled rows drew from, one per row (a
    chain's drafts keep theirs through the verify pass)."""
    block = max(sampling_block_rows(vocab_size, verify_tokens), sampling_block_rows(vocab_size))
    scratch = SAMPLING_BYTES_PER_LOGIT * min(verify_rows, block) * vocab_size
    return scratch, DISTRIBUTION_BYTES_PER_LOGIT * verify_rows * vocab_size


@dataclass(frozen=True)
class ForwardGeometry:
    """The shapes one model's forward pass allocates per token (whole model; ``tp`` shards it)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab_size: int
    dtype_bytes: int
    # MLA (DeepSeek-V2/V3): the latent width and the rope part; None for per-head K/V attention.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @classmethod
    def of(cls, shape) -> "ForwardGeometry":
        """From a ``ModelShape``; a config without ``intermediate_size`` is priced at 4 x hidden."""
        return cls(shape.hidden_size, shape.intermediate_size or 4 * shape.hidden_size, shape.num_attention_heads,
                   shape.num_kv_heads, shape.head_dim, shape.v_head_dim, shape.vocab_size, shape.dtype_bytes,
                   shape.kv_lora_rank, shape.qk_rope_head_dim)

    @property
    def attention_value_dim(self) -> int:
        """Values per head the attention kernel writes: the latent under MLA (lifted afterwards)."""
        return self.v_head_dim if self.kv_lora_rank is None else self.kv_lora_rank

    def token_bytes(self, tp: int) -> int:
        """Bytes live per token at a decoder layer's peak, on one of ``tp`` GPUs.

        Residual stream, normed input and layer output (3 x hidden); the attention's tensors; the
        MLP's gate, up and their product (3 x intermediate / t). Attention and MLP temporaries are
        not live together, so summing both is an upper bound. Attention: q, k and v and the output;
        under MLA (absorbed queries, latent width w = kv_lora_rank + rope) per head q, its rotated
        rope part, the absorbed query and its concatenation with the rope part (each at most w
        wide when qk_nope + rope <= w, as in DeepSeek), the attended latent (at most w) and the
        lifted output (v_head_dim); and the token's latent row twice (projection and cell).
        """
        heads = math.ceil(self.num_heads / tp)
        if self.kv_lora_rank is None:
            kv_heads = max(1, self.num_kv_heads // tp)
            attention = heads * (self.head_dim + self.v_head_dim) + kv_heads * (self.head_dim + self.v_head_dim)
        else:
            width = self.kv_lora_rank + self.qk_rope_head_dim
            attention = heads * (5 * width + self.v_head_dim) + 2 * width
        per_token = 3 * self.hidden_size + attention + 3 * math.ceil(self.intermediate_size / tp)
        return per_token * self.dtype_bytes

    def logit_bytes(self, rows: int, tp: int = 1) -> int:
        """Logits of ``rows`` tokens at their peak, with their fp32 copy. On one of ``tp`` GPUs each
        rank computes its ceil(vocab / t) columns and gathers every rank's before concatenating:
        the peak is the larger of (own shard + gathered shards + concatenation) and
        (concatenation + fp32 copy); one GPU holds the logits and their fp32 copy."""
        shard = rows * math.ceil(self.vocab_size / tp) * self.dtype_bytes
        fp32 = rows * self.vocab_size * LOGIT_FP32_BYTES
        if tp == 1:
            return shard + fp32
        return max(shard * (1 + 2 * tp), shard * tp + fp32)

    def decode_workspace_bytes(self, batch: int, tp: int) -> int:
        """Split-KV partials of one decode step (each layer reuses the same size)."""
        return (batch * math.ceil(self.num_heads / tp) * DECODE_MAX_KV_SPLITS * (self.attention_value_dim + 1)
                * PARTIAL_BYTES)

    def verify_workspace_bytes(self, batch: int, tokens_per_req: int, tp: int, tree: bool = False,
                               max_tokens: int | None = None, shard_tp: int | None = None) -> int:
        """Split-KV partials of a pass of up to ``tokens_per_req`` new tokens per request (and at
        most ``max_tokens`` in all), for any batch up to ``batch``
        (``triton_attention.verify_attention``): an fp32 output and log-sum-exp per row, head and
        split, and one more split for a tree's nodes. Splits fall as batches grow, so a smaller
        batch may need the most. None where the extend kernel takes the pass, or under MLA (its
        own kernels). A pass of one split and no tree writes its output without partials; it is
        priced as if it had them (an upper bound). ``shard_tp``: a model priced whole at ``tp`` whose heads really shard
        ``shard_tp`` ways (an EAGLE head): its ranks' query groups can be smaller, so a pass the
        whole model would leave to the extend kernel may split there; the larger of the two."""
        if shard_tp is not None and shard_tp != tp:
            return max(self.verify_workspace_bytes(batch, tokens_per_req, t, tree, max_tokens) for t in (tp, shard_tp))
        heads, kv_heads = math.ceil(self.num_heads / tp), max(1, self.num_kv_heads // tp)
        if self.kv_lora_rank is not None or not verify_fits(tokens_per_req, heads // kv_heads):
            return 0
        cap = max_tokens or batch * tokens_per_req
        row_splits = max(min(b * tokens_per_req, cap) * (kv_splits(b, kv_heads, KV_SPLIT_MAX_SMS) + tree)
                         for b in range(1, batch + 1))
        return row_splits * heads * (self.attention_value_dim + 1) * PARTIAL_BYTES

    def eager_split_bytes(self, requests: int, tokens: int, tp: int, tree: bool, decode_above: int,
                          shard_tp: int | None = None) -> int:
        """The split-KV partials of any eager pass of up to ``requests`` requests and ``tokens``
        tokens: the verify kernel takes requests of up to ``VERIFY_MAX_ROWS / group`` new tokens
        each (short prompts in a prefill chunk too), and decode steps of more than
        ``decode_above`` requests (the graphs' largest batch) run eagerly."""
        group = math.ceil(self.num_heads / tp) // max(1, self.num_kv_heads // tp)
        verify = self.verify_workspace_bytes(requests, max(1, VERIFY_MAX_ROWS // group), tp, tree, tokens, shard_tp)
        return max(verify, self.decode_workspace_bytes(requests, tp) if requests > decode_above else 0)

    def graph_pool_bytes(self, batch: int, tp: int, logit_tp: int | None = None) -> int:
        """A CUDA graph pool for decode batches up to ``batch``: the largest graph's activations,
        logits (gathered over ``logit_tp`` ranks, default ``tp``) and kernel workspace (smaller
        graphs reuse its memory). Independent of the context."""
        logits = self.logit_bytes(batch, tp if logit_tp is None else logit_tp)
        return batch * self.token_bytes(tp) + logits + self.decode_workspace_bytes(batch, tp)

    def verify_pool_bytes(self, batch: int, verify_tokens: int, tp: int, tree: bool = False) -> int:
        """Verify graphs up to ``batch`` requests of ``verify_tokens`` rows, with their split-KV partials."""
        rows = batch * verify_tokens
        return (rows * self.token_bytes(tp) + self.logit_bytes(rows, tp)
                + self.verify_workspace_bytes(batch, verify_tokens, tp, tree))


def tree_inputs_bytes(batch: int, tokens: int, keys: int) -> int:
    """A tree graph's static inputs beyond a plain batch's (engine/speculation/tree_graph.py): per request a
    ``[tokens, keys]`` int8 mask, its keys' slots and positions, and its prefix length."""
    return batch * (tokens * keys + 2 * TREE_INDEX_BYTES * keys + TREE_INDEX_BYTES)


def draft_tree_step_bytes(target: ForwardGeometry, draft: ForwardGeometry, batch: int, topk: int,
                          steps: int, tp: int = 1) -> int:
    """The head's draft-tree-step graphs up to ``batch`` requests, ``topk`` rows each: the
    activations and logits of those rows, their logits over the target's vocabulary in fp32 (an
    EAGLE3 head scatters its own vocabulary there) and the log-softmax the expansion ranks, the
    head features staged per row, and the mask over the ``topk x (steps - 1)`` expanded nodes."""
    rows = batch * topk
    return (rows * draft.token_bytes(1) + draft.logit_bytes(rows, tp)
            + 2 * rows * target.vocab_size * LOGIT_FP32_BYTES
            + rows * draft.hidden_size * target.dtype_bytes
            + tree_inputs_bytes(batch, topk, topk * (steps - 1))
            + draft.verify_workspace_bytes(batch, topk, 1, tree=True, shard_tp=tp))


def extend_graph_bytes(draft: ForwardGeometry, batch: int, width: int, tp: int, logit_tp: int,
                       feature_bytes: int = 0) -> int:
    """A draft's extend graphs up to ``batch`` requests of ``width`` rows, logits for each
    request's last row only: a STANDALONE draft's first step over the two tokens it has not
    cached, or a head's extend over a round's accepted tokens (``feature_bytes``: the target
    features staged per row). Activations of every row, the last rows' logits (gathered over
    ``logit_tp`` ranks, the ranks its heads shard over) and the split-KV partials."""
    rows = batch * width
    return (rows * (draft.token_bytes(tp) + feature_bytes) + draft.logit_bytes(batch, logit_tp)
            + draft.verify_workspace_bytes(batch, width, tp, shard_tp=logit_tp))


def runtime_reserve_bytes(tp: int, nodes: int = 1) -> int:
    """CUDA context, workspaces and allocator slack, plus NCCL buffers when t > 1 (more across nodes)."""
    return (RUNTIME_BASE_BYTES + (tp * NCCL_BYTES_PER_RANK if tp > 1 else 0)
            + (NCCL_INTER_NODE_BYTES if nodes > 1 else 0))


def nodes_per_replica(tp: int, gpus_per_node: int) -> int:
    """The fewest pods (one per node) that hold t GPUs in equal shares of at most ``gpus_per_node``."""
    return next(n for n in range(1, tp + 1) if tp % n == 0 and tp // n <= gpus_per_node)


def default_serving_limits(total_bytes: int, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU size, as SGLang's server defaults pick them."""
    mib = total_bytes / MIB
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 2048, 24 if tp < 4 else 80
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def dynamic_reserve_bytes(algorithm: str, target: ForwardGeometry, draft: ForwardGeometry | None, tp: int,
                          chunked_prefill_size: int, cuda_graph_max_bs: int, max_running_requests: int,
                          verify_tokens: int = VERIFY_TOKENS, tree_topk: int = 1, tree_steps: int = 1) -> int:
    """Memory outside the weights and KV pools at the engine's peak, on one GPU:

        ALLOCATOR_SLACK x (eager pass + CUDA graph pools)

    eager pass: the larger of a prefill chunk and a verify batch (max_running x verify_tokens
    tokens) through the larger model's layers, or, when larger, one block of the verify batch's
    sampling and acceptance with every filter on (``SAMPLING_BYTES_PER_LOGIT`` per row of
    ``sampling_block_rows``; the pass's activations are gone by then); plus the verify batch's
    logits, the distributions sampled rows drew from (``sampling_bytes``), and the features an EAGLE
    head takes from the target for a chunk. Graph pools: decode graphs up to ``cuda_graph_max_bs``
    for the target and for a STANDALONE draft; the target's verify graphs (k + 1 rows per request)
    share its decode graphs' pool, which is then the larger of the two (STANDALONE, NGRAM, and
    EAGLE/EAGLE3/MTP, whose target graphs also return the head's features, and whose head or
    NextN layer has a graph pool of its own for the chain's draft steps). An EAGLE tree
    (``tree_topk`` > 1, over ``tree_steps`` steps) verifies ``verify_tokens`` nodes under a mask
    staged with the batch, and its head's graphs are draft-tree steps of ``tree_topk`` rows per
    request (``draft_tree_step_bytes``), or the chain's when those are larger, so that a chain of
    the same width served under the tree's plan fits it. Each runner's sizes write into its
    largest graph's outputs, so a pool holds one set of outputs. MLA models (DeepSeek) price their
    absorbed queries and latent split-KV partials (``ForwardGeometry``).
    """
    verify_rows = max_running_requests * verify_tokens
    tokens = max(chunked_prefill_size, verify_rows)
    # A draft is priced unsharded (exact for a replicated draft, an upper bound for a sharded EAGLE
    # head), except MTP's NextN layer, which always shards with the target.
    draft_tp = tp if algorithm == "MTP" else 1
    per_token = target.token_bytes(tp)
    if draft is not None:
        per_token = max(per_token, draft.token_bytes(draft_tp))
    feature_bytes = FEATURE_HIDDENS.get(algorithm, 0) * target.hidden_size * target.dtype_bytes
    features = tokens * feature_bytes
    # A pass's activations are freed before its logits are sampled: the larger of the two is live.
    scratch, held = sampling_bytes(target.vocab_size, verify_rows, verify_tokens)
    tree = tree_topk > 1
    splits = target.eager_split_bytes(max_running_requests, tokens, tp, tree, cuda_graph_max_bs)
    if draft is not None:
        splits = max(splits, draft.eager_split_bytes(max_running_requests, tokens, draft_tp, tree, cuda_graph_max_bs,
                                                     shard_tp=tp))
    eager = max(tokens * per_token + splits, scratch) + held + target.logit_bytes(verify_rows, tp) + features
    graphs = target.graph_pool_bytes(cuda_graph_max_bs, tp)
    if algorithm in ("STANDALONE", "NGRAM", "EAGLE", "EAGLE3", "MTP"):
        graphs = max(graphs, target.verify_pool_bytes(cuda_graph_max_bs, verify_tokens, tp, tree))
    if algorithm in ("EAGLE", "EAGLE3", "MTP"):
        graphs += cuda_graph_max_bs * verify_tokens * feature_bytes
        if draft is not None:
            # the head's extend over a round's accepted tokens (at most k + 1, which also bounds a
            # tree's depth + 1 and is what a chain served under a tree's plan takes), then its
            # chain steps; their logits are gathered over the target's t ranks
            graphs += extend_graph_bytes(draft, cuda_graph_max_bs, verify_tokens, draft_tp, tp, feature_bytes)
            chain = draft.graph_pool_bytes(cuda_graph_max_bs, draft_tp, logit_tp=tp)
        if tree:
            graphs += tree_inputs_bytes(cuda_graph_max_bs, verify_tokens, verify_tokens)
            if draft is not None:  # a chain served under a tree's plan fits it too (serve_shape.py)
                graphs += max(chain, draft_tree_step_bytes(target, draft, cuda_graph_max_bs, tree_topk,
                                                           tree_steps, tp))
        elif draft is not None:
            graphs += chain
    if algorithm == "STANDALONE" and draft is not None:
        # decode steps, and the first step over the two tokens a fully accepted round leaves
        graphs += draft.graph_pool_bytes(cuda_graph_max_bs, 1) + extend_graph_bytes(draft, cuda_graph_max_bs, 2, 1, 1)
    return math.ceil(ALLOCATOR_SLACK * (eager + graphs))


def blas_workspace_bytes(gpu_name: str) -> int:
    """cuBLAS's workspaces on one GPU of ``gpu_name``: ``BLAS_WORKSPACES`` of PyTorch's default
    size for it (``devices.blas_workspace_bytes``). Whole blocks the allocator keeps: no slack."""
    return BLAS_WORKSPACES * devices.blas_workspace_bytes(gpu_name)


def priced_shape(req: "PlanRequest") -> dict[str, int | str]:
    """The speculative shape the dynamic reserve was priced for, as ``serve --plan`` checks it
    (``serve_shape.py``): verify rows per request (proposals + 1), an EAGLE tree's top-k and depth
    (top-k 1: a chain, whose depth is its proposals), and the bytes of an activation element (the
    planned --dtype's, else the checkpoint's; ``serve --dtype`` could widen it). A plan priced for
    an explicit --dtype names it, and ``serve --dtype auto`` on a GPU then serves it."""
    shape: dict[str, int | str] = {"verifyTokens": req.verify_tokens, "treeTopk": req.tree_topk,
                                   "treeSteps": req.tree_steps}
    if req.target_geometry is not None:
        shape["dtypeBytes"] = req.target_geometry.dtype_bytes
    if req.compute_dtype is not None:
        shape["dtype"] = req.compute_dtype
    return shape


def _floor3(x: float) -> float:
    return math.floor(x * 1000 + 1e-9) / 1000


def _ceil3(x: float) -> float:
    return math.ceil(x * 1000 - 1e-9) / 1000


@dataclass(frozen=True)
class Candidate:
    """Everything the plan needs for one tensor-parallel size."""

    tp: int
    target_weight_bytes: int
    draft_weight_bytes: int
    target_bytes_per_token: int
    draft_bytes_per_token: int


@dataclass(frozen=True)
class PlanArgs:
    """What to plan, as ``specdecode-worker plan`` is asked: model folders and sizing choices.

    None means auto: the smallest tensor-parallel size that fits, the derived static fraction, the
    model's own context length, SGLang's serving limits, the device's own memory.
    """

    target: str
    algorithm: str
    draft: str | None = None
    tp: int | None = None
    gpu_memory_gib: float | None = None
    gpu_product: str | None = None
    mem_fraction_static: float | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"  # the compute dtype the worker serves (--dtype); auto: the checkpoint's
    context_length: int | None = None
    min_kv_tokens: int = 0
    max_running_requests: int | None = None
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None
    verify_tokens: int = VERIFY_TOKENS  # tokens verified per request per step (proposals + 1)
    tree_topk: int = 1  # EAGLE: branches per draft step (1: a chain)
    tree_steps: int = 1  # EAGLE: draft steps per round (a tree's depth)
    max_total_tokens: int | None = None
    kv_cache_memory_gib: float | None = None
    max_tp: int = DEFAULT_MAX_TP  # the largest t auto may choose (gpu.maxPerReplica)
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE  # beyond it a replica spans nodes (gpu.perNode)
    engine: str = DEFAULT_ENGINE  # whose arithmetic the plan is restated in (runtimes/)


@dataclass(frozen=True)
class PlanRequest:
    """``PlanArgs`` resolved: configs and headers read, the device found, every number checked."""

    algorithm: str
    target_name: str
    draft_name: str | None
    gpu_memory_bytes: int
    gpu_total_bytes: int
    gpu_source: str
    gpu_name: str
    kv_cache_dtype: str
    draft_num_layers: int
    target_num_layers: int
    target_vocab_size: int
    min_tokens: int
    context_length: int
    tp: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_running_requests: int | None = None
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None
    target_geometry: ForwardGeometry | None = None  # required to size the dynamic reserve
    draft_geometry: ForwardGeometry | None = None
    verify_tokens: int = VERIFY_TOKENS
    tree_topk: int = 1
    tree_steps: int = 1
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    compute_dtype: str | None = None  # an explicit serve --dtype the plan priced (None: the checkpoint's)


@dataclass(frozen=True)
class _Sizing:
    tp: int
    f: float
    f_cap: float
    tokens: int
    runtime: int
    dynamic: int
    chunk: int
    graph_bs: int
    max_running: int
    fits: bool
    shortfall: int


def _size(req: PlanRequest, c: Candidate) -> _Sizing:
    g = req.gpu_memory_bytes
    chunk_default, bs_default = default_serving_limits(req.gpu_total_bytes, c.tp)
    chunk = req.chunked_prefill_size or chunk_default
    graph_bs = req.cuda_graph_max_bs or bs_default
    max_running = req.max_running_requests or graph_bs
    runtime = runtime_reserve_bytes(c.tp, nodes_per_replica(c.tp, req.gpus_per_node))
    if req.target_geometry is None:
        raise ValueError("PlanRequest.target_geometry is needed to size the dynamic reserve")
    dynamic = dynamic_reserve_bytes(req.algorithm, req.target_geometry, req.draft_geometry, c.tp, chunk, graph_bs,
                                    max_running, req.verify_tokens, req.tree_topk, req.tree_steps)
    dynamic += blas_workspace_bytes(req.gpu_name)
    cell = c.target_bytes_per_token + c.draft_bytes_per_token
    static_fixed = c.target_weight_bytes + c.draft_weight_bytes + runtime
    f_cap = max(0.001, _floor3(1 - dynamic / g))  # a GPU smaller than the dynamic reserve fits nothing

    if req.kv_cache_memory_bytes is not None:
        f = (req.kv_cache_memory_bytes + static_fixed) / g
    elif req.mem_fraction_static is not None:
        f = req.mem_fraction_static
        f_cap = max(f_cap, f)  # the user chose the split; R_dynamic is what f leaves
    else:
        f = f_cap
    tokens = kv_token_capacity(g, f, c.target_weight_bytes, c.draft_weight_bytes, runtime,
                               c.target_bytes_per_token, c.draft_bytes_per_token)
    if req.max_total_tokens is not None and tokens > req.max_total_tokens:
        tokens = req.max_total_tokens
        f = (tokens * cell + static_fixed) / g

    kv_missing = req.min_tokens * cell - (g * f - static_fixed)
    over_device = g * f - g * f_cap if f > f_cap + 1e-12 else 0
    shortfall = max(0, math.ceil(kv_missing), math.ceil(over_device))
    fits = tokens >= max(req.min_tokens, 1) and over_device <= 0 and f <= 1
    return _Sizing(c.tp, f, f_cap, tokens, runtime, dynamic, chunk, graph_bs, max_running, fits,
                   0 if fits else max(shortfall, 1))


def build_plan(req: PlanRequest, candidates: dict[int, Candidate] | Callable[[int], Candidate],
               valid_tps: list[int]) -> dict[str, Any]:
    """The MemoryPlan for ``req``: the requested t, or the smallest valid t that fits.

    ``candidates`` gives per-GPU weights and KV cells for each t in ``valid_tps`` (already filtered
    to sizes that divide the attention heads). Without a fit under auto t, the plan is made for the
    largest valid t (the closest to fitting) and says what is missing.
    """
    get = candidates.__getitem__ if isinstance(candidates, dict) else candidates
    sizings = {tp: _size(req, get(tp)) for tp in valid_tps}
    fitting = [tp for tp in valid_tps if sizings[tp].fits]
    min_tp = fitting[0] if fitting else None
    if req.tp is not None:
        tp = req.tp
        if tp not in sizings:
            sizings[tp] = _size(req, get(tp))
    else:
        tp = min_tp if min_tp is not None else valid_tps[-1]
    s, c = sizings[tp], get(tp)
    g = req.gpu_memory_bytes
    cell = c.target_bytes_per_token + c.draft_bytes_per_token
    static_fixed = c.target_weight_bytes + c.draft_weight_bytes + s.runtime
    min_f = _ceil3((req.min_tokens * cell + static_fixed) / g)

    legacy_tokens = kv_token_capacity(g, s.f, c.target_weight_bytes, 0, s.runtime, c.target_bytes_per_token, 0)
    legacy_peak = static_fixed + legacy_tokens * cell + s.dynamic
    ratio_cell = c.target_bytes_per_token
    if req.algorithm != "NGRAM":
        ratio_cell = int(c.target_bytes_per_token * (1 + req.draft_num_layers / req.target_num_layers))
    ratio_tokens = kv_token_capacity(g, s.f, c.target_weight_bytes, c.draft_weight_bytes, s.runtime, ratio_cell, 0)

    plan: dict[str, Any] = {
        "apiVersion": PLAN_API_VERSION,
        "kind": PLAN_KIND,
        "fits": s.fits,
        "algorithm": req.algorithm,
        "target": _short(req.target_name),
        "draft": None if req.draft_name is None else _short(req.draft_name),
        "tensorParallelSize": tp,
        "nodesPerReplica": nodes_per_replica(tp, req.gpus_per_node),
        "gpu": {"name": _short(req.gpu_name, 64), "source": req.gpu_source, "totalBytes": req.gpu_total_bytes},
        "gpuMemoryBytes": g,
        "memFractionStatic": s.f,
        "weights": {"targetBytes": c.target_weight_bytes, "draftBytes": c.draft_weight_bytes},
        "kvCache": {
            "dtype": req.kv_cache_dtype,
            "targetBytesPerToken": c.target_bytes_per_token,
            "draftBytesPerToken": c.draft_bytes_per_token,
            "draftNumLayers": req.draft_num_layers if req.algorithm != "NGRAM" else 0,
            "maxTotalNumTokens": s.tokens,
            "minTokens": req.min_tokens,
            "contextLength": req.context_length,
            "poolBytes": s.tokens * cell,
        },
        "reserve": {
            "runtimeBytes": s.runtime,
            "dynamicBytes": s.dynamic,
            "blasWorkspaceBytes": blas_workspace_bytes(req.gpu_name),  # a part of dynamicBytes
            "chunkedPrefillSize": s.chunk,
            "cudaGraphMaxBs": s.graph_bs,
            "maxRunningRequests": s.max_running,
            **priced_shape(req),
        },
        "shortfallBytes": s.shortfall,
        "minMemFractionStatic": min_f,
        "minTensorParallelSize": min_tp,
        "legacy": {"maxTotalNumTokens": legacy_tokens, "peakBytes": legacy_peak, "fits": legacy_peak <= g},
        "layerRatio": {"maxTotalNumTokens": ratio_tokens, "bytesPerToken": ratio_cell},
    }
    plan["message"] = _message(req, plan, s, max(valid_tps))
    excess = len(to_json(plan).encode()) - (TERMINATION_LOG_LIMIT - 1)
    if excess > 0:  # very long folder names: keep the numbers, shorten the prose
        plan["message"] = plan["message"][: max(0, len(plan["message"]) - excess - 3)] + "..."
    return plan


def _short(name: str, limit: int = 128) -> str:
    """Identities stay short so the plan fits a termination message whatever the folder names."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _message(req: PlanRequest, plan: dict[str, Any], s: _Sizing, largest_tp: int) -> str:
    tp = plan["tensorParallelSize"]
    kv = plan["kvCache"]
    nodes = plan["nodesPerReplica"]
    where = f"{tp} GPU(s)" if nodes == 1 else f"{tp} GPUs ({nodes} nodes of {tp // nodes})"
    if s.fits:
        text = (f"fits on {where}: {kv['maxTotalNumTokens']} KV tokens (need {req.min_tokens}) at "
                f"mem_fraction_static {plan['memFractionStatic']:.3f}")
        legacy = plan["legacy"]
        if not legacy["fits"]:
            text += (f"; target-only accounting would have sized {legacy['maxTotalNumTokens']} tokens and "
                     f"overrun the GPU by {_gib(legacy['peakBytes'] - req.gpu_memory_bytes)}")
        return text
    parts = [f"does not fit on {where} of {_gib(req.gpu_memory_bytes)}: {kv['maxTotalNumTokens']} KV tokens "
             f"for a floor of {req.min_tokens}, short by {_gib(plan['shortfallBytes'])} per GPU"]
    if plan["minTensorParallelSize"] is not None and plan["minTensorParallelSize"] != tp:
        parts.append(f"fits with --tp {plan['minTensorParallelSize']}")
    elif plan["minTensorParallelSize"] is None:
        parts.append(f"no tensor-parallel size up to {largest_tp} fits")
        if largest_tp < max(TP_CANDIDATES):
            parts.append("or allow more GPUs per replica (--max-tp, gpu.maxPerReplica)")
    if plan["minMemFractionStatic"] < 1:
        parts.append(f"or with --mem-fraction-static {plan['minMemFractionStatic']:.3f} on {tp} GPU(s)")
    parts.append("or lower --context-length/--min-kv-tokens, use --kv-cache-dtype fp8_e4m3, or a larger GPU")
    return "; ".join(parts)
