"""Live `pagedmodel serve` processes on 127.0.0.1 for the HTTP API tests, and helpers to read /metrics.

Servers run as real subprocesses (the CLI, uvicorn, signals and all) on a tiny random Llama that uses
the SmolLM2 tokenizer and chat template, so tokenization and templates are real while a step costs ms.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import free_port, stop_process, wait_healthy, wait_until

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def server_model_dir(tiny_llama_dir: Path) -> Path:
    """The shared tiny Llama (tests/conftest.py): SmolLM2's tokenizer and chat template, random weights."""
    return Path(tiny_llama_dir)


class ServerProcess:
    """`pagedmodel serve` in a subprocess; logs go to a file the tests can read."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, api_key: str | None = None,
                 model_as_argument: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        model = [str(model_dir)] if model_as_argument else ["--model", str(model_dir)]   # vLLM's form, or ours
        args = [sys.executable, "-m", "pagedmodel.cli", "serve", *model,
                "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        wait_healthy(self.base_url, self.proc, timeout, self.log_path)
        return self

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, timeout: float = 30.0) -> int:
        code = stop_process(self.proc, timeout)
        self._log.close()
        return code


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, plus label-free sums under the bare name.

    Parsed by the metrics contract's parser (the one in the tree); the keys are what the tests look up.
    """
    from pagedmodel import metrics_contract as mc

    out: dict[str, float] = {}
    for s in mc.parse(text):
        labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        if labels and "le" not in s.labels:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="session")
def api_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The general-purpose server: API key required, request logging on."""
    log = tmp_path_factory.mktemp("api_server") / "server.log"
    srv = ServerProcess(server_model_dir, log, "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                        "--log-requests", "--served-model-name", "tiny-smol", api_key=API_KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


VLLM_KEY = "vllm-env-key"
VLLM_MODEL = "vllm-flags"
# The flags a vLLM deployment's command line carries (docs/vllm_compat.md), every one of them at once
VLLM_COMMAND_LINE = (
    "--root-path", "/proxy", "--enable-request-id-headers", "--show-hidden-metrics-for-version", "0.10",
    "--enable-prompt-tokens-details", "--structured-outputs-config.backend", "guidance", "--runner", "generate",
    "--max-cpu-loras", "2", "--load-format", "auto", "--no-enable-chunked-prefill", "--enable-prefix-caching",
    "--disable-frontend-multiprocessing", "--return-tokens-as-token-ids", "--max-logprobs", "151936",
    "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking", "--enable-force-include-usage",
    "--no-async-scheduling",
)


@pytest.fixture(scope="session")
def vllm_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server started the way a vLLM deployment starts one: its flags, and the key in $VLLM_API_KEY."""
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    old = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = VLLM_KEY   # the child copies the environment at start
    try:
        srv = ServerProcess(server_model_dir, log, "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                            "--served-model-name", VLLM_MODEL, *VLLM_COMMAND_LINE, model_as_argument=True)
    finally:
        if old is None:
            os.environ.pop("VLLM_API_KEY")
        else:
            os.environ["VLLM_API_KEY"] = old
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture()
def client(api_server: ServerProcess):
    import openai
    with openai.OpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


class InProcessServer:
    """build_app + uvicorn on a thread, around an LLMEngine the test can reach into (e.g. to break it)."""

    def __init__(self, model_dir: Path, **engine_overrides: Any):
        from pagedmodel.server.engine.args import EngineArgs
        from pagedmodel.server.engine.llm_engine import LLMEngine

        kw = dict(model=str(model_dir), device="cpu", max_model_len=128, kv_cache_memory=4 << 20)
        kw.update(engine_overrides)
        self.engine = LLMEngine(EngineArgs(**kw))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "InProcessServer":
        import threading

        import uvicorn

        from pagedmodel.server.api.app import build_app
        from pagedmodel.server.api.serving import ServerConfig

        self.app = build_app(self.engine, ServerConfig(served_model_name=self.engine.model_name))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_until(lambda: self.server.started, timeout=30):
            raise TimeoutError("in-process server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "in-process server did not stop"
