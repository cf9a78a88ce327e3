"""The CPUs a worker may use: affinity capped by the cgroup quota (v2 and v1 layouts)."""

from __future__ import annotations

from specdecode_worker.cpus import quota_cpus, threads_per_rank, usable_cpus


def _v2(tmp_path, text: str):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _v1(tmp_path, quota: int, period: int = 100000):
    (tmp_path / "cpu").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_a_pod_limit_caps_the_cores_the_node_shows(tmp_path):
    node = set(range(64))
    assert usable_cpus(node, _v2(tmp_path, "200000 100000\n")) == 2
    assert quota_cpus(tmp_path) == 2.0


def test_a_fractional_quota_rounds_up_and_never_below_one(tmp_path):
    assert usable_cpus(set(range(8)), _v2(tmp_path, "150000 100000")) == 2
    (tmp_path / "cpu.max").write_text("10000 100000")
    assert usable_cpus(set(range(8)), tmp_path) == 1


def test_no_quota_leaves_the_affinity(tmp_path):
    assert usable_cpus({0, 3, 5}, _v2(tmp_path, "max 100000")) == 3
    assert usable_cpus({0, 1}, tmp_path / "missing") == 2  # no cgroup file: nothing caps it


def test_cgroup_v1_quota_and_its_unlimited_marker(tmp_path):
    assert usable_cpus(set(range(16)), _v1(tmp_path / "a", 400000)) == 4
    assert usable_cpus(set(range(16)), _v1(tmp_path / "b", -1)) == 16


def test_an_affinity_narrower_than_the_quota_wins(tmp_path):
    assert usable_cpus({2, 3}, _v2(tmp_path, "800000 100000")) == 2


def test_ranks_share_the_cpus(tmp_path):
    root = _v2(tmp_path, "400000 100000")
    assert threads_per_rank(2, set(range(32)), root) == 2
    assert threads_per_rank(8, set(range(32)), root) == 1


def test_the_cpu_worker_takes_its_threads_from_its_cpus_unless_told(monkeypatch):
    torch = __import__("pytest").importorskip("torch")
    from specdecode_worker import cpus
    from specdecode_worker.serving.serve_cli import use_cpus

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "usable_cpus", lambda affinity=None, root=None: 3)
    try:
        assert use_cpus("cpu") == 3 and torch.get_num_threads() == 3
        assert use_cpus("cpu", ranks=2) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(before)
        assert use_cpus("cuda") is None and torch.get_num_threads() == before
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        assert use_cpus("cpu") is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
