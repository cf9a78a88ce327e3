"""``serve --plan``: the serving shape checked against the shape the plan's reserve was priced for.

The dynamic reserve (``plan.dynamic_reserve_bytes``) grows with the verify width, an EAGLE tree's
top-k and depth, the CUDA graph batch, the prefill chunk and the running requests. ``serve`` takes
each as a flag, so a worker started by hand or by another operator version could run a wider pass
than was priced and run out of memory after the plan said it fits. Before any weight loads, a flag
wider than the plan is refused (exit 2, naming the flag, the planned value and what to do); a
narrower one fits and is served. Flags left out take the plan's values.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from ..contract import EAGLE_ALGORITHMS, MemoryPlan, PlanReserve
from ..errors import InputError

log = logging.getLogger("specdecode_worker.serve")

# Proposals per verify round when neither the flag nor the plan says.
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class ServeShape:
    """What the engine runs: the flags, or the plan's values where a flag is left out."""

    num_draft_tokens: int
    speculative_num_steps: int | None  # None: --num-draft-tokens (a chain)
    speculative_eagle_topk: int
    max_running_requests: int
    cuda_graph_max_bs: int
    chunked_prefill_size: int


def fill_from_plan(args: argparse.Namespace, plan: MemoryPlan | None) -> None:
    """Speculative flags left out take the plan's priced shape (else the worker's defaults)."""
    width, topk, steps = (plan.reserve.verify_tokens, plan.reserve.tree_topk, plan.reserve.tree_steps) if plan \
        else (None, None, None)
    if args.num_draft_tokens is None:
        args.num_draft_tokens = width - 1 if width else DEFAULT_NUM_DRAFT_TOKENS
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = topk or 1
    if args.speculative_num_steps is None and args.speculative_eagle_topk > 1 and (topk or 1) > 1:
        args.speculative_num_steps = steps


def serve_shape(args: argparse.Namespace, plan: MemoryPlan) -> ServeShape:
    """The shape to serve: the reserve's limits unless a flag lowers them (checked first)."""
    def limit(name: str, default: int) -> int:
        given = getattr(args, name)
        return int(given) if given is not None else (getattr(plan.reserve, name) or default)

    return ServeShape(
        num_draft_tokens=args.num_draft_tokens, speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=args.speculative_eagle_topk,
        max_running_requests=limit("max_running_requests", 1),
        cuda_graph_max_bs=limit("cuda_graph_max_bs", 0),
        chunked_prefill_size=limit("chunked_prefill_size", 0),
    )


# Serving limits the reserve is priced from: (flag's attribute, the same name in PlanReserve, what it sizes).
LIMITS = (
    ("max_running_requests", "running requests"),
    ("cuda_graph_max_bs", "CUDA graph batches"),
    ("chunked_prefill_size", "prefill chunks"),
)


# Bytes per element of serve's --dtype choices (auto: the checkpoint's, as the plan priced it).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def planned_dtype(args: argparse.Namespace, plan: MemoryPlan | None, device: str) -> str:
    """``--dtype``, or on a GPU the dtype a plan was priced for when ``--dtype`` is auto (auto would
    serve the checkpoint's, which may be wider). CPU keeps auto: it computes in float32 regardless."""
    given = getattr(args, "dtype", None) or "auto"
    planned = plan.reserve.dtype if plan else None
    return planned if given == "auto" and planned and device == "cuda" else given


def check_against_plan(args: argparse.Namespace, plan: MemoryPlan, path: str, device: str = "cuda") -> list[str]:
    """Refuse (InputError) a serving shape wider than the one the plan priced; return what was
    checked narrower (logged at info), or warn once when the plan records no shape to check.
    On CPU the engine computes in float32 whatever the plan priced (a budget, not a GPU)."""
    reserve = plan.reserve
    narrower: list[str] = []
    planned_bytes = reserve.dtype_bytes
    given_bytes = DTYPE_BYTES.get(getattr(args, "dtype", None) or "auto")
    if device == "cuda" and planned_bytes and given_bytes and given_bytes > planned_bytes:
        planned_as = reserve.dtype or "auto"
        raise InputError(f"--dtype {args.dtype}: the plan {path} priced weights and activations at {planned_bytes} "
                         f"bytes per element (--dtype {planned_as}), {args.dtype} takes {given_bytes}; give "
                         f"--dtype {planned_as}, or re-plan with --dtype {args.dtype}")
    for name, what in LIMITS:
        given, planned = getattr(args, name), getattr(reserve, name)
        if given is None or planned is None:
            continue
        narrower += _compare(f"--{name.replace('_', '-')}", int(given), planned, path,
                             f"{what} of up to {planned}")
    if args.algorithm == "NONE":  # the target alone verifies nothing
        return narrower
    width = reserve.verify_tokens
    if width is None:
        log.warning("the plan %s does not record the speculative shape its reserve was priced for (a plan from "
                    "an older planner): --num-draft-tokens %s, --speculative-eagle-topk %s and "
                    "--speculative-num-steps %s could not be checked against it; re-plan to have them checked",
                    path, args.num_draft_tokens, args.speculative_eagle_topk, args.speculative_num_steps)
        return narrower
    narrower += _compare("--num-draft-tokens", args.num_draft_tokens, width - 1, path,
                         f"verify passes of {width} tokens per request ({width - 1} proposals)")
    if args.algorithm in EAGLE_ALGORITHMS:
        narrower += _check_tree(args, reserve, path)
    return narrower


def _check_tree(args: argparse.Namespace, reserve: PlanReserve, path: str) -> list[str]:
    topk, planned_topk = args.speculative_eagle_topk, reserve.tree_topk or 1
    if topk > 1 and planned_topk == 1:
        raise InputError(
            f"--speculative-eagle-topk {topk}: the plan {path} priced a chain (--speculative-eagle-topk 1), whose "
            f"graphs are smaller than a tree's; re-plan with --speculative-eagle-topk {topk} and the same "
            "--speculative-num-steps and --num-draft-tokens, or serve a chain with --speculative-eagle-topk 1")
    if topk == 1:  # a chain of the plan's width fits a tree's plan (plan.dynamic_reserve_bytes)
        return [f"--speculative-eagle-topk 1: a chain under the plan's tree of top-k {planned_topk}"] \
            if planned_topk > 1 else []
    steps = args.speculative_num_steps or args.num_draft_tokens
    planned_steps = reserve.tree_steps or 1
    return (_compare("--speculative-eagle-topk", topk, planned_topk, path, f"a tree of top-k {planned_topk}")
            + _compare("--speculative-num-steps", steps, planned_steps, path, f"a tree {planned_steps} steps deep"))


def _compare(flag: str, given: int, planned: int, path: str, priced: str) -> list[str]:
    if given > planned:
        raise InputError(f"{flag} {given}: the plan {path} priced its dynamic reserve for {priced} "
                         f"({flag} {planned}); re-plan with {flag} {given}, or give {flag} {planned} or less")
    return [f"{flag} {given} (planned {planned})"] if given < planned else []
