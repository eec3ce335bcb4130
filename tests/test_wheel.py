"""The wheel as users install it: built from a clean copy of the tree, unpacked away from the source tree,
every module imported from it, and `pagedmodel serve` started from it with an unwritable home.

Every other test imports the source tree, so a module left out of the wheel (as server/engine/lora/ once
was) or ops that compile at first start (impossible under a pod's read-only root) pass everywhere else.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from pagedmodel.kernels import cpu_isa
from wheel_support import REPO, build_wheel, timed_serve_start, unpack, unwritable_home

pytestmark = pytest.mark.model
# source folder -> where its modules land in the wheel
LAYOUT = {"pagedmodel": "pagedmodel", "server": "pagedmodel/server", "operator": "pagedmodel/operator"}
IMPORT_ALL = """
import importlib, pkgutil, sys
import pagedmodel
site = sys.argv[1]
# the CPU ops' shared objects are torch libraries (torch.ops.load_library), not Python modules
names = ["pagedmodel"] + [m.name for m in pkgutil.walk_packages(pagedmodel.__path__, "pagedmodel.")
                          if not m.name.rpartition(".")[2].startswith("_cpu_ops_")]
failed = []
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    if not getattr(module, "__file__", "").startswith(site):
        failed.append(f"{name}: imported from {module.__file__}, not the wheel")
print(len(names), "modules")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the wheel, its files unpacked, a scratch folder outside the repo)."""
    work = tmp_path_factory.mktemp("wheel")
    built = build_wheel(work)
    return built, unpack(built, work / "site"), work


def _outside_repo_env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", **extra}


def test_the_wheel_holds_every_module_and_the_compiled_ops(wheel):
    built, _, _ = wheel
    names = set(zipfile.ZipFile(built).namelist())
    tracked = subprocess.run(["git", "ls-files", *LAYOUT], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    expected = {LAYOUT[path.split("/", 1)[0]] + "/" + path.split("/", 1)[1] for path in tracked if path.endswith(".py")}
    assert len(expected) > 100 and sorted(expected - names) == []
    assert "pagedmodel/operator/crd.yaml" in names         # package data: the operator's defaults come from it
    for level in cpu_isa.LEVELS:
        assert any(n.startswith(f"pagedmodel/kernels/{level.extension}.") and n.endswith(".so") for n in names), level
    manifest = json.loads(zipfile.ZipFile(built).read("pagedmodel/kernels/cpu_ops_build.json"))
    assert {name for name, entry in manifest["levels"].items() if "file" in entry} == set(cpu_isa.BY_NAME)
    assert not any(n.endswith((".cpp", ".h")) for n in names)   # compiled: the sources stay in kernels/


def test_every_module_imports_from_the_wheel(wheel):
    _, site, work = wheel
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(site)], cwd=work, env=_outside_repo_env(site),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_serve_from_the_wheel_with_an_unwritable_home(wheel, smollm2_dir):
    """Loads the installed ops (not the torch fallback, nothing compiled or written), answers a completion;
    a start killed half-way leaves nothing behind that holds up the next one."""
    _, site, work = wheel
    env = _outside_repo_env(site, **unwritable_home(work), PAGEDMODEL_CACHE_DIR=str(smollm2_dir.parents[1]),
                            PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pagedmodel.cli", "serve"]
    _killed_while_loading(cmd, env, work)
    report = timed_serve_start(cmd, env, work, model="SmolLM2-135M-Instruct")
    print("start from the wheel:", {name: round(s, 2) for name, s in report.phases.items()},
          f"healthy {report.healthy_s:.1f} s, first completion {report.first_completion_s:.2f} s")
    assert report.ops_files and all(path.startswith(str(site)) for path in report.ops_files), report.ops_files
    assert "CPU ops: the " in report.log and "unavailable" not in report.log, report.log[-3000:]
    assert report.completion["choices"][0]["text"] and report.completion["usage"]["completion_tokens"] == 8


def _killed_while_loading(cmd: list[str], env: dict[str, str], work: Path) -> None:
    """SIGKILL a start as it loads the CPU ops (what a kubelet does to a pod that overruns its grace period)."""
    proc = subprocess.Popen([*cmd, "--port", "0"], cwd=work, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "CPU ops: the " in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def test_without_a_compiler_the_package_installs_and_says_why_the_ops_are_missing(tmp_path):
    built = build_wheel(tmp_path, env={"CXX": str(tmp_path / "no-such-c++"), "CC": str(tmp_path / "no-such-cc")})
    site = unpack(built, tmp_path / "site")
    manifest = json.loads((site / "pagedmodel" / "kernels" / "cpu_ops_build.json").read_text())
    assert all("error" in entry and "file" not in entry for entry in manifest["levels"].values()), manifest
    probe = ("from pagedmodel.kernels import cpu_ops, torch_attention\n"
             "assert cpu_ops.load() is None and cpu_ops.paged_attention() is None\n"
             "print(cpu_ops.load_error())")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_outside_repo_env(site),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the CPU ops did not build at install" in run.stdout and "a C++ compiler" in run.stdout
    assert run.stderr.count("CPU ops unavailable") == 1   # one warning, however many ops are asked for
