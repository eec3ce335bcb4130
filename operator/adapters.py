"""spec.adapters as the engine pods see them: where each adapter's directory is inside the container,
which PersistentVolumeClaims the pod must mount for them, and the LoRA flags of `pagedmodel serve`.

Pure. The pod template depends on the adapter list only through the set of claims it mounts, never on
the names or paths: adding or removing an adapter on an already-mounted claim (or a `file://` one)
leaves the template, and so the running pods, alone; the operator loads it through the engines' API.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

ADAPTER_MOUNT = "/adapters"
# LoRA slot defaults when spec.engine leaves them out. Fixed numbers, not derived from the adapter list:
# a default that followed the list would change the pod template, and roll the engines, on every edit.
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
LORA_FLAGS = frozenset({"--enable-lora", "--max-loras", "--max-lora-rank", "--lora-modules"})
MAX_ADAPTERS = 64

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
_NAME = re.compile(NAME_PATTERN)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SCHEME = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<rest>.*)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class AdapterSource:
    scheme: str      # pvc | file | hf
    claim: str       # PVC name ("" for file:// and hf://)
    path: str        # directory inside the claim (no leading "/"), the absolute path for file://, the hf:// id


@dataclass(frozen=True)
class Adapter:
    name: str
    source: str      # as written in the spec
    path: str        # what /v1/load_lora_adapter is given: a directory inside the container, or hf://ORG/NAME


def parse_adapter_source(source: Any) -> AdapterSource:
    """pvc://CLAIM/PATH, file:///ABS/PATH or hf://ORG/NAME; ValueError with the reason otherwise."""
    m = _SCHEME.match(source) if isinstance(source, str) else None
    if not m:
        raise ValueError(f"{source!r} is not pvc://CLAIM/PATH, file:///PATH or hf://ORG/NAME")
    scheme, rest = m["scheme"], m["rest"]
    if scheme == "hf":
        if not _HUB_ID.match(rest):
            raise ValueError(f"{source!r} is not a Hugging Face Hub id hf://ORG/NAME")
        return AdapterSource("hf", "", source)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _DNS_LABEL.match(claim) or len(claim) > 253:
            raise ValueError(f"PVC name {claim!r} is not a valid Kubernetes name")
        _check_path(path)
        return AdapterSource("pvc", claim, path.strip("/"))
    if scheme == "file":
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"{source!r} must name an absolute directory: file:///PATH")
        _check_path(rest)
        return AdapterSource("file", "", "/" + rest.strip("/"))
    raise ValueError(f"scheme {scheme}:// is not one of pvc://, file://, hf://")


def _check_path(path: str) -> None:
    if ".." in path.split("/"):
        raise ValueError(f"path {path!r} must not contain '..'")
    if any(c.isspace() for c in path):
        raise ValueError(f"path {path!r} must not contain whitespace")


def container_path(source: AdapterSource) -> str:
    """Where the adapter's directory is inside the engine container; for hf:// the hub id itself, which the
    engine fetches into its Hugging Face cache."""
    if source.scheme in ("file", "hf"):
        return source.path
    root = f"{ADAPTER_MOUNT}/{source.claim}"
    return f"{root}/{source.path}" if source.path else root


def lora_enabled(spec: dict[str, Any]) -> bool:
    """LoRA is on when spec.adapters is present, even as [] (so the first adapter added later needs no
    rollout) or when spec.engine sets a LoRA limit."""
    engine = spec.get("engine") or {}
    return "adapters" in spec or "maxLoras" in engine or "maxLoraRank" in engine


def desired_adapters(spec: dict[str, Any]) -> list[Adapter]:
    """The adapters of a validated spec, in spec order, with their paths inside the container."""
    return [Adapter(a["name"], a["source"], container_path(parse_adapter_source(a["source"])))
            for a in spec.get("adapters") or []]


def adapter_claims(spec: dict[str, Any]) -> list[str]:
    """Distinct claims the adapters live on, sorted: the only part of the list the pod template sees."""
    claims = {parse_adapter_source(a["source"]).claim for a in spec.get("adapters") or []}
    return sorted(c for c in claims if c)


def volume_name(claim: str) -> str:
    """A volume name (a DNS label of at most 63) for a claim name of up to 253 characters."""
    return "adapters-" + hashlib.sha256(claim.encode()).hexdigest()[:12]


def adapter_volumes(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the adapters' claims, each read-only at /adapters/CLAIM."""
    volumes, mounts = [], []
    for claim in adapter_claims(spec):
        name = volume_name(claim)
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{ADAPTER_MOUNT}/{claim}", "readOnly": True})
    return volumes, mounts


def lora_args(spec: dict[str, Any]) -> list[str]:
    """`--enable-lora --max-loras N --max-lora-rank R` or nothing. Never --lora-modules: every adapter is
    loaded through the API, so the template does not follow the list, and one unreadable adapter is a
    Warning on the PagedModel instead of engines that cannot start."""
    if not lora_enabled(spec):
        return []
    engine = spec.get("engine") or {}
    return ["--enable-lora", "--max-loras", str(engine.get("maxLoras", DEFAULT_MAX_LORAS)),
            "--max-lora-rank", str(engine.get("maxLoraRank", DEFAULT_MAX_LORA_RANK))]


def adapter_errors(adapters: Any, served_name: str) -> list[tuple[str, str]]:
    """(field, message) for each rule spec.adapters breaks: shape, names, uniqueness, sources."""
    where = "spec.adapters"
    if not isinstance(adapters, list):
        return [(where, "must be a list of {name, source}")]
    if len(adapters) > MAX_ADAPTERS:
        return [(where, f"at most {MAX_ADAPTERS} adapters")]
    errors: list[tuple[str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(adapters):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            errors.append((at, "must be an object {name, source}"))
            continue
        name = item.get("name")
        if not (isinstance(name, str) and _NAME.match(name) and len(name) <= 128):
            errors.append((f"{at}.name", "is required: letters, digits, '.', '_', '/', '-' (at most 128), "
                                         "starting with a letter or digit"))
        elif name == served_name:
            errors.append((f"{at}.name", f"{name!r} is the model's served name; an adapter needs its own"))
        elif name in seen:
            errors.append((f"{at}.name", f"adapter {name!r} is listed twice"))
        else:
            seen.add(name)
        try:
            parse_adapter_source(item.get("source"))
        except ValueError as exc:
            errors.append((f"{at}.source", str(exc)))
    return errors
