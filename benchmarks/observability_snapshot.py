"""Render the chart's Grafana dashboard from real data: its own queries, evaluated by a real Prometheus
that scraped an engine, a router and the operator (tests/observability/stack.py), drawn with matplotlib
(Grafana itself is not in our package registries).

    python3 benchmarks/observability_snapshot.py --out docs/observability.png [--seconds 90]

The load: a few minutes of completions straight to the engine (repeated prefixes, so the prefix cache
hits) and bursts through the router, whose 1 request/s limit answers part of them with 429.
"""
from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for sub in ("tests", "tests/observability", "tests/operator"):
    sys.path.insert(0, str(REPO / sub))

import monitoring  # noqa: E402
import prometheus_tools  # noqa: E402
from stack import MODEL, NAMESPACE, Stack  # noqa: E402

STEP_S = 2.0


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def load(stack: Stack, seconds: float) -> None:
    """Traffic for `seconds`, in waves, so the panels show change rather than flat lines."""
    end = time.time() + seconds
    while time.time() < end:
        stack.traffic(rounds=3, pause=0.2)
        time.sleep(2.0)


def plot(stack: Stack, start: float, end: float, out: Path, command: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = monitoring.render().dashboard()["panels"]
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    variables = {"namespace": NAMESPACE, "pagedmodel": MODEL, "pod": ".*"}
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            expr = monitoring.substitute(target["expr"], variables, "30s")
            for series in stack.query_range(expr, start, end, STEP_S):
                xs = [(float(t) - start) / 60 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=legend(target["legendFormat"], series["metric"]))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=7)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        if unit:
            ax.set_ylabel(unit, fontsize=8)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle(f"PagedModel dashboard ({NAMESPACE}/{MODEL}): the chart's queries over a real Prometheus", fontsize=13)
    fig.text(0.01, 0.005, f"{command}  |  {stamp}  |  1 engine (tiny random Llama, CPU) + router + operator "
             "passes against an in-memory Kubernetes API; Prometheus 2.42 scraping every 1 s", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(out, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "observability.png")
    ap.add_argument("--seconds", type=float, default=90.0, help="how long to send traffic")
    args = ap.parse_args()
    if args.seconds <= 0:
        ap.error("--seconds must be > 0")
    from tiny_models import make_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model_dir(Path(tmp) / "model", "llama")
        stack = Stack(model, prometheus_tools.binaries()[0], Path(tmp))
        try:
            start = time.time()
            load(stack, args.seconds)
            time.sleep(5)
            plot(stack, start, time.time(), args.out, "python3 benchmarks/observability_snapshot.py " +
                 " ".join(sys.argv[1:]))
        finally:
            stack.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
