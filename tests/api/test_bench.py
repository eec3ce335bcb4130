"""`pagedmodel bench serve`: a short real run against our server, plus its workload and statistics pieces."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pagedmodel.bench import RequestResult, _stats, arrival_delays, jsonl_requests, summarize, synthetic_requests

from .conftest import API_KEY, ServerProcess


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedmodel.cli", "bench", "serve", "--no-progress", *args],
                          capture_output=True, text=True, timeout=300)


def test_bench_serve_short_run_against_our_server(api_server: ServerProcess, tmp_path: Path) -> None:
    before = api_server.metrics()
    out = tmp_path / "result.json"
    r = bench("--base-url", api_server.base_url, "--api-key", API_KEY, "--num-prompts", "8", "--request-rate", "40",
              "--input-len", "24", "--output-len", "6", "--seed", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    for label in ("Successful requests:", "Request throughput (req/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "Mean E2EL (ms):"):
        assert label in r.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["model"] == "tiny-smol"
    assert result["total_output_tokens"] == 8 * 6            # ignore_eos: every request runs to max_tokens
    after = api_server.metrics()
    gen = 'vllm:generation_tokens_total{model_name="tiny-smol"}'
    prompt = 'vllm:prompt_tokens_total{model_name="tiny-smol"}'
    assert after[gen] - before[gen] == result["total_output_tokens"]
    assert after[prompt] - before[prompt] == result["total_input_tokens"]
    assert 0 < result["ttft_ms"]["mean"] <= result["e2el_ms"]["mean"]
    assert result["ttft_ms"]["p99"] >= result["ttft_ms"]["median"]
    assert result["tpot_ms"]["mean"] > 0 and result["itl_ms"]["mean"] > 0
    assert len(result["per_request"]) == 8
    assert result["request_throughput"] == pytest.approx(8 / result["duration_s"])


def test_bench_chat_endpoint_with_concurrency_cap(api_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    r = bench("--base-url", api_server.base_url, "--api-key", API_KEY, "--endpoint", "/v1/chat/completions",
              "--num-prompts", "6", "--max-concurrency", "2", "--output-len", "4", "--input-len", "10",
              "--burstiness", "0.5", "--request-rate", "100", "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24


def test_bench_reports_failures_and_bad_arguments(api_server: ServerProcess, tmp_path: Path) -> None:
    # wrong key: every request fails -> exit 1 with the error counted
    out = tmp_path / "fail.json"
    r = bench("--base-url", api_server.base_url, "--api-key", "wrong", "--model", "tiny-smol", "--num-prompts", "3",
              "--json", str(out))
    assert r.returncode == 1
    assert json.loads(out.read_text())["errors"] == {"HTTP 401": 3}
    # unreachable server, no --model: a clear error, exit 2
    r = bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "1")
    assert r.returncode == 2 and "cannot reach" in r.stderr
    # argument validation
    for bad in (["--num-prompts", "0"], ["--request-rate", "-1"], ["--percentiles", "50,101"]):
        r = bench("--base-url", api_server.base_url, *bad)
        assert r.returncode == 2, bad
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"prompt": "ok"}\n{not json}\n')
    r = bench("--base-url", api_server.base_url, "--dataset-path", str(bad_file))
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr


def test_jsonl_dataset_is_cycled_and_validated(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    reqs = jsonl_requests(f, 5, default_output_len=7, seed=0, chat=False)
    assert len(reqs) == 5
    assert sorted({(r.prompt, r.max_tokens) for r in reqs}) == [("a", 3), ("b", 7)]
    chat = jsonl_requests(f, 2, default_output_len=7, seed=0, chat=True)
    assert all(isinstance(r.prompt, list) for r in chat)
    f.write_text('{"prompt": "a", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        jsonl_requests(f, 1, 7, 0, False)


def test_synthetic_lengths_follow_range_ratio() -> None:
    reqs = synthetic_requests(200, input_len=100, output_len=50, range_ratio=0.2, seed=1, chat=False)
    outs = [r.max_tokens for r in reqs]
    ins = [r.expected_input_len for r in reqs]
    assert min(outs) >= 40 and max(outs) <= 60 and len(set(outs)) > 5
    assert min(ins) >= 80 and max(ins) <= 120
    assert len({r.prompt for r in reqs}) == 200       # distinct prompts: no accidental prefix-cache benchmark
    fixed = synthetic_requests(3, input_len=10, output_len=5, range_ratio=0.0, seed=1, chat=True)
    assert [r.max_tokens for r in fixed] == [5, 5, 5] and fixed[0].prompt[0]["role"] == "user"


def test_arrivals_poisson_and_gamma() -> None:
    poisson = list(arrival_delays(20000, rate=10.0, burstiness=1.0, seed=0))
    assert statistics.fmean(poisson) == pytest.approx(0.1, rel=0.05)
    assert statistics.pstdev(poisson) == pytest.approx(0.1, rel=0.05)     # exponential: std == mean
    bursty = list(arrival_delays(20000, rate=10.0, burstiness=0.25, seed=0))
    assert statistics.fmean(bursty) == pytest.approx(0.1, rel=0.1)
    assert statistics.pstdev(bursty) == pytest.approx(0.2, rel=0.1)       # gamma: cv = 1/sqrt(shape)
    assert set(arrival_delays(5, rate=math.inf, burstiness=1.0, seed=0)) == {0.0}


def test_stats_and_summary_math() -> None:
    s = _stats([0.001 * i for i in range(1, 101)], [50, 99])
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    ok = RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2el=0.5, itl=[0.1] * 4)
    assert ok.tpot == pytest.approx(0.1)
    bad = RequestResult(ok=False, error="HTTP 503: overloaded")
    args = argparse.Namespace(percentiles=[50.0], base_url="u", endpoint="/v1/completions", request_rate=math.inf,
                              burstiness=1.0, max_concurrency=None)
    res = summarize([ok, ok, bad], 2.0, model="m", args=args)
    assert res["completed"] == 2 and res["failed"] == 1 and res["errors"] == {"HTTP 503": 1}
    assert res["output_throughput"] == pytest.approx(5.0) and res["request_throughput"] == pytest.approx(1.0)
    assert res["request_rate"] is None
