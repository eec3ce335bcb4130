"""`pagedmodel serve`: flags, loading the engine, and a uvicorn server that drains on SIGTERM."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from fastapi import FastAPI

from pagedmodel.server.http_common.api_key import add_auth_arguments
from .app import build_app
from .chat_template import load_chat_template
from pagedmodel.server.http_common.http_limits import HTTPLimits, add_limit_arguments, limits_from_args
from .http_protocol import limited_protocol
from .reasoning import engine_reasoning_config
from .serving import OpenAIServing, ServerConfig
from .vllm_flags import add_vllm_flag_arguments, check_vllm_flags, max_logprobs_for

logger = logging.getLogger("pagedmodel.server.api")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedmodel.server.engine.args import EngineArgs
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` names it (the same as --model)")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every path but --auth-exempt "
                             "(also read from $PAGEDMODEL_API_KEY, or vLLM's $VLLM_API_KEY)")
    add_auth_arguments(parser)
    add_limit_arguments(parser, engine=True)
    parser.add_argument("--log-requests", action="store_true", help="log one INFO line per request")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--enable-debug-endpoints", action="store_true",
                        help="serve GET /debug/kv_blocks: KV pool counts and the block invariant check "
                             "(behind --api-key; for soaks and debugging)")
    from .tool_parsers import TOOL_PARSERS
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (a file, or the template text) in place of the model's own")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": the model decides, --tool-call-parser reads its calls')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model's tool-call format (hermes: <tool_call>{...}</tool_call>)")
    add_vllm_flag_arguments(parser)


class _GracefulServer:
    """uvicorn.Server whose SIGTERM ends the process with status 0 after draining, as Kubernetes expects."""

    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str,
                 limits: HTTPLimits | None = None):
        import uvicorn
        limits = limits or HTTPLimits()
        # h11 with our protocol (http_protocol.py): header size, head timeout and connection limits as JSON
        # errors; uvicorn's own limit_concurrency would answer in plain text, so it stays off.
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                     timeout_graceful_shutdown=max(0.0, shutdown_timeout), lifespan="on",
                                     http=limited_protocol(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
                                     timeout_keep_alive=limits.keep_alive_timeout)
        self.server = uvicorn.Server(self.config)
        self.app = app

    def run(self) -> None:
        serving: OpenAIServing = self.app.state.serving
        orig = self.server.handle_exit

        def handle_exit(sig: int, frame: Any) -> None:
            serving.draining = True   # new requests on open connections get 503; /health turns 503
            if sig == signal.SIGTERM:
                logger.info("SIGTERM: draining in-flight requests (up to %.0fs), then exiting",
                            self.config.timeout_graceful_shutdown or 0)
            orig(sig, frame)
        self.server.handle_exit = handle_exit  # type: ignore[method-assign]
        # uvicorn re-raises the caught signal after shutdown; a no-op SIGTERM handler turns that into exit 0.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            self.server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)


def _one_line(exc: BaseException, limit: int = 500) -> str:
    """The error as one line: the pod's termination message (and so `kubectl describe pm`) shows the log's
    last line, and a multi-line message would leave only its tail there."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def api_key_from(flag: str | None, environ: dict[str, str]) -> str | None:
    """--api-key, else $PAGEDMODEL_API_KEY, else vLLM's $VLLM_API_KEY (a vLLM deployment's env keeps working)."""
    return flag or environ.get("PAGEDMODEL_API_KEY") or environ.get("VLLM_API_KEY") or None


def model_from_args(args: argparse.Namespace) -> str | None:
    """`serve MODEL` (vLLM's form) or `serve --model MODEL`; both are fine when they agree."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"the model is named twice, differently: {tag!r} and --model {args.model!r}")
    return tag if tag is not None else args.model


def run(args: argparse.Namespace) -> int:
    import os

    from pagedmodel.server.engine.args import ConfigError, EngineArgs

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("starting: loading torch and the engine")   # the first lines of a start take seconds to come
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 <pid>` dumps every thread's stack
    from .allocator import tune_malloc
    tune_malloc()   # before the weights load and the engine's threads start (allocator.py says why)
    try:
        args.model = model_from_args(args)
        engine_args = EngineArgs.from_cli_args(args)
        # --max-logprobs is checked against the vocabulary once the model is loaded
        limits_from_args(args, max_logprobs_ceiling=sys.maxsize, max_logprobs=max(args.max_logprobs, 0))
        vllm_notes = check_vllm_flags(args)
        chat_template = load_chat_template(args.chat_template) if args.chat_template else None
        engine_args.reasoning_config = engine_reasoning_config(args.reasoning_parser, engine_args.reasoning_config)
    except (ConfigError, ValueError) as exc:
        print(f"pagedmodel serve: error: {exc}", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("pagedmodel serve: error: --enable-auto-tool-choice requires --tool-call-parser", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"pagedmodel serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    from pagedmodel.server.engine.llm_engine import LLMEngine
    from pagedmodel.server.engine.model_store import ModelNotAvailableError
    try:
        engine = LLMEngine(engine_args)
    except (ConfigError, ModelNotAvailableError, OSError, ValueError) as exc:
        logger.debug("engine start failed", exc_info=True)     # the traceback, with --log-level debug
        print(f"pagedmodel serve: error: cannot load the model: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:    # anything else from a checkpoint or a device: still one line, last in the log
        logger.debug("engine start failed", exc_info=True)
        print(f"pagedmodel serve: error: cannot start the engine: {type(exc).__name__}: {_one_line(exc)} "
              "(--log-level debug shows the traceback)", file=sys.stderr)
        return 1
    if chat_template is not None:   # before build_app: the API renders with copies of this tokenizer
        engine.tokenizer.chat_template = chat_template
    for note in vllm_notes:
        logger.info("%s", note)
    vocab = len(engine.tokenizer) if engine.tokenizer is not None else engine.vocab_size
    limits = limits_from_args(args, max_logprobs_ceiling=vocab, max_logprobs=max_logprobs_for(args.max_logprobs, vocab))
    config = ServerConfig(served_model_name=engine.model_name, api_key=api_key_from(args.api_key, dict(os.environ)),
                          log_requests=args.log_requests, max_queue_len=engine_args.max_queue_len,
                          model_root=engine_args.model, enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser,
                          enable_debug_endpoints=args.enable_debug_endpoints, auth_exempt=args.auth_exempt,
                          limits=limits, enable_request_id_headers=args.enable_request_id_headers,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          enable_server_load_tracking=args.enable_server_load_tracking,
                          enable_force_include_usage=args.enable_force_include_usage,
                          root_path=args.root_path or "",
                          reasoning_parser=args.reasoning_parser)
    app = build_app(engine, config)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", engine.model_name, args.host, args.port,
                engine.max_model_len)
    _GracefulServer(app, args.host, args.port, args.shutdown_timeout, args.log_level, limits).run()
    return 0
