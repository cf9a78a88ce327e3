"""Child processes of the development tools: started with a log, waited for, stopped.

`stop` ends a child this process holds. `Background` is a named process that outlives the command
that started it (the demo's operator and worker): a later command finds it again by the files it
keeps in a state folder, reuses it while it runs the same command line, or stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


class NotReady(RuntimeError):
    """A process exited, or did not answer, before it was ready."""


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; waits for it either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def answers(url: str) -> bool:
    """Whether a GET of ``url`` returns 200 within two seconds."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``url`` answers 200; NotReady if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"exited with code {proc.returncode}")
        if answers(url):
            return
        time.sleep(0.3)
    raise NotReady(f"did not answer {url} within {timeout:.0f}s")


def runs(pid: int, marker: str) -> bool:
    """Whether ``pid`` is alive and its command line holds ``marker`` (a recycled pid does not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return marker in cmdline


class Background:
    """A process in a session of its own, known by NAME.pid, NAME.log (this start's output) and
    NAME.json (the command line it was started with and where it answers) in ``state``. ``marker``
    is a word of its command line: a pid the system has given to another process is left alone."""

    def __init__(self, state: Path, name: str, marker: str):
        self.state, self.name, self.marker = state, name, marker
        self.pid_file = state / f"{name}.pid"
        self.log = state / f"{name}.log"
        self.record = state / f"{name}.json"

    def pid(self) -> int | None:
        """Its pid while it still runs."""
        if not self.pid_file.exists():
            return None
        pid = int(self.pid_file.read_text())
        return pid if runs(pid, self.marker) else None

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log, "wb") as out:  # one start per log: its tail explains this start's failure
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=self.state)
        self.pid_file.write_text(str(proc.pid))
        return proc

    def stop(self, timeout: float = 15) -> int | None:
        """SIGTERM to its process group, SIGKILL after ``timeout`` seconds; returns the pid it
        stopped, None when it was not running. Its pid file is gone afterwards either way."""
        pid = self.pid()
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while runs(pid, self.marker) and time.monotonic() < deadline:
                time.sleep(0.2)
            if runs(pid, self.marker):
                os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return pid

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def remember(self, key: list[str], health: str, **info: str) -> None:
        """Records the command line it was started with (``key``) and its health URL, for `reusable`."""
        self.record.write_text(json.dumps({"key": key, "health": health, **info}))

    def reusable(self, key: list[str]) -> dict | None:
        """What `remember` recorded, while it runs the same command line and its health URL answers."""
        if not self.record.exists() or self.pid() is None:
            return None
        info = json.loads(self.record.read_text())
        return info if info.get("key") == key and answers(info["health"]) else None
