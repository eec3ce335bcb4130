"""The images the real node runs, built here with buildah and pushed to the local registry.

    python -m e2e.node.images [--no-project]

- ``registry.k8s.io/pause:3.10``: the pod sandbox, a static binary of ``pause.c``;
- ``localhost/pagedmodel-base:bookworm``: Debian bookworm from Debian's packages (mmdebstrap), the
  Dockerfile's base where the public ``python:3.11-slim`` cannot be pulled;
- the chart's image (``image.repository:appVersion``) from the project's Dockerfile, unchanged.

buildah keeps its storage (and so every layer) in ``~/.cache/pagedmodel/buildah``: a rebuild after a
change to the code redoes the project's layers only, and the push moves only the layers the registry
lacks. Stdlib + PyYAML only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from . import host, registry
from .containerd import PAUSE_IMAGE

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/pagedmodel-base:bookworm"
BASE_PACKAGES = "python3,python3-pip,passwd,ca-certificates"


class ImageBuildError(RuntimeError):
    pass


def _say(message: str) -> None:
    print(f"[images] {message}", flush=True)


def cache_dir() -> Path:
    base = os.environ.get("PAGEDMODEL_BUILDAH_ROOT") or Path.home() / ".cache" / "pagedmodel" / "buildah"
    return Path(base)


def buildah(*args: str, capture: bool = True, cwd: Path | None = None) -> str:
    """buildah on our own storage; runc, never crun (crun refuses this host's hybrid cgroups)."""
    argv = ["buildah", "--root", str(cache_dir() / "storage"), "--runroot", str(cache_dir() / "run"), *args]
    env = {**os.environ, "BUILDAH_RUNTIME": "runc", "BUILDAH_ISOLATION": "chroot"}
    proc = subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=capture)
    if proc.returncode != 0:
        tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-12:])
        raise ImageBuildError(f"buildah {args[0]} failed ({proc.returncode}):\n{tail}")
    return proc.stdout or ""


def chart_image() -> str:
    """The image the chart names: ``image.repository`` at the chart's ``appVersion``."""
    chart = yaml.safe_load((REPO / "charts" / "pagedmodel" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "pagedmodel" / "values.yaml").read_text())
    return f"{values['image']['repository']}:{values['image'].get('tag') or chart['appVersion']}"


def _exists(image: str) -> bool:
    try:
        buildah("inspect", "--type", "image", image)
        return True
    except ImageBuildError:
        return False


def _push(image: str) -> None:
    path, tag = registry.repository(image)
    started = time.monotonic()
    buildah("push", "--tls-verify=false", image, f"docker://{registry.ADDRESS}/{path}:{tag}")
    _say(f"pushed {image} to {registry.URL}/{path}:{tag} in {time.monotonic() - started:.0f}s")


def ensure_pause() -> None:
    """The sandbox image in the local registry (built once: a 1 MB static binary)."""
    if registry.manifest_digest(PAUSE_IMAGE) is not None:
        return
    if not _exists(PAUSE_IMAGE):
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "pause"
            proc = subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(Path(__file__).with_name("pause.c"))],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise ImageBuildError(f"compiling pause.c failed (gcc -static needs libc6-dev):\n{proc.stderr}")
            container = buildah("from", "scratch").strip()
            try:
                buildah("copy", "--chmod", "0755", container, str(binary), "/pause")
                buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", container)
                buildah("commit", "--quiet", container, PAUSE_IMAGE)
            finally:
                buildah("rm", container)
    _push(PAUSE_IMAGE)


def ensure_base() -> None:
    """Debian bookworm with Python and pip, from Debian's packages (the public base can't be pulled)."""
    if _exists(BASE_IMAGE):
        return
    _say(f"making {BASE_IMAGE} with mmdebstrap ({BASE_PACKAGES}) ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        proc = subprocess.run(["mmdebstrap", "--variant=apt", f"--include={BASE_PACKAGES}", "--quiet",
                               "bookworm", str(rootfs)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageBuildError(f"mmdebstrap failed:\n{proc.stderr[-2000:]}")
        container = buildah("from", "scratch").strip()
        try:
            buildah("add", container, str(rootfs), "/")
            # PyPI is reached through this machine's CA bundle (it may hold a proxy's CA).
            buildah("copy", container, "/etc/ssl/certs/ca-certificates.crt", "/etc/ssl/certs/ca-certificates.crt")
            buildah("config", "--env", "PIP_BREAK_SYSTEM_PACKAGES=1", "--env", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                    "--cmd", '["python3"]', container)
            buildah("commit", "--quiet", container, BASE_IMAGE)
        finally:
            buildah("rm", container)
    _say(f"  {BASE_IMAGE} in {time.monotonic() - started:.0f}s")


def build_project() -> str:
    """The chart's image from the Dockerfile (layers cached), pushed to the local registry."""
    image = chart_image()
    ensure_base()
    _say(f"building {image} from {REPO / 'Dockerfile'} (first time: ~10 min; later only the project's layers)")
    started = time.monotonic()
    buildah("bud", "--pull=never", "--layers", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", image,
            "-f", str(REPO / "Dockerfile"), str(REPO))
    size = buildah("images", "--format", "{{.Size}}", "--noheading", image).strip()
    _say(f"  {image} ({size}) in {time.monotonic() - started:.0f}s")
    _push(image)
    return image


def prune() -> None:
    """Layers no tag uses any more (each rebuild leaves the old project layers behind), and the working
    containers of builds that did not finish (killed, or out of disk), which hold their images."""
    buildah("rm", "--all")
    buildah("rmi", "--prune")


def main(argv: list[str] | None = None) -> int:
    from ..kube.component import Component

    parser = argparse.ArgumentParser(prog="python -m e2e.node.images", description=__doc__.split("\n")[0])
    parser.add_argument("--no-project", action="store_true", help="the pause image only")
    args = parser.parse_args(argv)
    try:
        host.check_host()
    except host.NodeMissing as exc:
        print(f"[images] error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        server: Component = registry.registry_component(Path(tmp))
        server.start()
        try:
            server.wait_healthy(time.monotonic() + 30)
            ensure_pause()
            if not args.no_project:
                build_project()
                prune()
        except ImageBuildError as exc:
            print(f"[images] error: {exc}", file=sys.stderr)
            return 2
        finally:
            server.stop()
            shutil.rmtree(Path(tmp) / "logs", ignore_errors=True)
        registry.collect_garbage(Path(tmp))   # the registry, like buildah, keeps only what a tag names
    return 0


if __name__ == "__main__":
    sys.exit(main())
