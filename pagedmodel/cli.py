"""The `pagedmodel` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that owns it; this file only wires argparse
and imports each subcommand's module only to build its flags (the heavy imports — torch, the
engine — happen inside the modules' run functions), so `pagedmodel --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedmodel.server.api.serve", "serve a model over the OpenAI-compatible HTTP API"),
    "generate": ("pagedmodel.generate", "generate text offline from prompts (no HTTP)"),
    "models": ("pagedmodel.server.engine.model_store", "prepare models offline (`models pull`)"),
    "router": ("pagedmodel.server.router.app", "rate-limiting, KV-aware router in front of engine replicas"),
    "operator": ("pagedmodel.operator.main", "run the PagedModel Kubernetes operator"),
    "bench": ("pagedmodel.bench", "load-test a running server (`bench serve`)"),
    "watermark": ("pagedmodel.watermark", "score text for a --watermark-config's watermark (`watermark detect`)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmodel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
