"""`benchmarks/soak.py --quick` as the suite runs it: two short phases (one engine; a router over two engines)
of the fixed-seed mix against real `pagedmodel serve` processes on the tiny model, and the soak's own
checks: 0 "other" outcomes, KV blocks back to 0 (gauge and pool invariants), preemption in both modes,
bounded RSS and router connections/tasks back to idle."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_quick_passes_and_prints_its_outcome_table(tmp_path: Path) -> None:
    """Guards: the soak's outcome table has 0 'other' errors and every end-of-phase leak check holds."""
    proc = subprocess.run([sys.executable, str(SOAK), "--quick", "--logdir", str(tmp_path)], capture_output=True,
                          text=True, timeout=1500)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-6000:]
    assert out.rstrip().endswith("SOAK PASS"), out[-3000:]
    header = re.findall(r"^outcome\s+(.+)$", out, re.M)
    rows = re.findall(r"^requests\s+(.+)$", out, re.M)
    assert len(header) == len(rows) == 2, out[-3000:]   # one table per phase
    for head, row in zip(header, rows):
        counts = dict(zip(head.split(), map(int, row.split())))
        assert counts["other"] == 0 and counts["completed"] > 0 and counts["aborted"] > 0, counts
    assert out.count("invariants ok") == 3, out[-3000:]   # engine A in both phases, engine B in the second
    assert "upstream_in_use 0/0" in out
