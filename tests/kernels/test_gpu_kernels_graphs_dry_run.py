"""benchmarks/gpu_kernels.py --dry-run --sections graphs: the CUDA-graph comparison runs on CPU.

The full dry run (tests/kernels/test_gpu_kernels_dry_run.py) runs this section too; this test
checks what the section reports: both engines ran, decode went through the graph runner (the
CPU stand-in) including a padded batch, and the greedy tokens agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.slow
def test_graphs_section_dry_run(tmp_path, tiny_llama_dir):
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PAGEDMODEL_ATTENTION_BACKEND", "PAGEDMODEL_CUDA_GRAPHS")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--sections", "graphs", "--out", str(out),
         "--model", str(tiny_llama_dir)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["sections"] == ["graphs"] and results["correctness"] is None
    graphs = results["graphs"]
    assert "eager_error" not in graphs and "graphs_error" not in graphs, graphs
    assert graphs["graph_backend"] == "emulated" and graphs["graph_sizes"] == [1, 2, 4]
    # batches 1 and 3 (plus a 2-prompt warm-up): the 3-row decode steps replay the 4-row graph
    # with one padding row
    assert set(graphs["graph_replays_by_size"]) == {"1", "2", "4"}, graphs
    assert [r["batch"] for r in graphs["rows"]] == [1, 3]
    for row in graphs["rows"]:
        assert row["eager_tokens_per_s"] > 0 and row["graphs_tokens_per_s"] > 0
        assert row["identical"] == row["of"] == row["batch"], row
    assert "CUDA graphs vs eager" in proc.stdout
    markdown = out.with_suffix(".md").read_text()
    assert "| decode batch | eager tok/s | graphs tok/s | speedup | identical outputs |" in markdown
    assert "| 3 |" in markdown and "emulated graphs for decode batches 1..4" in markdown
