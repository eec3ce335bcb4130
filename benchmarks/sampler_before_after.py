"""The batched sampler's cost on unconstrained rows, this tree against another checkout of the repo.

    git worktree add /tmp/before <commit> && python benchmarks/sampler_before_after.py --before /tmp/before

Loads ``server/engine/sampler.py`` of both trees side by side in one process and times ``sample`` on
``--rows`` rows of random logits as wide as SmolLM2's vocabulary: greedy rows, and seeded top-p rows.
The trees alternate every round; each keeps its best of ``--reps`` calls. Used for structured outputs'
"no regression for unconstrained traffic" (docs/benchmarks.md). A benchmark, not a test: compare the
ratios of one run.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import types
from pathlib import Path

import torch


def load_engine(tag: str, root: Path):
    """``root``'s engine package under the name ``tag`` (its modules import each other relatively)."""
    package = types.ModuleType(tag)
    package.__path__ = [str(root / "server" / "engine")]
    sys.modules[tag] = package
    return importlib.import_module(f"{tag}.sampler"), importlib.import_module(f"{tag}.sampling_params")


def rows_of(tree, kind: str, n: int) -> list:
    sampler, sp = tree
    rows = []
    for i in range(n):
        if kind == "greedy":
            rows.append(sampler.SamplingRow(sp.SamplingParams(temperature=0), [1, 2, 3], [4], None))
        else:
            gen = torch.Generator()
            gen.manual_seed(i)
            rows.append(sampler.SamplingRow(sp.SamplingParams(temperature=0.8, top_p=0.9), [1, 2, 3], [4], gen))
    return rows


def best_ms(tree, rows: list, logits: torch.Tensor, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        work = logits.clone()
        start = time.perf_counter()
        tree[0].sample(work, rows)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trees = {"before": load_engine("engine_before", args.before),
             "after": load_engine("engine_after", Path(__file__).resolve().parents[1])}
    logits = torch.randn(args.rows, args.vocab)
    times: dict[tuple[str, str], list[float]] = {(t, k): [] for t in trees for k in ("greedy", "top_p")}
    for r in range(args.rounds):
        for kind in ("greedy", "top_p"):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                times[(name, kind)].append(best_ms(trees[name], rows_of(trees[name], kind, args.rows), logits, args.reps))
    for kind in ("greedy", "top_p"):
        before, after = min(times[("before", kind)]), min(times[("after", kind)])
        print(f"{kind:7s} {args.rows} rows: before {before:.2f} ms, after {after:.2f} ms, after/before {after / before:.3f}")


if __name__ == "__main__":
    main()
