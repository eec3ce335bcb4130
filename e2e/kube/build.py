"""Build etcd and the Kubernetes control plane from the official Go modules into a local cache.

    python -m e2e.kube.build [--print-bin] [--regenerate] [-j N]

Binaries land in ``~/.cache/pagedmodel/kube/<version>/bin`` (``PAGEDMODEL_KUBE_CACHE`` moves the
root). A build is skipped when the binary's stamp (version + go.mod/go.sum digest) matches, so a
second run takes seconds. Stdlib only: CI runs this before anything else.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import gomod

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
COREDNS_VERSION = "v1.15.0"
REGISTRY_VERSION = "v3.1.2"
HERE = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """A failure with a message meant for people, not a Go stack."""


@dataclass(frozen=True)
class Module:
    directory: Path
    name: str
    root: str            # the module we require (k8s.io/kubernetes, go.etcd.io/etcd/server/v3)
    version: str
    replace_version: str
    binaries: dict[str, str]   # binary name -> package
    version_pkgs: tuple[str, ...] = ()


CONTROL_PLANE = Module(
    HERE / "controlplane", "pagedmodel.local/e2e/kube/controlplane", "k8s.io/kubernetes",
    KUBERNETES_VERSION, gomod.staging_version(KUBERNETES_VERSION),
    {"kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
     "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
     "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
     "kubectl": "k8s.io/kubernetes/cmd/kubectl",
     "kubelet": "k8s.io/kubernetes/cmd/kubelet",
     "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
     # ours (controlplane/cmd/): nvidia.com/gpu capacity through the kubelet's device-plugin API
     "fake-gpu-plugin": "pagedmodel.local/e2e/kube/controlplane/cmd/fake-gpu-plugin"},
    ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"))
ETCD = Module(
    HERE / "etcd", "pagedmodel.local/e2e/kube/etcd", "go.etcd.io/etcd/server/v3",
    ETCD_VERSION, ETCD_VERSION, {"etcd": "go.etcd.io/etcd/server/v3"})
# Cluster DNS (its `kubernetes` plugin answers *.svc.cluster.local from the API, as in every cluster).
COREDNS = Module(
    HERE / "coredns", "pagedmodel.local/e2e/kube/coredns", "github.com/coredns/coredns",
    COREDNS_VERSION, COREDNS_VERSION, {"coredns": "github.com/coredns/coredns"})
# The node pulls images from this local registry, as a real node pulls from its registry.
REGISTRY = Module(
    HERE / "registry", "pagedmodel.local/e2e/kube/registry", "github.com/distribution/distribution/v3",
    REGISTRY_VERSION, REGISTRY_VERSION, {"registry": "github.com/distribution/distribution/v3/cmd/registry"})
MODULES = (ETCD, CONTROL_PLANE, COREDNS, REGISTRY)


def cache_root() -> Path:
    base = os.environ.get("PAGEDMODEL_KUBE_CACHE") or Path.home() / ".cache" / "pagedmodel" / "kube"
    return Path(base) / KUBERNETES_VERSION


def bin_dir() -> Path:
    return cache_root() / "bin"


def binaries_present() -> bool:
    return all((bin_dir() / name).is_file() and _stamp_ok(module, name)
               for module in MODULES for name in module.binaries)


def _say(message: str) -> None:
    print(f"[kube-build] {message}", flush=True)


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("the Go toolchain ('go') is not on PATH; install Go >= 1.26 "
                         "(https://go.dev/dl/) to build the e2e control plane")
    return go


def _run_go(args: list[str], cwd: Path, what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([_go(), *args], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        hint = ""
        if any(s in tail for s in ("dial tcp", "no such host", "proxy.golang.org", "i/o timeout",
                                   "connection refused", "403 Forbidden", "404 Not Found")):
            proxy = subprocess.run([_go(), "env", "GOPROXY"], capture_output=True, text=True).stdout.strip()
            hint = f"\ncannot fetch Go modules through GOPROXY={proxy}; check the network or GOPROXY."
        raise BuildError(f"{what} failed (go {' '.join(args[:2])} ...):\n{tail}{hint}")
    return proc.stdout


def _digest(module: Module) -> str:
    """go.mod, go.sum and our own Go sources in the module: what a binary's build depends on."""
    h = hashlib.sha256()
    for path in [module.directory / "go.mod", module.directory / "go.sum",
                 *sorted(module.directory.rglob("*.go"))]:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _stamp_path(name: str) -> Path:
    return bin_dir() / f".{name}.stamp"


