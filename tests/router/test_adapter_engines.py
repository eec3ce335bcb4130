"""Adapter affinity end to end: `pagedmodel router` in front of two real `pagedmodel serve` engines (tiny
random Llama, --enable-lora) where adapter `sql` is loaded on engine 1 only. Every request for `sql` lands on
engine 1 (engine 2 would answer 404), an unknown name is the router's own 404, and an adapter loaded into
engine 2 at run time is routable at once, long before the router's next scrape."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lora_adapters import make_peft_adapter
from support import assert_openai_error, free_port, start_cli, stop_process, wait_healthy, wait_until

from pagedmodel import metrics_contract as mc

BASE = "tiny"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # std 0.5: the tiny model's logits are far apart by design, and PEFT's scale of 0.05 moves no argmax
    root = tmp_path_factory.mktemp("router-adapters")
    return {"sql": make_peft_adapter(tiny_llama_dir, root / "sql", rank=8, seed=1, std=0.5),
            "chat": make_peft_adapter(tiny_llama_dir, root / "chat", rank=8, seed=2, std=0.5)}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, adapters, tmp_path_factory) -> Iterator[tuple[list[str], str]]:
    logs = tmp_path_factory.mktemp("router-adapter-engines")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    common = ["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--host", "127.0.0.1", "--max-model-len",
              "256", "--kv-cache-memory", str(8 << 20), "--served-model-name", BASE, "--dtype", "float32",
              "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    procs = [start_cli([*common, "--port", str(ports[0]), "--lora-modules", f"sql={adapters['sql']}"],
                       logs / "engine1.log"),
             start_cli([*common, "--port", str(ports[1])], logs / "engine2.log")]
    router = None
    try:
        for i, (url, proc) in enumerate(zip(urls, procs)):
            wait_healthy(url, proc, 180, logs / f"engine{i + 1}.log")
        rport = free_port()
        # A scrape cycle longer than the test: what the router learns after its first round, it learns
        # from the refresh on a miss (or on GET /v1/models).
        router = start_cli(["router", "--upstream", urls[0], "--upstream", urls[1], "--host", "127.0.0.1",
                            "--port", str(rport), "--scrape-interval", "120"], logs / "router.log")
        router_url = f"http://127.0.0.1:{rport}"
        wait_healthy(router_url, router, 60, logs / "router.log")
        yield urls, router_url
    finally:
        if router is not None:
            stop_process(router)
        for proc in procs:
            stop_process(proc)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _text(url: str, model: str, prompt: str) -> str:
    with _client(url) as c:
        return c.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text


def _successes(url: str) -> float:
    return mc.sums(httpx.get(url + "/metrics", timeout=30).text, [mc.REQUEST_SUCCESS.name + "_total"]).get(
        mc.REQUEST_SUCCESS.name + "_total", 0.0)


def test_every_request_for_the_adapter_lands_on_its_engine(cluster):
    (e1, e2), router = cluster
    wait_until(lambda: "sql" in {m.id for m in _client(router).models.list().data}, 30)
    before = _successes(e1), _successes(e2)
    prompts = [f"Request number {i} says" for i in range(6)]
    routed = [_text(router, "sql", p) for p in prompts]     # engine 2 would answer 404 to any of them
    assert routed == [_text(e1, "sql", p) for p in prompts]   # and engine 1 gives the same text directly
    assert _successes(e1) - before[0] == 12 and _successes(e2) == before[1]
    assert _text(router, "sql", prompts[0]) != _text(router, BASE, prompts[0])   # the adapter was applied


def test_unknown_model_is_the_routers_404_and_reaches_no_engine(cluster):
    (e1, e2), router = cluster
    before = _successes(e1), _successes(e2)
    r = httpx.post(router + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1}, timeout=30)
    err = assert_openai_error(r.status_code, r.content, 404, param="model")
    assert err["code"] == "model_not_found" and "`sql`" in err["message"] and f"`{BASE}`" in err["message"]
    assert "behind this router" in err["message"]   # the router answered, not an engine
    assert (_successes(e1), _successes(e2)) == before


def test_adapter_loaded_at_run_time_is_routed_before_the_next_scrape(cluster, adapters):
    (e1, e2), router = cluster
    r = httpx.post(e2 + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])},
                   timeout=60)
    assert r.status_code == 200, r.text
    before = _successes(e2)
    assert _text(router, "chat", "Hello there") == _text(e2, "chat", "Hello there")
    assert _successes(e2) - before == 2
    models = {m.id: m for m in _client(router).models.list().data}
    assert set(models) == {BASE, "sql", "chat"} and models["chat"].parent == BASE
