"""`pagedmodel router` in front of a real `pagedmodel serve` (tiny random Llama), driven by the openai SDK."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from support import free_port, start_cli, stop_process, wait_healthy


@pytest.fixture(scope="module")
def engine_and_router(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("router_e2e")
    eport, rport = free_port(), free_port()
    engine_url, router_url = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{rport}"
    engine = start_cli(["serve", "--model", str(tiny_llama_dir), "--device", "cpu", "--host", "127.0.0.1",
                     "--port", str(eport), "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                     "--served-model-name", "tiny-smol"], logs / "engine.log")
    router = None
    try:
        wait_healthy(engine_url, engine, 180, logs / "engine.log")
        router = start_cli(["router", "--upstream", engine_url, "--host", "127.0.0.1", "--port", str(rport),
                         "--rate-limit", "100", "--burst", "100"], logs / "router.log")
        wait_healthy(router_url, router, 60, logs / "router.log")
        yield engine_url, router_url
    finally:
        if router is not None:
            stop_process(router)
        stop_process(engine)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_streaming_through_router_equals_direct(engine_and_router):
    engine_url, router_url = engine_and_router

    def stream(url: str) -> list[str]:
        with _client(url) as c:
            chunks = c.completions.create(model="tiny-smol", prompt="The capital of France is", max_tokens=12,
                                          temperature=0, stream=True)
            return [ch.choices[0].text for ch in chunks if ch.choices]

    direct, routed = stream(engine_url), stream(router_url)
    assert len(direct) > 1 and routed == direct


def test_chat_and_models_through_router_equal_direct(engine_and_router):
    engine_url, router_url = engine_and_router

    def chat(url: str) -> tuple[str, list[str]]:
        with _client(url) as c:
            out = c.chat.completions.create(model="tiny-smol", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0)
            return out.choices[0].message.content, [m.id for m in c.models.list().data]

    assert chat(router_url) == chat(engine_url)


def test_engine_errors_pass_through_unchanged(engine_and_router):
    _engine_url, router_url = engine_and_router
    with _client(router_url) as c, pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="tiny-smol", prompt="x", max_tokens=-5)
    assert exc.value.status_code == 400
