"""The async engine front, in-process: a dead engine loop turns into 500s for pending work and 503s after."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from support import wait_until

from .conftest import InProcessServer

PROMPT = {"prompt": "hello", "max_tokens": 2}


def test_engine_loop_death_fails_pending_requests_and_health(server_model_dir: Path) -> None:
    with InProcessServer(server_model_dir) as srv:
        url = srv.base_url
        assert httpx.post(url + "/v1/completions", json=PROMPT).status_code == 200

        # A stream that is running when the engine breaks gets an in-band error event, then [DONE].
        body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None

            def broken_step():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            srv.engine.step = broken_step
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["type"] == "InternalServerError" and "engine loop died" in err["message"]
        assert "illegal memory access" not in err["message"]   # no internals leak to clients

        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert "illegal memory access" not in health.text
        after = httpx.post(url + "/v1/completions", json=PROMPT)
        assert after.status_code == 503 and "engine" in after.json()["error"]["message"]
        assert "Traceback" not in after.text


def test_engine_loop_death_fails_a_waiting_non_streamed_request_with_500(server_model_dir: Path) -> None:
    with InProcessServer(server_model_dir) as srv:
        calls = {"n": 0}
        real_step = srv.engine.step

        def step_then_die():
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("boom")
            return real_step()
        srv.engine.step = step_then_die
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_error"
        assert wait_until(lambda: httpx.get(srv.base_url + "/health").status_code == 503, timeout=5)


def test_chat_without_template_is_a_clear_400(tmp_path: Path, server_model_dir: Path) -> None:
    """A model whose tokenizer has no chat template: chat completions are refused, completions work."""
    model = tmp_path / "no_template"
    shutil.copytree(server_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with InProcessServer(model) as srv:
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        assert "chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "chat_template_missing"
        assert httpx.post(srv.base_url + "/v1/completions", json=PROMPT).status_code == 200
