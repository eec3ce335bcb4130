"""Real `pagedmodel serve` and `pagedmodel router` processes for the fault-injection tests, restartable on the
same address, plus the few HTTP reads the tests make (metrics, one request, one stream)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagedmodel import metrics_contract as mc
from support import free_port, stop_process, wait_healthy, wait_until

MODEL = "tiny-smol"


@dataclass
class Server:
    """One server process; `restart()` brings a fresh one up on the same port."""
    name: str
    args: list[str]
    logdir: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        self.starts += 1
        log = self.logdir / f"{self.name}.{self.starts}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", *self.args, "--host", "127.0.0.1",
                                           "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_healthy(self.url, self.popen, timeout, log)

    def signal(self, sig: signal.Signals) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGCONT)   # a stopped process cannot handle SIGTERM
            stop_process(self.popen, timeout=10)


def engine(name: str, model_dir: Path, logdir: Path) -> Server:
    return Server(name, ["serve", "--model", str(model_dir), "--device", "cpu", "--served-model-name", MODEL,
                         "--max-model-len", "1024", "--kv-cache-memory", str(8 << 20), "--max-num-seqs", "16"], logdir)


def router(upstreams: list[Server], logdir: Path, *extra: str) -> Server:
    args = ["router", "--strategy", "round-robin", "--scrape-interval", "0.5", "--eject-backoff", "0.5",
            "--eject-max-backoff", "2", "--queue-timeout", "30", *extra]
    for up in upstreams:
        args += ["--upstream", up.url]
    return Server("router", args, logdir)


def metrics(url: str) -> list[mc.Sample]:
    return mc.parse(httpx.get(url + "/metrics", timeout=5).text)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    return sum(s.value for s in metrics(url) if s.name == name and labels.items() <= s.labels.items())


def upstream_healthy(router_url: str, upstream: Server) -> bool | None:
    for s in metrics(router_url):
        if s.name == "pagedmodel_router_upstream_healthy" and s.labels.get("upstream") == upstream.url:
            return s.value == 1
    return None


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Seconds it took `predicate` to hold; fails the test with `what` after `timeout`."""
    start = time.monotonic()

    def safe() -> Any:
        try:
            return predicate()
        except httpx.HTTPError:
            return False
    assert wait_until(safe, timeout=timeout, interval=0.2), f"{what}: not within {timeout:.0f} s"
    return time.monotonic() - start


@dataclass
class Outcome:
    """What a client saw: the status, a JSON body or SSE events, whether [DONE] came, any transport error."""
    kind: str
    started: float
    ended: float = 0.0
    status: int | None = None
    body: Any = None
    events: list[Any] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    @property
    def error_events(self) -> list[Any]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]


def body(stream: bool, max_tokens: int, prompt: str = "The history of the river") -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}
    if stream:
        out["stream"] = True
    return out


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], timeout: float = 120.0) -> Outcome:
    """One completion through `url`; never raises: transport errors and timeouts land in Outcome.error."""
    out = Outcome("stream" if payload.get("stream") else "whole", time.monotonic())
    try:
        await asyncio.wait_for(_send(client, url, payload, out), timeout)
    except asyncio.TimeoutError:
        out.error = f"no end within {timeout:.0f} s"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    return out


async def _send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], out: Outcome) -> None:
    async with client.stream("POST", url + "/v1/completions", json=payload) as resp:
        out.status = resp.status_code
        if out.kind == "stream" and resp.status_code == 200:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        out.done = True
                    else:
                        out.events.append(json.loads(data))
        else:
            out.body = json.loads(await resp.aread())
