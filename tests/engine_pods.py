"""Runs a vllm or sglang worker pod's own command here, standing in for the container runtime and
the pod network of the test bed, where KWOK runs no containers.

The command is the pod's, as the operator rendered it: the image's ``python3`` becomes the engine's
cached virtualenv (devtools/engines/venv.sh), mount paths become the claim's local folder
(planner_runtime's mapping rule), and the server listens on a loopback address of its own, which
is then written to the pod's ``status.podIP`` as a CNI plugin would. The operator reaches the engine
there, exactly as it reaches a pod in a cluster. ``change`` replaces flag values, to play an engine
that sized its cache differently from what it was told.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

from devtools.cluster.planner_runtime import map_paths, volume_paths
from devtools.cluster.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]
PORT = 8000  # the worker pods' containerPort


def engine_venv(engine: str) -> Path:
    """The engine's cached virtualenv, built from its pins on first use (a few minutes)."""
    out = subprocess.run(["bash", str(ROOT / "devtools" / "engines" / "venv.sh"), engine],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"devtools/engines/venv.sh {engine} failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def free_loopback_address() -> str:
    """A 127.0.0.x address whose port 8000 is free (all of 127/8 reaches the loopback device)."""
    for _ in range(50):
        ip = f"127.0.{random.randint(1, 254)}.{random.randint(2, 254)}"
        with socket.socket() as s:
            try:
                s.bind((ip, PORT))
                return ip
            except OSError:
                continue
    raise RuntimeError("no free loopback address for port 8000")


class EnginePod:
    def __init__(self, cluster, pod: dict, venv: Path, workdir: Path, change: dict[str, str] | None = None):
        self.cluster, self.pod, self.venv = cluster, pod, venv
        self.ip = free_loopback_address()
        self.log = workdir / f"{pod['metadata']['name']}.log"
        container = pod["spec"]["containers"][0]
        mapping = volume_paths(pod, container, Path(cluster.pvc_root), workdir)
        command = [map_paths(a, mapping) for a in container["command"] + container["args"]]
        assert command[0] == "python3", command
        command[0] = str(venv / "bin" / "python")
        replace = {"--host": self.ip, **(change or {})}
        self.argv = [replace[prev] if prev in replace else a for prev, a in zip([""] + command, command)]
        self.env = dict(os.environ, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{PORT}"

    def start(self, timeout: float = 420) -> "EnginePod":
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

        def healthy():
            assert self.proc.poll() is None, f"engine exited {self.proc.returncode}:\n{self.tail()}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, timeout=timeout, interval=1, what=f"engine of pod {self.pod['metadata']['name']} healthy")
        return self

    def announce(self) -> None:
        """The pod's IP is where its engine listens, as the pod network would make it."""
        patch = {"status": {"podIP": self.ip, "podIPs": [{"ip": self.ip}]}}
        self.cluster.kubectl("patch", "pod", self.pod["metadata"]["name"], "-n", self.pod["metadata"]["namespace"],
                             "--subresource=status", "--type=merge", "-p", json.dumps(patch))

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""
