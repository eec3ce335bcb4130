"""The HTTP front end: Kubernetes REST paths, watch streaming, Tables, logs, discovery."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Callable

import yaml
from aiohttp import web

from . import discovery, podexec as pod_exec, protobuf, tables
from .api import Api, WriteOptions
from .errors import ApiError, bad_request, method_not_allowed
from .resources import ResourceType
from .selectors import field_selector_name, labels_match, parse_field_selector, parse_label_selector
from .store import Delivery, WatchEvent, Watcher

log = logging.getLogger("e2e.apiserver")

BOOKMARK_INTERVAL_S = 2.0
# (namespace, pod, container, previous) -> log file path, provided by the local kubelet.
LogLocator = Callable[[str, str, str, bool], "str | None"]


def _json(body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    headers = {}
    if warnings:
        headers["Warning"] = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json",
                        headers=headers)


def _int_param(query: Any, name: str) -> int | None:
    """An integer query parameter, or a 400 naming it (never a 500 from int())."""
    text = query.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise bad_request(f'invalid value for parameter "{name}": {text!r} is not an integer') from None


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "t", "yes")


class ApiServer:
    """aiohttp application serving an :class:`Api`."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.log_locator: LogLocator | None = None
        self.exec_locator: pod_exec.ExecLocator | None = None
        self.address = "127.0.0.1:0"
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self._closing = asyncio.Event()

    def close(self) -> None:
        self._closing.set()
        self.api.store.close_watchers()

    # --- dispatch ----------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as err:
            return _json(err.status(), err.code)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:   # an emulator bug must still answer like an API server would
            log.exception("internal error serving %s %s", request.method, request.path_qs)
            return _json(ApiError(500, "InternalError", f"Internal error occurred: {exc!r}").status(), 500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return _json(discovery.version_info())
        if path == "/api":
            return _json(discovery.api_versions(self.address))
        if path == "/apis":
            return _json(discovery.api_group_list(self.api.registry))
        if path == "/openapi/v3":
            return _json(discovery.openapi_root(self.api.registry))
        if path.startswith("/openapi/v3/"):
            parts = path[len("/openapi/v3/"):].split("/")
            group, version = ("", parts[1]) if parts[0] == "api" and len(parts) == 2 else (
                (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else (None, None))
            doc = discovery.openapi_document(self.api.registry, group, version) if version else None
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(doc)
        segments = [s for s in path.split("/") if s]
        if segments[:1] == ["api"] and len(segments) >= 2:
            group, version, rest = "", segments[1], segments[2:]
        elif segments[:1] == ["apis"] and len(segments) >= 2:
            if len(segments) == 2:
                doc = discovery.api_group(self.api.registry, segments[1])
                if doc is None:
                    raise ApiError(404, "NotFound", "the server could not find the requested resource")
                return _json(doc)
            group, version, rest = segments[1], segments[2], segments[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            doc = discovery.resource_list(self.api.registry, group, version)
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(doc)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            rt = self.api.registry.get(group, version, rest[2])
            if rt is not None and rt.namespaced:
                namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        rt = self.api.resource(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and sub not in ("status", "scale", "log", "finalize", "exec"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if (sub == "status" and not rt.status_subresource) or (sub == "scale" and rt.scale is None) or (
                sub in ("log", "exec") and rt.storage_key != "pods") or (sub == "finalize" and rt.storage_key != "namespaces"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if rt.namespaced and name is not None and namespace is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return await self._resource(request, rt, namespace, name, sub)

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        ctype = request.content_type
        if ctype == protobuf.MEDIA_TYPE:
            try:
                return protobuf.decode(raw)
            except protobuf.ProtobufError as exc:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                               f"accepted media types include: application/json, application/yaml ({exc})") from None
        try:
            if ctype == "application/apply-patch+yaml" or ctype.endswith("yaml"):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"error decoding request body: {exc}") from None

    def _opts(self, request: web.Request) -> WriteOptions:
        q = request.query
        validation = q.get("fieldValidation", "Warn")
        if validation not in ("Strict", "Warn", "Ignore"):
            raise bad_request(f'fieldValidation must be one of "Ignore", "Warn", or "Strict", got "{validation}"')
        return WriteOptions(dry_run=q.get("dryRun") == "All", field_validation=validation)

    async def _resource(self, request: web.Request, rt: ResourceType, namespace: str | None, name: str | None,
                        sub: str | None) -> web.StreamResponse:
        q = request.query
        method = request.method
        api = self.api
        table = tables.wants_table(request.headers.get("Accept"))
        if sub == "exec":
            if method not in ("GET", "POST"):
                raise method_not_allowed()
            from ..kubelet.environment import resolve_command

            return await pod_exec.serve(request, api.get(rt, namespace, name or ""), self.exec_locator,
                                        resolve_command)
        if method == "GET":
            if sub == "log":
                return await self._logs(request, rt, namespace, name)
            if _truthy(q.get("watch")):
                fs = q.get("fieldSelector")
                if name:
                    fs = f"metadata.name={name}" + (f",{fs}" if fs else "")
                return await self._watch(request, rt, namespace, fs, table)
            if name is None:
                items, meta = api.list(rt, namespace, label_selector=q.get("labelSelector"),
                                       field_selector=q.get("fieldSelector"),
                                       limit=_int_param(q, "limit"),
                                       continue_token=q.get("continue"))
                if table:
                    return _json(self._table(rt, items, meta, q.get("includeObject")))
                return _json({"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items})
            if sub == "scale":
                return _json(api.get_scale(rt, namespace, name))
            obj = api.get(rt, namespace, name)
            if table:
                return _json(self._table(rt, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]},
                                         q.get("includeObject")))
            return _json(obj)
        if method == "POST":
            if name is not None:
                raise method_not_allowed()
            opts = self._opts(request)
            obj = api.create(rt, namespace, await self._body(request), opts)
            return _json(obj, 201, opts.warnings)
        if method == "PUT":
            if name is None:
                raise method_not_allowed()
            opts = self._opts(request)
            body = await self._body(request)
            if sub == "finalize":
                obj = api.update(rt, namespace, name, self._finalize_body(rt, name, body), opts=opts)
            else:
                obj = api.update(rt, namespace, name, body, subresource=sub, opts=opts)
            return _json(obj, 200, opts.warnings)
        if method == "PATCH":
            if name is None:
                raise method_not_allowed()
            opts = self._opts(request)
            body = await self._body(request)
            obj = api.patch(rt, namespace, name, request.headers.get("Content-Type", ""), body, subresource=sub,
                            opts=opts)
            return _json(obj, 200, opts.warnings)
        if method == "DELETE":
            body = await self._body(request) or {}
            if not isinstance(body, dict):
                raise bad_request("DeleteOptions must be an object")
            for key in ("propagationPolicy", "gracePeriodSeconds", "orphanDependents"):
                if key in q:
                    body[key] = _int_param(q, key) if key == "gracePeriodSeconds" else (
                        _truthy(q[key]) if key == "orphanDependents" else q[key])
            dry_run = q.get("dryRun") == "All" or body.get("dryRun") == ["All"]
            if name is None:
                items = api.delete_collection(rt, namespace, body, label_selector=q.get("labelSelector"),
                                              field_selector=q.get("fieldSelector"))
                return _json({"kind": rt.list_kind, "apiVersion": rt.api_version,
                              "metadata": {"resourceVersion": str(api.store.resource_version)}, "items": items})
            obj, removed = api.delete(rt, namespace, name, body, dry_run=dry_run)
            return _json(obj, 200 if removed else 202)
        raise method_not_allowed()

    def _finalize_body(self, rt: ResourceType, name: str, body: Any) -> Any:
        """PUT namespaces/{name}/finalize only changes spec.finalizers."""
        current = self.api.get(rt, None, name)
        current["spec"] = dict(current.get("spec") or {})
        current["spec"]["finalizers"] = ((body or {}).get("spec") or {}).get("finalizers") or []
        return current

    def _table(self, rt: ResourceType, items: list[dict[str, Any]], meta: dict[str, Any],
               include: str | None, include_columns: bool = True) -> dict[str, Any]:
        result = tables.table(rt, items, meta, include_columns)
        for row, obj in zip(result["rows"], items):
            if include == "None":
                row.pop("object")
            elif include != "Object":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": obj["metadata"]}
        return result

    # --- watch -------------------------------------------------------------------------

    async def _watch(self, request: web.Request, rt: ResourceType, namespace: str | None, field_selector: str | None,
                     table: bool) -> web.StreamResponse:
        q = request.query
        api = self.api
        labels = parse_label_selector(q.get("labelSelector"))
        fields = parse_field_selector(field_selector)
        only_name = field_selector_name(field_selector)
        ns = namespace if rt.namespaced else None
        bookmarks = _truthy(q.get("allowWatchBookmarks"))
        initial_events = _truthy(q.get("sendInitialEvents"))
        timeout = _int_param(q, "timeoutSeconds")
        rv_text = q.get("resourceVersion") or ""
        if rv_text not in ("", "0") and not rv_text.isdigit():
            raise bad_request(f"resourceVersion: Invalid value: {rv_text!r}: must be a number")

        def visible(stored: dict[str, Any] | None) -> dict[str, Any] | None:
            if stored is None:
                return None
            meta = stored["metadata"]
            if ns and meta.get("namespace") != ns:
                return None
            if only_name and meta["name"] != only_name:
                return None
            obj = api.served(rt, stored)
            return obj if labels_match(labels, obj) and fields(obj) else None

        def transform(event: WatchEvent) -> Delivery | None:
            now = visible(event.obj) if event.type != "DELETED" else None
            before = visible(event.old) if event.old is not None else None
            if event.type == "DELETED":
                return (event.rv, "DELETED", before) if before is not None else None
            if now is not None:
                return (event.rv, "MODIFIED" if before is not None else "ADDED", now)
            if before is not None:   # it stopped matching the selector: to this watcher it is gone
                gone = api.served(rt, event.obj)
                return (event.rv, "DELETED", gone)
            return None

        watcher = Watcher(rt.storage_key, transform)
        start_rv = api.store.resource_version
        initial: list[Delivery] = []
        if rv_text in ("", "0") or initial_events:
            for stored in api.store.list(rt.storage_key, ns):
                obj = visible(stored)
                if obj is not None:
                    initial.append((int(obj["metadata"]["resourceVersion"]), "ADDED", obj))
            backlog = api.store.subscribe(watcher, None)
        else:
            backlog = api.store.subscribe(watcher, int(rv_text))
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                           "Cache-Control": "no-cache, private"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        first = [True]

        async def send(kind: str, obj: dict[str, Any]) -> None:
            if table and kind in ("ADDED", "MODIFIED", "DELETED"):
                obj = self._table(rt, [obj], {"resourceVersion": obj["metadata"].get("resourceVersion", "")},
                                  q.get("includeObject"), include_columns=first[0])
                first[0] = False
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        def bookmark(rv: int, initial_end: bool = False) -> dict[str, Any]:
            meta: dict[str, Any] = {"resourceVersion": str(rv)}
            if initial_end:
                meta["annotations"] = {"k8s.io/initial-events-end": "true"}
            return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

        try:
            if backlog is None:
                gone = ApiError(410, "Expired", f"too old resource version: {rv_text} ({api.store.oldest_watchable})")
                await send("ERROR", gone.status())
                return response
            for _, kind, obj in initial + backlog:
                await send(kind, obj)
            last_rv = max([start_rv] + [d[0] for d in backlog])
            if initial_events:
                await send("BOOKMARK", bookmark(start_rv, initial_end=True))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            next_bookmark = loop.time() + BOOKMARK_INTERVAL_S
            while not self._closing.is_set():
                wait = BOOKMARK_INTERVAL_S
                if deadline is not None:
                    wait = min(wait, deadline - loop.time())
                    if wait <= 0:
                        break
                try:
                    delivery = await asyncio.wait_for(watcher.queue.get(), timeout=max(wait, 0.01))
                except asyncio.TimeoutError:
                    delivery = ...
                if delivery is None:
                    break
                if request.transport is None or request.transport.is_closing():
                    break
                if delivery is not ...:
                    last_rv = delivery[0]
                    await send(delivery[1], delivery[2])
                if bookmarks and loop.time() >= next_bookmark:
                    await send("BOOKMARK", bookmark(max(last_rv, api.store.resource_version)
                                                    if watcher.queue.empty() else last_rv))
                    next_bookmark = loop.time() + BOOKMARK_INTERVAL_S
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            api.store.unsubscribe(watcher)
        try:
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass
        return response

    # --- logs --------------------------------------------------------------------------

    async def _logs(self, request: web.Request, rt: ResourceType, namespace: str | None,
                    name: str | None) -> web.StreamResponse:
        q = request.query
        pod = self.api.get(rt, namespace, name or "")
        containers = [c["name"] for c in pod.get("spec", {}).get("containers") or []]
        container = q.get("container")
        if container is None:
            if len(containers) != 1:
                raise bad_request(f"a container name must be specified for pod {name}, choose one of: "
                                  f"[{' '.join(containers)}]")
            container = containers[0]
        if container not in containers:
            raise bad_request(f"container {container} is not valid for pod {name}")
        path = self.log_locator(namespace or "", name or "", container, _truthy(q.get("previous"))) \
            if self.log_locator else None
        if path is None or not os.path.exists(path):
            if _truthy(q.get("previous")):
                raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        with open(path, "rb") as fh:
            data = fh.read()
        offset = len(data)   # follow from exactly what was read, so no line is skipped or repeated
        tail = _int_param(q, "tailLines")
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:]) if tail > 0 else b""
        if not _truthy(q.get("follow")):
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        uid = pod["metadata"]["uid"]
        while not self._closing.is_set():
            await asyncio.sleep(0.2)
            if request.transport is None or request.transport.is_closing():
                break
            current = self.api.store.peek("pods", namespace or "", name or "")
            if current is None or current["metadata"]["uid"] != uid:
                break
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                break
            if chunk:
                offset += len(chunk)
                await response.write(chunk)
            statuses = {c["name"]: c for c in (current.get("status") or {}).get("containerStatuses") or []}
            if "terminated" in (statuses.get(container, {}).get("state") or {}) and not chunk:
                break
        return response
