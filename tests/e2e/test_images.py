"""The two images: static checks of the Dockerfile, then the built images run with podman.

Static: each image's target in the Dockerfile must be multi-stage, on pinned bases, run as a
non-root user, copy only paths that exist, and start an entry point that the distribution really
declares. The operator image must not need torch: neither its declared dependency closure nor its
code may pull it in.

Built (marked `images` and `e2e`, so `make test-unit` skips them; images/build.sh builds the
images once, keyed by their inputs): each entry point's --help is the local CLI's; both images run
as the chart's UID under its read-only root filesystem; the operator image has no torch; the
worker image imports the engine and plans a checkpoint mounted read-only exactly as the local CLI
does; and the operator image, run with the chart Deployment's arguments and nothing but the chart
ServiceAccount's token, reconciles an example to Ready on the local control plane.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import podman
from tests.chart_helpers import OperatorProcess
from devtools.cluster.controlplane import free_ports

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_ROOTS = [ROOT / d for d in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]]
DOCKERFILE = ROOT / "Dockerfile"
IMAGES = ("operator", "worker")  # the Dockerfile's targets, one per image
# Anything that would drag the CUDA stack into the operator image.
TORCH_STACK = {"torch", "triton", "transformers", "safetensors", "nvidia-ml-py"}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    args: dict[str, str]
    stages: list[Stage]


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions with continuations joined; global ARG defaults substituted into FROM."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a line continuation"

    args: dict[str, str] = {}
    stages: list[Stage] = []
    for instr in logical:
        keyword, _, rest = instr.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif not stages and keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip().strip('"')
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(args=args, stages=stages)


def copied_from(stage: Stage) -> list[str]:
    """The stages (or images) that a stage's COPY --from instructions name."""
    return [re.search(r"--from=(\S+)", r).group(1) for k, r in stage.instructions if k == "COPY" and "--from=" in r]


