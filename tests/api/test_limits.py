"""Every limit of docs/limits.md on `pagedmodel serve`, set low by flag: each hostile request gets a
bounded, clear answer (OpenAI error body; 400/408/413/431/503), costs bounded memory, holds no KV
block, and the server serves normally afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from raw_http import connect, post_head, send_raw, trickle
from support import assert_openai_error, wait_until
from .conftest import ServerProcess

MODEL = "tiny-smol"
C = "/v1/completions"
READ_TIMEOUT = 1.0
LIMIT_FLAGS = ("--max-body-bytes", "131072", "--max-header-bytes", "4096", "--request-read-timeout", str(READ_TIMEOUT),
               "--max-connections", "6", "--max-n", "2", "--max-best-of", "3", "--max-logprobs", "2",
               "--max-stop-strings", "2", "--max-stop-string-len", "8", "--max-prompt-tokens", "32",
               "--stream-idle-timeout", "0.3")


@pytest.fixture(scope="module")
def limited(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("limits") / "server.log"
    # a 1,024-token context, so that a request can hold the one sequence slot for ~1,000 steps (below)
    srv = ServerProcess(server_model_dir, log, "--max-model-len", "1024", "--kv-cache-memory", str(8 << 20),
                        "--max-num-seqs", "1", "--served-model-name", MODEL, *LIMIT_FLAGS)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


FIELD_CASES = [
    ("n", {"n": 3, "temperature": 1.0}, "n"),
    ("best_of", {"n": 1, "best_of": 4, "temperature": 1.0}, "best_of"),
    ("logprobs", {"logprobs": 3}, "logprobs"),
    ("stop-count", {"stop": ["a", "b", "c"]}, "stop"),
    ("stop-10000", {"stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("stop-length", {"stop": ["123456789"]}, "stop"),
    ("stop-token-ids-count", {"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    ("prompt-token-ids", {"prompt": [100] * 33}, "prompt"),
    ("prompt-text-tokens", {"prompt": "hello " * 40}, "prompt"),
]


@pytest.mark.parametrize("name,fields,param", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_field_limits_are_400s_naming_the_field(limited: ServerProcess, name: str, fields: dict, param: str) -> None:
    r = httpx.post(limited.base_url + C, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}, timeout=30)
    assert_openai_error(r.status_code, r.text, 400, param)


def test_at_the_limits_requests_are_served(limited: ServerProcess) -> None:
    r = httpx.post(limited.base_url + C, timeout=30, json={
        "model": MODEL, "prompt": [100] * 32, "max_tokens": 2, "n": 2, "best_of": 3, "temperature": 1.0,
        "logprobs": 2, "stop": ["12345678", "x"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_100k_token_prompt_is_refused_without_tokenizing(limited: ServerProcess) -> None:
    """600 kB of text (100k tokens) over a 128 KiB body limit: 413; just under the limit, the character
    bound refuses it before the tokenizer runs."""
    r = httpx.post(limited.base_url + C, json={"model": MODEL, "prompt": "hello " * 100_000}, timeout=30)
    assert_openai_error(r.status_code, r.text, 413)
    started = time.monotonic()
    r = httpx.post(limited.base_url + C, json={"model": MODEL, "prompt": "hello " * 10_000}, timeout=30)
    err = assert_openai_error(r.status_code, r.text, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 10


def test_10mb_body_is_413_and_costs_no_memory(limited: ServerProcess) -> None:
    rss = limited.rss_bytes()
    body = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    r = httpx.post(limited.base_url + C, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(r.status_code, r.text, 413)

    def chunks() -> Iterator[bytes]:   # no Content-Length: counted as it streams, cut off at the limit
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = httpx.post(limited.base_url + C, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(r.status_code, r.text, 413)
    assert limited.rss_bytes() - rss < 32 << 20


def test_oversized_headers_get_431(limited: ServerProcess) -> None:
    head = post_head(C, 2, extra="X-Filler: " + "a" * 8000 + "\r\n")
    r = send_raw(limited.port, head + b"{}")
    err = assert_openai_error(r.status or 0, r.body, 431)
    assert err["code"] == "headers_too_large"


def test_slow_loris_headers_get_408(limited: ServerProcess) -> None:
    r = trickle(limited.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X-Slow: aaaaaaaa", every=0.2,
                limit_s=15)
    assert_openai_error(r.status or 0, r.body, 408)
    assert r.elapsed < READ_TIMEOUT + 3


def test_slow_loris_body_gets_408(limited: ServerProcess) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    r = trickle(limited.port, post_head(C, len(body) + 50), body + b" " * 50, every=0.2, limit_s=15)
    assert_openai_error(r.status or 0, r.body, 408)
    assert r.elapsed < READ_TIMEOUT + 3


def test_idle_connection_is_closed_without_an_answer(limited: ServerProcess) -> None:
    sock = connect(limited.port)
    started = time.monotonic()
    assert sock.recv(1024) == b""   # closed by the server, nothing sent
    assert time.monotonic() - started < READ_TIMEOUT + 3
    sock.close()


def test_connections_past_the_limit_get_503_then_recover(limited: ServerProcess) -> None:
    idle = [connect(limited.port) for _ in range(6)]
    try:
        time.sleep(0.1)
        r = httpx.get(limited.base_url + "/v1/models", timeout=10)
        err = assert_openai_error(r.status_code, r.text, 503)
        assert err["code"] == "too_many_connections" and r.headers["retry-after"] == "1"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert httpx.get(limited.base_url + "/v1/models", timeout=10).status_code == 200


def _running(srv: ServerProcess) -> int:
    """vLLM's gauge of the requests in the engine's running batch, read from /metrics."""
    for line in httpx.get(srv.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("/metrics has no vllm:num_requests_running")


def test_stream_idle_timeout_ends_a_queued_stream_with_an_error_event(limited: ServerProcess) -> None:
    """With one sequence slot busy for longer than --stream-idle-timeout, a queued stream sends nothing:
    it is ended with an error event and [DONE], and aborted (no blocks held afterwards)."""
    import threading
    # 1,000 tiny-model steps take ~1 s: well over the 0.3 s timeout (240 no longer were, once serve's
    # steps stopped paying page faults for every buffer)
    blocker = threading.Thread(target=lambda: httpx.post(limited.base_url + C, timeout=60, json={
        "model": MODEL, "prompt": "block", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}))
    blocker.start()
    # the blocker must hold the slot before the stream arrives (on a busy machine 50 ms was not enough)
    wait_until(lambda: _running(limited) == 1, timeout=30, interval=0.01)
    with httpx.stream("POST", limited.base_url + C, timeout=30, json={
            "model": MODEL, "prompt": "queued", "max_tokens": 4, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    blocker.join()
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:]) for e in events[:-1] if "error" in json.loads(e[6:])]
    assert errors and errors[0]["error"]["code"] == "stream_idle_timeout", events
    m = limited.metrics()
    assert m[f'pagedmodel:kv_cache_blocks_free{{model_name="{MODEL}"}}'] == m[
        f'pagedmodel:kv_cache_blocks_total{{model_name="{MODEL}"}}']


def test_server_is_healthy_after_the_hostile_requests(limited: ServerProcess) -> None:
    assert httpx.get(limited.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(limited.base_url + C, timeout=30,
                   json={"model": MODEL, "prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("flag,value", [("--max-n", "17"), ("--max-logprobs", "-2"),
                                        ("--request-read-timeout", "0")])
def test_a_limit_beyond_its_ceiling_is_refused_at_startup(server_model_dir: Path, flag: str, value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "serve", "--model", str(server_model_dir),
                           "--device", "cpu", flag, value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert flag in proc.stderr or "must be" in proc.stderr, proc.stderr
