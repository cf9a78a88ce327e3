"""``specdecode-worker serve``: three-phase start-up against a memory plan, then the HTTP API.

The plan comes from ``--plan PLAN.json`` (what the operator pins) or is made in-process from the
planner's sizing flags, with the same code the planner pod runs. Phase 2 measures the real KV
capacity with every weight resident and logs it next to the plan; below the plan's floor the
worker exits before serving.

Exit codes: 0 stopped cleanly; 2 bad input; 3 the measured KV capacity is below the plan's floor;
1 internal error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract import GIB, KV_CACHE_DTYPES, SERVED_ALGORITHMS, ExitCode, MemoryPlan
from ..errors import InputError
from ..flags import CommandParser, add_sizing_flags, asks_for_help
from ..planner.hub import model_name
from ..planner.model_identity import check_models
from .cpu_threads import follow_load, use_cpus
from .serve_shape import DEFAULT_NUM_DRAFT_TOKENS, check_against_plan, fill_from_plan, planned_dtype, serve_shape
from .tokenizer import eos_ids, load_tokenizer

log = logging.getLogger("specdecode_worker.serve")


def parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specdecode-worker serve",
                      description="Serve an OpenAI-compatible API with speculative decoding.")
    p.add_argument("--target", required=True, help="target model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--draft", help="draft model folder (STANDALONE) or head checkpoint (EAGLE, EAGLE3)")
    p.add_argument("--algorithm", default="NONE", help=", ".join(SERVED_ALGORITHMS))
    p.add_argument("--plan", help="MemoryPlan JSON to serve against (default: plan in-process from the flags below); "
                   "sizing flags given with it must agree with it, and the speculative shape and serving limits "
                   "may not exceed the ones it priced")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--device-memory-gib", type=float, help="memory budget standing in for the GPU on cpu")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model id in the API (default: the target folder's name; "
                   "for a hub cache folder OWNER/NAME/COMMIT, NAME)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--num-draft-tokens", type=int,
                   help=f"proposals per verify round (default: the --plan's, else {DEFAULT_NUM_DRAFT_TOKENS}); "
                   "with --plan at most the plan's")
    p.add_argument("--speculative-num-steps", type=int,
                   help="EAGLE draft steps per round (default: the --plan's tree depth, else --num-draft-tokens, "
                   "a chain)")
    p.add_argument("--speculative-eagle-topk", type=int,
                   help="EAGLE branches per draft step: 1 drafts a chain, more a tree of --num-draft-tokens nodes "
                   "(default: the --plan's, else 1)")
    p.add_argument("--spec-policy", choices=("adaptive", "fixed"), default="adaptive",
                   help="adaptive: each round drafts the length (down to none) expected to give the most tokens/s, "
                        "and only while drafting measures faster than plain rounds; fixed: always --num-draft-tokens")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix NGRAM matches")
    p.add_argument("--ngram-min", type=int, default=1,
                   help="shortest suffix NGRAM drafts from (a shorter match proposes nothing)")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="recompute every prompt from its first token (default: prompts that start as an earlier "
                        "one did reuse its KV, for the target and the draft alike)")
    p.add_argument("--draft-quantization", choices=("none", "int8"), default="none",
                   help="int8: dynamically quantised draft linears (cpu only; a cheap draft of a copy of the target)")
    p.add_argument("--log-level", default="info")
    nodes = p.add_argument_group(
        "one replica over several pods (defaults from a LeaderWorkerSet group's environment)")
    nodes.add_argument("--nnodes", help="pods in the replica; each runs tp / nnodes ranks (default: "
                       "$LWS_GROUP_SIZE, else 1)")
    nodes.add_argument("--node-rank", help="this pod's place in the replica, 0 = the leader that serves HTTP "
                       "(default: $LWS_WORKER_INDEX, else 0)")
    nodes.add_argument("--master-addr", help="the leader pod's address (default: $LWS_LEADER_ADDRESS, else 127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=29500,
                       help="rendezvous port on the leader pod; pod supervision uses the next port")
    add_sizing_flags(p.add_argument_group("planner sizing flags (as in 'specdecode-worker plan')"), serving=True)
    return p


def load_plan_file(path: str) -> MemoryPlan:

    try:
        obj = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InputError(f"--plan {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"--plan {path}: not valid JSON ({exc})") from None
    try:
        return MemoryPlan.from_dict(obj)
    except ValueError as exc:
        raise InputError(f"--plan {path}: {exc}") from None


def resolve(args: argparse.Namespace) -> tuple[Any, MemoryPlan]:
    """EngineArgs and the plan they follow."""
    from ..engine.engine import EngineArgs

    if args.algorithm not in SERVED_ALGORITHMS:
        raise InputError(f"--algorithm {args.algorithm}: this worker serves {', '.join(SERVED_ALGORITHMS)}")
    plan = load_plan_file(args.plan) if args.plan else None
    fill_from_plan(args, plan)
    for name in ("num_draft_tokens", "ngram_max", "ngram_min", "port", "speculative_eagle_topk"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.ngram_min > args.ngram_max:
        raise InputError(f"--ngram-min {args.ngram_min}: must be at most --ngram-max {args.ngram_max}")
    device = node_device(args.device) or args.device or _default_device()
    if device == "cpu" and args.device_memory_gib is None and args.plan is None:
        raise InputError("--device-memory-gib: on cpu give the memory budget that stands in for the GPU")
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        raise InputError(f"--device-memory-gib: must be positive, got {args.device_memory_gib}")

    args.dtype = planned_dtype(args, plan, device)
    if plan is not None:
        if plan.algorithm != ("NGRAM" if args.algorithm == "NONE" else args.algorithm):
            raise InputError(f"--plan {args.plan}: planned for {plan.algorithm}, serving {args.algorithm}")
        check_models(args.target, args.draft, plan.models, args.plan)
        kv_cache_dtype = plan_kv_cache_dtype(plan, args.kv_cache_dtype, args.plan)
        check_flags_against_plan(args, plan, args.plan)
        for narrower in check_against_plan(args, plan, args.plan, device):
            log.info("serving below the plan %s, which fits: %s", args.plan, narrower)
    else:
        from ..planner.plan_cli import make_plan, plan_args

        kv_cache_dtype = args.kv_cache_dtype or "auto"
        ns = argparse.Namespace(**vars(args))
        ns.kv_cache_dtype = kv_cache_dtype
        ns.algorithm = "NGRAM" if args.algorithm == "NONE" else args.algorithm
        ns.tp = args.tp or "1"
        ns.dtype = args.dtype if device == "cuda" else "auto"  # CPU: a budget, priced as before
        ns.gpus_per_node = _gpus_per_pod(args, ns.tp)
        if device == "cpu":
            ns.gpu_memory_gib = args.device_memory_gib
        plan = MemoryPlan.from_dict(make_plan(plan_args(ns)))
    tp = plan.tensor_parallel_size
    if args.tp not in (None, "auto", str(tp)):
        raise InputError(f"--tp {args.tp}: the plan is for {tp} GPU(s); give --tp {tp} or auto")
    if not plan.fits:
        raise InputError(f"the memory plan does not fit: {plan.message}")

    kv, reserve = plan.kv_cache, plan.reserve
    shape = serve_shape(args, plan)
    budget = plan.gpu_memory_bytes
    cpu_budget_gib = args.device_memory_gib or node_device_memory_gib()
    if device == "cpu" and cpu_budget_gib is not None:
        budget = int(cpu_budget_gib * GIB)
    engine_args = EngineArgs(
        target=args.target, draft=args.draft, algorithm=args.algorithm, device=device,
        dtype=None if args.dtype == "auto" else args.dtype,
        device_memory_bytes=budget if device == "cpu" else None,
        mem_fraction_static=plan.mem_fraction_static, runtime_bytes=reserve.runtime_bytes,
        context_len=kv.context_length, min_kv_tokens=kv.min_tokens, max_total_tokens=args.max_total_tokens,
        max_running_requests=shape.max_running_requests, cuda_graph_max_bs=shape.cuda_graph_max_bs,
        num_draft_tokens=shape.num_draft_tokens, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        speculative_num_steps=shape.speculative_num_steps, speculative_eagle_topk=shape.speculative_eagle_topk,
        planned_tokens=kv.max_total_num_tokens,
        draft_quantization=None if args.draft_quantization == "none" else args.draft_quantization,
        kv_cache_dtype=kv_cache_dtype, spec_policy=args.spec_policy,
        chunked_prefill_size=shape.chunked_prefill_size,
        planned_dynamic_bytes=reserve.dynamic_bytes, prefix_cache=not args.disable_prefix_cache,
    )
    return engine_args, plan


def check_flags_against_plan(args: argparse.Namespace, plan: MemoryPlan, path: str) -> None:
    """A sizing flag given with --plan must say what the plan says: the plan's numbers are served.
    (The serving limits the reserve is priced from may also be lower: serve_shape.py.)"""
    pinned = {"mem_fraction_static": plan.mem_fraction_static, "context_length": plan.kv_cache.context_length}
    for name, planned in pinned.items():
        given = getattr(args, name)
        if given in (None, "auto") or planned is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            agrees = math.isclose(float(given), float(planned), rel_tol=1e-9)
        except ValueError:
            raise InputError(f"{flag}: must be a number, got {given!r}") from None
        if not agrees:
            raise InputError(f"{flag} {given}: the plan {path} has {planned}; give {flag} {planned}, drop the flag, "
                             f"or re-plan with {flag} {given}")


def _gpus_per_pod(args: argparse.Namespace, tp: str) -> int | None:
    """In-process plans over --nnodes pods hold tp / nnodes GPUs per pod (None: the planner's default)."""
    import os

    raw = args.nnodes if args.nnodes is not None else os.environ.get("LWS_GROUP_SIZE")
    try:
        nnodes, t = int(raw or 1), int(tp)
    except ValueError:
        return None  # auto t, or a bad --nnodes that nodes_of reports
    return t // nnodes if nnodes > 1 and t % nnodes == 0 else None


def plan_kv_cache_dtype(plan: MemoryPlan, flag: str | None, path: str) -> str:
    """The KV dtype a pinned plan was sized with; a --kv-cache-dtype that contradicts it is refused.

    The plan names fp8 as the flag does and auto by the model's dtype (for example bfloat16).
    """
    planned = plan.kv_cache.dtype
    if planned is None:  # a plan written without it: the flag decides
        return flag or "auto"
    planned_flag = planned if planned in KV_CACHE_DTYPES else "auto"
    if flag is not None and flag != planned_flag:
        raise InputError(f"--kv-cache-dtype {flag}: the plan {path} was sized for a {planned} KV cache; "
                         f"give --kv-cache-dtype {planned_flag} or re-plan with {flag}")
    return planned_flag


NODE_DEVICE_ENV = "SPECDECODE_DEVICE"
NODE_MEMORY_ENV = "SPECDECODE_DEVICE_MEMORY_GIB"


def node_device(requested: str | None) -> str | None:
    """The device the node declares for its containers (``SPECDECODE_DEVICE``, set by a node's
    container runtime, as the test bed's real node does for pods that request GPUs but run on its
    CPU). It wins over ``--device``, and says so."""
    declared = os.environ.get(NODE_DEVICE_ENV)
    if not declared:
        return None
    if declared not in ("cpu", "cuda"):
        raise InputError(f"{NODE_DEVICE_ENV}={declared}: the node's device must be cpu or cuda")
    if requested and requested != declared:
        log.warning("serving on %s, not --device %s: this node declares %s=%s", declared, requested,
                    NODE_DEVICE_ENV, declared)
    return declared


def node_device_memory_gib() -> float | None:
    """The memory the node gives a CPU worker in place of a GPU's (``SPECDECODE_DEVICE_MEMORY_GIB``,
    beside ``SPECDECODE_DEVICE``); ``--device-memory-gib`` wins over it, and without either a
    worker on the CPU takes its plan's GPU memory."""
    declared = os.environ.get(NODE_MEMORY_ENV)
    if not declared:
        return None
    try:
        gib = float(declared)
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise InputError(f"{NODE_MEMORY_ENV}={declared}: the node's device memory must be a positive number of GiB")
    return gib


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class HttpOptions:
    host: str
    port: int
    model_name: str  # the model id in the API
    log_level: str


def http_options(args: argparse.Namespace) -> HttpOptions:
    return HttpOptions(args.host, args.port, args.served_model_name or model_name(args.target), args.log_level.lower())


def build(argv: list[str]):
    """Parse, plan, and return (uvicorn server, ServerState, outcome) without running anything."""
    args = parser().parse_args(argv)
    engine_args, plan = resolve(args)
    return build_server(engine_args, plan, http_options(args))


def build_server(engine_args, plan: MemoryPlan, http: HttpOptions):
    """The uvicorn server, its ServerState and the outcome the engine start-up will set."""
    import uvicorn

    from ..engine.engine import Engine, LoopHooks, StartupError
    from ..engine.parallel.group import get_tp
    from .engine_process import EngineProcess, in_own_process
    from .server import ServerState, build_app, start_engine_in_background

    tokenizer = load_tokenizer(engine_args.target)
    eos = eos_ids(engine_args.target, tokenizer)
    outcome = {"exit": ExitCode.OK}
    server = None

    def on_failure(exc: Exception) -> None:
        outcome["exit"] = (ExitCode.DOES_NOT_FIT if isinstance(exc, StartupError)
                           else ExitCode.BAD_INPUT if isinstance(exc, InputError) else ExitCode.INTERNAL_ERROR)
        server.should_exit = True

    def on_crash(why: str) -> None:  # the engine process died serving: answer 503, exit non-zero
        state.init_error = why
        on_failure(RuntimeError(why))

    if in_own_process() and get_tp().size == 1:
        engine = EngineProcess(engine_args, eos, on_crash=on_crash)
    else:  # a tensor-parallel leader drives its followers from the process that serves
        engine = Engine(engine_args, eos_token_ids=eos, hooks=LoopHooks(before_step=follow_load(engine_args.device)))
    state = ServerState(engine, http.model_name, plan, tokenizer)

    def start_engine() -> None:  # the HTTP port is up first, so /health can report the phases
        log.info("planned max_total_num_tokens %s (floor %s), KV cache dtype %s (--kv-cache-dtype %s)",
                 plan.kv_cache.max_total_num_tokens, plan.kv_cache.min_tokens, plan.kv_cache.dtype,
                 engine_args.kv_cache_dtype)
        start_engine_in_background(state, on_failure)

    app = build_app(state, on_startup=start_engine, on_shutdown=engine.stop)
    server = uvicorn.Server(uvicorn.Config(app, host=http.host, port=http.port, log_level=http.log_level))
    return server, state, outcome


def serve(engine_args, plan: MemoryPlan, http: HttpOptions) -> int:
    """Serve HTTP until stopped; the exit code of the module docstring."""
    try:
        server, state, outcome = build_server(engine_args, plan, http)
    except InputError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return ExitCode.BAD_INPUT
    server.run()
    if state.init_error:
        print(state.init_error, file=sys.stderr)
    return outcome["exit"]


def nodes_of(args: argparse.Namespace, tp: int, planned_nodes: int | None):
    """Where this pod sits in its replica, from the flags or the LeaderWorkerSet environment."""
    import os

    from ..engine.parallel.distributed import Nodes

    def number(flag: str, value: str | None, env: str, default: int) -> int:
        raw = value if value is not None else os.environ.get(env)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            source = flag if value is not None else f"${env}"
            raise InputError(f"{source}: expected a whole number, got {raw!r}") from None

    nnodes = number("--nnodes", args.nnodes, "LWS_GROUP_SIZE", 1)
    node_rank = number("--node-rank", args.node_rank, "LWS_WORKER_INDEX", 0)
    addr = args.master_addr or os.environ.get("LWS_LEADER_ADDRESS") or "127.0.0.1"
    if nnodes < 1:
        raise InputError(f"--nnodes {nnodes}: must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank {node_rank}: must be in 0..{nnodes - 1} for --nnodes {nnodes}")
    if tp % nnodes:
        raise InputError(f"--nnodes {nnodes}: the plan's {tp} GPU(s) do not split evenly over {nnodes} pods")
    if planned_nodes is not None and planned_nodes != nnodes:
        raise InputError(f"--nnodes {nnodes}: the plan spreads its {tp} GPU(s) over {planned_nodes} pod(s)")
    if not 0 < args.master_port < 65535:
        raise InputError(f"--master-port {args.master_port}: must be in 1..65534 (the next port supervises)")
    return Nodes(nnodes, node_rank, addr, args.master_port)


def _serve_rank(engine_args, plan: MemoryPlan, http: HttpOptions) -> int:
    """One rank process of a tensor-parallel worker: rank 0 serves HTTP, the others follow it."""
    from ..engine.parallel.distributed import get_tp
    from ..engine.parallel.tp_engine import follow_rank

    tp = get_tp()
    use_cpus(engine_args.device, tp.size)
    if tp.is_leader:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve(engine_args, plan, http)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {tp.rank} %(name)s: %(message)s")
    follow_rank(engine_args)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):
        parser().print_help()
        return ExitCode.OK
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = parser().parse_args(argv)
        engine_args, plan = resolve(args)
    except InputError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return ExitCode.BAD_INPUT
    http = http_options(args)
    tp = plan.tensor_parallel_size
    try:
        nodes = nodes_of(args, tp, plan.nodes_per_replica)
    except InputError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return ExitCode.BAD_INPUT
    if tp > 1:  # one process per rank, started with the arguments and plan resolved here
        from ..engine.parallel.tp_engine import run_tensor_parallel

        return run_tensor_parallel(tp, _serve_rank, (engine_args, plan, http), engine_args.device, nodes)
    use_cpus(engine_args.device)
    return serve(engine_args, plan, http)
