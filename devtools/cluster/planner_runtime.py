"""Test container runtime for planner pods: runs their container as a local process.

KWOK simulates pods without running anything. Planner pods (label ``specdecode.io/role:
planner``) must run the real planner, and model download pods (``specdecode.io/role:
model-cache``, the pods of the operator's download Jobs) must really download from the test
hub into the cache claim's folder, so this runner plays the container runtime for both:

* It picks pods with either label that are scheduled onto a KWOK node (a real node's kubelet
  runs its own), Running (KWOK's pod-ready stage) and not being deleted, and runs each pod once,
  keyed by pod UID. A marker file per UID in the state folder keeps that true across runner
  restarts: a pod whose process was cut off by a restart is recorded as exit code 137 rather than
  run again.
* Command: the first container's ``command`` + ``args``, with Kubernetes ``$(VAR)`` expansion.
  No ``command`` means the worker image's entrypoint, ``specdecode-worker``.
* Environment: the runner's environment plus the container's ``env`` (``value``, ``fieldRef``,
  ``configMapKeyRef``, ``secretKeyRef``); ``PATH`` starts with the project's virtualenv ``bin``
  (the folder of the Python running this module, then ``<repo>/.venv/bin``), so
  ``specdecode-worker`` resolves to the project's own entry point.
* Model store mapping rule: for each ``volumeMount`` whose volume is a
  ``persistentVolumeClaim`` with ``claimName`` C, the mount path M is replaced by
  ``<pvc_root>/<namespace>/<C>`` (plus the mount's ``subPath``) wherever M appears as a whole
  path or path prefix in args, command and env values. ``hostPath`` volumes map to their own
  path, ``emptyDir`` volumes to a fresh folder per pod. Other volume kinds are not mapped.
* ``terminationMessagePath`` (default ``/dev/termination-log``) in args and env values is
  replaced by a temporary file.
* ``securityContext.readOnlyRootFilesystem: true``: the process gets no writable place but its
  mounts. ``HOME`` (unless the container sets it) and the working folder become a path under
  ``/proc``, where no one, not even root, can create files; ``TMPDIR`` is the mapped ``/tmp``
  mount when the pod has one. A planner that writes outside its volumes fails here as it would
  in a real read-only container.
* When the process exits the runner annotates the pod with ``specdecode.test/exit-code``,
  ``specdecode.test/reason`` and ``specdecode.test/termination-message``, read like kubelet does:
  the last 4096 bytes of the termination file; if that is empty, the container exited non-zero
  and ``terminationMessagePolicy`` is ``FallbackToLogsOnError``, the last 80 lines (at most 2048
  bytes) of its output. KWOK's ``pod-exit-recorded`` stage (kwok-stages.yaml) turns these into
  ``status.containerStatuses[0].state.terminated`` and phase Succeeded or Failed.
* Output goes to ``<logs_dir>/pods/<namespace>.<pod>.<uid8>.log``. Deleting the pod kills the
  process.

The same process also runs the local volume provisioner (local_volumes.py), which binds each
claim to the folder this mapping rule names.

Run: ``python -m devtools.cluster.planner_runtime --kubeconfig K --pvc-root P --state-dir S
--logs-dir L`` (the control plane starts it).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .kube import ApiError, KubeClient
from .local_volumes import sync_volumes

ROLE_SELECTOR = "specdecode.io/role in (planner,model-cache)"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
ANN_EXIT_CODE = "specdecode.test/exit-code"
ANN_REASON = "specdecode.test/reason"
ANN_MESSAGE = "specdecode.test/termination-message"
DEFAULT_ENTRYPOINT = ["specdecode-worker"]
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
# No one, root included, can create files in /proc: it stands in for a read-only root filesystem
# (HOME points to a folder there that cannot be made, the working folder is /proc itself).
READ_ONLY_ROOT = "/proc"
READ_ONLY_HOME = "/proc/specdecode-read-only-home"
# kubelet's limits (pkg/kubelet/container/runtime.go).
MAX_MESSAGE_BYTES = 4096
MAX_LOG_MESSAGE_BYTES = 2048
MAX_LOG_MESSAGE_LINES = 80
REPO_ROOT = Path(__file__).resolve().parents[2]


class LaunchError(Exception):
    """The pod asks for something this runtime cannot provide; becomes the pod's message."""


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    termination_file: Path
    fallback_to_logs: bool


