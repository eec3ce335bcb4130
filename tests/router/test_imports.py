"""The router is its own program: importing it loads nothing of the engine's HTTP API, no FastAPI, no
uvicorn and no torch (issue #48). What both servers share lives in server/http_common/."""
from __future__ import annotations

import json
import subprocess
import sys

# `pagedmodel router` runs pagedmodel.server.router.app (pagedmodel/cli.py); every other router module too
ROUTER_MODULES = ["pagedmodel.server.router.app", "pagedmodel.cli"]
FORBIDDEN = ("pagedmodel.server.api", "fastapi", "starlette", "uvicorn", "torch")


def _loaded_after_import(modules: list[str]) -> list[str]:
    code = ("import importlib, json, pkgutil, sys\n"
            "import pagedmodel.server.router as router\n"
            f"for name in {modules!r} + [m.name for m in pkgutil.iter_modules(router.__path__, 'pagedmodel.server.router.')]:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def test_the_router_loads_no_engine_api_no_fastapi_and_no_torch() -> None:
    loaded = _loaded_after_import(ROUTER_MODULES)
    assert "pagedmodel.server.router.app" in loaded and "aiohttp" in loaded   # it did import the router
    assert [m for m in loaded if any(m == root or m.startswith(root + ".") for root in FORBIDDEN)] == []
