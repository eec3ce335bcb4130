"""`pagedmodel`'s public names: vLLM's offline imports work, and importing the package stays cheap."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_pagedmodel_does_not_load_torch_or_the_engine() -> None:
    r = _run("import sys, pagedmodel\n"
             "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('pagedmodel.server'))\n"
             "print(heavy)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_vllm_style_imports_resolve_to_the_engine_classes() -> None:
    r = _run("from pagedmodel import LLM, SamplingParams, RequestOutput, EngineArgs\n"
             "print(LLM.__module__, SamplingParams.__module__, RequestOutput.__module__, EngineArgs.__module__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pagedmodel.server.engine.llm", "pagedmodel.server.engine.sampling_params",
                                "pagedmodel.server.engine.outputs", "pagedmodel.server.engine.args"]


def test_unknown_name_is_an_attribute_error() -> None:
    import pagedmodel

    with pytest.raises(AttributeError, match="no attribute 'LLMEngine'"):
        pagedmodel.LLMEngine  # noqa: B018  (not public: the engine class is pagedmodel.server.engine's)
    assert {"LLM", "SamplingParams", "RequestOutput", "EngineArgs"} <= set(dir(pagedmodel))


def test_cli_builds_every_subcommand_without_loading_torch() -> None:
    """Every subcommand module is imported to build `pagedmodel --help`; the engine's torch loads only in run()."""
    r = _run("import sys\nfrom pagedmodel.cli import SUBCOMMANDS, build_parser\n"
             "parser = build_parser()\n"
             "sub = next(a for a in parser._actions if a.dest == 'command')\n"
             "print(sorted(sub.choices) == sorted(SUBCOMMANDS), 'torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
