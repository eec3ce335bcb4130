"""--chat-template (vLLM's flag): a template file or the template text replaces the model's own; a value
that is neither stops the server at start with one line naming the flag."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from .conftest import ServerProcess

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}<<assistant>>"


def rendered_text(srv: ServerProcess) -> str:
    r = httpx.post(srv.base_url + "/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    r.raise_for_status()
    ids = r.json()["tokens"]
    return httpx.post(srv.base_url + "/detokenize", json={"model": "m", "tokens": ids}, timeout=30).json()["prompt"]


def test_template_file_and_template_text_replace_the_models(server_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    for value in (str(path), TEMPLATE):
        srv = ServerProcess(server_model_dir, tmp_path / "server.log", "--max-model-len", "128",
                            "--kv-cache-memory", str(4 << 20), "--served-model-name", "m", "--chat-template", value)
        try:
            srv.wait_ready()
            assert rendered_text(srv) == "<<user>>hi\n<<assistant>>"
            info = httpx.get(srv.base_url + "/v1/models", timeout=30)
            assert info.status_code == 200
        finally:
            srv.stop()


def test_a_missing_template_file_stops_the_start(server_model_dir: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-template.jinja")
    proc = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "serve", "--model", str(server_model_dir),
                           "--device", "cpu", "--port", "0", "--chat-template", missing],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "--chat-template" in last and "no-such-template.jinja" in last
