"""A server with a small KV budget and a short queue: overload, client disconnects, metrics values."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from support import wait_until

from .conftest import ServerProcess, parse_metrics

MODEL = "small"
LBL = '{model_name="small"}'
MAX_NUM_SEQS = 4
MAX_QUEUE_LEN = 8
BLOCK_SIZE = 16   # explicit: the CPU default is 128, and this budget is counted in 16-token blocks
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4   # layers x (k, v) x block size x kv heads x head dim x fp32


@pytest.fixture(scope="module")
def small_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("small_server") / "server.log"
    # float32 explicitly: BLOCK_BYTES is a float32 block, and --dtype auto is bf16 on AMX/AVX512-BF16 CPUs
    srv = ServerProcess(server_model_dir, log, "--served-model-name", MODEL, "--max-model-len", "512", "--dtype", "float32",
                        "--kv-cache-memory", str(64 * BLOCK_BYTES), "--block-size", str(BLOCK_SIZE),
                        "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-queue-len", str(MAX_QUEUE_LEN))
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0


def idle_and_all_blocks_free(srv: ServerProcess) -> bool:
    m = srv.metrics()
    return (m[f"vllm:num_requests_running{LBL}"] == 0 and m[f"vllm:num_requests_waiting{LBL}"] == 0
            and m[f"pagedmodel:kv_cache_blocks_free{LBL}"] == m[f"pagedmodel:kv_cache_blocks_total{LBL}"])


def test_kv_budget_is_the_one_asked_for(small_server: ServerProcess) -> None:
    assert small_server.metrics()[f"pagedmodel:kv_cache_blocks_total{LBL}"] == 64


def test_block_allocations_are_timed_into_the_histogram(small_server: ServerProcess) -> None:
    """pagedmodel:kv_block_allocation_seconds counts the engine's allocations (served from its stats)."""
    name = "pagedmodel:kv_block_allocation_seconds"
    before = small_server.metrics()
    r = httpx.post(small_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": [7] * 40, "max_tokens": 20, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    after = wait_until(lambda: (lambda m: m if m[f"{name}_count{LBL}"] > before[f"{name}_count{LBL}"] else None)(
        small_server.metrics()), timeout=10)
    assert after, "no allocation was observed"
    assert after[f'{name}_bucket{{le="+Inf",model_name="small"}}'] == after[f"{name}_count{LBL}"]
    assert after[f"{name}_sum{LBL}"] >= before[f"{name}_sum{LBL}"]