def lineage(df: Dockerfile, target: str) -> list[Stage]:
    """``target`` and the stages it is built on, base first: what its image inherits."""
    by_name = {s.name: s for s in df.stages if s.name}
    assert target in by_name, f"the Dockerfile has no target {target}"
    chain = [by_name[target]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def target_stages(df: Dockerfile, target: str) -> list[Stage]:
    """Every stage that building ``target`` runs: the stages it is built on and copies from, and
    theirs, in file order."""
    by_name = {s.name: s for s in df.stages if s.name}
    needed, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        assert name in by_name, f"{target}: COPY --from={name} names no stage"
        needed.add(name)
        stage = by_name[name]
        todo += copied_from(stage) + ([stage.base] if stage.base in by_name else [])
    return [s for s in df.stages if s.name in needed]


def inherited(df: Dockerfile, target: str, keyword: str) -> list[str]:
    return [rest for stage in lineage(df, target) for k, rest in stage.instructions if k == keyword]


def exec_form(value: str) -> list[str]:
    value = value.strip()
    assert value.startswith("["), f"use the exec form (a JSON list), got: {value}"
    return ast.literal_eval(value)


def copy_sources(rest: str) -> list[str] | None:
    """Source paths of a COPY from the build context; None when it copies from a stage."""
    tokens = rest.split()
    if any(t.startswith("--from=") for t in tokens):
        return None
    paths = [t for t in tokens if not t.startswith("--")]
    return paths[:-1]


def entry_module(script: str) -> tuple[Path, str]:
    target = PYPROJECT["project"]["scripts"][script]
    module, _, func = target.partition(":")
    rel = Path(*module.split("."))
    for root in SOURCE_ROOTS:
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate, func
    pytest.fail(f"console script {script} points at {module}, which is not under {SOURCE_ROOTS}")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_is_multistage_on_pinned_bases(image):
    df = parse_dockerfile(DOCKERFILE)
    stages = target_stages(df, image)
    assert len(stages) >= 2, f"{image}: build and runtime stages expected"
    for i, stage in enumerate(stages):
        if stage.base in {s.name for s in stages[:i]}:
            continue  # built on an earlier stage, which is itself checked
        assert "$" not in stage.base, f"{image}: FROM {stage.base} uses an ARG without a default"
        name, _, tag = stage.base.partition("@")[0].rpartition(":")
        pinned_by_digest = "@sha256:" in stage.base
        assert name and (pinned_by_digest or re.search(r"\d+\.\d+\.\d+", tag)), (
            f"{image}: base {stage.base} is not pinned to an exact version (x.y.z tag or digest)"
        )
        assert tag != "latest"
    assert any(copied_from(s) for s in lineage(df, image)), (
        f"{image}: the runtime stage should copy the built environment from a stage")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runtime_stage_runs_as_non_root(image):
    users = inherited(parse_dockerfile(DOCKERFILE), image, "USER")
    assert users, f"{image}: the runtime stage never sets USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, f"{image}: runtime user is {users[-1]}"
    assert user.isdigit(), (
        f"{image}: use a numeric USER so that Kubernetes runAsNonRoot can verify it, got {user}"
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copy_sources_exist_in_the_build_context(image):
    sources = []
    for stage in target_stages(parse_dockerfile(DOCKERFILE), image):
        for keyword, rest in stage.instructions:
            assert keyword != "ADD", f"{image}: use COPY, not ADD ({rest})"
            if keyword == "COPY" and (paths := copy_sources(rest)) is not None:
                sources.extend(paths)
    assert sources, f"{image}: copies nothing from the repository"
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"{image}: COPY sources missing from the repository root: {missing}"
    # The source roots of the distribution must all be copied, or pip cannot build it.
    for root in SOURCE_ROOTS:
        pkg_dirs = [p for p in root.iterdir() if (p / "__init__.py").is_file()]
        for pkg in pkg_dirs:
            rel = str(pkg.relative_to(ROOT))
            assert any(rel == s.rstrip("/") or rel.startswith(s.rstrip("/") + "/") for s in sources), (
                f"{image}: package {rel} is not copied into the build"
            )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entry_point_is_a_declared_console_script_that_exists(image):
    entries = inherited(parse_dockerfile(DOCKERFILE), image, "ENTRYPOINT")
    assert entries, f"{image}: no ENTRYPOINT"
    script = exec_form(entries[-1])[0]
    assert script == f"specdecode-{image}", f"{image}: unexpected entry point {script}"
    assert script in PYPROJECT["project"]["scripts"], f"{script} is not in [project.scripts]"
    path, func = entry_module(script)
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert func in defined | imported, f"{path} does not define {func}() for {script}"


@pytest.mark.parametrize("image,extra", [("operator", "operator"), ("worker", "worker")])
def test_image_installs_its_own_extra(image, extra):
    stages = target_stages(parse_dockerfile(DOCKERFILE), image)
    text = " ".join(r for s in stages for k, r in s.instructions if k == "RUN")
    installed = set(re.findall(r'"?\.\[([a-z,]+)\]"?', text))
    assert installed == {extra}, f"{image}: installs extras {installed}, expected only [{extra}]"


def _closure(requirements: list[str]) -> dict[str, str]:
    """Installed distributions reachable from `requirements` -> the requirement that reached them."""
    env = default_environment()
    seen: dict[str, str] = {}
    queue = [(Requirement(r), "pyproject") for r in requirements]
    while queue:
        req, parent = queue.pop()
        if req.marker and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen[name] = parent
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} (needed by {parent}) is not installed: run `make setup`")
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            if sub_req.marker:
                wanted = [{**env, "extra": e} for e in sorted(req.extras)] or [{**env, "extra": ""}]
                if not any(sub_req.marker.evaluate(w) for w in wanted):
                    continue
                sub_req.marker = None
            queue.append((sub_req, name))
    return seen


def test_operator_dependency_closure_excludes_torch():
    declared = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["operator"]
    closure = _closure(declared)
    assert {"kopf", "kubernetes"} <= set(closure), "the closure walk found nothing: it is broken"
    leaked = {n: closure[n] for n in closure if n in TORCH_STACK or n.startswith("nvidia-")}
    assert not leaked, f"the operator's dependencies pull in the torch stack: {leaked}"
    # The reference: the worker's closure does contain torch, so the walk can see it.
    worker = _closure(PYPROJECT["project"]["optional-dependencies"]["worker"])
    assert "torch" in worker


def test_operator_code_imports_without_torch():
    """Every operator module imports with torch made unimportable (as in the operator image)."""
    code = (
        "import sys, importlib, pkgutil\n"
        "for blocked in ('torch', 'transformers', 'safetensors', 'triton'):\n"
        "    sys.modules[blocked] = None\n"
        "import specdecode_operator as p\n"
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')\n"
        "         if not m.name.endswith('__main__')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"an operator module needs torch or fails to import:\n{out.stderr}"
    assert int(out.stdout.strip()) >= 1, "no operator modules found"



# ---- the built images, run with podman ------------------------------------------------------------

BIN = Path(sys.executable).parent  # the local CLIs: the reference for what the images print
CHART_VALUES = yaml.safe_load((ROOT / "charts" / "specdecode-operator" / "values.yaml").read_text())
CHART_UID = CHART_VALUES["podSecurityContext"]["runAsUser"]
CHART_GID = CHART_VALUES["podSecurityContext"]["runAsGroup"]
H100 = "NVIDIA-H100-80GB-HBM3"


def built(test):
    """A test of the built images: skipped by `make test-unit`; the first build takes minutes."""
    for mark in (pytest.mark.images, pytest.mark.e2e, pytest.mark.timeout(3600)):
        test = mark(test)
    return test


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    try:
        return podman.build_images()
    except podman.ImageBuildError as exc:
        pytest.fail(str(exc))


def python_in(image: str, code: str, options: list[str]) -> dict:
    """Run `code` with the image's Python; it prints one JSON object."""
    ran = podman.run(image, "-c", code, entrypoint="python", options=options)
    assert ran.returncode == 0, f"python in {image} exited {ran.returncode}:\n{ran.stderr}"
    return json.loads(ran.stdout.splitlines()[-1])


@built
@pytest.mark.parametrize("image,args", [
    ("operator", ["--help"]),
    ("worker", ["--help"]),
    ("worker", ["plan", "--help"]),
    ("worker", ["serve", "--help"]),
], ids=["operator", "worker", "worker-plan", "worker-serve"])
def test_entry_point_help_is_the_local_clis(images, image, args):
    ran = podman.run(images[image], *args, options=["--env", "COLUMNS=100", *podman.chart_options()])
    assert ran.returncode == 0, f"{image} {' '.join(args)} exited {ran.returncode}:\n{ran.stderr}"
    local = subprocess.run([str(BIN / f"specdecode-{image}"), *args], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, COLUMNS="100"))
    assert local.returncode == 0, local.stderr
    assert "usage: specdecode-" in ran.stdout
    assert ran.stdout == local.stdout


CODE_PROBE = """
import hashlib, json, pathlib, specdecode_operator, specdecode_worker
files = {}
for pkg in (specdecode_operator, specdecode_worker):
    root = pathlib.Path(pkg.__file__).parent
    for f in root.rglob('*.py'):
        files[f"{pkg.__name__}/{f.relative_to(root)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
print(json.dumps(files))
"""


@built
@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_holds_this_checkouts_code(images, image):
    """Every module file in the image is the checkout's, byte for byte (no stale build cache)."""
    local = {}
    for root in SOURCE_ROOTS:
        for f in root.glob("specdecode_*/**/*.py"):
            rel = f.relative_to(root)
            local[str(rel)] = hashlib.sha256(f.read_bytes()).hexdigest()
    in_image = python_in(images[image], CODE_PROBE, options=podman.chart_options())
    stale = sorted(name for name in local.keys() | in_image.keys() if local.get(name) != in_image.get(name))
    assert len(local) > 10 and not stale, f"{image} image differs from the checkout in: {stale[:10]}"


WRITE_PROBE = """
import errno, json, os
def writable(d):
    try:
        with open(os.path.join(d, '.probe'), 'w'):
            return 'yes'
    except OSError as e:
        return errno.errorcode[e.errno]
print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'code': writable('/opt/specdecode'),
                  'tmp': writable('/tmp'), 'home': os.path.expanduser('~')}))
"""


@built
@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_runs_as_the_chart_user_and_under_a_read_only_root(images, image):
    # The image's own user (no --user) is the one the chart's securityContext names.
    own = python_in(images[image], WRITE_PROBE, options=[])
    assert (own["uid"], own["gid"]) == (CHART_UID, CHART_GID) == (10001, 10001)
    assert own["code"] == "EACCES", "the image's user may change its own code"
    # Under the chart's pod settings: read-only root, only the /tmp emptyDir writable.
    chart = python_in(images[image], WRITE_PROBE, options=podman.chart_options())
    assert (chart["uid"], chart["gid"]) == (CHART_UID, CHART_GID)
    assert chart["code"] == "EROFS" and chart["tmp"] == "yes"


PACKAGES_PROBE = """
import importlib.metadata as m, importlib.util, json
print(json.dumps({'torch': importlib.util.find_spec('torch') is not None,
                  'dists': sorted({d.metadata['Name'].lower() for d in m.distributions()})}))
"""


@built
def test_operator_image_has_no_torch(images):
    operator = python_in(images["operator"], PACKAGES_PROBE, options=podman.chart_options())
    assert {"kopf", "kubernetes", "specdecode"} <= set(operator["dists"])
    leaked = [d for d in operator["dists"] if d in TORCH_STACK or d.startswith("nvidia-")]
    assert not operator["torch"] and not leaked, f"the operator image has the torch stack: {leaked}"
    # The reference: the same probe sees torch where it is installed.
    worker = python_in(images["worker"], PACKAGES_PROBE, options=podman.chart_options())
    assert worker["torch"] and "torch" in worker["dists"]


def apply_fs_group(root: Path, gid: int) -> None:
    """What kubelet does to a volume for a pod's fsGroup: group-owned, group-readable."""
    for path in [root, *root.rglob("*")]:
        os.chown(path, -1, gid)
        path.chmod(path.stat().st_mode | (0o050 if path.is_dir() else 0o040))


@built
def test_worker_image_imports_the_engine_and_plans_a_read_only_checkpoint_like_the_local_cli(images, tmp_path):
    from devtools.tiny_models import write_tiny_pair

    options = [*podman.chart_options(), "--env", "CUDA_VISIBLE_DEVICES="]
    engine = python_in(images["worker"], "import json, specdecode_worker.engine as e; "
                       "print(json.dumps({'file': e.__file__}))", options=options)
    assert engine["file"].startswith("/opt/specdecode/")

    store = tmp_path / "models"
    target, draft = write_tiny_pair(store, "llama")
    apply_fs_group(store, CHART_VALUES["podSecurityContext"]["fsGroup"])
    args = ["--algorithm", "STANDALONE", "--gpu-product", H100, "--context-length", "256", "--output", "json"]
    ran = podman.run(images["worker"], "plan", "--target", f"/models/{target.name}", "--draft",
                     f"/models/{draft.name}", *args, options=[*options, "--volume", f"{store}:/models:ro"])
    assert ran.returncode == 0, f"plan in the worker image exited {ran.returncode}:\n{ran.stderr}"
    local = subprocess.run([str(BIN / "specdecode-worker"), "plan", "--target", str(target), "--draft", str(draft),
                            *args], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert local.returncode == 0, local.stderr
    plan = json.loads(ran.stdout)
    assert plan == json.loads(local.stdout)
    assert plan["fits"] and plan["target"] == target.name and plan["draft"] == draft.name


# ---- the operator image on the local control plane ------------------------------------------------

RELEASE = "sdo-image"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where kubelet mounts the token


class OperatorContainer(OperatorProcess):
    """The operator image run as the chart's Deployment would run it: its image, arguments, env
    and security settings, with only a token of the chart's ServiceAccount mounted where kubelet
    mounts it. Host network, to reach the API server on loopback; the liveness endpoint moves to
    a free loopback port (the chart's 8080 on 0.0.0.0 could be taken on a shared host)."""

    what = "operator container"

    def __init__(self, cluster, namespace: str, deployment: dict, token_dir: Path, log: Path):
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        self.name = f"specdecode-operator-test-{uuid.uuid4().hex[:8]}"
        port = free_ports(1)[0]
        self.health = f"http://127.0.0.1:{port}/healthz"
        args = [a for a in container["args"] if not a.startswith("--liveness=")] + [f"--liveness={self.health}"]
        server = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
        host, _, api_port = server.removeprefix("https://").rpartition(":")
        env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": api_port}
        fields = {"metadata.namespace": namespace, "metadata.name": self.name}
        for item in container.get("env", []):
            env[item["name"]] = item["value"] if "value" in item else fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        empty_dirs = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod.get("volumes", []) if "emptyDir" in v}
        mounts = {m["mountPath"]: empty_dirs[m["name"]] for m in container.get("volumeMounts", [])
                  if m["name"] in empty_dirs}
        options = podman.pod_options(pod.get("securityContext", {}), container.get("securityContext", {}), mounts)
        cmd = ["podman", "run", "--rm", "--name", self.name, "--network", "host", *options,
               "--volume", f"{token_dir}:{SA_DIR}:ro", *(f"--env={k}={v}" for k, v in env.items()),
               container["image"], *args]
        self.launch(cmd, podman.env(), log, timeout=120)

    def stop(self) -> None:
        subprocess.run(["podman", "stop", "--time", "20", self.name], env=podman.env(), capture_output=True)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            subprocess.run(["podman", "rm", "--force", self.name], env=podman.env(), capture_output=True)
            self.proc.wait()
        self._out.close()


def service_account_volume(cluster, namespace: str, sa: str, path: Path) -> Path:
    """What kubelet projects into a pod for its ServiceAccount: token, ca.crt, namespace."""
    path.mkdir(mode=0o755)
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    ca = yaml.safe_load(Path(cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["certificate-authority-data"]
    for name, content in {"token": token, "ca.crt": base64.b64decode(ca).decode(), "namespace": namespace}.items():
        (path / name).write_text(content)
        (path / name).chmod(0o644)
    return path


@built
def test_operator_image_reconciles_an_example_with_the_chart_deployment_and_token(images, cluster, namespace,
                                                                                  tmp_path):
    from tests.chart_helpers import CHART, assert_example_reconciles

    ns = namespace
    repository, _, tag = images["operator"].rpartition(":")
    cluster.helm("install", RELEASE, str(CHART), "-n", ns, "--wait", "--timeout", "120s",
                 "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                 "--set", "image.pullPolicy=Never")  # built here, in no registry
    sa = f"{RELEASE}-specdecode-operator"
    deployment = json.loads(cluster.kubectl("get", "deployment", sa, "-n", ns, "-o", "json").stdout)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == images["operator"]
    token_dir = service_account_volume(cluster, ns, sa, tmp_path / "serviceaccount")
    op = OperatorContainer(cluster, ns, deployment, token_dir, tmp_path / "operator-container.log")
    try:
        assert_example_reconciles(cluster, op, ns, "tiny-image")
        cluster.kubectl("delete", "sdd", "tiny-image", "-n", ns, "--wait=true", timeout=120)
    finally:
        op.stop()
        print(f"--- operator container log (tail) ---\n{op.tail(80)}")
    cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "120s")
