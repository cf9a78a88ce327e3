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
    assert threads_per_rank(2, usable_cpus(set(range(32)), root)) == 2
    assert threads_per_rank(8, usable_cpus(set(range(32)), root)) == 1


def test_the_cpu_worker_takes_its_threads_from_its_cpus_unless_told(monkeypatch):
    torch = __import__("pytest").importorskip("torch")
    from specdecode_worker import cpus
    from specdecode_worker.serving.cpu_threads import use_cpus

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


PROC_STAT = """cpu  300 0 100 900 10 0 5 5 0 0
cpu0 100 0 50 400 5 0 2 3 0 0
cpu1 200 0 50 500 5 0 3 2 0 0
intr 12345
"""


def test_busy_ticks_count_every_busy_field_of_the_chosen_cpus():
    from specdecode_worker.cpus import busy_ticks

    assert busy_ticks(PROC_STAT, {0}) == 100 + 50 + 2 + 3  # user, system, softirq, steal; not idle, iowait
    assert busy_ticks(PROC_STAT, {0, 1}) == 155 + 255
    assert busy_ticks(PROC_STAT, {7}) == 0


def test_process_ticks_are_utime_plus_stime_whatever_the_name():
    from specdecode_worker.cpus import process_ticks

    stat = "4242 (python) serve) S 1 4242 4242 0 -1 4194304 10 0 0 0 731 96 0 0 20 0 9 0 100 0 0"
    assert process_ticks(stat) == 731 + 96


class Ticks:
    """A stand-in for /proc: busy ticks of the CPUs and of this process, advanced by hand."""

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0, 0

    def run(self, seconds: float, ours: float, others: float, hz: int = 100) -> None:
        self.now += seconds
        self.own += int(ours * seconds * hz)
        self.busy += int((ours + others) * seconds * hz)


def test_the_governor_gives_a_thread_back_for_each_cpu_another_process_keeps_busy():
    from specdecode_worker.cpus import ThreadGovernor

    ticks, set_to = Ticks(), []
    gov = ThreadGovernor({0, 1, 2, 3}, interval=1.0, read=lambda cpus: (ticks.busy, ticks.own),
                         set_threads=set_to.append, clock=lambda: ticks.now, ticks_per_second=100)
    assert gov.tick() == 4 and set_to == []  # the first reading only starts the count
    ticks.run(1.0, ours=3.9, others=0.1)
    assert gov.tick() == 4 and set_to == []  # a client's tenth of a CPU is not a core taken
    ticks.run(1.0, ours=2.0, others=2.0)
    assert gov.tick() == 2 and set_to == [2] and gov.others == 2.0
    ticks.run(0.5, ours=0, others=4.0)
    assert gov.tick() == 2 and set_to == [2]  # within the interval: no reading, no change
    ticks.run(1.0, ours=1.0, others=3.0)  # the whole 1.5 s since the last reading: 3.33 others
    assert gov.tick() == 1 and set_to == [2, 1]
    ticks.run(1.0, ours=1.0, others=0.0)
    assert gov.tick() == 4 and set_to == [2, 1, 4]  # the load went away: every CPU again


def test_only_a_single_rank_on_its_own_cpus_is_governed(monkeypatch):
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    from specdecode_worker import cpus
    from specdecode_worker.serving.cpu_threads import thread_governor

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpus, "usable_cpus", lambda affinity=None, root=None: 4)
    gov = thread_governor("cpu")
    assert isinstance(gov, cpus.ThreadGovernor) and gov.cpus == {0, 1, 2, 3}
    assert thread_governor("cuda") is None
    monkeypatch.setattr(cpus, "usable_cpus", lambda affinity=None, root=None: 2)  # a quota of 2 of the 4
    assert thread_governor("cpu") is None
    monkeypatch.setattr(cpus, "usable_cpus", lambda affinity=None, root=None: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert thread_governor("cpu") is None


def test_read_ticks_sees_this_process_run_on_its_cpus():
    import os
    import time

    from specdecode_worker.cpus import read_ticks

    cpus = os.sched_getaffinity(0)
    busy0, own0 = read_ticks(cpus)
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU time
        pass
    busy1, own1 = read_ticks(cpus)
    hz = os.sysconf("SC_CLK_TCK")
    assert own1 - own0 >= 0.25 * hz
    assert busy1 - busy0 >= own1 - own0 - 0.05 * hz  # its time is part of its CPUs' busy time
