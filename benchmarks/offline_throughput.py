"""Offline throughput: our engine vs HF `generate` (static batches) vs HF `generate_batch` (continuous
batching), same model, dtype, prompts and thread count, in one process. Prints tok/s and ratios.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 64] [--model DIR]

A benchmark, not a test: CPU timings are noisy, so compare the ratios printed by one run.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = ("serving memory block cache token batch request latency kernel scheduler prefix model the a of "
             "and to in is for with on as by GPU CPU paged attention throughput queue").split()
    prompts = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        ids = tokenizer(" ".join(rng.choice(words) for _ in range(n * 2))).input_ids[:n]
        prompts.append(ids)
    return prompts


def bench_ours(model_dir, prompts, output_len, dtype, block_size) -> float:
    from pagedmodel import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype=dtype, block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def _hf_model(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def bench_hf_static(model_dir, prompts, output_len, dtype, batch_size, pad_id) -> float:
    model = _hf_model(model_dir, dtype)
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                           do_sample=False, pad_token_id=pad_id)
    return len(prompts) * output_len / (time.perf_counter() - t)


def bench_hf_continuous(model_dir, prompts, output_len, dtype) -> float | None:
    from transformers import GenerationConfig

    model = _hf_model(model_dir, dtype)
    if not hasattr(model, "generate_batch"):
        return None
    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    return len(prompts) * output_len / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pagedmodel.server.engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = make_prompts(tok, args.num_prompts, *args.input_len, seed=0)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output tokens each, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}")
    results = {"ours": bench_ours(model_dir, prompts, args.output_len, args.dtype, args.block_size)}
    print(f"pagedmodel engine          {results['ours']:8.1f} tok/s")
    results["hf_generate_static"] = bench_hf_static(model_dir, prompts, args.output_len, args.dtype,
                                                    args.hf_batch_size, tok.pad_token_id or 0)
    print(f"HF generate (batch {args.hf_batch_size:3d})   {results['hf_generate_static']:8.1f} tok/s")
    try:
        results["hf_generate_batch"] = bench_hf_continuous(model_dir, prompts, args.output_len, args.dtype)
    except Exception as exc:  # report, don't hide: HF's continuous batching API is young and changes
        print(f"HF generate_batch failed: {type(exc).__name__}: {exc}")
        results["hf_generate_batch"] = None
    if results["hf_generate_batch"]:
        print(f"HF generate_batch          {results['hf_generate_batch']:8.1f} tok/s")
    for name in ("hf_generate_static", "hf_generate_batch"):
        if results.get(name):
            print(f"ratio ours / {name}: {results['ours'] / results[name]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_s": results}, f, indent=2)


if __name__ == "__main__":
    main()
