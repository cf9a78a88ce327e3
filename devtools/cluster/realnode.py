"""One real node in the local control plane: containerd, kubelet and kube-proxy run pods for real.

The node (``real-node-0``) runs the project's images as containers under runc, with a CNI bridge
(``sdnode0``, 10.245.0.1/24) for pod addresses and kube-proxy for Services. The API server binds
the bridge's address, so pods reach it through the ``kubernetes`` Service as they would in any
cluster. The node advertises ``nvidia.com/gpu`` as an extended resource and GPU Feature
Discovery's labels for a product named ``CPU``: GPU-requesting pods schedule onto it and run on
the CPU, with the plan's GPU memory as their budget.

Everything it starts stays inside the cgroup this process runs in (kubelet's cgroup root and
every container lie below it), and everything it makes (mounts, cgroups, the bridge, kube-proxy's
rules) is removed by ``cleanup``, or by the next node's ``sweep_stale`` if its process was killed
first. containerd keeps images in one folder per machine (imports of a 6 GB image are not
repeated per plane). A lock that containerd itself holds keeps the node one per machine.

``missing_parts()`` says what a machine lacks for a real node; callers fall back to KWOK-only
planes and say so.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Callable

import yaml

from .build_scripts import run_build_script

NAME = "real-node-0"
BRIDGE = "sdnode0"
IP = "10.245.0.1"
POD_SUBNET = "10.245.0.0/24"
GPU_PRODUCT = "CPU"  # the nvidia.com/gpu.product label SDDs name to run here
GPUS = 4  # nvidia.com/gpu the node advertises: pods that request them run on the CPU
GPU_MEMORY_MIB = 4096  # its nvidia.com/gpu.memory label (SDDs give gpu.memoryGiB for the plan)
KUBELET_PORT = 10250
# What the node's containers run on, and the memory that stands in for a GPU's (the worker's
# node_device() and node_device_memory_gib()).
DEVICE_ENV, DEVICE_MEMORY_ENV = "SPECDECODE_DEVICE", "SPECDECODE_DEVICE_MEMORY_GIB"
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
HERE = Path(__file__).resolve().parent
LOCK = Path("/run/lock" if Path("/run/lock").is_dir() else "/tmp") / "specdecode-real-node.lock"


class RealNodeError(RuntimeError):
    """The real node could not start; the message says which part and why."""


def cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CLUSTER_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdecode" / "cluster"
    return Path(root) / "real-node"


def build(progress: Callable[[str], None] = print) -> Path:
    """Run build_node.sh (instant when cached) and return the folder with containerd and pause."""
    progress("real node: checking containerd and pause (devtools/cluster/build_node.sh)")
    return run_build_script(HERE / "build_node.sh")


# ---- what a machine needs --------------------------------------------------------------------


def own_cgroup() -> tuple[str, bool]:
    """This process's cgroup path, and whether the machine uses cgroup v1 (the memory
    controller's path then; the unified path on v2)."""
    lines = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return path, True
    return next(path for hid, _, path in lines if hid == "0"), False


def cgroup_dir(controller: str, path: str, v1: bool) -> Path:
    return Path("/sys/fs/cgroup") / (controller if v1 else "") / path.lstrip("/")


def cni_dir() -> str | None:
    for d in CNI_DIRS:
        if all(Path(d, p).is_file() for p in CNI_PLUGINS):
            return d
    return None


# What the node runs from Debian's packages: each package, and how to tell this machine has it.
PACKAGES = {"runc": lambda: shutil.which("runc"), "iptables": lambda: shutil.which("iptables"),
            "iproute2": lambda: shutil.which("ip"), "containernetworking-plugins": cni_dir}


def missing_packages() -> list[str]:
    return [package for package, present in PACKAGES.items() if not present()]


