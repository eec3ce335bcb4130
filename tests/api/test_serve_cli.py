"""`pagedmodel serve` flags: vLLM's names are all there, and bad values fail fast with a message, exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedmodel.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_help_lists_the_architecture_flags() -> None:
    r = cli("serve", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--host", "--port", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                 "--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory", "--swap-space",
                 "--enable-prefix-caching", "--preemption-mode", "--dtype", "--device", "--max-queue-len",
                 "--api-key", "--served-model-name", "--log-requests", "--shutdown-timeout"):
        assert flag in r.stdout, flag
    bench = cli("bench", "serve", "--help")
    assert bench.returncode == 0
    for flag in ("--base-url", "--request-rate", "--num-prompts", "--burstiness", "--dataset-path", "--json"):
        assert flag in bench.stdout, flag


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model/dir"], "does not exist"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-queue-len", "-1"], "--max-queue-len must be >= 0"),
])
def test_serve_rejects_bad_flags_without_traceback(args: list[str], message: str, server_model_dir: Path) -> None:
    if "--model" not in args:
        args = ["--model", str(server_model_dir), *args]
    r = cli("serve", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_rejects_max_model_len_beyond_the_model(server_model_dir: Path) -> None:
    r = cli("serve", "--model", str(server_model_dir), "--device", "cpu", "--max-model-len", "999999")
    assert r.returncode == 2 and "exceeds the model's limit" in r.stderr and "Traceback" not in r.stderr
