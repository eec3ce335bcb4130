"""Container processes: spawned in their own session, tied to our lifetime, ended SIGTERM then SIGKILL."""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_live: dict[int, subprocess.Popen[bytes]] = {}
try:
    # Resolved once in the parent: the child must not dlopen between fork and exec (other threads may
    # have held the loader lock when we forked).
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent(parent: int) -> None:
    # Runs in the child: if the harness dies (even by SIGKILL) the kernel kills the pod process too.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # the harness died before prctl took effect
        os._exit(1)


def spawn(argv: list[str], env: dict[str, str], cwd: str, log_file: Path) -> subprocess.Popen[bytes]:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=functools.partial(_die_with_parent, os.getpid()))
    _live[proc.pid] = proc
    return proc


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def forget(proc: subprocess.Popen[bytes]) -> None:
    _live.pop(proc.pid, None)


def kill_all(grace_s: float = 2.0) -> None:
    """Last line of defence (atexit and shutdown): every process group we started goes away."""
    procs = list(_live.values())
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            pass
        # The group may outlive its leader (children of a shell); SIGKILL it regardless.
        signal_group(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        forget(proc)


def live_pids() -> list[int]:
    return [pid for pid, proc in _live.items() if proc.poll() is None]


atexit.register(kill_all)
