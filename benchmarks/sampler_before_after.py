"""The batched sampler's cost on unconstrained rows, this tree against another checkout of the repo.

    git worktree add /tmp/before <commit> && python benchmarks/sampler_before_after.py --before /tmp/before

Loads ``server/engine/sampler.py`` of both trees side by side in one process and times ``sample`` on
``--rows`` rows of random logits as wide as SmolLM2's vocabulary: greedy rows, seeded top-p rows, and
a chat client's rows (top-p with repetition and presence penalties). The trees alternate every round;
each keeps its best of ``--reps`` calls, in thread CPU time. Used for structured outputs'
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

KINDS = ("greedy", "top_p", "penalised")


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
        elif kind == "top_p":
            gen = torch.Generator()
            gen.manual_seed(i)
            rows.append(sampler.SamplingRow(sp.SamplingParams(temperature=0.8, top_p=0.9), [1, 2, 3], [4], gen))
        else:   # a chat client's settings: top-p plus repetition and presence penalties over a 200-token history
            gen = torch.Generator()
            gen.manual_seed(i)
            params = sp.SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3)
            rows.append(sampler.SamplingRow(params, list(range(100 + i, 300 + i)), list(range(40)), gen))
    return rows


def best_ms(tree, rows: list, logits: torch.Tensor, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        work = logits.clone()
        start = time.thread_time()    # CPU time: the development machine is shared, wall time measures waiting
        tree[0].sample(work, rows)
        best = min(best, time.thread_time() - start)
    return best * 1e3


def smollm2_logits(rows: int) -> torch.Tensor:
    """SmolLM2-135M-Instruct's logits for the first reply token of ``rows`` different chat prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedmodel.server.engine.model_store import resolve_model

    path = resolve_model("smollm2")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    topics = ("the sea", "taxes", "a cat", "rust", "jazz", "Paris", "sleep", "chess")
    out = []
    for i in range(rows):
        chat = [{"role": "user", "content": f"Write {i % 5 + 1} sentences about {topics[i % len(topics)]}."}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out.append(model(**ids).logits[0, -1].float())
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152, help="width of --logits random")
    ap.add_argument("--logits", choices=("smollm2", "random"), default="smollm2",
                    help="smollm2: the real model's next-token logits after --rows chat prompts (what users' rows "
                         "look like: peaked); random: N(0, 1) logits (flat: top-p's worst case)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trees = {"before": load_engine("engine_before", args.before),
             "after": load_engine("engine_after", Path(__file__).resolve().parents[1])}
    logits = smollm2_logits(args.rows) if args.logits == "smollm2" else torch.randn(args.rows, args.vocab)
    times: dict[tuple[str, str], list[float]] = {(t, k): [] for t in trees for k in KINDS}
    for r in range(args.rounds):
        for kind in KINDS:
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                times[(name, kind)].append(best_ms(trees[name], rows_of(trees[name], kind, args.rows), logits, args.reps))
    for kind in KINDS:
        before, after = min(times[("before", kind)]), min(times[("after", kind)])
        print(f"{kind:9s} {args.rows} rows: before {before:.2f} ms, after {after:.2f} ms, after/before {after / before:.3f}")


if __name__ == "__main__":
    main()
