"""The local OCI registry (distribution, built by ``python -m e2e.kube.build``): the node pulls its
images from here as a real node pulls from its registry, so only changed layers move.

Its storage lives in ``~/.cache/pagedmodel/registry`` and outlives clusters: an image pushed once
is there for every later run.
"""
from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from ..kube import build
from ..kube.component import Component

ADDRESS = "127.0.0.1:5555"
URL = f"http://{ADDRESS}"
# The names our pods use, mirrored by the local registry (containerd's hosts.toml per registry).
MIRRORED = ("ghcr.io", "registry.k8s.io", "docker.io")


def storage_dir() -> Path:
    base = os.environ.get("PAGEDMODEL_REGISTRY_DIR") or Path.home() / ".cache" / "pagedmodel" / "registry"
    return Path(base)


def registry_component(workdir: Path) -> Component:
    config = workdir / "registry.yaml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage_dir())}, "delete": {"enabled": True}},
        "http": {"addr": ADDRESS}}))
    storage_dir().mkdir(parents=True, exist_ok=True)
    return Component("registry", [str(build.bin_dir() / "registry"), "serve", str(config)],
                     workdir / "logs", f"{URL}/v2/")


def collect_garbage(workdir: Path) -> None:
    """Delete the manifests no tag names and the blobs nothing references (each push of a rebuilt tag
    leaves the old build's behind). The registry must be stopped."""
    config = workdir / "registry.yaml"
    proc = subprocess.run([str(build.bin_dir() / "registry"), "garbage-collect", "--delete-untagged", str(config)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"registry garbage-collect failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


def repository(image: str) -> tuple[str, str]:
    """``ghcr.io/pagedmodel/pagedmodel:0.1.0`` -> (``pagedmodel/pagedmodel``, ``0.1.0``): where the
    image lives in the local registry, which mirrors its registry host."""
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        name, tag = image, "latest"
    host, _, path = name.partition("/")
    if host not in MIRRORED:
        raise ValueError(f"{image!r}: the local registry mirrors {', '.join(MIRRORED)} only")
    if host == "docker.io" and "/" not in path:
        path = f"library/{path}"
    return path, tag


def manifest_digest(image: str) -> str | None:
    """The digest the registry holds for ``image``, or None if it holds none."""
    path, tag = repository(image)
    request = urllib.request.Request(f"{URL}/v2/{path}/manifests/{tag}", method="HEAD", headers={
        "Accept": ", ".join(("application/vnd.oci.image.manifest.v1+json",
                             "application/vnd.docker.distribution.manifest.v2+json"))})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.headers.get("Docker-Content-Digest")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def hosts_toml(registry_host: str) -> str:
    """containerd's mirror configuration for one registry host: pull and resolve from the local one."""
    return "\n".join([f'server = "https://{registry_host}"', "",
                      f'[host."{URL}"]', '  capabilities = ["pull", "resolve"]', "  skip_verify = true", ""])