def install_packages(say: Callable[[str], None] = print) -> None:
    """apt-get install what the node needs from Debian and this machine lacks (as root, where apt-get
    exists; otherwise missing_parts() says what to install)."""
    wanted = missing_packages()
    if not wanted or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    say(f"real node: installing {' '.join(wanted)} from Debian")
    cmd = ["apt-get", "install", "-y", "-q", *wanted]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(cmd, env=env, capture_output=True)


def missing_parts() -> list[str]:
    """What this machine lacks for a real node, each with how to get it (empty: nothing)."""
    if os.environ.get("SPECDECODE_NO_REAL_NODE") == "1":
        return ["SPECDECODE_NO_REAL_NODE=1 turns it off"]
    missing = []
    if os.geteuid() != 0:
        missing.append("root: containerd and kubelet mount file systems and make network namespaces")
    missing += [f"apt-get install {package}" for package in missing_packages()]
    if "overlay" not in Path("/proc/filesystems").read_text():
        missing.append("the overlay file system (modprobe overlay)")
    try:
        path, v1 = own_cgroup()
        probe = cgroup_dir("memory", path, v1) / f"specdecode-probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except (OSError, StopIteration) as exc:
        missing.append(f"a cgroup this process may make children in ({exc})")
    return missing


# ---- the node's processes ----------------------------------------------------------------------


