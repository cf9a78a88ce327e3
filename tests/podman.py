"""The project's images for tests: built by images/build.sh, run with podman under the chart's
security settings.

`build_images()` returns the two image names (a rerun with unchanged inputs builds nothing).
`pod_options()` turns a pod's security contexts and emptyDirs into podman flags, so a container
here runs as it would in that pod: its user and groups, a read-only root filesystem with only the
emptyDirs writable, no capabilities, no privilege escalation. `chart_options()` is that for the
operator chart's defaults.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "images" / "build.sh"
CONTAINERS_CONF = ROOT / "images" / "containers.conf"
CHART_VALUES = ROOT / "charts" / "specdecode-operator" / "values.yaml"


class ImageBuildError(RuntimeError):
    pass


def env() -> dict[str, str]:
    return dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))


def build_images(timeout: float = 3600) -> dict[str, str]:
    """{"operator": name, "worker": name}, building what is missing (minutes when cold)."""
    operator, worker = _build_script(timeout=timeout)
    return {"operator": operator, "worker": worker}


def build_vllm_cpu_image(timeout: float = 3600) -> str:
    """The test bed's vLLM CPU image (images/vllm-cpu.Dockerfile), built when its pins are new:
    about 6 GB and several minutes cold. Its progress goes to this process's stderr."""
    (name,) = _build_script("vllm-cpu", timeout=timeout, show_progress=True)
    return name


def _build_script(*args: str, timeout: float, show_progress: bool = False) -> list[str]:
    """images/build.sh's image names (its stdout), or ImageBuildError with the end of its log."""
    if shutil.which("podman") is None and os.geteuid() != 0:
        raise ImageBuildError("podman is not installed (apt-get install podman buildah mmdebstrap runc)")
    result = subprocess.run(["bash", str(BUILD_SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=None if show_progress else subprocess.PIPE, text=True, env=env(),
                            timeout=timeout)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or "(its log is above)").splitlines()[-40:])
        raise ImageBuildError(f"images/build.sh {' '.join(args)} failed with exit code {result.returncode}:\n{tail}")
    return result.stdout.split()


def pod_options(pod_security: dict, container_security: dict, empty_dirs: dict[str, str | None]) -> list[str]:
    """podman flags for a pod's securityContext, its container's (which wins where both set a
    field) and its emptyDir mounts ({mount path: sizeLimit or None})."""
    merged = {**pod_security, **container_security}
    options = []
    if "runAsUser" in merged:
        options += ["--user", f"{merged['runAsUser']}:{merged.get('runAsGroup', merged['runAsUser'])}"]
    if "fsGroup" in pod_security:
        options += ["--group-add", str(pod_security["fsGroup"])]
    if merged.get("readOnlyRootFilesystem"):
        # Only the pod's emptyDirs are writable, not the extra tmpfs mounts podman adds by default.
        options += ["--read-only", "--read-only-tmpfs=false"]
    for path, limit in empty_dirs.items():
        size = f",size={_tmpfs_size(limit)}" if limit else ""
        options += ["--tmpfs", f"{path}:rw,mode=1777{size}"]
    for cap in merged.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", cap]
    if merged.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    assert not merged.get("privileged"), "a privileged container is asked for"
    return options


def chart_options() -> list[str]:
    """pod_options for the chart's default values and its Deployment's emptyDir at /tmp."""
    values = yaml.safe_load(CHART_VALUES.read_text())
    return pod_options(values["podSecurityContext"], values["securityContext"], {"/tmp": "64Mi"})


def _tmpfs_size(quantity: str) -> str:
    """A Kubernetes quantity (64Mi, 1Gi, 1000000) as tmpfs's size option."""
    units = {"Ki": "k", "Mi": "m", "Gi": "g"}
    for suffix, tmpfs in units.items():
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + tmpfs
    assert quantity.isdigit(), f"unsupported quantity {quantity}"
    return quantity


def run(image: str, *args: str, options: list[str] | tuple[str, ...] = (), entrypoint: str | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`podman run --rm` without network, returning its output."""
    cmd = ["podman", "run", "--rm", "--network", "none", *options]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return subprocess.run([*cmd, image, *args], capture_output=True, text=True, env=env(), timeout=timeout)


def inspect(image: str) -> dict:
    out = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, env=env(),
                         check=True)
    return yaml.safe_load(out.stdout)[0]
