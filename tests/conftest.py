"""Session-wide model fixtures shared by all test folders.

`smollm2_dir` is the real SmolLM2-135M-Instruct, prepared once into the model cache
($PAGEDMODEL_CACHE_DIR, default ~/.cache/pagedmodel; outside the repo) and reused by later runs.
The tiny_* fixtures are 2-layer random models with the SmolLM2 tokenizer (see tiny_models.py);
build variants with `from tiny_models import make_tiny_model_dir`.
"""
from __future__ import annotations

import os
from pathlib import Path

# OpenMP worker threads that spin while they wait thrash when the test process, engine subprocesses and
# HF references share two cores: an HF SmolLM2 generate took 10.6 s with spinning and 1.4 s with passive
# waiting at load 10. Set before anything loads torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from pagedmodel.server.engine.model_store import resolve_model

    return resolve_model(None)


def _tiny(tmp_path_factory: pytest.TempPathFactory, arch: str, tokenizer_dir: Path) -> Path:
    from tiny_models import make_tiny_model_dir  # lazily: keeps torch out of test runs that need no model

    return make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return _tiny(tmp_path_factory, "llama", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return _tiny(tmp_path_factory, "qwen2", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return _tiny(tmp_path_factory, "mistral", smollm2_dir)
