"""SIGTERM, as Kubernetes sends it: stop accepting, let in-flight requests finish (up to a timeout), exit 0."""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from support import wait_until

from .conftest import ServerProcess

REAL_MODEL_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", str(64 << 20))


def _stream_in_background(srv: ServerProcess, max_tokens: int) -> tuple[threading.Thread, list[str], threading.Event]:
    """A streaming request on its own thread; `started` is set once its first chunk has arrived."""
    lines: list[str] = []
    started = threading.Event()

    def run() -> None:
        body = {"prompt": "shutdown test", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as exc:   # a stream cut by the shutdown timeout
            lines.append(f"ERROR {type(exc).__name__}")
        finally:
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, lines, started


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


@pytest.mark.slow
def test_sigterm_drains_in_flight_stream_then_exits_zero(smollm2_dir: Path, tmp_path: Path) -> None:
    # the real model, not the tiny one: its 300 steps take seconds on any machine (the tiny model's ~1 ms steps
    # raced the signal on a fast one), so the stream is still running when SIGTERM lands
    srv = ServerProcess(smollm2_dir, tmp_path / "server.log", *REAL_MODEL_ARGS).wait_ready()
    try:
        thread, lines, started = _stream_in_background(srv, max_tokens=300)
        assert started.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        # the listening socket closes at once, while the stream is still being served
        assert wait_until(lambda: _refused(srv.base_url), timeout=5), "still accepting connections after SIGTERM"
        assert thread.is_alive(), "the stream should still be in flight while new connections are refused"
        thread.join(60)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 300          # the in-flight request was completed, not cut
    finishes = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-2]]
    assert finishes[-1] == "length"
    assert "draining in-flight requests" in srv.log()


@pytest.mark.slow
def test_sigterm_shutdown_timeout_bounds_the_drain(smollm2_dir: Path, server_model_dir: Path, tmp_path: Path) -> None:
    # 1,000 steps of the real model take far longer than the 0.5 s the drain is given
    srv = ServerProcess(smollm2_dir, tmp_path / "server.log", *REAL_MODEL_ARGS, "--shutdown-timeout", "0.5").wait_ready()
    try:
        thread, lines, started = _stream_in_background(srv, max_tokens=1000)
        assert started.wait(30)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log()
        waited = time.monotonic() - t0
        thread.join(30)
    finally:
        srv.stop()
    assert waited < 15
    # cut off: 1,000 tokens were not done within the timeout. The client sees the connection drop, or (when
    # the engine loop stops first) an in-band engine_error event and [DONE]; never a finished completion.
    assert not any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    assert lines[-1].startswith("ERROR") or any("engine_error" in line for line in lines[-2:]), lines[-3:]
    # an idle server exits promptly with status 0 as well
    idle = ServerProcess(server_model_dir, tmp_path / "idle.log", "--max-model-len", "128",
                         "--kv-cache-memory", str(4 << 20)).wait_ready()
    t0 = time.monotonic()
    assert idle.stop() == 0
    assert time.monotonic() - t0 < 10