def test_metrics_token_counters_match_real_counts(small_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key="unused", max_retries=0)
    before = small_server.metrics()
    # (prompt token ids, max_tokens, n): exact counts, since ignore_eos makes every sample run to max_tokens
    plan = [([10, 11, 12], 5, 1), ([20] * 17, 9, 1), ([30, 31], 4, 2)]
    usage_prompt = usage_completion = 0
    for ids, max_tokens, n in plan:
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, n=n, temperature=1.0,
                                      extra_body={"ignore_eos": True})
        usage_prompt += r.usage.prompt_tokens
        usage_completion += r.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count me"}],
                                          max_tokens=3, extra_body={"ignore_eos": True})
    usage_prompt += chat.usage.prompt_tokens
    usage_completion += chat.usage.completion_tokens
    after = small_server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert usage_prompt == 3 + 17 + 2 + chat.usage.prompt_tokens
    assert usage_completion == 5 + 9 + 4 * 2 + 3
    assert delta(f"vllm:prompt_tokens_total{LBL}") == usage_prompt
    assert delta(f"vllm:generation_tokens_total{LBL}") == usage_completion
    assert delta('vllm:request_success_total{finished_reason="length",model_name="small"}') == 4
    assert delta(f"vllm:time_to_first_token_seconds_count{LBL}") == 4
    assert delta(f"vllm:e2e_request_latency_seconds_count{LBL}") == 4
    assert delta(f"vllm:request_queue_time_seconds_count{LBL}") == 4
    # one inter-token gap per step after the first token (n=2 samples advance in the same step)
    assert delta(f"vllm:inter_token_latency_seconds_count{LBL}") == (5 - 1) + (9 - 1) + (4 - 1) + (3 - 1)
    assert delta(f"vllm:e2e_request_latency_seconds_sum{LBL}") > 0
    # request-length histograms (the operator's tuner reads the length mix from them)
    assert delta(f"vllm:request_prompt_tokens_count{LBL}") == 4
    assert delta(f"vllm:request_prompt_tokens_sum{LBL}") == usage_prompt
    assert delta(f"vllm:request_generation_tokens_sum{LBL}") == usage_completion
    assert delta('vllm:request_prompt_tokens_bucket{le="16.0",model_name="small"}') == 2   # 3 and 2 tokens
    # configuration gauges (the router caps in-flight requests per replica at max_num_seqs)
    assert after[f"pagedmodel:max_num_seqs{LBL}"] == MAX_NUM_SEQS
    assert after[f"pagedmodel:block_size{LBL}"] == 16
    # every name from the architecture contract is exported, with the model_name label
    for name in ("vllm:num_requests_swapped", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:cpu_cache_usage_perc", "pagedmodel:kv_cache_fragmentation", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert f"{name}{LBL}" in after, name


def _hold(srv: ServerProcess, n: int, max_tokens: int = 480) -> tuple[list[threading.Thread], threading.Event]:
    """n long streaming requests that read one chunk each, then hang up when `release` is set.

    The server keeps generating into the socket buffer meanwhile, so a request is "held" for as long as
    its max_tokens steps take (about a second here); the checks below poll faster than that.
    """
    release = threading.Event()

    def one() -> None:
        body = {"model": MODEL, "prompt": "hold on", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()   # keep a reference: a collected iterator closes the connection
            next(lines)
            release.wait(60)
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, release


def test_running_and_waiting_gauges_follow_held_requests(small_server: ServerProcess) -> None:
    assert wait_until(lambda: idle_and_all_blocks_free(small_server), timeout=10)
    threads, release = _hold(small_server, 1)
    try:
        m = wait_until(lambda: (lambda m: m if m[f"vllm:num_requests_running{LBL}"] == 1 else None)(
            small_server.metrics()), timeout=10, interval=0.01)
        assert m and m[f"vllm:num_requests_waiting{LBL}"] == 0
        assert m[f"pagedmodel:kv_cache_blocks_free{LBL}"] < 64 and m[f"vllm:kv_cache_usage_perc{LBL}"] > 0
    finally:
        release.set()
        for t in threads:
            t.join(30)
    threads, release = _hold(small_server, MAX_NUM_SEQS + 2)
    try:
        m = wait_until(lambda: (lambda m: m if m[f"vllm:num_requests_waiting{LBL}"] == 2 else None)(
            small_server.metrics()), timeout=10, interval=0.01)
        assert m, small_server.metrics()
        assert m[f"vllm:num_requests_running{LBL}"] == MAX_NUM_SEQS
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert wait_until(lambda: idle_and_all_blocks_free(small_server), timeout=10)


def test_disconnected_streams_leave_no_blocks_behind(small_server: ServerProcess) -> None:
    before = small_server.metrics()
    threads, release = _hold(small_server, 3, max_tokens=480)
    assert wait_until(lambda: small_server.metrics()[f"vllm:num_requests_running{LBL}"] == 3, timeout=10,
                      interval=0.01)
    release.set()   # all three hang up mid-stream, long before 480 tokens
    for t in threads:
        t.join(30)
    assert wait_until(lambda: idle_and_all_blocks_free(small_server), timeout=5), small_server.metrics()
    after = small_server.metrics()
    abort = 'vllm:request_success_total{finished_reason="abort",model_name="small"}'
    assert after.get(abort, 0) - before.get(abort, 0) == 3
    # they were cut short: far fewer than 3 x 480 tokens were generated
    gen = f"vllm:generation_tokens_total{LBL}"
    assert after[gen] - before[gen] < 3 * 480


def test_disconnected_non_streamed_request_is_aborted(small_server: ServerProcess) -> None:
    before = small_server.metrics()
    # 480 tiny-model steps took 0.48 s on a fast machine: the client hangs up after 0.1 s, well before the end
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_server.base_url + "/v1/completions", timeout=httpx.Timeout(30, read=0.1),
                   json={"model": MODEL, "prompt": "never mind", "max_tokens": 480, "ignore_eos": True})
    assert wait_until(lambda: idle_and_all_blocks_free(small_server), timeout=5), small_server.metrics()
    after = small_server.metrics()
    abort = 'vllm:request_success_total{finished_reason="abort",model_name="small"}'
    assert after.get(abort, 0) - before.get(abort, 0) == 1


async def _overload(base_url: str, clients: int) -> list[tuple[str, float, object]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, float, object]:
        t0 = time.monotonic()
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=f"client {i} says hello", max_tokens=6, stream=True, temperature=1.0,
                extra_body={"ignore_eos": True})
            text, finish = "", None
            async for chunk in stream:
                if i % 10 == 0 and text:   # every tenth client hangs up mid-stream
                    await stream.close()
                    return "hung_up", time.monotonic() - t0, None
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            return "ok", time.monotonic() - t0, finish
        except openai.APIStatusError as exc:
            return f"status_{exc.status_code}", time.monotonic() - t0, exc.response.headers.get("retry-after")

    try:
        return await asyncio.gather(*(one(i) for i in range(clients)))
    finally:
        await client.close()


def test_overload_gets_complete_answers_or_fast_503(small_server: ServerProcess) -> None:
    rss_before = small_server.rss_bytes()
    results = asyncio.run(_overload(small_server.base_url, 200))
    kinds = [k for k, _, _ in results]
    assert set(kinds) <= {"ok", "status_503", "hung_up"}, sorted(set(kinds))
    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] == "status_503"]
    assert ok and rejected, (len(ok), len(rejected))
    assert all(finish == "length" for _, _, finish in ok)           # complete answers, not truncated ones
    assert all(ra is not None and int(ra) >= 1 for _, _, ra in rejected)   # Retry-After on every 503
    assert max(t for _, t, _ in rejected) < 10, "503s must be fast, not queued"
    assert small_server.proc.poll() is None and httpx.get(small_server.base_url + "/health").status_code == 200
    assert wait_until(lambda: idle_and_all_blocks_free(small_server), timeout=10), small_server.metrics()
    # bounded memory: 200 clients must not leave the server much bigger than before
    assert small_server.rss_bytes() - rss_before < 200 << 20
    # and it still serves normally
    r = httpx.post(small_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "after the storm", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # this server runs without --log-requests: 200 requests, not one access line
    assert "POST /v1/completions" not in small_server.log()


def test_parse_metrics_helper() -> None:
    m = parse_metrics('# HELP x y\nfoo{a="1"} 2.0\nfoo{a="2"} 3.0\nbar 1e+00\n')
    assert m == {'foo{a="1"}': 2.0, 'foo{a="2"}': 3.0, "foo": 5.0, "bar": 1.0}
