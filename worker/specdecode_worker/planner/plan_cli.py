"""``specdecode-worker plan``: the dry-run memory plan the planner pod runs.

Exit codes: 0 it fits; 3 it does not fit (the plan is still printed and written); 2 bad input
(one line on stderr naming the file and the field; for hub models also a missing repo, revision or
token); 4 the hub is unreachable or failing (retry); 1 internal error. With ``--termination-log``
the compact plan JSON is written there (on exit 2 or 1, the one-line error instead), which is
where Kubernetes picks up a container's termination message.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
from pathlib import Path
from typing import Any

from .. import termination
from ..contract import (DEFAULT_ENGINE, ENGINES, FP8_KV_CACHE_DTYPES, GIB, PLANNED_ALGORITHMS, ExitCode, MemoryPlan,
                        PlanReserve, to_json)
from ..devices import resolve_device_memory
from ..errors import InputError
from ..flags import CommandParser, add_sizing_flags
from ..model_rules.checkpoint import SERVED_DTYPES, as_served, read_checkpoint, split_target_draft, total_bytes
from ..model_rules.eagle_rule import aux_layer_ids
from ..model_rules.model_config import ModelShape, load_shape, read_config
from ..model_rules.mtp_rule import check_mtp_draft, check_standalone_draft
from ..model_rules.vocabulary import check_vocabulary
from . import runtimes
from .hub import HubClient, model_name
from .model_identity import identity
from .plan import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_MAX_TP,
    TP_CANDIDATES,
    VERIFY_TOKENS,
    Candidate,
    ForwardGeometry,
    PlanArgs,
    PlanRequest,
    build_plan,
)

DEFAULT_CONTEXT_LENGTH = 4096


def parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specdecode-worker plan", description="Dry-run GPU memory plan for a target + draft pair.")
    p.add_argument("--target", required=True,
                   help="target model folder (config.json + *.safetensors), or OWNER/NAME with --model-source hub")
    p.add_argument("--draft", help="draft model folder, or OWNER/NAME with --model-source hub "
                                   "(not for NGRAM; MTP defaults to the target)")
    p.add_argument("--model-source", choices=("path", "hub"), default="path",
                   help="path: --target/--draft are folders (default); hub: they are hub models, read over HTTP "
                        "(configs and safetensors headers only) from $HF_ENDPOINT with $HF_TOKEN")
    for role in ("target", "draft"):
        p.add_argument(f"--{role}-revision",
                       help=f"with --model-source hub: branch, tag or commit of the {role} (default main)")
    p.add_argument("--algorithm", required=True, choices=PLANNED_ALGORITHMS)
    add_sizing_flags(p, serving=False)
    p.add_argument("--dtype", default="auto", choices=("auto", *SERVED_DTYPES),
                   help="compute dtype the worker serves (serve --dtype): weights, activations and an auto KV "
                        "cache are priced in it (default auto: the checkpoint's)")
    p.add_argument("--num-draft-tokens", type=int, default=VERIFY_TOKENS - 1,
                   help="proposals per verify round, as the worker serves them: verify batches and their CUDA "
                        f"graphs take this + 1 rows per request (default {VERIFY_TOKENS - 1})")
    p.add_argument("--max-tp", type=int, default=DEFAULT_MAX_TP,
                   help="largest tensor-parallel size auto may choose: 1, 2, 4, 8, 16 or 32 (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=DEFAULT_GPUS_PER_NODE,
                   help="GPUs one node offers a replica; a larger t spans nodes (default 8)")
    p.add_argument("--speculative-num-steps", type=int, help="EAGLE draft steps per round, as serve takes them")
    p.add_argument("--speculative-eagle-topk", type=int,
                   help="EAGLE branches per draft step, as serve takes them: a tree's graphs are priced from it")
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=ENGINES,
                   help="the engine the worker pod runs: the plan is restated in its arithmetic and pinned with "
                        f"its flags (vLLM {runtimes.vllm.VERSION}, SGLang {runtimes.sglang.VERSION}; "
                        f"default {DEFAULT_ENGINE})")
    p.add_argument("--output", default="json", choices=("json", "table"))
    p.add_argument("--termination-log", help="also write the compact plan JSON to this file")
    return p


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise InputError(f"--{name}: must be positive, got {value}")


def _kv_bytes(shape: ModelShape, kv_dtype: str) -> int:
    return 1 if kv_dtype in FP8_KV_CACHE_DTYPES else shape.dtype_bytes


def _kv_dtype_name(shape: ModelShape, kv_dtype: str) -> str:
    return shape.torch_dtype if kv_dtype == "auto" else kv_dtype


def _as_served(shape: ModelShape, dtype: str) -> ModelShape:
    """The model's shape computing in ``dtype`` (auto: the checkpoint's)."""
    return shape if dtype == "auto" else dataclasses.replace(shape, torch_dtype=dtype)


def _splits(tp: int, shape: ModelShape) -> bool:
    """Whether ``tp`` GPUs can split the model's heads (KV heads may also be replicated)."""
    kv_ok = shape.is_mla or shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0
    return shape.num_attention_heads % tp == 0 and kv_ok