@dataclass
class Result:
    exit_code: int
    reason: str
    message: str


def venv_path_dirs() -> list[str]:
    """Folders that must come first on PATH so the project's console scripts win."""
    dirs = [str(Path(sys.executable).parent), str(REPO_ROOT / ".venv" / "bin")]
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


def volume_paths(pod: dict, container: dict, pvc_root: Path, scratch: Path) -> dict[str, str]:
    """Container mount path -> local path, per the model store mapping rule."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    namespace = pod["metadata"]["namespace"]
    mapping: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        if "persistentVolumeClaim" in volume:
            base = pvc_root / namespace / volume["persistentVolumeClaim"]["claimName"]
        elif "hostPath" in volume:
            base = Path(volume["hostPath"]["path"])
        elif "emptyDir" in volume:
            base = scratch / "volumes" / mount["name"]
            base.mkdir(parents=True, exist_ok=True)
        else:
            continue
        if mount.get("subPath"):
            base = base / mount["subPath"]
        mapping[mount["mountPath"].rstrip("/") or "/"] = str(base)
    return mapping


def map_paths(value: str, mapping: dict[str, str]) -> str:
    """Replace each container path in ``mapping`` where it stands as whole path components.

    A match may not continue a longer name: the character before it may not be a letter,
    digit, ``.``, ``-``, ``_`` or ``/``, and the one after it may not be a letter, digit,
    ``.``, ``-`` or ``_`` (``/`` after it is fine: that is a path inside the mount).
    """
    if not mapping:
        return value
    alternatives = "|".join(re.escape(p) for p in sorted(mapping, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])")
    return pattern.sub(lambda m: mapping[m.group(1)], value)


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known names expand, ``$$`` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, value)


def _field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return meta.get(m.group(1), {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path not in simple:
        raise LaunchError(f"env fieldRef {path!r} is not supported by the test runtime")
    return simple[path] or ""


def container_env(pod: dict, container: dict, client: KubeClient | None) -> dict[str, str]:
    """The container's own env entries, resolved in order like kubelet does."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "valueFrom" not in entry:
            env[name] = expand_vars(entry.get("value", ""), env)
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind, ref = ("configmaps", source["configMapKeyRef"]) if "configMapKeyRef" in source else (
                "secrets", source["secretKeyRef"])
            value = _ref_value(client, namespace, kind, ref)
            if value is not None:
                env[name] = value
        else:
            raise LaunchError(f"env {name}: only value, fieldRef, configMapKeyRef and secretKeyRef are supported")
    return env


def _ref_value(client: KubeClient | None, namespace: str, kind: str, ref: dict) -> str | None:
    if client is None:
        raise LaunchError(f"env from {kind} needs an API client")
    try:
        obj = client.get(f"/api/v1/namespaces/{namespace}/{kind}/{ref['name']}")
    except ApiError as exc:
        if exc.status == 404 and ref.get("optional"):
            return None
        raise LaunchError(f"{kind[:-1]} {ref['name']!r} for env: {exc}") from None
    data = obj.get("data", {})
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise LaunchError(f"{kind[:-1]} {ref['name']!r} has no key {ref['key']!r}")
    value = data[ref["key"]]
    return base64.b64decode(value).decode() if kind == "secrets" else value


