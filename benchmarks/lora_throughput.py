"""Multi-LoRA throughput (issue #17 item 5): one fixed-seed batch generated offline (`pagedmodel.LLM`) with
the base model only, then on a LoRA-enabled engine with 0 adapters (every request on the base model), 1
adapter (every request on it) and 4 adapters mixed in the batch (requests spread round-robin over ranks
8, 16, 8, 16). Prints output tokens per second and the ratio to base only, all within one run.

    OMP_NUM_THREADS=1 python benchmarks/lora_throughput.py [--model DIR] [--num-prompts 32] [--output-len 32]

Adapters are PEFT adapters made by tests/lora_adapters.py (random non-zero weights on every projection),
written to a temporary directory. Before the timed runs, every variant generates once untimed, so all four
adapters are resident in the engine's --max-loras 4 slots and the figures are steady-state batching, not
slot loading. Each variant is timed `--repeats` times in interleaved order and its best run counts.

Rates are per second of this process's CPU time (with one torch thread, the time it actually computed) as
well as per wall-clock second: on a machine shared with other busy processes the wall clock mostly measures
how long it waited for a core, so the CPU-time ratios are the ones to read there. A benchmark, not a test:
compare the ratios of one run, not figures across machines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # lora_adapters.py

WORDS = ("serving memory block cache token batch request latency kernel scheduler prefix model the a of and to in "
         "is for with on as by adapter rank low update weights fine tuned paged attention throughput queue").split()
RANKS = (8, 16, 8, 16)


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        prompts.append(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n * 2)))[:n])
    return prompts


def make_adapters(model_dir: Path, root: Path) -> list:
    from lora_adapters import make_peft_adapter

    from pagedmodel import LoRARequest

    return [LoRARequest(f"a{i}-r{rank}", i + 1, str(make_peft_adapter(model_dir, root / f"a{i}", rank=rank, seed=i)))
            for i, rank in enumerate(RANKS)]


def timed(llm, prompts, params, loras) -> tuple[float, float, list[list[int]]]:
    """Output tokens per CPU second and per wall second for one generate() of the whole batch, and the tokens."""
    cpu, wall = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(map(len, tokens))
    return n / cpu, n / wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes of KV cache per engine")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    import torch

    from pagedmodel import LLM, SamplingParams
    from pagedmodel.server.engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    engine_args = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.num_prompts,
                       kv_cache_memory=args.kv_cache_memory, max_model_len=args.input_len[1] + args.output_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = make_adapters(model_dir, Path(tmp))
        base = LLM(str(model_dir), **engine_args)
        lora = LLM(str(model_dir), enable_lora=True, max_loras=len(adapters), max_lora_rank=max(RANKS), **engine_args)
        prompts = make_prompts(base.tokenizer, args.num_prompts, *args.input_len, seed=0)
        n = len(prompts)
        variants = {
            "base only (LoRA off)": (base, [None] * n),
            "0 adapters (LoRA on)": (lora, [None] * n),
            "1 adapter": (lora, [adapters[0]] * n),
            "4 adapters mixed": (lora, [adapters[i % len(adapters)] for i in range(n)]),
        }
        print(f"{model_dir.name}, {n} prompts ({sum(map(len, prompts))} prompt tokens, {args.input_len[0]}-"
              f"{args.input_len[1]} each), {args.output_len} output tokens each, {args.dtype} on {args.device}, "
              f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
              f"adapter ranks {RANKS}, load average {os.getloadavg()[0]:.2f}")
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for llm, loras in variants.values():   # untimed: loads every adapter into a slot
            llm.generate(prompts[:len(adapters)], warm, lora_request=loras[:len(adapters)])
        best_cpu: dict[str, float] = {}
        best_wall: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for repeat in range(args.repeats):
            for name, (llm, loras) in variants.items():
                cpu_rate, wall_rate, outputs[name] = timed(llm, prompts, params, loras)
                best_cpu[name] = max(best_cpu.get(name, 0.0), cpu_rate)
                best_wall[name] = max(best_wall.get(name, 0.0), wall_rate)
                print(f"  run {repeat + 1}: {name:24s} {cpu_rate:7.1f} tok/CPU-s {wall_rate:7.1f} tok/s wall",
                      flush=True)
        if outputs["1 adapter"] == outputs["0 adapters (LoRA on)"]:
            raise SystemExit("the adapter did not change any output: the benchmark would measure a no-op")
        ref_cpu, ref_wall = best_cpu["base only (LoRA off)"], best_wall["base only (LoRA off)"]
        print(f"{'variant':24s} {'tok/CPU-s':>10s} {'vs base':>8s} {'tok/s wall':>11s} {'vs base':>8s}")
        for name in variants:
            print(f"{name:24s} {best_cpu[name]:10.1f} {best_cpu[name] / ref_cpu:7.2f}x "
                  f"{best_wall[name]:11.1f} {best_wall[name] / ref_wall:7.2f}x")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_cpu_s": best_cpu, "tok_per_wall_s": best_wall}, f, indent=2)


if __name__ == "__main__":
    main()
