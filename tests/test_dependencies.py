"""Every module the package, the test suite and the e2e tier import is the standard library's, ours, or
from a distribution pyproject.toml declares: a machine whose Python already ships a package (this one's
ships `cryptography`) must not hide a dependency a user's fresh venv lacks."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("pagedmodel", "server", "operator", "tests", "e2e")
RUNTIME = ("pagedmodel", "server", "operator")
# imported only where the module says it is optional, behind an ImportError fallback or a device check
OPTIONAL = {"triton", "vllm", "ninja"}


def _declared(extra: str | None) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    return {_normalise(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]) for requirement in requirements}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_names() -> set[str]:
    """Top-level names our own files provide: the package, and the helpers tests and e2e import by name."""
    names = {"pagedmodel", "setup"}
    for folder in ("tests", "e2e", "benchmarks", *RUNTIME):
        for path in (REPO / folder).rglob("*"):
            if path.suffix == ".py" or (path / "__init__.py").exists():
                names.add(path.stem)
    return names | {"e2e", "tests", "benchmarks"}


def _imports(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Top-level module name -> the files that import it."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _undeclared(folders: tuple[str, ...], declared: set[str]) -> dict[str, list[str]]:
    providers = importlib.metadata.packages_distributions()
    local, missing = _local_names(), {}
    for top, files in sorted(_imports(folders).items()):
        if top in sys.stdlib_module_names or top in local or top in OPTIONAL or top == "__future__":
            continue
        if not {_normalise(d) for d in providers.get(top, [])} & declared:
            missing[f"{top} (from {', '.join(providers.get(top, ['nothing installed']))})"] = sorted(files)[:3]
    return missing


def test_the_package_imports_only_its_declared_dependencies():
    assert _undeclared(RUNTIME, _declared(None)) == {}


def test_the_suite_and_the_e2e_tier_import_only_declared_dependencies():
    assert _undeclared(SCANNED, _declared("test")) == {}
