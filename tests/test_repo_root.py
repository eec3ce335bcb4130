"""Python started from the repository root, as the README's commands start it, gets the standard library's
modules: the card's top-level `operator/` folder must not shadow the standard library's `operator`."""
from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_operator_from_the_repo_root_is_the_standard_library():
    """-S: no .pth file imports collections (and so the real operator) before the repo root is searched."""
    code = "import operator; print(operator.__file__); print(operator.__spec__.origin); print(operator.eq(1, 1))"
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    path, origin, equal = run.stdout.split()
    stdlib = Path(os.__file__).parent / "operator.py"     # the standard library's folder, as `os` is found
    assert Path(path) == Path(origin) == stdlib and equal == "True"


def test_a_fresh_venv_runs_pip_from_the_repo_root(tmp_path):
    """What a user's `pip install -e .` does first: a venv with no .pth files, started from the checkout
    (it died with `cannot import name 'eq' from 'operator'`)."""
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    for code in ("import collections, functools, pickle, operator; print(pickle.loads(pickle.dumps(operator.itemgetter(1)))([5, 6]))",
                 "import runpy, operator; print(operator.__spec__.origin)"):
        run = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        assert str(REPO) not in run.stdout
