"""`cache_salt` over HTTP (vLLM's field): requests share prefix-cache blocks only within one salt."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import wait_until

from .conftest import ServerProcess

MODEL = "tiny-smol"
HITS = "vllm:prefix_cache_hits_total"
PROMPT = list(range(100, 164))     # 64 token ids: four full 16-token blocks


@pytest.fixture(scope="module")
def prefix_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("salt_server") / "server.log"
    srv = ServerProcess(server_model_dir, log, "--served-model-name", MODEL, "--max-model-len", "256",
                        "--kv-cache-memory", str(8 << 20), "--enable-prefix-caching", "--block-size", "16")
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0


def hits_after(srv: ServerProcess, path: str, body: dict) -> float:
    """POST, then the server's prefix-cache hit counter once the engine's stats include this request."""
    before = srv.metrics()
    r = httpx.post(srv.base_url + path, json={"model": MODEL, "max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 200, r.text
    queries = "vllm:prefix_cache_queries_total"
    after = wait_until(lambda: (lambda m: m if m[queries] > before[queries] else None)(srv.metrics()), timeout=10)
    assert after, "the request never reached the prefix-cache counters"
    return after[HITS] - before[HITS]


def test_completions_share_blocks_within_a_salt_and_never_across(prefix_server: ServerProcess) -> None:
    C = "/v1/completions"
    assert hits_after(prefix_server, C, {"prompt": PROMPT, "cache_salt": "tenant-a"}) == 0   # cold
    assert hits_after(prefix_server, C, {"prompt": PROMPT, "cache_salt": "tenant-b"}) == 0   # other salt: no sharing
    assert hits_after(prefix_server, C, {"prompt": PROMPT}) == 0                             # no salt is its own space
    assert hits_after(prefix_server, C, {"prompt": PROMPT, "cache_salt": "tenant-a"}) >= 48  # same salt: full blocks hit
    assert hits_after(prefix_server, C, {"prompt": PROMPT}) >= 48


def test_chat_carries_the_salt_too(prefix_server: ServerProcess) -> None:
    C = "/v1/chat/completions"
    messages = [{"role": "user", "content": "a long enough question about paged attention and block tables " * 4}]
    assert hits_after(prefix_server, C, {"messages": messages, "cache_salt": "chat-1"}) == 0
    assert hits_after(prefix_server, C, {"messages": messages, "cache_salt": "chat-2"}) == 0
    assert hits_after(prefix_server, C, {"messages": messages, "cache_salt": "chat-1"}) >= 16


@pytest.mark.parametrize("salt, message", [("", "cache_salt must be a non-empty string"), (7, "cache_salt")])
def test_bad_salt_is_a_400_naming_cache_salt(prefix_server: ServerProcess, salt: object, message: str) -> None:
    r = httpx.post(prefix_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "cache_salt": salt}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and message in err["message"]
