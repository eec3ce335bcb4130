"""Flags a vLLM command line carries, so `vllm serve ...` arguments never die at parse here.

Each flag is one of three kinds:
- implemented: it does here what it does in vLLM (--root-path, --enable-request-id-headers, ...);
- no effect: it only tunes something this engine does not have or always does (the frontend process,
  chunked prefill); accepted, and one log line says so;
- refused: a value that would change results in a way we cannot honour (--runner pooling, a
  --reasoning-parser we do not have): exit 2 with a message naming the flag.

(--load-format and --skip-tokenizer-init change what the engine loads: EngineArgs owns them.)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .reasoning import REASONING_PARSERS, check_reasoning_parser

# vLLM's backends for --structured-outputs-config.backend; every one constrains to the same grammar, so
# any of them is served by ours (xgrammar) and only the compile speed differs.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
OUR_STRUCTURED_OUTPUT_BACKEND = "xgrammar"
RUNNERS_SERVED = ("auto", "generate")


@dataclass(frozen=True)
class NoEffectFlag:
    """A flag accepted for compatibility; ``why`` is the log line's reason."""

    dest: str
    flag: str
    why: str


NO_EFFECT_FLAGS = (
    NoEffectFlag("show_hidden_metrics_for_version", "--show-hidden-metrics-for-version",
                 "no metric is hidden here: every metric we export is always shown"),
    NoEffectFlag("max_cpu_loras", "--max-cpu-loras",
                 "loaded adapters all stay in host memory; --max-loras bounds the ones batched at once"),
    NoEffectFlag("enable_chunked_prefill", "--[no-]enable-chunked-prefill",
                 "prefill is always chunked to --max-num-batched-tokens; outputs do not depend on it"),
    NoEffectFlag("disable_frontend_multiprocessing", "--disable-frontend-multiprocessing",
                 "the HTTP frontend always runs in the engine's process"),
    NoEffectFlag("async_scheduling", "--[no-]async-scheduling",
                 "each step is scheduled after the previous one's tokens are known; outputs do not depend on it"),
)


def add_vllm_flag_arguments(parser: argparse.ArgumentParser) -> None:
    """The vLLM serve flags this module owns (the engine's own live in EngineArgs)."""
    g = parser.add_argument_group("vLLM compatibility")
    a = g.add_argument
    a("--root-path", default=None, help="the path prefix a proxy serves this app under (ASGI root_path)")
    a("--enable-request-id-headers", action="store_true",
      help="every response carries X-Request-Id (the client's own, when it sent one)")
    a("--enable-prompt-tokens-details", action="store_true",
      help="usage carries prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache)")
    a("--return-tokens-as-token-ids", action="store_true",
      help='logprobs name tokens as "token_id:N" (for tokens that are not valid UTF-8 alone)')
    a("--enable-tokenizer-info-endpoint", action="store_true",
      help="serve GET /tokenizer_info: the tokenizer's configuration and chat template")
    a("--enable-server-load-tracking", action="store_true",
      help="GET /load reports the model requests in progress")
    a("--enable-force-include-usage", action="store_true",
      help="every stream carries usage: on each chunk and in a final usage chunk, whatever stream_options say")
    a("--structured-outputs-config.backend", dest="structured_outputs_backend", default=None,
      choices=STRUCTURED_OUTPUT_BACKENDS, help=f"accepted; structured outputs always use {OUR_STRUCTURED_OUTPUT_BACKEND}")
    a("--runner", default=None, choices=("auto", "generate", "pooling", "draft"),
      help="only the generate runner is served (auto means generate)")
    a("--show-hidden-metrics-for-version", default=None, metavar="VERSION", help="accepted; no effect here")
    a("--max-cpu-loras", type=int, default=None, help="accepted; no effect here")
    a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
      help="accepted; prefill is always chunked here")
    a("--disable-frontend-multiprocessing", action="store_true", default=None, help="accepted; no effect here")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
      help="accepted; steps are always scheduled one after another here")
    # a free string, so vLLM's other names reach check_vllm_flags and its message (argparse would only list ours)
    a("--reasoning-parser", default=None, metavar="NAME",
      help=f"split chat answers' thinking into `reasoning`: {' or '.join(sorted(REASONING_PARSERS))}")


def check_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Refuse (ValueError) what would change results; return one log line per no-effect flag given."""
    runner = getattr(args, "runner", None)
    if runner is not None and runner not in RUNNERS_SERVED:
        raise ValueError(f"--runner {runner} is not served: this engine runs generative models only "
                         f"(--runner generate)")
    check_reasoning_parser(getattr(args, "reasoning_parser", None))
    check_tokenizer_free(args)
    notes = [f"{f.flag} has no effect here: {f.why}" for f in NO_EFFECT_FLAGS
             if getattr(args, f.dest, None) is not None]
    backend = getattr(args, "structured_outputs_backend", None)
    if backend not in (None, "auto", OUR_STRUCTURED_OUTPUT_BACKEND):
        notes.append(f"--structured-outputs-config.backend {backend} has no effect here: structured outputs "
                     f"are always compiled by {OUR_STRUCTURED_OUTPUT_BACKEND}, which enforces the same constraints")
    return notes


# flags whose feature reads or writes text, so cannot work without a tokenizer
NEEDS_TOKENIZER = (("chat_template", "--chat-template"), ("enable_auto_tool_choice", "--enable-auto-tool-choice"),
                   ("reasoning_parser", "--reasoning-parser"), ("reasoning_config", "--reasoning-config"),
                   ("enable_tokenizer_info_endpoint", "--enable-tokenizer-info-endpoint"))


def check_tokenizer_free(args: argparse.Namespace) -> None:
    """--skip-tokenizer-init serves token ids only: a flag that needs the tokenizer is refused with it, at start."""
    if not getattr(args, "skip_tokenizer_init", False):
        return
    given = [flag for dest, flag in NEEDS_TOKENIZER if getattr(args, dest, None)]
    if given:
        raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} the tokenizer, so cannot go "
                         f"with --skip-tokenizer-init")


def max_logprobs_for(requested: int, vocab_size: int) -> int:
    """--max-logprobs as a count: -1 (vLLM's "the vocabulary") and anything larger are capped at it."""
    return vocab_size if requested == -1 else min(requested, vocab_size)
