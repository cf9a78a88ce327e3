"""Static checks of the two images (no container engine here, so they cannot be built in tests).

Each Dockerfile must be multi-stage, on pinned bases, run as a non-root user, copy only paths that
exist, and start an entry point that the distribution really declares. The operator image must
not need torch: neither its declared dependency closure nor its code may pull it in.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_ROOTS = [ROOT / d for d in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]]
IMAGES = {"operator": ROOT / "operator" / "Dockerfile", "worker": ROOT / "worker" / "Dockerfile"}
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
    df = parse_dockerfile(IMAGES[image])
    assert len(df.stages) >= 2, f"{image}: build and runtime stages expected"
    for stage in df.stages:
        assert "$" not in stage.base, f"{image}: FROM {stage.base} uses an ARG without a default"
        name, _, tag = stage.base.partition("@")[0].rpartition(":")
        pinned_by_digest = "@sha256:" in stage.base
        assert name and (pinned_by_digest or re.search(r"\d+\.\d+\.\d+", tag)), (
            f"{image}: base {stage.base} is not pinned to an exact version (x.y.z tag or digest)"
        )
        assert tag != "latest"
    runtime = df.stages[-1]
    copied_from = [r for k, r in runtime.instructions if k == "COPY" and "--from=" in r]
    assert copied_from, f"{image}: the runtime stage should copy the built environment from a stage"
    stage_names = {s.name for s in df.stages[:-1]}
    for rest in copied_from:
        source_stage = re.search(r"--from=(\S+)", rest).group(1)
        assert source_stage in stage_names, f"{image}: COPY --from={source_stage} names no stage"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runtime_stage_runs_as_non_root(image):
    runtime = parse_dockerfile(IMAGES[image]).stages[-1]
    users = [rest for keyword, rest in runtime.instructions if keyword == "USER"]
    assert users, f"{image}: the runtime stage never sets USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, f"{image}: runtime user is {users[-1]}"
    assert user.isdigit(), (
        f"{image}: use a numeric USER so that Kubernetes runAsNonRoot can verify it, got {user}"
    )


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copy_sources_exist_in_the_build_context(image):
    df = parse_dockerfile(IMAGES[image])
    sources = []
    for stage in df.stages:
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
    runtime = parse_dockerfile(IMAGES[image]).stages[-1]
    entries = [rest for keyword, rest in runtime.instructions if keyword == "ENTRYPOINT"]
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
    text = " ".join(r for s in parse_dockerfile(IMAGES[image]).stages for k, r in s.instructions if k == "RUN")
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
