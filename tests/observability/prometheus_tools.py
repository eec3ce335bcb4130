"""Prometheus and promtool from Debian's `prometheus` package, fetched once and cached.

`apt-get download` needs no root install and no network beyond the Debian mirror the machine already
uses; `dpkg-deb -x` unpacks the .deb without installing it. The binaries are cached under
~/.cache/pagedmodel/prometheus/ (or $PAGEDMODEL_CACHE_DIR/prometheus/), so later runs start at once.
When they cannot be had, `binaries()` raises with what to do: the observability tests fail, never skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "prometheus"


def cache_dir() -> Path:
    base = Path(os.environ.get("PAGEDMODEL_CACHE_DIR", Path.home() / ".cache" / "pagedmodel"))
    return base / "prometheus"


class PrometheusUnavailable(RuntimeError):
    pass


def binaries() -> tuple[Path, Path]:
    """(prometheus, promtool), fetched and unpacked on first use."""
    root = cache_dir() / "root"
    prom, tool = root / "usr" / "bin" / "prometheus", root / "usr" / "bin" / "promtool"
    if prom.is_file() and tool.is_file():
        return prom, tool
    for exe in ("apt-get", "dpkg-deb"):
        if shutil.which(exe) is None:
            raise PrometheusUnavailable(
                f"{exe} not found: the observability tests need Debian's {PACKAGE} package; install it "
                f"(apt-get install {PACKAGE}) or unpack its .deb into {root}")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True, timeout=300)
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if got.returncode != 0 or not debs:
            raise PrometheusUnavailable(
                f"`apt-get download {PACKAGE}` failed (exit {got.returncode}): {got.stderr.strip()[-500:]}\n"
                "Run `apt-get update` first, or unpack the package yourself into " + str(root))
        cache_dir().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache_dir()))
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(staging)], check=True, timeout=300)
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)      # atomic: a half-unpacked tree is never taken for a cache hit
    if not (prom.is_file() and tool.is_file()):
        raise PrometheusUnavailable(f"{debs[-1].name} holds no usr/bin/prometheus and usr/bin/promtool")
    return prom, tool
