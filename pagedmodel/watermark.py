"""`pagedmodel watermark detect`: score text (or token ids) for the gumbel watermark a server put on it.

Give the key and context width the server ran with (its --watermark-config JSON as it is, or --key) and the
generated answer alone: the prompt was never watermarked. Text is tokenized by --model's tokenizer, which
must be the serving model's, since the watermark lives in token ids. Prints the detection as JSON; exits 0
(1 with --exit-code when the text is not watermarked, for scripts).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["detect"], help="detect: score text for the watermark")
    key = parser.add_mutually_exclusive_group(required=True)
    key.add_argument("--watermark-config", metavar="JSON", help="the server's --watermark-config (key, context_width)")
    key.add_argument("--key", type=int, help="the secret key (context width from --context-width)")
    parser.add_argument("--context-width", type=int, default=4, help="with --key: the server's context_width")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the generated text")
    source.add_argument("--file", type=Path, help="a file holding the generated text")
    source.add_argument("--token-ids", help="the generated token ids, comma-separated (no tokenizer needed)")
    parser.add_argument("--model", default=None, help="whose tokenizer reads --text/--file (default: SmolLM2)")
    parser.add_argument("--p-value-threshold", type=float, default=0.01, help="watermarked at or below this")
    parser.add_argument("--no-deduplicate-contexts", dest="deduplicate", action="store_false",
                        help="score every token, repeated contexts too (their evidence is then not independent)")
    parser.add_argument("--exit-code", action="store_true", help="exit 1 when the text is not watermarked")


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        try:
            return [int(t) for t in args.token_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--token-ids must be integers separated by commas, got {args.token_ids!r}") from None
    text = args.text if args.text is not None else args.file.read_text()
    from transformers import AutoTokenizer

    from pagedmodel.server.engine.model_store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(args: argparse.Namespace) -> int:
    from pagedmodel.server.engine.watermark_config import parse_watermark_config
    from pagedmodel.server.engine.watermark_detector import detect_watermark

    try:
        if args.watermark_config is not None:
            config = parse_watermark_config(args.watermark_config)
            key, width = config.key, config.context_width
        else:
            key, width = args.key, args.context_width
        detection = detect_watermark(_token_ids(args), key, width, args.p_value_threshold, args.deduplicate)
    except (OSError, ValueError) as exc:
        print(f"pagedmodel watermark: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(detection)))
    return 1 if args.exit_code and not detection.is_watermarked else 0
