"""The package as users get it: a wheel built from the tree, unpacked apart from it, and a timed start of
`pagedmodel serve` from it with an unwritable home.

Tests import it as `wheel_support` (pytest puts tests/ on sys.path through the top-level conftest);
benchmarks/cold_start.py puts tests/ on sys.path itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from support import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]
# log lines that open each phase of a start (serve.py, llm_engine.py, worker.py, cpu_linear.py, app)
PHASES = (("imports", "starting: loading torch"), ("model preparation", "preparing the model"),
          ("weights", "loading the weights"), ("linear plan and packing", "packing the linear layers"),
          ("KV cache", "sizing and allocating the KV cache"), ("HTTP server", "engine ready"))


def tree_copy(dest: Path) -> Path:
    """The files git would commit (tracked, and untracked but not ignored) copied to ``dest``: what a clean
    clone of this working tree holds, without in-place builds or caches."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(work: Path, env: dict[str, str] | None = None) -> Path:
    """A wheel of this tree, built from a clean copy of it with the running Python's torch (no build
    isolation: the test environment already has the pinned torch). Returns the wheel's path."""
    source, dist = tree_copy(work / "src"), work / "dist"
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "--wheel-dir", str(dist), str(source)], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=1200)
    if run.returncode != 0:
        raise RuntimeError(f"pip wheel failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    (wheel,) = dist.glob("pagedmodel-*.whl")
    return wheel


def unpack(wheel: Path, site: Path) -> Path:
    """The wheel's files under ``site``, as pip would lay them out in site-packages (scripts aside)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    for path in site.joinpath("pagedmodel", "kernels").glob("_cpu_ops_*.so"):
        path.chmod(0o755)   # zip entries lose their mode bits here; pip restores them the same way
    return site


def unwritable_home(work: Path) -> dict[str, str]:
    """HOME and TORCH_EXTENSIONS_DIR where nothing can be written, even by root: a regular file stands where
    a directory must be, so every mkdir under it fails (ENOTDIR). What a pod's read-only root gives."""
    blocker = work / "not-a-directory"
    blocker.write_text("")
    return {"HOME": str(blocker / "home"), "TORCH_EXTENSIONS_DIR": str(blocker / "torch_extensions"),
            "XDG_CACHE_HOME": str(blocker / "cache")}


@dataclass
class StartReport:
    healthy_s: float                                        # spawn to /health 200
    first_completion_s: float                               # the first request, after healthy
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    log: str = ""
    ops_files: list[str] = field(default_factory=list)      # the CPU ops' shared objects mapped in the server
    completion: dict = field(default_factory=dict)


def timed_serve_start(cmd: list[str], env: dict[str, str], cwd: Path, model: str,
                      timeout: float = 300.0) -> StartReport:
    """Starts ``cmd`` (a `pagedmodel serve` without --port), times each phase from its log lines, waits for
    /health, answers one completion, and stops it."""
    import httpx

    port, lines, start = free_port(), [], time.monotonic()
    proc = subprocess.Popen([*cmd, "--port", str(port), "--host", "127.0.0.1"], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, line) for line in proc.stdout),
                              daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        healthy = _wait_healthy(url, proc, start, timeout, lines)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        ops_files = sorted({line.split()[-1] for line in maps.splitlines() if "_cpu_ops_" in line})
        asked = time.monotonic()
        answer = httpx.post(url + "/v1/completions", timeout=120,
                            json={"model": model, "prompt": "The capital of France is", "max_tokens": 8})
        first = time.monotonic() - asked
        answer.raise_for_status()
    finally:
        stop_process(proc)
        reader.join(10)
    log = "".join(line for _, line in lines)
    return StartReport(healthy, first, phase_seconds(lines, healthy), log, ops_files, answer.json())


def _wait_healthy(url: str, proc: subprocess.Popen, start: float, timeout: float, lines: list) -> float:
    """Seconds from ``start`` to /health's first 200."""
    import httpx

    while time.monotonic() < start + timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before /health answered:\n"
                               + "".join(line for _, line in lines)[-4000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("serve not healthy in time:\n" + "".join(line for _, line in lines)[-4000:])


def phase_seconds(lines: list[tuple[float, str]], healthy: float) -> dict[str, float]:
    """Seconds from each phase's opening line to the next phase's (the last phase ends at /health); the
    time before the first line is the interpreter's and the CLI's own start."""
    opened = [(name, next((t for t, line in lines if marker in line), None)) for name, marker in PHASES]
    opened = [(name, t) for name, t in opened if t is not None]
    ends = [t for _, t in opened[1:]] + [healthy]
    phases = {"python start": opened[0][1]} if opened else {}
    phases.update({name: end - t for (name, t), end in zip(opened, ends)})
    return phases
