"""GET /v1/kv_events on a real app and engine (tiny Llama): snapshot, live batches, resume, resync, auth."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from pagedmodel.server.router.prefix_index import hash_chain
from support import free_port, wait_until

KEY = "sk-kv"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(100, 150))     # 50 token ids: three full 16-token blocks before the last token


class Server:
    def __init__(self, model_dir, api_key: str | None = KEY, **engine_kw) -> None:
        import uvicorn

        from pagedmodel.server.api.app import build_app
        from pagedmodel.server.api.serving import ServerConfig
        from pagedmodel.server.engine.args import EngineArgs
        from pagedmodel.server.engine.llm_engine import LLMEngine

        kw = dict(model=str(model_dir), device="cpu", max_model_len=128, num_gpu_blocks_override=64, block_size=16)
        kw.update(engine_kw)
        self.engine = LLMEngine(EngineArgs(**kw))
        self.url = f"http://127.0.0.1:{free_port()}"
        app = build_app(self.engine, ServerConfig(served_model_name="tiny", api_key=api_key))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[Server]:
    with Server(tiny_llama_dir, enable_prefix_caching=True) as srv:
        yield srv


def lines(srv: Server, **params) -> Iterator[dict]:
    with httpx.stream("GET", srv.url + "/v1/kv_events", params=params, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        for line in r.iter_lines():
            if line:
                yield json.loads(line)


def complete(srv: Server, prompt: list[int]) -> None:
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_snapshot_then_live_batches_then_resume(server):
    stream = lines(server)
    snap = next(stream)
    assert snap["type"] == "snapshot" and snap["block_size"] == 16 and snap["instance"] == server.engine.kv_events.instance
    threading.Thread(target=complete, args=(server, PROMPT)).start()
    batch = next(m for m in stream if m["type"] == "batch")
    assert batch["seq"] == snap["seq"] + 1
    published = [h for e in batch["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert published[:3] == [h.hex() for h in hash_chain(PROMPT, 16)]   # what the router recomputes
    stream.close()
    # Resuming where we stopped replays what followed, without a snapshot.
    resumed = lines(server, since=str(snap["seq"]), instance=snap["instance"])
    first = next(resumed)
    assert first == {"type": "resume", "instance": snap["instance"], "seq": snap["seq"], "block_size": 16}
    assert next(resumed)["seq"] == batch["seq"]
    resumed.close()


def test_another_instance_or_a_future_seq_gets_a_snapshot(server):
    for params in ({"since": "0", "instance": "an-engine-that-restarted"}, {"since": "999999"}):
        stream = lines(server, **params)
        assert next(stream)["type"] == "snapshot"
        stream.close()


def test_quiet_stream_sends_heartbeats(server, monkeypatch):
    from pagedmodel.server.api import kv_events
    monkeypatch.setattr(kv_events, "HEARTBEAT_S", 0.1)
    stream = lines(server)
    snap = next(stream)
    beat = next(stream)
    assert beat == {"type": "heartbeat", "seq": snap["seq"]}
    stream.close()


def test_bad_since_and_missing_key_are_refused(server):
    r = httpx.get(server.url + "/v1/kv_events", params={"since": "-1"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    r = httpx.get(server.url + "/v1/kv_events")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_engine_without_prefix_caching_answers_404(tiny_llama_dir):
    with Server(tiny_llama_dir, api_key=None) as srv:
        r = httpx.get(srv.url + "/v1/kv_events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_events_unavailable"
