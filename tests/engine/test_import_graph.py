"""The engine's and the kernels' modules form no import loop, and the scheduler loads no torch.

Every import counts: at module level, under TYPE_CHECKING and inside functions (a loop closed by a lazy
import is still a loop: the two modules cannot be understood, or moved, apart). Records the step passes
along live in step_types.py, a leaf, so that producers and consumers need not import each other.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# installed package name -> folder (setup.py's PACKAGE_DIRS for the packages this test covers)
PACKAGES = {"pagedmodel.server.engine": REPO / "server" / "engine", "pagedmodel.kernels": REPO / "pagedmodel" / "kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _imported_names(path: Path, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement anywhere in the file names, relative ones made absolute; for
    ``from X import y`` both ``X`` and ``X.y`` (y may be a submodule)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            root = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(root + ([node.module] if node.module else []))
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {n for n in _imported_names(p, m, p.name == "__init__.py") if n in modules and n != m}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks():
    graph = import_graph()
    # step_types names the beam search's hypothesis type under TYPE_CHECKING only
    assert "pagedmodel.server.engine.beam_search" in graph["pagedmodel.server.engine.step_types"]
    assert "pagedmodel.server.engine.step_types" in graph["pagedmodel.server.engine.scheduler"]


def test_no_import_cycle_in_the_engine_or_the_kernels():
    assert cycles(import_graph()) == []


def test_the_scheduler_loads_no_torch():
    code = "import sys, pagedmodel.server.engine.scheduler; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
