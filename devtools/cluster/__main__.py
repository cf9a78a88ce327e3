"""``python -m devtools.cluster up|down|status|env``: the local control plane for people.

``up`` builds the binaries if needed (cached), starts the plane in the background and prints
shell lines (``eval "$(python -m devtools.cluster up)"`` works): the kubeconfig path as a comment,
``export KUBECONFIG=...`` and ``export PATH=...`` for kubectl and helm. ``down`` stops it and
deletes its data, keeping the logs. ``up --real-node`` adds one real node (realnode.py) that
runs pods in containers; on a machine that cannot run one it says what is missing and exits 1.
The work folder is ``$SPECDECODE_CLUSTER_DIR`` or ``~/.cache/specdecode/cluster-up``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from . import realnode
from .controlplane import ControlPlane, build_binaries


def default_workdir() -> Path:
    env = os.environ.get("SPECDECODE_CLUSTER_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specdecode" / "cluster-up"


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _print_env(plane: ControlPlane) -> None:
    print(f"# kubeconfig: {plane.kubeconfig}")
    print(f"export KUBECONFIG={plane.kubeconfig}")
    print(f"export PATH={plane.bin_dir}:$PATH  # kubectl, helm")


def up(workdir: Path, real_node: bool = False) -> int:
    existing = ControlPlane.attach(workdir)
    if existing is not None and existing.running() and (existing.node is not None or not real_node):
        _err(f"control plane already running in {workdir}")
        _print_env(existing)
        return 0
    node_bin_dir = None
    if real_node:
        realnode.install_packages(say=_err)
        missing = realnode.missing_parts()
        if missing:
            _err("this machine cannot run a real node; missing:\n  " + "\n  ".join(missing))
            return 1
        node_bin_dir = realnode.build(progress=_err)
    if existing is not None:
        existing.stop()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    plane = ControlPlane(workdir, build_binaries(progress=_err), node_bin_dir)
    try:
        plane.start(detach=True, progress=_err)
    except Exception as exc:
        _err(str(exc))
        return 1
    _err(f"logs: {plane.logs_dir}; model store root (PVC folders): {plane.pvc_root}")
    _err("stop it with: make cluster-down")
    _print_env(plane)
    return 0


def down(workdir: Path) -> int:
    plane = ControlPlane.attach(workdir)
    if plane is None:
        _err(f"no control plane in {workdir}")
        return 0
    plane.stop()
    plane.remove_data()
    _err(f"control plane stopped; logs kept in {plane.logs_dir}")
    return 0


def status(workdir: Path) -> int:
    plane = ControlPlane.attach(workdir)
    if plane is None or not plane.running():
        _err("control plane: not running")
        return 1
    _err(f"control plane: running in {workdir}")
    return 0


def env(workdir: Path) -> int:
    plane = ControlPlane.attach(workdir)
    if plane is None or not plane.running():
        _err("control plane: not running (start it with: make cluster-up)")
        return 1
    _print_env(plane)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    parser.add_argument("--real-node", action="store_true",
                        help="up: add a real node (containerd, kubelet, kube-proxy) that runs pods")
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(args.workdir, args.real_node)
    return {"down": down, "status": status, "env": env}[args.command](args.workdir)


if __name__ == "__main__":
    sys.exit(main())
