"""The operator's calls to engine pods for LoRA adapters (I/O): list what each ready engine serves
(`GET /v1/models`: adapters are the entries with a `parent`), then `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` as `adapter_plan.plan_sync` says. Engines are synced concurrently, each
call with its own timeout, so one slow pod does not hold up the others or the pass for long.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from . import names
from .adapter_plan import PodSync, plan_sync, trim
from .adapters import Adapter

LIST_TIMEOUT_S = 3.0
# Loading reads the adapter's files (on a PVC, maybe over the network) in the engine's worker thread.
LOAD_TIMEOUT_S = 60.0
UNLOAD_TIMEOUT_S = 10.0


class AdapterCallError(Exception):
    """An engine refused or did not answer an adapter call; the message says why, in one line."""


class AdapterAPI(Protocol):
    def listed(self, ip: str) -> dict[str, str]: ...
    def load(self, ip: str, name: str, path: str) -> None: ...
    def unload(self, ip: str, name: str) -> None: ...


class HTTPAdapterAPI:
    """AdapterAPI over HTTP to `http://<pod IP>:8000`."""

    def __init__(self, port: int = names.ENGINE_PORT) -> None:
        self.port = port

    def _post(self, ip: str, path: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
        import httpx

        try:
            r = httpx.post(f"http://{ip}:{self.port}{path}", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise AdapterCallError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
        try:
            payload = r.json()
        except ValueError:
            payload = r.text
        return r.status_code, payload

    def listed(self, ip: str) -> dict[str, str]:
        import httpx

        try:
            r = httpx.get(f"http://{ip}:{self.port}/v1/models", timeout=LIST_TIMEOUT_S)
            r.raise_for_status()
            cards = r.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise AdapterCallError(f"GET /v1/models: {type(exc).__name__}: {exc}") from None
        return {c["id"]: c.get("root") or "" for c in cards if isinstance(c, dict) and c.get("parent")}

    def load(self, ip: str, name: str, path: str) -> None:
        status, payload = self._post(ip, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                     LOAD_TIMEOUT_S)
        if status >= 300 and not (status == 400 and _param(payload) == "lora_name"):
            # (a 400 on lora_name: another pass loaded it meanwhile; the next listing shows its path)
            raise AdapterCallError(f"HTTP {status}: {_message(payload)}")

    def unload(self, ip: str, name: str) -> None:
        status, payload = self._post(ip, "/v1/unload_lora_adapter", {"lora_name": name}, UNLOAD_TIMEOUT_S)
        if status >= 300 and status != 404:          # 404: already gone, which is what was wanted
            raise AdapterCallError(f"HTTP {status}: {_message(payload)}")


def _error(payload: Any) -> dict[str, Any]:
    err = payload.get("error") if isinstance(payload, dict) else None
    return err if isinstance(err, dict) else {}


def _param(payload: Any) -> str | None:
    return _error(payload).get("param")


def _message(payload: Any) -> str:
    return str(_error(payload).get("message") or payload)


def sync_pod(api: AdapterAPI, pod: str, ip: str, desired: list[Adapter]) -> PodSync:
    """Bring one engine to `desired`: unloads first (they free slots), then loads; each failure is
    recorded against its adapter and the rest go on."""
    result = PodSync(pod)
    try:
        loaded = api.listed(ip)
    except AdapterCallError as exc:
        result.error = trim(str(exc))
        return result
    plan = plan_sync(desired, loaded)
    for name in plan.unload:
        try:
            api.unload(ip, name)
            result.unloaded_now.append(name)
            loaded.pop(name, None)
        except AdapterCallError as exc:
            result.failures[name] = trim(f"unload: {exc}")
    for adapter in plan.load:
        if adapter.name in loaded:      # its unload failed: the old path still serves under that name
            continue
        try:
            api.load(ip, adapter.name, adapter.path)
            result.loaded_now.append(adapter.name)
            loaded[adapter.name] = adapter.path
        except AdapterCallError as exc:
            result.failures[adapter.name] = trim(str(exc))
    result.loaded = {a.name for a in desired if loaded.get(a.name) == a.path}
    return result


def sync_pods(api: AdapterAPI, pods: list[tuple[str, str]], desired: list[Adapter],
              max_workers: int = 16) -> list[PodSync]:
    """sync_pod on each (name, IP) concurrently; results in the pods' order."""
    if not pods:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(pods))) as pool:
        return list(pool.map(lambda p: sync_pod(api, p[0], p[1], desired), pods))
