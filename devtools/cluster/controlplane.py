"""A real Kubernetes control plane as local processes on loopback.

etcd, kube-apiserver (client-certificate admin, RBAC), kube-controller-manager (all
controllers), kube-scheduler, the KWOK controller (kwok-stages.yaml) with the fake GPU nodes of
nodes.yaml, and the planner runtime (planner_runtime.py, which runs the planner pods of KWOK nodes
and binds volume claims). Given ``node_bin_dir``, also one real node (realnode.py: containerd,
kubelet, kube-proxy) that runs pods as containers; the API server then serves on the node's
bridge address instead of loopback. Ports are chosen free, so runs never collide. Everything
lives in one work folder: ``kubeconfig``, ``pki/``, ``node/`` (the real node's),
``logs/<component>.log``, ``pvc/`` (the local model store root) and ``state.json`` (what
``python -m devtools.cluster down`` needs to stop a detached plane).
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from . import pki as pki_mod
from .kube import ApiError, KubeClient
from . import realnode
from .build_scripts import run_build_script
from .local_volumes import STORAGE_CLASS

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
NODES_FILE = HERE / "nodes.yaml"
STAGES_FILE = HERE / "kwok-stages.yaml"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
# Stopped in this order: clients of the API server first, etcd last.
STOP_ORDER = [
    ["lws-controller", "planner-runtime", "kwok", "kube-scheduler", "kube-controller-manager", "kubelet",
     "kube-proxy"],
    ["containerd"],
    ["kube-apiserver"],
    ["etcd"],
]
OPTIONAL = {"lws-controller"}  # started per test module (devtools/cluster/lws.py)
REAL_NODE = {"containerd", "kubelet", "kube-proxy"}  # only in planes with a real node


class CommandError(subprocess.CalledProcessError):
    """A kubectl/helm call failed; the message carries its stderr."""

    def __str__(self) -> str:
        cmd = " ".join(map(str, self.cmd))
        return f"`{cmd}` exited {self.returncode}: {(self.stderr or '').strip() or (self.output or '').strip()}"


def build_binaries(progress: Callable[[str], None] = print) -> Path:
    """Run build.sh (instant when cached) and return the folder holding the binaries."""
    script = HERE / "build.sh"
    progress(f"control plane: checking binaries ({script.relative_to(REPO_ROOT)})")
    return run_build_script(script)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a crashed test run must not leave the plane behind.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class Component:
    name: str
    pid: int
    argv0: str
    log: Path
    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            return False
        # A zombie, or a recycled pid running something else, is not our component.
        return stat.rsplit(")", 1)[1].split()[0] != "Z" and cmdline == self.argv0

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass


class ControlPlane:
    def __init__(self, workdir: Path, bin_dir: Path, node_bin_dir: Path | None = None):
        """``node_bin_dir``: realnode.build()'s folder, for a plane with a real node."""
        self.workdir = Path(workdir)
        self.bin_dir = Path(bin_dir)
        self.node_bin_dir = Path(node_bin_dir) if node_bin_dir else None
        self.node = (realnode.RealNode(self.workdir / "node", self.bin_dir, self.node_bin_dir, self.workdir / "pki")
                     if self.node_bin_dir else None)
        self.logs_dir = self.workdir / "logs"
        self.pvc_root = self.workdir / "pvc"
        self.kubeconfig = str(self.workdir / "kubeconfig")
        self.components: dict[str, Component] = {}
        self.ports: dict[str, int] = {}
        self._launches: dict[str, tuple] = {}  # name -> how _spawn started it (restart)
        self._api: KubeClient | None = None

    # ---- what tests use -------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = self.kubeconfig
        env["PATH"] = os.pathsep.join([str(self.bin_dir), env.get("PATH", os.defpath)])
        helm = self.workdir / "helm"
        env.update(HELM_CACHE_HOME=str(helm / "cache"), HELM_CONFIG_HOME=str(helm / "config"),
                   HELM_DATA_HOME=str(helm / "data"))
        return env

    @property
    def api(self) -> KubeClient:
        if self._api is None:
            self._api = KubeClient(self.kubeconfig)
        return self._api

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return self._tool("kubectl", args, input, check, timeout)

    def helm(self, *args: str, input: str | None = None, check: bool = True,
             timeout: float = 300) -> subprocess.CompletedProcess:
        return self._tool("helm", args, input, check, timeout)

    def _tool(self, tool: str, args, input, check, timeout) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / tool), *map(str, args)]
        result = subprocess.run(cmd, input=input, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise CommandError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def log_tails(self, lines: int = 25, pods: int = 5) -> str:
        """The end of each component's log, then of the newest planner pods' output."""
        logs = sorted(self.logs_dir.glob("*.log"))
        logs += sorted(self.logs_dir.glob("pods/*.log"), key=lambda p: p.stat().st_mtime)[-pods:]
        parts = []
        for log in logs:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"==> {log} <==\n" + "\n".join(tail))
        return "\n\n".join(parts)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, *, detach: bool = False, progress: Callable[[str], None] = print) -> "ControlPlane":
        """Start every component and return once nodes are Ready; stops what it started on failure."""
        t0 = time.monotonic()
        say = lambda msg: progress(f"control plane [{time.monotonic() - t0:5.1f}s] {msg}")  # noqa: E731
        try:
            self._start(detach, say)
        except BaseException:
            self.stop()
            raise
        say(f"ready: {self.kubeconfig}")
        return self

    def _start(self, detach: bool, say: Callable[[str], None]) -> None:
        for d in (self.logs_dir, self.pvc_root, self.workdir / "etcd", self.workdir / "kwok",
                  self.workdir / "runtime"):
            d.mkdir(parents=True, exist_ok=True)
        (self.workdir / "etcd").chmod(0o700)  # etcd warns about wider permissions
        if self.node is not None:
            self.node.take_lock()
            self.node.sweep_stale()
            self.node.make_bridge()  # the API server binds the bridge's address
        names = ["etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]
        self.ports = dict(zip(names, free_ports(len(names))))
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn("etcd", detach, [
            "--name=node0", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=node0={peer_url}", "--unsafe-no-fsync=true",
            "--auto-compaction-retention=1", "--log-level=warn",
        ])
        say(f"etcd started on {etcd_url}; making certificates")
        p = pki_mod.make_pki(self.workdir / "pki", extra_ips=(realnode.IP,) if self.node else ())
        self._write_kubeconfig(p)
        self._save_state()
        self._wait(lambda: _http_ok(f"{etcd_url}/health"), "etcd /health", 30)

        api = self.ports["kube-apiserver"]
        node_flags = [] if self.node is None else [
            # Pods reach the API server through the kubernetes Service, at the bridge's address.
            f"--advertise-address={realnode.IP}", f"--kubelet-client-certificate={p.admin_crt}",
            f"--kubelet-client-key={p.admin_key}", "--kubelet-preferred-address-types=InternalIP",
        ]
        self._spawn("kube-apiserver", detach, [
            f"--etcd-servers={etcd_url}", f"--bind-address={self.api_host}", f"--secure-port={api}", *node_flags,
            f"--tls-cert-file={p.serving_crt}", f"--tls-private-key-file={p.serving_key}",
            f"--client-ca-file={p.ca_crt}", "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p.sa_pub}", f"--service-account-signing-key-file={p.sa_key}",
            # Front-proxy settings, which the other components' delegated authentication reads.
            f"--proxy-client-cert-file={p.front_proxy_client_crt}",
            f"--proxy-client-key-file={p.front_proxy_client_key}",
            f"--requestheader-client-ca-file={p.front_proxy_ca_crt}",
            "--requestheader-allowed-names=front-proxy-client", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        ])  # API Priority and Fairness on, as in any cluster: the admin user is exempt, service accounts not
        say(f"kube-apiserver starting on https://{self.api_host}:{api}")
        self._wait(lambda: self.api.get("/readyz") == "ok", "kube-apiserver /readyz", 120)
        say("kube-apiserver ready; starting controller-manager, scheduler, kwok, planner runtime")

        common = [f"--kubeconfig={self.kubeconfig}", f"--authentication-kubeconfig={self.kubeconfig}",
                  f"--authorization-kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1"]
        self._spawn("kube-controller-manager", detach, [
            *common, f"--secure-port={self.ports['kube-controller-manager']}", "--leader-elect=false",
            "--controllers=*", f"--service-account-private-key-file={p.sa_key}", f"--root-ca-file={p.ca_crt}",
            f"--cluster-signing-cert-file={p.ca_crt}", f"--cluster-signing-key-file={p.ca_key}",
            "--node-monitor-period=5s", "--pvclaimbinder-sync-period=5s",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])
        sched_config = self.workdir / "kube-scheduler.yaml"
        sched_config.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": self.kubeconfig, "qps": 200, "burst": 400},
            "leaderElection": {"leaderElect": False},
        }))
        self._spawn("kube-scheduler", detach, [
            f"--config={sched_config}", *common[1:], f"--secure-port={self.ports['kube-scheduler']}",
        ])
        self._spawn("kwok", detach, [
            f"--kubeconfig={self.kubeconfig}", f"--config={STAGES_FILE}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=10.1.0.1", f"--cidr={POD_CIDR}", "--node-lease-duration-seconds=40",
        ], env={"KWOK_WORKDIR": str(self.workdir / "kwok")})
        self._spawn("planner-runtime", detach, [
            "-m", "devtools.cluster.planner_runtime", f"--kubeconfig={self.kubeconfig}",
            f"--pvc-root={self.pvc_root}", f"--state-dir={self.workdir / 'runtime'}",
            f"--logs-dir={self.logs_dir}",
        ], executable=sys.executable, cwd=REPO_ROOT)
        self._save_state()

        for node in yaml.safe_load_all(NODES_FILE.read_text()):
            self._create("/api/v1/nodes", node)
        self._create("/apis/storage.k8s.io/v1/storageclasses", STORAGE_CLASS)
        node_names = [n["metadata"]["name"] for n in yaml.safe_load_all(NODES_FILE.read_text())]
        say(f"nodes {', '.join(node_names)} registered; waiting for Ready")
        self._wait(lambda: self._nodes_ready(node_names), "fake nodes Ready and untainted", 90)
        self._wait(lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
                   "the default service account (controller-manager)", 60)
        for name in ("kube-controller-manager", "kube-scheduler"):
            url = f"https://127.0.0.1:{self.ports[name]}/healthz"
            self._wait(lambda url=url: _http_ok(url, insecure=True), f"{name} /healthz", 60)
        self._wait(lambda: (self.workdir / "runtime" / "ready").exists(), "planner runtime", 30)
        if self.node is not None:
            self._start_node(p, detach, say)

    @property
    def api_host(self) -> str:
        return realnode.IP if self.node_bin_dir else "127.0.0.1"

    def _start_node(self, p: pki_mod.Pki, detach: bool, say: Callable[[str], None]) -> None:
        node = self.node
        assert node is not None
        certs = {
            "kubelet": pki_mod.make_client_cert(p, self.workdir / "pki", "kubelet",
                                                f"/O=system:nodes/CN=system:node:{realnode.NAME}"),
            "kube-proxy": pki_mod.make_client_cert(p, self.workdir / "pki", "kube-proxy", "/CN=system:kube-proxy"),
        }
        node.write_configs(f"https://{self.api_host}:{self.ports['kube-apiserver']}", certs)
        commands = node.commands()
        self._spawn("containerd", detach, commands["containerd"][1:], env=node.env(),
                    executable=commands["containerd"][0], pass_fds=(node.lock_fd,))
        os.close(node.lock_fd)  # containerd holds the lock from here on
        node.lock_fd = None
        self._wait(lambda: node.socket.exists(), "containerd's socket", 30)
        node.import_pause()
        for name in ("kubelet", "kube-proxy"):
            self._spawn(name, detach, commands[name][1:], env=node.env(), executable=commands[name][0])
        self._save_state()
        say(f"real node: containerd, kubelet and kube-proxy started; waiting for {realnode.NAME} Ready")
        self._wait(lambda: self._nodes_ready([realnode.NAME]), f"{realnode.NAME} Ready", 90)
        # The documented way to advertise an extended resource: a patch of the node's status.
        self.api.merge_patch(f"/api/v1/nodes/{realnode.NAME}/status",
                             {"status": {"capacity": {"nvidia.com/gpu": str(realnode.GPUS)}}})
        self._wait(lambda: self.api.get(f"/api/v1/nodes/{realnode.NAME}")["status"]["allocatable"]
                   .get("nvidia.com/gpu") == str(realnode.GPUS), "the real node's nvidia.com/gpu", 30)

    def restart(self, name: str, down_for: float = 0) -> None:
        """Stop one component, leave it down ``down_for`` seconds, and start it again with the same
        command line (fault tests: an API server outage); returns once the API server is ready."""
        detach, args, options = self._launches[name]
        comp = self.components[name]
        comp.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10  # the API server drains its watches for up to a minute
        while comp.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        comp.signal(signal.SIGKILL)
        if comp.proc is not None:
            comp.proc.wait(30)
        time.sleep(down_for)
        self._spawn(name, detach, args, **options)
        self._wait(lambda: self.api.get("/readyz") == "ok", "kube-apiserver /readyz", 120)

    def _spawn(self, name: str, detach: bool, args: list[str], *, env: dict[str, str] | None = None,
               executable: str | None = None, cwd: Path | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self._launches[name] = (detach, args, {"env": env, "executable": executable, "cwd": cwd})
        argv0 = executable or str(self.bin_dir / name)
        log = self.logs_dir / f"{name}.log"
        full_env = dict(os.environ, **(env or {}))
        if cwd is not None:
            full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), full_env.get("PYTHONPATH")]))
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [argv0, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=full_env, cwd=cwd or self.workdir, start_new_session=True, pass_fds=pass_fds,
                preexec_fn=None if detach else _die_with_parent,
            )
        self.components[name] = Component(name, proc.pid, argv0, log, proc)

    def _wait(self, predicate: Callable[[], object], what: str, timeout: float) -> None:
        """Like wait_for, but a component that exits ends the wait at once with its logs."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            dead = [c.name for c in self.components.values() if not c.alive()]
            if dead:
                raise RuntimeError(f"control plane: {', '.join(dead)} exited while waiting for {what}\n"
                                   f"{self.log_tails()}")
            try:
                last = predicate()
                if last:
                    return
            except Exception as exc:  # the API server refuses connections until it listens
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"control plane: timed out after {timeout}s waiting for {what}; "
                                   f"last: {last!r}\n{self.log_tails()}")
            time.sleep(0.2)

    def _create(self, path: str, obj: dict) -> None:
        try:
            self.api.create(path, obj)
        except ApiError as exc:
            if exc.status != 409:
                raise

    def _exists(self, path: str) -> bool:
        try:
            self.api.get(path)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    def _nodes_ready(self, names: list[str]) -> bool:
        nodes = {n["metadata"]["name"]: n for n in self.api.get("/api/v1/nodes")["items"]}
        for name in names:
            node = nodes.get(name)
            if node is None:
                return False
            conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            taints = [t["key"] for t in node["spec"].get("taints", [])]
            if conditions.get("Ready") != "True" or any(t.startswith("node.kubernetes.io/") for t in taints):
                return False
        return True

    def _write_kubeconfig(self, p: pki_mod.Pki) -> None:
        b64 = lambda path: base64.b64encode(path.read_bytes()).decode()  # noqa: E731
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "specdecode-test", "cluster": {
                "server": f"https://{self.api_host}:{self.ports['kube-apiserver']}",
                "certificate-authority-data": b64(p.ca_crt)}}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": b64(p.admin_crt), "client-key-data": b64(p.admin_key)}}],
            "contexts": [{"name": "specdecode-test", "context": {
                "cluster": "specdecode-test", "user": "admin", "namespace": "default"}}],
            "current-context": "specdecode-test",
        }
        path = Path(self.kubeconfig)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)

    def stop(self, timeout: float = 15) -> None:
        """Stop every component (SIGTERM, then SIGKILL after ``timeout``), clients first."""
        for group in STOP_ORDER:
            comps = [self.components[n] for n in group if n in self.components]
            for c in comps:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in comps:
                while c.alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
                if c.alive():
                    c.signal(signal.SIGKILL)
                if c.proc is not None:
                    c.proc.wait()
        self.components.clear()
        if self.node is not None and (self.node.dir / "cgroups.json").exists():
            self.node.cleanup()

    # ---- detached planes (python -m devtools.cluster up|down) ---------------------------------

    def _save_state(self) -> None:
        state = {
            "bin_dir": str(self.bin_dir),
            "node_bin_dir": str(self.node_bin_dir) if self.node_bin_dir else None,
            "ports": self.ports,
            "components": {c.name: {"pid": c.pid, "argv0": c.argv0, "log": str(c.log)}
                           for c in self.components.values()},
        }
        (self.workdir / "state.json").write_text(json.dumps(state, indent=2))

    @classmethod
    def attach(cls, workdir: Path) -> "ControlPlane | None":
        """The plane a previous process started in ``workdir``, or None if there is none."""
        state_file = Path(workdir) / "state.json"
        if not state_file.exists():
            return None
        state = json.loads(state_file.read_text())
        plane = cls(workdir, Path(state["bin_dir"]), state.get("node_bin_dir"))
        plane.ports = state["ports"]
        plane.components = {name: Component(name, c["pid"], c["argv0"], Path(c["log"]))
                            for name, c in state["components"].items()}
        return plane

    def running(self) -> bool:
        names = {n for group in STOP_ORDER for n in group} - OPTIONAL - (set() if self.node else REAL_NODE)
        return names <= self.components.keys() and all(c.alive() for c in self.components.values())

    def remove_data(self) -> None:
        """Delete everything in the work folder but the logs."""
        for child in self.workdir.iterdir():
            if child != self.logs_dir:
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def _http_ok(url: str, insecure: bool = False) -> bool:
    ctx = None
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return resp.status == 200
    except OSError:
        return False
