"""One control-plane process (etcd, kube-apiserver, ...): started with its log file, health-checked
over HTTP(S), stopped SIGTERM then SIGKILL, and killed by the kernel if the harness dies."""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved before fork, never in the child
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent(parent: int) -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Component:
    def __init__(self, name: str, argv: list[str], log_dir: Path, health_url: str,
                 ssl_context: ssl.SSLContext | None = None, *,
                 health_check: Callable[[], bool] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_file = Path(log_dir) / f"{name}.log"
        self.health_url = health_url   # or, for a daemon without an HTTP health endpoint, health_check
        self.ssl_context = ssl_context
        self.health_check = health_check
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=functools.partial(_die_with_parent, os.getpid()))

    def healthy(self) -> bool:
        if self.health_check is not None:
            return self.health_check()
        try:
            with urllib.request.urlopen(self.health_url, timeout=2, context=self.ssl_context) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; last log lines:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy at {self.health_url} in time; last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # anything left in the group
        except (ProcessLookupError, PermissionError):
            pass
