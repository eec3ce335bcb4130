"""The control-plane build: go.mod generated from upstream's, and clear errors without Go."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from e2e.kube import build, gomod

UPSTREAM = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tk8s.io/api v0.0.0
\tgithub.com/x/y v1.2.3
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/new-thing => ./staging/src/k8s.io/new-thing
)

replace k8s.io/single => ./staging/src/k8s.io/single
"""


def test_every_local_replace_becomes_the_published_version():
    text = gomod.render("example.local/m", UPSTREAM, {"k8s.io/kubernetes": "v1.37.2"}, "v0.37.2",
                        ["k8s.io/kubernetes/cmd/kube-apiserver"])
    assert gomod.local_replaces(UPSTREAM) == ["k8s.io/api", "k8s.io/new-thing", "k8s.io/single"]
    for module in ("k8s.io/api", "k8s.io/new-thing", "k8s.io/single"):
        assert f"\t{module} => {module} v0.37.2" in text
    assert "go 1.26.0" in text and "godebug default=go1.26" in text
    assert "\tk8s.io/kubernetes/cmd/kube-apiserver" in text
    assert "./staging" not in text


def test_staging_version_rejects_non_releases():
    assert gomod.staging_version("v1.37.2") == "v0.37.2"
    for bad in ("1.37.2", "v2.0.0", "latest"):
        try:
            gomod.staging_version(bad)
        except ValueError as exc:
            assert "not a Kubernetes release" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_committed_go_mod_replaces_exactly_upstreams_staging_modules():
    """The committed go.mod matches what upstream's go.mod asks for (a new staging module cannot be missed)."""
    info = json.loads(subprocess.run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{build.KUBERNETES_VERSION}"],
                                     cwd=build.CONTROL_PLANE.directory, capture_output=True, text=True,
                                     check=True).stdout)
    upstream = set(gomod.local_replaces(Path(info["GoMod"]).read_text()))
    ours = (build.CONTROL_PLANE.directory / "go.mod").read_text()
    replaced = {line.split()[0] for line in ours.splitlines() if " => " in line}
    assert replaced == upstream and len(upstream) > 20
    assert all(f"=> {m} {build.CONTROL_PLANE.replace_version}" in ours for m in upstream)


def test_missing_go_is_a_clear_message_not_a_stack(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), PAGEDMODEL_KUBE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "e2e.kube.build"], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    assert "the Go toolchain ('go') is not on PATH" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_proxy_is_named(tmp_path):
    """With the module cache empty and the proxy unreachable (a closed loopback port), the error says so."""
    env = dict(os.environ, GOPROXY="http://127.0.0.1:9", GOMODCACHE=str(tmp_path / "mod"), GOFLAGS="",
               PAGEDMODEL_KUBE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "e2e.kube.build"], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "cannot fetch Go modules through GOPROXY=http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_binaries_name_the_build_command(tmp_path):
    from e2e.kube.control_plane import BinariesMissing, ControlPlane

    try:
        ControlPlane(tmp_path / "c", bin_dir=tmp_path / "empty")
    except BinariesMissing as exc:
        assert "python -m e2e.kube.build" in str(exc) and "kube-apiserver" in str(exc)
    else:
        raise AssertionError("a control plane without binaries was accepted")
