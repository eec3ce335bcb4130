"""Helpers for tests and benchmarks that start real servers: free ports, polling, /health, stopping.

Tests import it as `support` (pytest puts tests/ on sys.path through the top-level conftest);
benchmarks put tests/ on sys.path themselves.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _log_text(log: Path | None) -> str:
    return log.read_text(errors="replace") if log is not None and log.exists() else "(no log)"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0, log: Path | None = None,
                 interval: float = 0.2) -> None:
    """Wait for GET `url`/health to answer 200; fail early, with the log, if `proc` exits first."""
    import httpx  # lazily: benchmarks that never start a server need not have it

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode} before /health answered:\n"
                               f"{_log_text(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s:\n{_log_text(log)}")


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def start_cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m pagedmodel.cli ARGS` in the background, output to ``log``, one OpenMP thread."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def assert_openai_error(status: int, body: bytes | str, expected: int, param: str | None = None) -> dict:
    """The answer is ``expected`` with an OpenAI-style error body (naming ``param`` when given); returns it."""
    assert status == expected, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) > 5
    if param is not None:
        assert err["param"] == param, err
    return err
