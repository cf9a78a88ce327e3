"""devtools/processes.py: background processes that a later command finds again, reuses or stops
(the demo's operator and worker), and the wait for a health URL."""

from __future__ import annotations

import os
import sys

import pytest

from devtools import processes
from devtools.cluster.controlplane import free_ports
from devtools.cluster.wait import wait_for

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_later_command_finds_reuses_and_stops_a_background_server(tmp_path):
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    url = f"http://127.0.0.1:{port}/"
    server = processes.Background(tmp_path, "server", marker="http.server")
    proc = server.start(argv, ENV)
    try:
        processes.wait_http(url, proc, timeout=30)
        server.remember(argv, health=url, url=url)
        later = processes.Background(tmp_path, "server", marker="http.server")  # as `demo/run.py` run again
        assert later.pid() == proc.pid
        assert later.reusable(argv) == {"key": argv, "health": url, "url": url}
        assert later.reusable([*argv, "--directory", "/"]) is None  # another command line is not reused
        assert later.stop() == proc.pid
        assert proc.wait(timeout=10) < 0  # ended by a signal
        assert not later.pid_file.exists() and later.pid() is None and later.reusable(argv) is None
        assert later.stop() is None
    finally:
        processes.stop(proc, timeout=5)


def test_a_process_that_exits_before_it_answers_is_not_ready_and_its_log_says_why(tmp_path):
    child = processes.Background(tmp_path, "child", marker="boom")
    proc = child.start(python("print('boom: no model'); raise SystemExit(3)"), ENV)
    with pytest.raises(processes.NotReady, match="exited with code 3"):
        processes.wait_http(f"http://127.0.0.1:{free_ports(1)[0]}/", proc, timeout=30)
    assert child.tail() == "boom: no model"


def test_stop_ends_the_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    code = ("import signal, subprocess, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print(subprocess.Popen(['sleep', '600']).pid, flush=True)\n"
            "time.sleep(600)\n")
    child = processes.Background(tmp_path, "stubborn", marker="SIG_IGN")
    proc = child.start(python(code), ENV)
    try:
        with pytest.raises(processes.NotReady, match="did not answer"):
            processes.wait_http(f"http://127.0.0.1:{free_ports(1)[0]}/", proc, timeout=0.5)
        grandchild = int(wait_for(lambda: child.tail(), timeout=30, what="the grandchild's pid"))
        assert child.stop(timeout=0.5) == proc.pid
        assert proc.wait(timeout=10) == -9
        wait_for(lambda: not processes.runs(grandchild, "sleep"), timeout=10, what="the grandchild to end")
    finally:
        processes.stop(proc, timeout=5)


def test_a_recycled_pid_is_left_alone(tmp_path):
    child = processes.Background(tmp_path, "gone", marker="specdecode-no-such-command")
    child.pid_file.write_text(str(os.getpid()))  # now some other process's pid: this test's own
    assert child.pid() is None
    assert child.stop() is None and not child.pid_file.exists()