class RealNode:
    """The files and command lines of one real node whose state lives in ``workdir``."""

    def __init__(self, workdir: Path, bin_dir: Path, node_bin_dir: Path, pki_dir: Path):
        self.dir = Path(workdir)
        self.bin_dir, self.node_bin_dir, self.pki_dir = Path(bin_dir), Path(node_bin_dir), Path(pki_dir)
        self.state = self.dir / "state"
        self.kubelet_dir = self.dir / "kubelet"
        self.root = cache_dir() / "containerd"  # images, kept from one plane to the next
        self.socket = self.state / "containerd.sock"
        path, self.cgroup_v1 = own_cgroup()
        self.cgroup_root = f"{path.rstrip('/')}/specdecode-node"
        self.lock_fd: int | None = None

    # -- before the API server: the lock and the bridge it binds --

    def take_lock(self) -> int:
        """Lock the machine's one real node (its bridge, address and kubelet port are the
        machine's); containerd inherits the lock and holds it while it runs."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RealNodeError(f"another real node runs on this machine (its containerd holds {LOCK}); "
                                "stop that control plane first (make cluster-down, or demo/run.py down)") from None
        self.lock_fd = fd
        return fd

    def make_bridge(self) -> None:
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "replace", f"{IP}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")

    # -- configuration --

    def write_configs(self, api_server: str, certs: dict[str, tuple[Path, Path]]) -> None:
        """Every config file; ``certs``: the kubelet's and kube-proxy's client certificate and key."""
        for d in (self.state, self.kubelet_dir, self.dir / "cni"):
            d.mkdir(parents=True, exist_ok=True)
        (self.dir / "containerd.toml").write_text(self.containerd_config())
        (self.dir / "base-spec.json").write_text(json.dumps(self.base_spec(), indent=1))
        (self.dir / "cni" / "10-specdecode.conflist").write_text(json.dumps(CNI_CONFIG, indent=1))
        for name, (crt, key) in certs.items():
            kubeconfig = {
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{"name": "local", "cluster": {
                    "server": api_server, "certificate-authority": str(self.pki_dir / "ca.crt")}}],
                "users": [{"name": name, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": name}}],
                "current-context": "local",
            }
            (self.dir / f"{name}.kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        (self.dir / "kubelet.yaml").write_text(yaml.safe_dump(self.kubelet_config()))
        (self.dir / "kube-proxy.yaml").write_text(yaml.safe_dump(self.proxy_config()))
        self._record_new_cgroups()
        self._make_cgroup_root()

    def _make_cgroup_root(self) -> None:
        """kubelet wants its cgroup root to exist in every hierarchy; a new cpuset cgroup starts with
        no CPUs and no memory nodes, so it gets its parent's."""
        for top in self._cgroup_tops():
            top.mkdir(parents=True, exist_ok=True)
            chain = [top, *top.parents]
            for d in reversed([d for d in chain if (d / "cpuset.cpus").exists()]):
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / name).read_text().strip():
                        (d / name).write_text((d.parent / name).read_text())

    def _cgroup_tops(self) -> list[Path]:
        """The node's cgroup root in each hierarchy."""
        hierarchies = [d for d in Path("/sys/fs/cgroup").iterdir() if d.is_dir() and d.name != "unified"] \
            if self.cgroup_v1 else [Path("/sys/fs/cgroup")]
        return [h / self.cgroup_root.lstrip("/") for h in hierarchies]

    def _record_new_cgroups(self) -> None:
        """Note the cgroup folders kubelet will make on the way to its root (on v1, the hierarchies
        this process sits higher in), so that cleanup removes those and no others."""
        made = []
        for top in self._cgroup_tops():
            d = top
            while not d.exists() and d != d.parent:
                made.append(str(d))
                d = d.parent
        (self.dir / "cgroups.json").write_text(json.dumps(made))

    def containerd_config(self) -> str:
        state = self.state
        return f"""version = 3
root = "{self.root}"
state = "{state}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{pause_image()}"
[plugins."io.containerd.cri.v1.runtime"]
  # Lowering a process's OOM score needs CAP_SYS_RESOURCE, which a container host may lack:
  # keep every container's score at or above containerd's own.
  restrict_oom_score_adj = true
  # Pod network namespaces live under the node's folder, so cleanup finds and unmounts them.
  netns_mounts_under_state_dir = true
[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{cni_dir()}"]
  conf_dir = "{self.dir / 'cni'}"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  base_runtime_spec = "{self.dir / 'base-spec.json'}"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  BinaryName = "{shutil.which('runc')}"
  Root = "{state / 'runc'}"
  SystemdCgroup = false
"""

    def base_spec(self) -> dict:
        """containerd's default container spec, plus the node's declaration that its accelerator
        is the CPU with GPU_MEMORY_MIB to use (the worker reads both, as a GPU node's container
        toolkit declares its devices)."""
        spec = json.loads(subprocess.run([str(self.node_bin_dir / "ctr"), "oci", "spec"], check=True,
                                         capture_output=True).stdout)
        spec["process"]["env"] = [*spec["process"].get("env", []), f"{DEVICE_ENV}=cpu",
                                  f"{DEVICE_MEMORY_ENV}={GPU_MEMORY_MIB / 1024:g}"]
        return spec

    def kubelet_config(self) -> dict:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": IP, "port": KUBELET_PORT, "readOnlyPort": 0, "healthzPort": 0,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.pki_dir / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},  # only clients with the plane's certificates get in
            # Every pod lies in a cgroup below this process's own, within the machine's limits.
            # kubelet names a pod's cgroup parent only through its QoS cgroups (without them
            # containerd puts pods in /k8s.io, outside): keep those, below cgroupRoot, and leave
            # node-allocatable unenforced, so that no limit is set on them.
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "cgroupsPerQOS": True,
            "enforceNodeAllocatable": [],
            # A shared development machine: its disk use is not the node's to police.
            "evictionHard": {}, "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "failSwapOn": False, "protectKernelDefaults": False, "localStorageCapacityIsolation": False,
            "serializeImagePulls": False, "registerNode": True, "resolvConf": "/etc/resolv.conf",
            "syncFrequency": "10s", "fileCheckFrequency": "10s", "nodeStatusReportFrequency": "10s",
        }
        if self.cgroup_v1:
            # Kubernetes 1.35 and later refuse cgroup v1 unless told otherwise; this machine's
            # cgroups are v1, and the node needs nothing that only v2 offers.
            config["failCgroupV1"] = False
        return config

    def proxy_config(self) -> dict:
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.dir / "kube-proxy.kubeconfig")},
            "mode": "iptables", "clusterCIDR": POD_SUBNET, "hostnameOverride": NAME,
            "bindAddress": IP, "healthzBindAddress": "", "metricsBindAddress": "",
            "nodePortAddresses": [f"{IP}/32"],
            # Leave the machine's conntrack settings alone (they are not this node's).
            "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }

    def commands(self) -> dict[str, list[str]]:
        """Each process's command line, in start order."""
        labels = ",".join(f"{k}={v}" for k, v in node_labels().items())
        return {
            "containerd": [str(self.node_bin_dir / "containerd"), "--config", str(self.dir / "containerd.toml")],
            "kubelet": [str(self.bin_dir / "kubelet"), f"--config={self.dir / 'kubelet.yaml'}",
                        f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}", f"--root-dir={self.kubelet_dir}",
                        f"--hostname-override={NAME}", f"--node-ip={IP}", f"--node-labels={labels}", "--v=1"],
            "kube-proxy": [str(self.bin_dir / "kube-proxy"), f"--config={self.dir / 'kube-proxy.yaml'}"],
        }

    def env(self) -> dict[str, str]:
        # containerd finds its shim next to itself; kubelet and kube-proxy find iptables and mount.
        return {"PATH": os.pathsep.join([str(self.node_bin_dir), os.environ.get("PATH", os.defpath)])}

    # -- images --

    def ctr(self, *args: str, input: bytes | None = None, stdin=None) -> subprocess.CompletedProcess:
        cmd = [str(self.node_bin_dir / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io", *args]
        result = subprocess.run(cmd, input=input, stdin=stdin, capture_output=True)
        if result.returncode != 0:
            raise RealNodeError(f"`{' '.join(cmd)}` exited {result.returncode}: {result.stderr.decode().strip()}")
        return result

    def image_labels(self) -> dict[str, str]:
        """{image name: the podman image ID it was imported from} for the images in the node."""
        out = self.ctr("images", "ls").stdout.decode().splitlines()[1:]
        found = {}
        for line in out:
            parts = line.split()
            labels = dict(kv.split("=", 1) for kv in parts[-1].split(",") if "=" in kv)
            found[parts[0]] = labels.get("specdecode.io/podman-id", "")
        return found

    def import_pause(self) -> None:
        if pause_image() not in self.image_labels():
            self.ctr("images", "import", "--local", "-", input=pause_archive(self.node_bin_dir / "pause"))

    def import_image(self, source: str, names: list[str], say: Callable[[str], None]) -> None:
        """Copy podman's ``source`` image into the node, named ``names`` (skipped when the node has
        it from the same podman image)."""
        image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", source],
                                  capture_output=True, text=True)
        if image_id.returncode != 0:
            raise RealNodeError(f"podman has no image {source}: {image_id.stderr.strip()} (build it: make images)")
        podman_id = image_id.stdout.strip()
        have = self.image_labels()
        if all(have.get(n) == podman_id for n in names):
            say(f"{source}: in the node already (podman image {podman_id[:12]})")
            return
        t0 = time.monotonic()
        say(f"{source}: copying into the node (podman save | ctr images import)")
        tmp = self.dir / "tmp"  # podman save stages the archive in $TMPDIR
        tmp.mkdir(exist_ok=True)
        save = subprocess.Popen(["podman", "save", "--format", "docker-archive", source],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, TMPDIR=str(tmp)))
        try:
            self.ctr("images", "import", "--local", "--discard-unpacked-layers",
                     "--label", f"specdecode.io/podman-id={podman_id}", "-", stdin=save.stdout)
        finally:
            save.stdout.close()
            err = save.stderr.read().decode()
            if save.wait() != 0:
                raise RealNodeError(f"podman save {source} failed: {err.strip()}")
            shutil.rmtree(tmp, ignore_errors=True)
        imported = _qualified(source)
        for name in names:
            if name != imported:
                self.ctr("images", "tag", "--force", imported, name)
            self.ctr("images", "label", name, f"specdecode.io/podman-id={podman_id}")
        say(f"{source}: in the node as {', '.join(names)} ({time.monotonic() - t0:.0f}s)")

    # -- after stop: nothing left behind --

    def cleanup(self) -> None:
        """Kill what the stopped node left running and undo what it made: containers and their
        shims, mounts under its folder, its cgroups, kube-proxy's rules and the bridge."""
        self._kill_and_unmount(lambda folder: folder == self.dir)
        made = json.loads((self.dir / "cgroups.json").read_text()) if (self.dir / "cgroups.json").exists() else []
        for top in self._cgroup_tops():
            if top.is_dir():
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    _rmdir(d)
        for d in sorted(made, key=lambda p: -len(Path(p).parts)):  # deepest first
            _rmdir(Path(d))
        proxy = self.bin_dir / "kube-proxy"
        if proxy.exists():
            subprocess.run([str(proxy), "--cleanup"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)

    def sweep_stale(self) -> None:
        """Before starting, with the lock held (so no other node runs): end what nodes killed
        before their cleanup left behind, their containers, shims and mounts."""
        self._kill_and_unmount(lambda d: d != self.dir)

    def _kill_and_unmount(self, is_gone: Callable[[Path], bool]) -> None:
        """Kill the containers below the node's cgroup and the shims of nodes ``is_gone`` says are
        gone (a node's folder: where its socket lies), then unmount what lies in those folders."""
        pids, gone = set(), set()
        top = cgroup_dir("memory", self.cgroup_root, self.cgroup_v1)
        for procs in top.rglob("cgroup.procs") if top.is_dir() else []:
            pids.update(int(p) for p in procs.read_text().split())
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv[0].endswith("containerd-shim-runc-v2") and "-address" in argv:
                socket = Path(argv[argv.index("-address") + 1])
                folder = socket.parent.parent  # <node folder>/state/containerd.sock
                if socket.name == "containerd.sock" and is_gone(folder):
                    pids.add(int(proc.name))
                    gone.add(folder)
        if self.dir.exists() and is_gone(self.dir):
            gone.add(self.dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2 if pids else 0)
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for mount in reversed(mounts):
            if any(mount.startswith(f"{folder}/") for folder in gone):
                subprocess.run(["umount", "-l", mount], capture_output=True)


def node_labels() -> dict[str, str]:
    """GPU Feature Discovery's labels, for the product that stands for this node's CPU."""
    return {
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": GPU_PRODUCT,
        "nvidia.com/gpu.count": str(GPUS), "nvidia.com/gpu.memory": str(GPU_MEMORY_MIB),
        "specdecode.io/real-node": "true",
    }


CNI_CONFIG = {
    "cniVersion": "1.0.0", "name": "specdecode-node",
    "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET, "gateway": IP}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"},
    ],
}


def pause_image() -> str:
    version = next(line.split("=", 1)[1].strip() for line in (HERE / "node.env").read_text().splitlines()
                   if line.startswith("PAUSE_VERSION="))
    return f"registry.k8s.io/pause:{version}"


def pause_archive(program: Path) -> bytes:
    """An OCI image archive of one layer holding ``program`` as /pause, named like the sandbox
    image containerd asks for (the node reaches no registry)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode = program.stat().st_size, 0o755
        tar.addfile(info, program.open("rb"))
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    layer_desc = blob(layer.getvalue(), "application/vnd.oci.image.layer.v1.tar")
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}
    config_desc = blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"io.containerd.image.name": pause_image(),
                                    "org.opencontainers.image.ref.name": pause_image().rsplit(":", 1)[1]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
                 "index.json": json.dumps(index).encode()}
        files.update({f"blobs/sha256/{d.split(':')[1]}": data for d, data in blobs.items()})
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _qualified(image: str) -> str:
    """An image reference as containerd names it (docker.io/library/ for bare names)."""
    first = image.split("/", 1)[0]
    if "/" not in image:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return image


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RealNodeError(f"`{' '.join(cmd)}` exited {result.returncode}: {result.stderr.strip()}")


def _rmdir(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass
