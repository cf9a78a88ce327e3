"""The package layout's rules, read from the import statements themselves (no module is imported).

- The engine does not import the planner or the HTTP layer: what both need lives in ``contract``
  or ``model_rules``.
- The planner, the model rules and the contract import no torch, and nothing from the engine.
- The operator imports from the worker package only ``contract`` (the engines' pinning flags
  included).
- Only tests import ``tests``.
- Model and speculator code never sees leader or follower: their one channel to the other ranks
  is their runner's ``Mirror``; nothing of theirs imports the rank driver (``parallel.distributed``).
- The engine stays split by responsibility: ``engine.py`` is the loop and its wiring, and no
  engine class grows past about 20 methods (a class that does has two jobs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker" / "specdecode_worker"


def _module(path: Path, source_root: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source_root: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved."""
    module = _module(path, source_root)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _violations(folder: Path, source_root: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{path.relative_to(ROOT)} imports {name}"
                  for path in folder.rglob("*.py")
                  for name in imports(path, source_root)
                  if any(name == f or name.startswith(f + ".") for f in forbidden))


def test_the_engine_imports_neither_the_planner_nor_the_http_layer():
    assert _violations(WORKER / "engine", WORKER.parent,
                       ("specdecode_worker.planner", "specdecode_worker.serving")) == []


def test_the_planner_the_model_rules_and_the_contract_import_no_torch_and_no_engine():
    forbidden = ("torch", "triton", "specdecode_worker.engine", "specdecode_worker.serving")
    found = [v for folder in (WORKER / "planner", WORKER / "model_rules", WORKER / "contract")
             for v in _violations(folder, WORKER.parent, forbidden)]
    for path in (WORKER / "devices.py", WORKER / "errors.py"):
        found += [f"{path.name} imports {n}" for n in imports(path, WORKER.parent)
                  if any(n == f or n.startswith(f + ".") for f in forbidden)]
    assert found == []


def test_the_operator_imports_only_the_contract_from_the_worker():
    allowed = ("specdecode_worker.contract",)
    operator = ROOT / "operator" / "specdecode_operator"
    used = {name for path in operator.rglob("*.py") for name in imports(path, operator.parent)
            if name.startswith("specdecode_worker")}
    assert used, "the operator reads the contract: an empty set means this test reads nothing"
    assert sorted(n for n in used if not any(n == a or n.startswith(a + ".") for a in allowed)) == []


def test_model_and_speculator_code_import_nothing_from_the_rank_driver():
    engine = WORKER / "engine"
    found = []
    for folder in (engine / "models", engine / "speculation", engine / "kernels", engine / "memory"):
        found += _violations(folder, WORKER.parent, ("specdecode_worker.engine.parallel.distributed",))
    for path in (engine / "model_runner.py", engine / "batch.py", engine / "forward_batch.py"):
        found += [f"{path.name} imports {n}" for n in imports(path, WORKER.parent)
                  if n.startswith("specdecode_worker.engine.parallel.distributed")]
    assert found == []
    back = [p.name for p in engine.rglob("*.py") if re.search(r"\.speculator\s*=\s*self\s*$", p.read_text(), re.M)]
    assert back == [], "no runner points back at its speculator"


def test_only_tests_import_tests():
    outside = [p for p in ROOT.rglob("*.py")
               if not p.relative_to(ROOT).parts[0].startswith((".", "tests"))]
    assert len(outside) > 100, "the walk found the repository's code"
    found = sorted(f"{p.relative_to(ROOT)} imports {n}" for p in outside
                   for n in imports(p, ROOT) if n == "tests" or n.startswith("tests."))
    assert found == []


def test_the_import_reader_resolves_relative_imports(tmp_path):
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("from ..contract import X\nfrom . import sibling\nimport torch\n")
    assert imports(pkg / "mod.py", tmp_path) >= {"pkg.contract", "pkg.contract.X", "pkg.sub.sibling", "torch"}


def _algorithm_comparisons(path: Path) -> list[int]:
    """Lines comparing something named ``algorithm`` with a string literal, or probing an attribute
    with ``hasattr``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            names = [n for n in (node.left, *node.comparators)
                     if (isinstance(n, ast.Name) and n.id == "algorithm")
                     or (isinstance(n, ast.Attribute) and n.attr == "algorithm")]
            literal = [n for n in (node.left, *node.comparators)
                       if isinstance(n, (ast.Constant, ast.Tuple, ast.List, ast.Set))]
            if names and literal:
                found.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
            found.append(node.lineno)
    return found


def test_the_engine_asks_the_algorithm_registry_not_names_and_probes():
    registry = WORKER / "engine" / "speculation" / "algorithms.py"
    found = {str(p.relative_to(ROOT)): lines for p in (WORKER / "engine").rglob("*.py")
             if p != registry and (lines := _algorithm_comparisons(p))}
    assert found == {}


def test_the_name_comparison_finder_finds_them(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('if args.algorithm == "NGRAM":\n    pass\nif algorithm in ("EAGLE",):\n    pass\n'
                      'if hasattr(fb, "mask"):\n    pass\nif method.drafts:\n    pass\n')
    assert _algorithm_comparisons(source) == [1, 3, 5]


ENGINE_LINES = 200  # engine.py: the loop and the wiring
CLASS_METHODS = 22  # any engine class


def methods_per_class(path: Path) -> dict[str, int]:
    return {node.name: sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def test_the_engine_stays_split_by_responsibility():
    assert len((WORKER / "engine" / "engine.py").read_text().splitlines()) <= ENGINE_LINES
    crowded = {f"{p.relative_to(ROOT)}:{name}": n for p in (WORKER / "engine").rglob("*.py")
               for name, n in methods_per_class(p).items() if n > CLASS_METHODS}
    assert crowded == {}


def test_the_method_counter_counts_methods_not_nested_functions(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("class A:\n    def f(self):\n        def g():\n            pass\n    @property\n"
                      "    def h(self):\n        pass\n    x = 1\nclass B:\n    pass\n")
    assert methods_per_class(source) == {"A": 2, "B": 0}


def import_graph(folder: Path, source_root: Path) -> dict[str, set[str]]:
    """Each module under ``folder`` and the modules under it that it imports (``from pkg import
    mod`` counts as importing ``pkg.mod``; importing a package counts as its ``__init__``)."""
    modules = {_module(p, source_root): p for p in folder.rglob("*.py")}
    return {m: {n for n in imports(p, source_root) if n in modules and n != m} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_engine_module_imports_one_that_imports_it_back():
    """Floors need no circle: a module that runs back up to one above it closes a loop. Imports
    under TYPE_CHECKING count too (a loop in the types is a loop in the design)."""
    graph = import_graph(WORKER / "engine", WORKER.parent)
    assert len(graph) > 40, "the walk found the engine"
    assert circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


FILE_LINES = 400  # any engine file: past it, a file holds two jobs


def test_no_engine_file_grows_past_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (WORKER / "engine").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > FILE_LINES}
    assert long == {}
