"""One tensor-parallel group over two "pods" on CPU (gloo over loopback): each pod is its own
process supervising its local ranks, as a LeaderWorkerSet group's pods do. Greedy output equals
the single-rank engine's, and a rank failing in the second pod stops both pods."""

from __future__ import annotations

import multiprocessing
import shutil
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.parallel.distributed import Nodes, RankFailure, launch  # noqa: E402
from specdecode_worker.engine.request import Request  # noqa: E402

from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402
from tests.tp_helpers import CONTEXT, GREEDY, PROMPTS, WALL_S, engine_kwargs, tp_rank  # noqa: E402

pytestmark = pytest.mark.slow


def _two_free_ports() -> int:
    """A port P with P + 1 free too (rendezvous and pod supervision)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def _pod(size: int, nodes: Nodes, rank_args: tuple, results) -> None:
    """One pod: supervises its local ranks and reports what its launch returned or raised."""
    try:
        results.put((nodes.node_rank, "ok", launch(size, tp_rank, rank_args, nodes=nodes, wall_timeout_s=WALL_S)))
    except RankFailure as exc:
        results.put((nodes.node_rank, "failed", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - the test shows it
        results.put((nodes.node_rank, "error", f"{type(exc).__name__}: {exc}"))


def _run_pods(size: int, rank_args: tuple, nnodes: int = 2) -> dict[int, tuple[str, object]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _two_free_ports()
    names = ["sdd-0"] + [f"sdd-0-{r}" for r in range(1, nnodes)]  # as LWS names a group's pods
    pods = [ctx.Process(target=_pod, args=(size, Nodes(nnodes, r, "127.0.0.1", port, pod=names[r]), rank_args, results))
            for r in range(nnodes)]
    for p in pods:
        p.start()
    out = {}
    for _ in pods:
        node_rank, status, value = results.get(timeout=WALL_S + 60)
        out[node_rank] = (status, value)
    for p in pods:
        p.join(timeout=30)
        assert p.exitcode == 0, "a pod's supervisor did not exit cleanly"
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("multinode"))


def test_four_ranks_over_two_pods_give_the_single_rank_greedy_output(models):
    kws = {a: engine_kwargs(models, 4, a) for a in ("NONE", "STANDALONE")}
    pods = _run_pods(4, (kws,))
    assert [pods[r][0] for r in (0, 1)] == ["ok", "ok"], pods
    leader, worker = pods[0][1], pods[1][1]
    assert len(leader) == 2 and len(worker) == 2 and all(r is not None for r in leader + worker)
    for algorithm in ("NONE", "STANDALONE"):
        draft = models["draft"] if algorithm == "STANDALONE" else None
        sched = engine(models["target"], algorithm, draft, context_len=CONTEXT, num_draft_tokens=3)
        single = [r.output_ids for r in run_all(sched, [Request(list(p), GREEDY) for p in PROMPTS])]
        assert leader[0][algorithm]["outputs"] == single, algorithm
    # Phase 2 agreed on one KV capacity in all four ranks across both pods.
    tokens = {r["NONE"]["allocated_tokens"] for r in leader + worker}
    assert len(tokens) == 1
    assert leader[0]["STANDALONE"]["proposed"] > 0


def test_a_rank_failing_in_the_second_pod_stops_both(models, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(models["target"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    pods = _run_pods(2, ({"NONE": engine_kwargs(models, 2, "NONE")}, {1: str(bad)}))
    for node_rank in (0, 1):
        status, message = pods[node_rank]
        assert status == "failed", pods
        # Both pods name the failing pod and rank, and the failing rank's own error.
        assert "rank 1 of 2 (pod sdd-0-1, node rank 1) failed" in message, message
        assert "deserializing header" in message, message
    assert multiprocessing.active_children() == []


def test_serve_over_two_pods_from_the_leaderworkerset_environment(models, tmp_path):
    """``serve --tp 2`` in two "pods" whose place comes from LWS_* variables: the leader answers
    like transformers; killing the worker pod stops the leader with the pod named."""
    import os
    import signal
    import subprocess

    pytest.importorskip("httpx")

    from specdecode_worker.engine.parallel.distributed import free_port
    from tests.server_helpers import wait_until_healthy
    from tests.tp_helpers import BUDGET_GIB, assert_serves_greedy_text, serve_tp2_argv

    http, master = free_port(), _two_free_ports()
    # The plan over two pods prices NCCL's network buffers (512 MiB) on top of one pod's budget.
    argv = serve_tp2_argv(models, http, BUDGET_GIB[2] + 0.5, "--master-port", str(master))
    logs = [tmp_path / f"pod-{r}.log" for r in (0, 1)]
    pods = []
    for r in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(r),
               "LWS_LEADER_ADDRESS": "127.0.0.1", "POD_NAME": f"sdd-0-{r}" if r else "sdd-0"}
        pods.append(subprocess.Popen(argv, stdout=logs[r].open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True))
    leader, worker = pods
    base = f"http://127.0.0.1:{http}"
    try:
        wait_until_healthy(base, leader, WALL_S, logs)
        assert_serves_greedy_text(base, models["target"], ["hello world what is the"], 12)

        os.killpg(worker.pid, signal.SIGKILL)  # the worker pod's node goes away
        assert leader.wait(timeout=60) == 1
        assert "pod sdd-0-1 (node rank 1) lost contact with sdd-0 (node rank 0)" in logs[0].read_text()
    finally:
        for p in pods:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def test_pod_place_from_flags_or_the_leaderworkerset_environment(monkeypatch):
    from specdecode_worker.errors import InputError
    from specdecode_worker.serving.serve_cli import nodes_of, parser

    base = ["--target", "t"]
    plan = (16, 2)  # the plan's tensorParallelSize and nodesPerReplica
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "sdd-0.sdd.ns")
    nodes = nodes_of(parser().parse_args(base), *plan)
    assert (nodes.nnodes, nodes.node_rank, nodes.master_addr, nodes.master_port) == (2, 1, "sdd-0.sdd.ns", 29500)
    assert nodes.local_ranks(16) == list(range(8, 16))
    flags = nodes_of(parser().parse_args([*base, "--node-rank", "0", "--master-addr", "10.0.0.5"]), *plan)
    assert (flags.node_rank, flags.master_addr) == (0, "10.0.0.5")
    with pytest.raises(InputError, match="plan spreads its 16 GPU.s. over 2 pod"):
        nodes_of(parser().parse_args([*base, "--nnodes", "4"]), *plan)
    with pytest.raises(InputError, match="do not split evenly over 3 pods"):
        nodes_of(parser().parse_args([*base, "--nnodes", "3"]), 8, None)
    with pytest.raises(InputError, match=r"--node-rank 2: must be in 0..1"):
        nodes_of(parser().parse_args([*base, "--node-rank", "2"]), *plan)
    monkeypatch.setenv("LWS_WORKER_INDEX", "x")
    with pytest.raises(InputError, match=r"\$LWS_WORKER_INDEX: expected a whole number"):
        nodes_of(parser().parse_args(base), *plan)
    monkeypatch.delenv("LWS_GROUP_SIZE")
    monkeypatch.delenv("LWS_WORKER_INDEX")
    monkeypatch.delenv("LWS_LEADER_ADDRESS")
    alone = nodes_of(parser().parse_args(base), 4, None)
    assert (alone.nnodes, alone.node_rank, alone.master_addr) == (1, 0, "127.0.0.1")
