"""`pagedmodel generate`: offline text generation from the command line (no HTTP server)."""
from __future__ import annotations

import argparse
import sys

from pagedmodel.server.engine.args import ConfigError, EngineArgs
from pagedmodel.server.engine.sampling_params import SamplingParams, SamplingParamsError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from pagedmodel.server.engine.llm import LLM
    from pagedmodel.server.engine.model_store import ModelNotAvailableError

    if args.skip_tokenizer_init:
        print("pagedmodel generate: reads and prints text, so needs the tokenizer: drop --skip-tokenizer-init",
              file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, n=args.n, seed=args.sampling_seed)
        engine_args = EngineArgs.from_cli_args(args)
        llm = LLM(**vars(engine_args))
    except (ConfigError, SamplingParamsError, ModelNotAvailableError, ValueError) as exc:
        print(f"pagedmodel generate: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompts
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"pagedmodel generate: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            print(f"{prompt}{completion.text}" if not args.chat else completion.text)
        m = out.metrics
        print(f"[{len(out.prompt_token_ids)} prompt + {sum(len(c.token_ids) for c in out.outputs)} generated tokens, "
              f"TTFT {m.time_to_first_token:.2f}s, total {m.e2e_latency:.2f}s]", file=sys.stderr)
    return 0