def plan_args(flags: argparse.Namespace) -> PlanArgs:
    """The typed request from the sizing flags (``plan``'s, and ``serve``'s without --plan)."""
    return PlanArgs(
        target=flags.target, algorithm=flags.algorithm, draft=flags.draft,
        tp=_auto_or(flags.tp, int, "--tp: must be auto or a positive integer"),
        gpu_memory_gib=flags.gpu_memory_gib, gpu_product=flags.gpu_product,
        mem_fraction_static=_auto_or(flags.mem_fraction_static, float,
                                     "--mem-fraction-static: must be auto or a number in (0, 1)"),
        kv_cache_dtype=flags.kv_cache_dtype, dtype=getattr(flags, "dtype", None) or "auto",
        context_length=flags.context_length, min_kv_tokens=flags.min_kv_tokens,
        max_running_requests=flags.max_running_requests, cuda_graph_max_bs=flags.cuda_graph_max_bs,
        chunked_prefill_size=flags.chunked_prefill_size, max_total_tokens=flags.max_total_tokens,
        kv_cache_memory_gib=flags.kv_cache_memory_gib,
        max_tp=_given(flags, "max_tp", DEFAULT_MAX_TP),
        gpus_per_node=_given(flags, "gpus_per_node", DEFAULT_GPUS_PER_NODE),
        # both commands know the proposals per round (the operator passes the worker's to the planner)
        verify_tokens=flags.num_draft_tokens + 1 if getattr(flags, "num_draft_tokens", None) else VERIFY_TOKENS,
        engine=getattr(flags, "engine", None) or DEFAULT_ENGINE,
        **_tree_size(flags),
    )


def _tree_size(flags: argparse.Namespace) -> dict[str, int]:
    """An EAGLE tree's top-k and depth from the flags that set them (chains price as top-k 1)."""
    topk = getattr(flags, "speculative_eagle_topk", None) or 1
    steps = getattr(flags, "speculative_num_steps", None) or getattr(flags, "num_draft_tokens", None) or 1
    return dict(tree_topk=topk, tree_steps=steps) if topk > 1 else {}


def _given(flags: argparse.Namespace, name: str, default: int) -> int:
    value = getattr(flags, name, None)  # serve's flags lack the multi-node sizing ones
    return default if value is None else value


def _auto_or(value: str | None, kind: type, problem: str):
    if value is None or value == "auto":
        return None
    try:
        return kind(value)
    except ValueError:
        raise InputError(f"{problem}, got {value!r}") from None


