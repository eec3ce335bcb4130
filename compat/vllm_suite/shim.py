"""A pytest plugin that points vLLM's own OpenAI-server tests at ``pagedmodel serve``.

vLLM's tests start their server through ``tests.utils.RemoteOpenAIServer`` (``vllm serve MODEL ARGS``) and
load tokenizers by hub name. This plugin changes only those two seams: the server command becomes
``pagedmodel serve <local model> ARGS --served-model-name MODEL`` (the vLLM arguments passed on as they are:
a vLLM command line must work unchanged), and every hub name resolves to the local model's files, since
nothing can be downloaded here. The tests themselves run unmodified.

Set by run.py: PAGEDMODEL_SUITE_MODEL (the local checkpoint), PAGEDMODEL_SUITE_SERVE (the ``pagedmodel``
executable).
"""
from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from typing import Any

import pytest

MODEL_DIR = os.environ.get("PAGEDMODEL_SUITE_MODEL", "")
SERVE = os.environ.get("PAGEDMODEL_SUITE_SERVE", "pagedmodel")


def local_name(name: Any) -> Any:
    """A hub name becomes the local model's directory; a real path (an adapter, a template) stays."""
    if isinstance(name, str) and name and not os.path.exists(name):
        return MODEL_DIR
    return name


HUB_CACHE = os.path.join(os.environ.get("PAGEDMODEL_SUITE_WORK", "/tmp"), "hub-cache")


def hub_cache_entry(name: str) -> bool:
    """Puts the local model in a Hugging Face cache (HUB_CACHE) under the hub id ``name``, as a download
    would have, so the server is started with the id itself (vLLM reports it as the model's root)."""
    if "/" not in name or name.count("/") > 1 or os.path.exists(name):
        return False
    snapshot = os.path.join(HUB_CACHE, "models--" + name.replace("/", "--"), "snapshots", "local")
    os.makedirs(snapshot, exist_ok=True)
    for entry in os.listdir(MODEL_DIR):
        link = os.path.join(snapshot, entry)
        if not os.path.lexists(link):
            os.symlink(os.path.join(MODEL_DIR, entry), link)
    refs = os.path.join(HUB_CACHE, "models--" + name.replace("/", "--"), "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, "main"), "w") as f:
        f.write("local")
    return True


def serve_command(model: str, vllm_args: list[str]) -> list[str]:
    args = list(vllm_args)
    if "--served-model-name" not in args and not any(a.startswith("--served-model-name=") for a in args):
        args += ["--served-model-name", model]
    return [*shlex.split(SERVE), "serve", model if hub_cache_entry(model) else local_name(model), *args]


SERVERS_STARTED = [0]   # servers launched so far: a test that launches one talks HTTP to it


def _start_server(self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None) -> None:
    SERVERS_STARTED[0] += 1
    env = os.environ.copy()
    env.update(env_dict or {})
    env["HF_HUB_CACHE"] = HUB_CACHE   # hub ids resolve to the local model (hub_cache_entry); nothing downloads
    cmd = serve_command(model, vllm_serve_args)
    print("shim: launching", " ".join(cmd), flush=True)
    self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)


NAME_KEYWORDS = ("pretrained_model_name_or_path", "tokenizer_name", "model_name", "name", "model")


def _with_local_name(load):
    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        # the name is the first positional string (after the class, for a classmethod)
        first = next((i for i, a in enumerate(args) if isinstance(a, str)), None)
        if first is not None:
            args = (*args[:first], local_name(args[first]), *args[first + 1:])
        for key in NAME_KEYWORDS:
            if key in kwargs:
                kwargs[key] = local_name(kwargs[key])
        return load(*args, **kwargs)
    return wrapper


def pytest_configure(config) -> None:
    if not MODEL_DIR:
        raise RuntimeError("PAGEDMODEL_SUITE_MODEL is not set (run compat/vllm_suite/run.py)")
    import transformers
    import vllm.tokenizers

    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        cls.from_pretrained = _with_local_name(cls.from_pretrained.__func__).__get__(cls)
    # the fixtures that compute reference embeddings with HF load the model itself (each AutoModel* class
    # holds its own copy of from_pretrained)
    for name in [n for n in dir(transformers) if n.startswith("AutoModel")]:
        cls = getattr(transformers, name)
        cls.from_pretrained = _with_local_name(cls.from_pretrained.__func__).__get__(cls)
    vllm.tokenizers.get_tokenizer = _with_local_name(vllm.tokenizers.get_tokenizer)

    import huggingface_hub

    huggingface_hub.HfApi.snapshot_download = lambda self, repo_id, *a, **k: snapshot_path(repo_id)
    huggingface_hub.snapshot_download = lambda repo_id, *a, **k: snapshot_path(repo_id)

    import tests.utils as utils

    utils.get_tokenizer = vllm.tokenizers.get_tokenizer
    utils.RemoteOpenAIServer._start_server = _start_server
    utils.RemoteOpenAIServer._pre_download_model = lambda self, model, args: None
    # last, once vLLM's own modules hold the class: tests build a ModelConfig by hub name for the vocab size
    import vllm.config

    model_config = vllm.config.ModelConfig
    vllm.config.ModelConfig = lambda *a, **k: model_config(*a, **{**k, "model": local_name(k.get("model"))})


def snapshot_path(repo_id: str) -> str:
    """A hub repository, as run.py prepared it here: a LoRA repository (vLLM's fixtures name a few)
    becomes a LoRA adapter made for the local model, anything else the local model."""
    adapters = os.environ.get("PAGEDMODEL_SUITE_ADAPTERS", "")
    names = sorted(os.listdir(adapters)) if adapters else []
    if names and any(k in repo_id.lower() for k in ("lora", "alice")):
        # a stable choice per repository, so that two fixtures get two different adapters
        return os.path.join(adapters, names[sum(map(ord, repo_id)) % len(names)])
    return MODEL_DIR


# Which tests talk to the server: they started one, or they hold one (or a client of one) among their
# fixtures. The others test vLLM's own Python objects, which run.py leaves out of the count.
RESULTS: dict[str, dict[str, Any]] = {}


def _talks_http(item, started_before: int) -> bool:
    import openai

    import tests.utils as utils

    if SERVERS_STARTED[0] > started_before:
        return True
    held = getattr(item, "funcargs", {}).values()
    if any(isinstance(v, (utils.RemoteOpenAIServer, openai.OpenAI, openai.AsyncOpenAI)) for v in held):
        return True
    return any(name == "client" or "server" in name for name in getattr(item, "fixturenames", []))


def pytest_runtest_setup(item):
    item.servers_before = SERVERS_STARTED[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    entry = RESULTS.setdefault(item.nodeid, {"http": False, "outcome": "passed", "message": ""})
    entry["http"] = entry["http"] or _talks_http(item, getattr(item, "servers_before", SERVERS_STARTED[0]))
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    elif report.failed and entry["outcome"] != "failed":
        entry["outcome"] = "failed"
        text = str(report.longrepr)
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
        entry["message"] = " ".join(ln[1:].strip() for ln in lines[:2])[:200]


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("PAGEDMODEL_SUITE_RESULTS")
    if out:
        import json

        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1, sort_keys=True)
