"""`--strategy prefix-cache` end to end: two real engines (tiny Llama, prefix caching) behind the real
router. A repeated long chat prompt goes to the engine that cached it; once that engine has evicted
it, or restarted, the prompt follows the engine that really holds it."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from pagedmodel.server.router.prompt_tokens import RemoteTokenizer, load_tokenizer, token_ids
from support import free_port, stop_process, wait_healthy, wait_until

MODEL = "tiny"
KEY = "sk-e2e"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = " ".join(f"rule {i}: answer in the voice of a lighthouse keeper" for i in range(30))   # ~300 tokens
CHAT = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": "Where is the ship?"}]}


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)


class Engine:
    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log, self.port = model_dir, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Engine":
        # 128 blocks of 16 tokens (bf16): a few long prompts evict the oldest one
        self.proc = _start(["serve", "--model", str(self.model_dir), "--device", "cpu", "--host", "127.0.0.1",
                            "--port", str(self.port), "--max-model-len", "512", "--kv-cache-memory", str(1 << 19),
                            "--enable-prefix-caching", "--block-size", "16", "--served-model-name", MODEL,
                            "--api-key", KEY], self.log)
        return self

    def wait(self) -> "Engine":
        assert self.proc is not None
        wait_healthy(self.url, self.proc, 180, self.log)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def queries(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(m) for m in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Engine], str]]:
    logs = tmp_path_factory.mktemp("prefix_cache_e2e")
    engines = [Engine(tiny_llama_dir, logs / f"engine{i}.log").start() for i in range(2)]
    router = None
    try:
        for e in engines:
            e.wait()
        rport = free_port()
        router_url = f"http://127.0.0.1:{rport}"
        router = _start(["router", *[a for e in engines for a in ("--upstream", e.url)], "--host", "127.0.0.1",
                         "--port", str(rport), "--strategy", "prefix-cache", "--tokenizer", str(tiny_llama_dir),
                         "--upstream-api-key", KEY], logs / "router.log")
        wait_healthy(router_url, router, 60, logs / "router.log")
        yield engines, router_url
    finally:
        if router is not None:
            stop_process(router)
        for e in engines:
            e.stop()


def post(url: str, body: dict) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def served_by(engines: list[Engine], router_url: str) -> int:
    """Send the chat prompt through the router; the index of the engine that got it."""
    time.sleep(0.5)   # the previous request's KV events reach the router's index
    before = [e.queries() for e in engines]
    post(router_url, CHAT)
    after = wait_until(lambda: (lambda q: q if q != before else None)([e.queries() for e in engines]), timeout=10)
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if a != b]
    assert len(changed) == 1, (before, after)
    return changed[0]


def test_router_tokenizes_chat_exactly_as_the_engine(cluster, tiny_llama_dir):
    engines, _ = cluster
    r = httpx.post(engines[0].url + "/tokenize", json={"model": MODEL, "messages": CHAT["messages"]}, headers=AUTH)
    assert r.status_code == 200, r.text
    ours = token_ids(load_tokenizer(str(tiny_llama_dir)), "/v1/chat/completions", CHAT)
    assert ours == r.json()["tokens"] and len(ours) > 200

    async def remote() -> list[int]:   # the no---tokenizer path: the engine's /tokenize, salt kept
        async with aiohttp.ClientSession() as session:
            got = await RemoteTokenizer(session, KEY).chains(engines[1].url, "/v1/chat/completions",
                                                             {**CHAT, "cache_salt": "t1"})
        assert got is not None and got.salt == b"t1"
        return got.token_ids
    assert asyncio.run(remote()) == ours


def test_repeated_prompt_follows_the_engine_that_really_holds_it(cluster):
    engines, router_url = cluster
    first = served_by(engines, router_url)
    assert [served_by(engines, router_url) for _ in range(3)] == [first] * 3
    other = 1 - first
    # The holder evicts it (other long prompts fill its 128 blocks) and the other engine caches it.
    for i in range(8):
        post(engines[first].url, {**CHAT, "messages": [{"role": "system", "content": f"{i} " + SYSTEM.replace("rule", "law")},
                                                      {"role": "user", "content": "x"}]})
    post(engines[other].url, CHAT)
    assert served_by(engines, router_url) == other
    # That engine restarts (same address, empty cache); the first one caches the prompt again.
    engines[other].stop()
    engines[other].start().wait()
    post(engines[first].url, CHAT)
    time.sleep(2)   # the router's subscription reconnects (every 0.5 s) and gets the new instance's snapshot
    assert served_by(engines, router_url) == first
    # A streamed request too; then every answered request's pending prefill has been let go.
    with httpx.stream("POST", router_url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 4},
                      headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    pending = re.findall(r"^pagedmodel_router_upstream_pending_prefill_tokens\{[^}]*\} (\S+)$",
                         httpx.get(router_url + "/metrics", timeout=10).text, re.M)
    assert len(pending) == 2 and all(float(v) == 0 for v in pending), pending