def _checked_numbers(args: PlanArgs) -> None:
    """Refuse numeric choices that no plan can honour."""
    if args.min_kv_tokens < 0:
        raise InputError(f"--min-kv-tokens: must be >= 0, got {args.min_kv_tokens}")
    for name in ("context_length", "max_running_requests", "cuda_graph_max_bs", "chunked_prefill_size",
                 "max_total_tokens", "kv_cache_memory_gib"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.max_tp not in TP_CANDIDATES:
        raise InputError(f"--max-tp: must be one of {', '.join(map(str, TP_CANDIDATES))}, got {args.max_tp}")
    _positive("gpus-per-node", args.gpus_per_node)
    if args.mem_fraction_static is None:
        return
    if args.kv_cache_memory_gib is not None:
        raise InputError("--kv-cache-memory-gib and --mem-fraction-static both set the KV budget: give one")
    if not 0 < args.mem_fraction_static < 1:
        raise InputError(f"--mem-fraction-static: must be auto or a number in (0, 1), got {args.mem_fraction_static!r}")


def _requested_tp(args: PlanArgs, shapes: list[ModelShape], valid: list[int]) -> int | None:
    """--tp (None for auto), refused when the models' heads cannot be split that way."""
    if args.tp is None:
        if not valid:
            raise InputError(f"{shapes[0].path}: no tensor-parallel size in "
                             f"{', '.join(str(t) for t in TP_CANDIDATES if t <= args.max_tp)} splits the attention "
                             "heads of target and draft; give --tp")
        return None
    tp = args.tp
    if tp < 1:
        raise InputError(f"--tp: must be auto or a positive integer, got {tp!r}")
    for shape in shapes:
        if not _splits(tp, shape):
            raise InputError(
                f"--tp {tp}: {shape.path} has {shape.num_attention_heads} attention heads and {shape.num_kv_heads} "
                f"KV heads, which {tp} GPUs cannot split; valid sizes: {', '.join(map(str, valid)) or 'none'}"
            )
    return tp


def _draft_shape(args: PlanArgs, target_dir: Path, target: ModelShape) -> tuple[Path | None, ModelShape | None, int]:
    """The draft's folder, shape and KV layer count for the algorithm (MTP: the target's NextN layers)."""
    algorithm = args.algorithm
    if algorithm == "NGRAM":
        if args.draft:
            raise InputError("--draft: NGRAM drafts from the prompt and takes no draft model; drop --draft")
        return None, None, 0
    if algorithm != "MTP" and not args.draft:
        raise InputError(f"--draft: {algorithm} needs the draft model folder")
    draft_dir = Path(args.draft) if args.draft else target_dir
    if algorithm == "MTP":
        draft = target if draft_dir.resolve() == target_dir.resolve() else load_shape(draft_dir)
        check_mtp_draft(draft, str(draft_dir / "config.json"))  # the worker's rule
        return draft_dir, draft, draft.num_nextn_predict_layers
    draft = load_shape(draft_dir)
    if algorithm == "EAGLE3":  # the worker's rule for the target layers the head reads
        aux_layer_ids(read_config(draft_dir), target.num_hidden_layers, str(draft_dir / "config.json"))
    if algorithm == "STANDALONE":
        check_standalone_draft(draft, str(draft_dir / "config.json"))
        check_vocabulary(target_dir, draft_dir, target, draft)
    return draft_dir, draft, draft.draft_num_layers


def make_plan(args: PlanArgs) -> dict[str, Any]:
    """Read configs and headers, resolve the device, and build the plan (raises InputError)."""
    algorithm = args.algorithm
    target_dir = Path(args.target)
    checkpoint_target = load_shape(target_dir)
    draft_dir, draft, draft_layers = _draft_shape(args, target_dir, checkpoint_target)
    # the worker computes target and draft in --dtype: activations, an auto KV cache and cast weights;
    # an EAGLE head in the target's, whatever its own config says (EagleRunner)
    target = _as_served(checkpoint_target, args.dtype)
    draft_dtype = target.torch_dtype if algorithm in ("EAGLE", "EAGLE3") else args.dtype
    draft = target if draft is checkpoint_target else (None if draft is None else _as_served(draft, draft_dtype))
    same_dir = draft_dir is not None and draft_dir.resolve() == target_dir.resolve()
    _checked_numbers(args)
    # A STANDALONE draft whose heads t GPUs cannot split is replicated whole on every GPU, as the
    # worker does; any other draft shares the target's layout and must split the same way.
    replicable = algorithm == "STANDALONE"
    shapes = [target] + ([draft] if draft is not None and draft is not target and not replicable else [])
    valid = [tp for tp in TP_CANDIDATES if tp <= args.max_tp and all(_splits(tp, s) for s in shapes)]
    tp_req = _requested_tp(args, shapes, valid)

    device = resolve_device_memory(args.gpu_memory_gib, args.gpu_product)

    target_tensors = read_checkpoint(target_dir)
    draft_tensors = None
    if draft_dir is not None and not same_dir:
        draft_tensors = read_checkpoint(draft_dir)
    target_w, draft_w = split_target_draft(algorithm, target_tensors, draft_tensors, target.num_hidden_layers)
    target_w, draft_w = as_served(target_w, args.dtype), as_served(draft_w, draft_dtype)
    if algorithm == "MTP" and not draft_w:
        raise InputError(
            f"{draft_dir}: no MTP layer tensors (model.layers.{target.num_hidden_layers}.*) in the checkpoint; "
            "give the folder that holds the MTP weights with --draft"
        )

    kv_t_bytes = _kv_bytes(target, args.kv_cache_dtype)

    @functools.lru_cache(maxsize=None)
    def candidate(tp: int) -> Candidate:
        draft_cell, draft_tp = 0, tp
        if draft is not None:  # MTP's draft is the target's own geometry over its NextN layers
            draft_tp = tp if not replicable or _splits(tp, draft) else 1
            draft_cell = draft.kv_bytes_per_token(draft_tp, _kv_bytes(draft, args.kv_cache_dtype), draft_layers)
        return Candidate(
            tp=tp,
            target_weight_bytes=total_bytes(target_w, tp, target.num_kv_heads),
            draft_weight_bytes=total_bytes(draft_w, draft_tp, draft.num_kv_heads if draft else None),
            target_bytes_per_token=target.kv_bytes_per_token(tp, kv_t_bytes),
            draft_bytes_per_token=draft_cell,
        )

    context = args.context_length or target.max_position_embeddings or DEFAULT_CONTEXT_LENGTH
    req = PlanRequest(
        algorithm=algorithm,
        target_name=model_name(target_dir),
        draft_name=None if draft_dir is None else model_name(draft_dir),
        gpu_memory_bytes=device.free_bytes,
        gpu_total_bytes=device.total_bytes,
        gpu_source=device.source,
        gpu_name=device.name,
        kv_cache_dtype=_kv_dtype_name(target, args.kv_cache_dtype),
        draft_num_layers=draft_layers,
        target_num_layers=target.num_attention_layers,
        target_vocab_size=target.vocab_size,
        min_tokens=max(context, args.min_kv_tokens),
        context_length=context,
        tp=tp_req,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        kv_cache_memory_bytes=None if args.kv_cache_memory_gib is None else int(args.kv_cache_memory_gib * GIB),
        max_running_requests=args.max_running_requests,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        chunked_prefill_size=args.chunked_prefill_size,
        target_geometry=ForwardGeometry.of(target),
        draft_geometry=None if draft is None else ForwardGeometry.of(draft),
        verify_tokens=args.verify_tokens,
        tree_topk=args.tree_topk,
        tree_steps=args.tree_steps,
        gpus_per_node=args.gpus_per_node,
        compute_dtype=None if args.dtype == "auto" else args.dtype,
    )
    problem = runtimes.check_engine(args.engine, algorithm, args.tree_topk)
    if problem:
        raise InputError(problem.replace("runtime.engine", "--engine")
                         .replace("draft.topK", "--speculative-eagle-topk"))
    plan = build_plan(req, candidate, valid or [tp_req])
    tp = plan["tensorParallelSize"]
    plan = runtimes.price(args.engine, plan, target.torch_dtype,
                          _draft_copies(algorithm, target_w, tp, target.num_kv_heads))
    if args.engine != DEFAULT_ENGINE and plan["nodesPerReplica"] > 1:
        raise InputError(runtimes.check_engine(args.engine, algorithm, nodes=plan["nodesPerReplica"])
                         .replace("runtime.engine", "--engine"))
    # the models it was made for, as serve --plan checks them (a draft in the target's folder is the target)
    plan["models"] = {"target": identity(target_dir, target_tensors),
                      **({"draft": identity(draft_dir, draft_tensors)} if draft_tensors is not None else {})}
    return plan


def _draft_copies(algorithm: str, target_w: list, tp: int, kv_heads: int) -> int:
    """Per GPU, the target tensors an EAGLE or MTP draft shares, which SGLang also loads as the
    draft's own copies and frees only after sizing its pool: the embedding, and the lm_head for a
    draft that has none of its own (EAGLE3 brings one)."""
    if algorithm not in ("EAGLE", "EAGLE3", "MTP"):
        return 0
    shared = [t for t in target_w if t.is_embedding or (t.is_lm_head and algorithm != "EAGLE3")]
    return total_bytes(shared, tp, kv_heads)


def make_hub_plan(args: PlanArgs, target_revision: str | None = None, draft_revision: str | None = None,
                  client: HubClient | None = None) -> dict[str, Any]:
    """The plan of hub models: ``make_plan`` over header-only copies, plus the commits read (``sources``).

    Every draft named is a source, even one that is the target's own repo and commit (an MTP
    draft named explicitly): it is read once, and the operator downloads each (repo, commit) once.
    """
    client = client or HubClient()
    target = client.resolve(args.target, target_revision or "main")
    draft = None
    if args.draft and args.algorithm != "NGRAM":  # NGRAM with a draft: make_plan says to drop it
        draft = client.resolve(args.draft, draft_revision or "main")
    tokenizer = args.algorithm == "STANDALONE"  # only the draft-compatibility rule reads tokenizer.json
    with tempfile.TemporaryDirectory(prefix="specdecode-plan-") as tmp:
        roots = (Path(tmp) / "target", Path(tmp) / "draft")
        target_dir = client.header_folder(target, roots[0] / target.repo, tokenizer)
        draft_dir = None
        if draft is not None:
            same = (draft.repo, draft.commit) == (target.repo, target.commit)
            draft_dir = target_dir if same else client.header_folder(draft, roots[1] / draft.repo, tokenizer)
        local = dataclasses.replace(args, target=str(target_dir),
                                    draft=str(draft_dir) if draft_dir is not None else args.draft)
        try:
            plan = make_plan(local)
        except InputError as exc:  # name the hub files, not the temporary copies
            message = str(exc)
            for root in roots:
                message = message.replace(f"{root}/", "")
            raise InputError(message) from None
    plan["sources"] = {"target": target.source(), **({"draft": draft.source()} if draft else {})}
    return plan


def plan_from_flags(flags: argparse.Namespace) -> dict[str, Any]:
    """The plan ``specdecode-worker plan`` prints, from folders or from a hub."""
    args = plan_args(flags)
    if flags.model_source == "hub":
        return make_hub_plan(args, flags.target_revision, flags.draft_revision)
    for name in ("target_revision", "draft_revision"):
        if getattr(flags, name):
            raise InputError(f"--{name.replace('_', '-')}: revisions are for hub models; add --model-source hub")
    return make_plan(args)


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def render_table(plan: MemoryPlan) -> str:
    """The plan for a person: per-GPU terms in GiB, then the older accountings next to it."""
    kv, weights, reserve, gpu = plan.kv_cache, plan.weights, plan.reserve, plan.gpu_memory_bytes
    fraction = plan.mem_fraction_static
    rows = [
        f"MemoryPlan  {plan.algorithm}  target={plan.target}  draft={plan.draft or '-'}",
        f"fits: {'yes' if plan.fits else 'NO'}   tensor parallel: {plan.tensor_parallel_size}   "
        f"nodes: {plan.nodes_per_replica or 1}   "
        f"GPU: {plan.gpu.name} ({plan.gpu.source})",
        "",
        "per GPU                          bytes",
        f"  free before weights (G)    {_gib(gpu)}",
        f"  static share f = {fraction:.3f}     {_gib(int(gpu * fraction))}",
        f"  target weights             {_gib(weights.target_bytes)}",
        f"  draft weights              {_gib(weights.draft_bytes)}",
        f"  runtime reserve            {_gib(reserve.runtime_bytes)}",
        f"  KV pools (target + draft)  {_gib(kv.pool_bytes)}",
        f"  dynamic reserve            {_gib(reserve.dynamic_bytes)}",
        *([f"    of it cuBLAS workspaces  {_gib(reserve.blas_workspace_bytes)}"]
          if reserve.blas_workspace_bytes is not None else []),
        "",
        f"KV bytes/token: target {kv.target_bytes_per_token}, draft {kv.draft_bytes_per_token} "
        f"({kv.draft_num_layers} draft layers, {kv.dtype})",
        f"KV tokens: {kv.max_total_num_tokens}  (floor {kv.min_tokens}, context {kv.context_length})",
        _priced_for(reserve),
        "",
        "accounting                         KV tokens   peak / fits",
        f"  this plan (draft priced)      {kv.max_total_num_tokens:>12}   fits={plan.fits}",
        f"  legacy (target-only profile)  {plan.legacy.max_total_num_tokens:>12}   "
        f"peak {plan.legacy.peak_bytes / GIB:.2f} GiB of {gpu / GIB:.2f} GiB, fits={plan.legacy.fits}",
        f"  layer ratio (scaled cell)     {plan.layer_ratio.max_total_num_tokens:>12}   "
        f"{plan.layer_ratio.bytes_per_token} B/token",
        "",
        f"shortfall: {plan.shortfall_bytes / GIB:.2f} GiB   "
        f"min mem_fraction_static: {plan.min_mem_fraction_static:.3f}   "
        f"min tensor parallel: {plan.min_tensor_parallel_size or 'none'}",
        plan.message,
    ]
    return "\n".join(rows) + "\n"


def _priced_for(reserve: PlanReserve) -> str:
    """The serving shape the dynamic reserve assumes (``serve --plan`` refuses a wider one)."""
    tree = reserve.tree_topk or 1
    shape = "a chain" if tree == 1 else f"a tree of top-k {tree}, {reserve.tree_steps} steps deep"
    return (f"reserve priced for: {reserve.verify_tokens} verify tokens per request ({shape}), "
            f"{reserve.max_running_requests} running requests, CUDA graphs up to batch {reserve.cuda_graph_max_bs}, "
            f"prefill chunks of {reserve.chunked_prefill_size} tokens, "
            f"{reserve.dtype_bytes}-byte activations ({reserve.dtype or 'the checkpoint dtype'})")


def main(argv: list[str] | None = None) -> int:
    return termination.run("plan", parser, argv, _plan)


def _plan(args) -> termination.Outcome:
    plan = MemoryPlan.from_dict(plan_from_flags(args))  # what a worker and the operator will read
    compact = to_json(plan.document)

    def show() -> None:
        print(render_table(plan) if args.output == "table" else compact, end="" if args.output == "table" else "\n")

    return compact, ExitCode.OK if plan.fits else ExitCode.DOES_NOT_FIT, show
