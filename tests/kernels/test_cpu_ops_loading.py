"""The CPU ops as installed: one build per x86-64 level, compiled at install, loaded without compiling.

Each level this CPU runs passes the CPU op tests against the torch reference: the level ``auto`` picks in
this process, the others in a subprocess each (one level per process: the builds register the same ops).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedmodel.kernels import cpu_isa, cpu_ops

REPO = Path(__file__).resolve().parents[2]
# the tests that call our ops and compare them with torch's (the model-level tests run at the auto level)
OP_TESTS = ["test_cpu_cache_write.py", "test_cpu_layer_ops.py", "test_cpu_linear.py", "test_cpu_prefill_attention.py",
            "test_cpu_sampling.py", "test_logits_stats.py", "test_torch_attention.py",
            "test_cpu_ops_loading.py::test_the_requested_level_is_the_one_loaded"]
AVX2_ONLY = cpu_isa.V3_FLAGS
SAPPHIRE_RAPIDS = cpu_isa.BY_NAME["amx"].cpu_flags | {"avx512_vnni", "avx512fp16"}
ALL_BUILT = set(cpu_isa.BY_NAME)


def _auto_level() -> cpu_isa.IsaLevel | None:
    built = {name for name, entry in cpu_ops.built_levels().items() if "file" in entry}
    return cpu_isa.choose("auto", cpu_isa.cpu_flags(), built)


def test_every_level_is_built_at_install():
    levels = cpu_ops.built_levels()
    assert levels, f"no {cpu_ops.MANIFEST.name} beside the package: the install built no CPU ops"
    failed = {name: entry.get("error") for name, entry in levels.items() if "file" not in entry}
    assert set(levels) == ALL_BUILT and not failed, failed
    for entry in levels.values():
        assert (cpu_ops.HERE / entry["file"]).is_file()


def test_the_built_ops_are_as_new_as_their_sources():
    assert cpu_ops.stale_levels() == [], f"kernels/ changed since the install: {cpu_ops.REBUILD_HINT}"


def test_the_requested_level_is_the_one_loaded():
    loaded = cpu_ops.load()
    assert loaded is not None, cpu_ops.load_error()
    wanted = cpu_ops.request()
    assert loaded.level.name == (_auto_level().name if wanted == "auto" else wanted)
    assert loaded.path.parent == cpu_ops.HERE


def test_auto_takes_the_highest_built_level_the_cpu_runs():
    assert cpu_isa.choose("auto", AVX2_ONLY, ALL_BUILT).name == "avx2"
    assert cpu_isa.choose("auto", SAPPHIRE_RAPIDS, ALL_BUILT).name == "amx"
    assert cpu_isa.choose("auto", SAPPHIRE_RAPIDS, {"avx2", "avx512"}).name == "avx512"   # amx failed to build
    assert cpu_isa.choose("auto", frozenset({"sse4_2", "avx"}), ALL_BUILT) is None     # older than x86-64-v3
    assert cpu_isa.choose("off", SAPPHIRE_RAPIDS, ALL_BUILT) is None


def test_a_level_the_cpu_or_the_install_lacks_is_refused():
    with pytest.raises(ValueError, match="this CPU lacks amx_bf16, amx_tile"):
        cpu_isa.choose("amx", cpu_isa.BY_NAME["avx512_bf16"].cpu_flags, ALL_BUILT)
    with pytest.raises(ValueError, match="not built at install"):
        cpu_isa.choose("amx", SAPPHIRE_RAPIDS, {"avx2"})
    with pytest.raises(ValueError, match=cpu_ops.OPS_ENV):
        cpu_ops.request("sse9")


def test_an_install_whose_builds_all_failed_says_so(monkeypatch, tmp_path):
    manifest = tmp_path / "cpu_ops_build.json"
    manifest.write_text(json.dumps({"torch": "x", "levels": {
        level.name: {"digest": "", "error": "CompileError: command 'c++' failed: No such file or directory"}
        for level in cpu_isa.LEVELS}}))
    monkeypatch.setenv(cpu_ops.OPS_ENV, "auto")
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "MANIFEST", manifest)
    assert cpu_ops.load() is None and cpu_ops.layer_ops() is None and cpu_ops.sampling() is None
    assert "did not build at install" in cpu_ops.load_error() and "No such file" in cpu_ops.load_error()


def test_sources_edited_after_the_install_are_noticed(tmp_path):
    sources = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", sources)
    manifest = tmp_path / "cpu_ops_build.json"
    manifest.write_text(json.dumps({"torch": "x", "levels": {
        level.name: {"digest": level.sources_digest(sources, cpu_ops.torch.__version__), "file": "x.so"}
        for level in cpu_isa.LEVELS}}))
    assert cpu_ops.stale_levels(manifest, sources) == []
    with (sources / "cpu_vector_math.h").open("a") as header:
        header.write("// an edit\n")
    assert cpu_ops.stale_levels(manifest, sources) == [level.name for level in cpu_isa.LEVELS]


def test_nothing_compiles_at_run_time():
    """The run-time JIT build, its lock and its stale-lock clean-up are gone: no module loads an extension
    through torch.utils.cpp_extension."""
    offenders = [str(path.relative_to(REPO)) for folder in ("pagedmodel", "server", "operator")
                 for path in (REPO / folder).rglob("*.py") if "cpp_extension" in path.read_text()]
    assert offenders == []


def _other_levels() -> list[str]:
    auto = _auto_level()
    return [level.name for level in cpu_isa.supported(cpu_isa.cpu_flags()) if auto is None or level != auto]


@pytest.mark.parametrize("level", _other_levels())
def test_each_level_this_cpu_runs_matches_the_torch_reference(level):
    env = {**os.environ, cpu_ops.OPS_ENV: level, "PYTHONDONTWRITEBYTECODE": "1"}
    here = Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          *[str(here / name) for name in OP_TESTS]],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail


def test_the_top_level_kernels_folder_shadows_no_package():
    """kernels/ holds C++ only, with no __init__.py: from the repo root (on sys.path for `python3 -m pytest`),
    `import kernels` still finds Hugging Face's package, which transformers imports, where a top-level
    package of that name once shadowed it."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    found = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr[-2000:]
    assert not Path(found.stdout.strip()).is_relative_to(REPO / "kernels"), found.stdout   # None: a namespace