def _stamp_ok(module: Module, name: str) -> bool:
    stamp = _stamp_path(name)
    return stamp.is_file() and stamp.read_text().strip() == f"{module.version} {_digest(module)}"


def _ldflags(module: Module) -> str:
    if not module.version_pkgs:
        return "-s -w"
    info = json.loads(_run_go(["mod", "download", "-json", f"{module.root}@{module.version}"],
                              module.directory, "reading the release date"))
    build_date = json.loads(Path(info["Info"]).read_text()).get("Time", "1970-01-01T00:00:00Z")
    major, minor = module.version.lstrip("v").split(".")[:2]
    values = {"gitVersion": module.version, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean", "buildDate": build_date}
    flags = ["-s", "-w"] + [f"-X '{pkg}.{key}={value}'"
                            for pkg in module.version_pkgs for key, value in values.items()]
    return " ".join(flags)


def build(jobs: int = 2) -> Path:
    """Build whatever is missing; returns the bin directory."""
    out = bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    for module in MODULES:
        missing = [name for name in module.binaries if not ((out / name).is_file() and _stamp_ok(module, name))]
        if not missing:
            _say(f"{', '.join(module.binaries)} {module.version}: cached in {out}")
            continue
        _say(f"downloading Go modules for {module.root} {module.version} (first time: minutes)")
        started = time.monotonic()
        _run_go(["mod", "download"], module.directory, f"downloading the modules of {module.root}")
        _say(f"  modules ready in {time.monotonic() - started:.0f}s")
        ldflags = _ldflags(module)
        for name in missing:
            started = time.monotonic()
            _say(f"building {name} {module.version} (-p {jobs}) ...")
            _run_go(["build", "-p", str(jobs), "-trimpath", "-ldflags", ldflags, "-o", str(out / name),
                     module.binaries[name]], module.directory, f"building {name}",
                    env={"CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly"})
            _stamp_path(name).write_text(f"{module.version} {_digest(module)}\n")
            size = (out / name).stat().st_size / 2**20
            _say(f"  {name}: {size:.0f} MiB in {time.monotonic() - started:.0f}s")
    return out


def regenerate() -> None:
    """Rewrite go.mod from the upstream go.mod files and refresh go.sum (needs the proxy)."""
    for module in MODULES:
        module.directory.mkdir(parents=True, exist_ok=True)
        info = json.loads(_run_go(["mod", "download", "-json", f"{module.root}@{module.version}"],
                                  module.directory.parent, f"fetching {module.root}@{module.version}"))
        upstream = Path(info["GoMod"]).read_text()
        text = gomod.render(module.name, upstream, {module.root: module.version},
                            module.replace_version,
                            sorted(p for p in module.binaries.values() if not p.startswith(module.name + "/")))
        (module.directory / "go.mod").write_text(text)
        (module.directory / "go.sum").touch()
        _say(f"{module.directory.name}/go.mod: {len(gomod.local_replaces(upstream))} replaces from "
             f"{module.root}@{module.version}; go mod tidy ...")
        _run_go(["mod", "tidy"], module.directory, f"go mod tidy in {module.directory.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.kube.build", description=__doc__.split("\n")[0])
    parser.add_argument("--regenerate", action="store_true", help="regenerate go.mod/go.sum from upstream")
    parser.add_argument("--print-bin", action="store_true", help="print the bin directory and exit 0 "
                        "if every binary is built, 1 otherwise (builds nothing)")
    parser.add_argument("-j", "--jobs", type=int, default=int(os.environ.get("PAGEDMODEL_KUBE_BUILD_JOBS", "2")))
    args = parser.parse_args(argv)
    if args.print_bin:
        print(bin_dir())
        return 0 if binaries_present() else 1
    try:
        if args.regenerate:
            regenerate()
        started = time.monotonic()
        out = build(args.jobs)
    except BuildError as exc:
        print(f"[kube-build] error: {exc}", file=sys.stderr)
        return 2
    _say(f"done in {time.monotonic() - started:.0f}s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
