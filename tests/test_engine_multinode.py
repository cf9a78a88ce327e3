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

from specdecode_worker.engine.distributed import Nodes, RankFailure, launch  # noqa: E402
from specdecode_worker.engine.request import Request  # noqa: E402

from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402
from tests.test_engine_tp import CONTEXT, GREEDY, PROMPTS, WALL_S, _engine_kw, _tp_rank  # noqa: E402

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
        results.put((nodes.node_rank, "ok", launch(size, _tp_rank, rank_args, nodes=nodes, wall_timeout_s=WALL_S)))
    except RankFailure as exc:
        results.put((nodes.node_rank, "failed", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - the test shows it
        results.put((nodes.node_rank, "error", f"{type(exc).__name__}: {exc}"))


def _run_pods(size: int, rank_args: tuple, nnodes: int = 2) -> dict[int, tuple[str, object]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _two_free_ports()
    pods = [ctx.Process(target=_pod, args=(size, Nodes(nnodes, r, "127.0.0.1", port, pod=f"sdd-0-{r}" if r else "sdd-0"),
                                           rank_args, results))
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
    kws = {a: _engine_kw(models, 4, a) for a in ("NONE", "STANDALONE")}
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
    pods = _run_pods(2, ({"NONE": _engine_kw(models, 2, "NONE")}, {1: str(bad)}))
    for node_rank in (0, 1):
        status, message = pods[node_rank]
        assert status == "failed", pods
        # Both pods name the failing pod and rank, and the failing rank's own error.
        assert "rank 1 of 2 (pod sdd-0-1, node rank 1) failed" in message, message
        assert "deserializing header" in message, message
    assert multiprocessing.active_children() == []