def plan_launch(pod: dict, pvc_root: Path, scratch: Path, base_env: dict[str, str],
                client: KubeClient | None = None) -> Launch:
    """Everything needed to start the pod's first container locally (no side effects but
    creating the scratch folder)."""
    container = pod["spec"]["containers"][0]
    scratch.mkdir(parents=True, exist_ok=True)
    own_env = container_env(pod, container, client)
    termination_path = container.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
    termination_file = scratch / "termination-log"
    termination_file.write_bytes(b"")
    mapping = volume_paths(pod, container, pvc_root, scratch)
    mapping[termination_path] = str(termination_file)

    env = dict(base_env)
    env["HOSTNAME"] = pod["metadata"]["name"]
    for name, value in own_env.items():
        env[name] = map_paths(value, mapping)
    path_dirs = venv_path_dirs()
    env["PATH"] = os.pathsep.join([*path_dirs, env.get("PATH", os.defpath)])
    read_only_root = bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))
    if read_only_root:
        env.pop("TMPDIR", None)
        if "/tmp" in mapping:
            env["TMPDIR"] = mapping["/tmp"]
        if "HOME" not in own_env:
            env["HOME"] = READ_ONLY_HOME

    command = container.get("command") or DEFAULT_ENTRYPOINT
    argv = [map_paths(expand_vars(a, own_env), mapping) for a in [*command, *container.get("args", [])]]
    workdir = container.get("workingDir")
    cwd = map_paths(workdir, mapping) if workdir else (READ_ONLY_ROOT if read_only_root else str(scratch))
    policy = container.get("terminationMessagePolicy", "File")
    return Launch(argv, env, cwd, termination_file, policy == "FallbackToLogsOnError")


def termination_message(file_bytes: bytes, log_bytes: bytes, exit_code: int, fallback_to_logs: bool) -> str:
    """kubelet's rule: the file's tail; else, on failure with FallbackToLogsOnError, the log's tail."""
    message = file_bytes[-MAX_MESSAGE_BYTES:]
    if not message and fallback_to_logs and exit_code != 0:
        lines = log_bytes.splitlines(keepends=True)[-MAX_LOG_MESSAGE_LINES:]
        message = b"".join(lines)[-MAX_LOG_MESSAGE_BYTES:]
    return message.decode(errors="replace")


