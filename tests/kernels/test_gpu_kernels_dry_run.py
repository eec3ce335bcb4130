"""benchmarks/gpu_kernels.py --dry-run: the GPU script's every section runs on CPU (interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path, tiny_llama_dir):
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDMODEL_ATTENTION_BACKEND")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--model", str(tiny_llama_dir)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True

    kernels = {r["kernel"] for r in results["correctness"]}
    assert kernels == {"paged_attention", "write_kv", "copy_blocks"}
    assert all(r["ok"] for r in results["correctness"]), results["correctness"]

    rows = results["decode_bandwidth"]
    assert len(rows) == 4 and not any("error" in r for r in rows)
    assert all(r["gbps"] > 0 and r["kernel_us"] > 0 and r["call_us"] > 0 and r["torch_us"] > 0 for r in rows)

    e2e = results["e2e"]
    assert "engine_error" not in e2e and "hf_error" not in e2e, e2e
    assert e2e["backend"] == "triton"
    assert e2e["engine_tokens_per_s"] > 0 and e2e["hf_tokens_per_s"] > 0
    assert e2e["greedy_agreement"]["of"] == e2e["prompts"]
    assert "decode attention bandwidth" in proc.stdout and "PASS" in proc.stdout
    markdown = out.with_suffix(".md").read_text()
    assert "| layout | batch | context |" in markdown and markdown.count("| tiny") == 4
    assert "cases pass." in markdown and "identical greedy outputs" in markdown