def exit_status(returncode: int) -> int:
    """A process killed by signal N exits 128 + N in a container."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Runner:
    client: KubeClient
    pvc_root: Path
    state_dir: Path
    logs_dir: Path
    base_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    active: dict[str, subprocess.Popen | None] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _kwok: set[str] = field(default_factory=set)
    _nodes_read: float = -1e9

    def poll_once(self) -> None:
        pods = self.client.get("/api/v1/pods", labelSelector=ROLE_SELECTOR)["items"]
        live = {}
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            live[uid] = pod
            if meta.get("deletionTimestamp") or not pod["spec"].get("nodeName"):
                continue
            if pod["spec"]["nodeName"] not in self.kwok_nodes(pod["spec"]["nodeName"]):
                continue
            if pod.get("status", {}).get("phase") != "Running":
                continue
            if ANN_EXIT_CODE in meta.get("annotations", {}):
                continue
            with self.lock:
                if uid in self.active or uid in self.finished:
                    continue
                marker = self.state_dir / f"{uid}.started"
                if marker.exists():
                    # An earlier runner started this pod and stopped before recording it.
                    self.finished.add(uid)
                    self._record(pod, Result(137, "Error",
                                             "the test container runtime stopped while this container ran"))
                    continue
                marker.touch()
                self.active[uid] = None
            threading.Thread(target=self._run, args=(pod,), daemon=True, name=f"pod-{meta['name']}").start()
        with self.lock:
            for uid, proc in self.active.items():
                gone = uid not in live or live[uid]["metadata"].get("deletionTimestamp")
                if gone and proc is not None and proc.poll() is None:
                    _kill_group(proc)

    def kwok_nodes(self, wanted: str) -> set[str]:
        """The nodes KWOK manages, read again when ``wanted`` is not among them (at most once a second)."""
        if wanted not in self._kwok and time.monotonic() - self._nodes_read > 1:
            nodes = self.client.get("/api/v1/nodes")["items"]
            self._kwok = {n["metadata"]["name"] for n in nodes
                          if (n["metadata"].get("annotations") or {}).get(KWOK_ANNOTATION) == "fake"}
            self._nodes_read = time.monotonic()
        return self._kwok

    def _run(self, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        log_path = self.logs_dir / "pods" / f"{meta['namespace']}.{meta['name']}.{uid[:8]}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = self._execute(pod, log_path)
        except LaunchError as exc:
            result = Result(128, "StartError", str(exc))
        except Exception as exc:  # record something on the pod rather than leave it Running
            result = Result(128, "StartError", f"test container runtime error: {exc!r}")
        self._record(pod, result)
        with self.lock:
            self.active.pop(uid, None)
            self.finished.add(uid)

    def _execute(self, pod: dict, log_path: Path) -> Result:
        scratch = Path(tempfile.mkdtemp(prefix=f"{pod['metadata']['name']}-", dir=self.state_dir))
        launch = plan_launch(pod, self.pvc_root, scratch, self.base_env, self.client)
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(launch.argv)}\n".encode())
            log.flush()
            start = log.tell()
            try:
                proc = subprocess.Popen(launch.argv, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                return Result(128, "StartError", f"exec: {launch.argv[0]!r}: {exc.strerror}")
            with self.lock:
                self.active[pod["metadata"]["uid"]] = proc
            code = exit_status(proc.wait())
        output = log_path.read_bytes()[start:]
        message = termination_message(launch.termination_file.read_bytes(), output, code, launch.fallback_to_logs)
        return Result(code, "Completed" if code == 0 else "Error", message)

    def _record(self, pod: dict, result: Result) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        patch = {"metadata": {"uid": meta["uid"], "annotations": {
            ANN_EXIT_CODE: str(result.exit_code), ANN_REASON: result.reason, ANN_MESSAGE: result.message}}}
        # A kubelet keeps reporting a container's end until the API server takes it: retry through
        # an outage (for up to five minutes), or the pod would stay Running forever.
        deadline = time.monotonic() + 300
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            try:
                self.client.merge_patch(path, patch)
                print(f"{meta['namespace']}/{meta['name']}: exit {result.exit_code}", flush=True)
                return
            except ApiError as exc:
                if exc.status in (404, 409):  # deleted, or replaced by a pod with another UID
                    return
                print(f"{meta['namespace']}/{meta['name']}: recording failed: {exc}", flush=True)
            except OSError as exc:
                print(f"{meta['namespace']}/{meta['name']}: recording failed: {exc}", flush=True)
            time.sleep(min(0.5 * attempt, 2.0))

    def stop_all(self) -> None:
        with self.lock:
            for proc in self.active.values():
                if proc is not None and proc.poll() is None:
                    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--pvc-root", required=True, type=Path)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--logs-dir", required=True, type=Path)
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between pod polls")
    args = parser.parse_args(argv)
    args.state_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(KubeClient(args.kubeconfig), args.pvc_root, args.state_dir, args.logs_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ready = args.state_dir / "ready"
    print(f"planner runtime: running pods with {ROLE_SELECTOR}", flush=True)
    volumes_synced = 0.0
    while not stop.is_set():
        try:
            # Claims matter less promptly than planner pods; polling them less often spares CPU.
            if time.monotonic() - volumes_synced >= 1.0:
                sync_volumes(runner.client, args.pvc_root)
                volumes_synced = time.monotonic()
            runner.poll_once()
            ready.touch()
        except (ApiError, OSError) as exc:
            print(f"poll failed: {exc}", flush=True)
        stop.wait(args.interval)
    runner.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
