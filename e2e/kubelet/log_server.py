"""The kubelet's HTTPS endpoint for ``pods/log``: kube-apiserver proxies ``kubectl logs`` here.

kube-apiserver connects to the Node's InternalIP and ``daemonEndpoints.kubeletEndpoint.Port``
with its kubelet client certificate (``--kubelet-client-certificate``); we require a client
certificate from the cluster CA, so nothing else on the machine can read pod logs.
Only ``/containerLogs`` is served: exec, attach and port-forward are not (see e2e/README.md).
"""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Callable

import aiohttp
from aiohttp import web

# (namespace, pod, container, previous) -> log file path or None
LogLocator = Callable[[str, str, str, bool], "str | None"]
# (namespace, pod, container) -> whether the container is still running
Running = Callable[[str, str, str], bool]


class LogServer:
    def __init__(self, host: str, locate: LogLocator, running: Running, ca_file: Path, cert_file: Path,
                 key_file: Path) -> None:
        self.host = host
        self.port = 0
        self._locate, self._running = locate, running
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca_file))
        self._ssl.load_cert_chain(str(cert_file), str(key_file))
        self._ssl.verify_mode = ssl.CERT_REQUIRED
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        self._closing = asyncio.Event()

    async def start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=self._ssl)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        self._closing.set()
        await self._runner.cleanup()

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        query = request.query
        previous = query.get("previous") in ("true", "1")
        path = self._locate(ns, pod, container, previous)
        if path is None or not Path(path).exists():
            which = "previous terminated container" if previous else "container"
            return web.Response(status=400, text=f'{which} "{container}" in pod "{pod}" is not available')
        data = Path(path).read_bytes()
        offset = len(data)   # follow from exactly what was read: no line skipped or repeated
        if query.get("tailLines") is not None:
            tail = int(query["tailLines"])
            data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail > 0 else b""
        if query.get("limitBytes"):
            data = data[:int(query["limitBytes"])]
        if query.get("follow") not in ("true", "1"):
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        try:
            await self._follow(request, response, data, path, offset, (ns, pod, container))
        except (ConnectionError, aiohttp.ClientError):
            pass   # the client (kubectl logs -f via kube-apiserver) went away
        return response

    async def _follow(self, request: web.Request, response: web.StreamResponse, data: bytes, path: str,
                      offset: int, ref: tuple[str, str, str]) -> None:
        await response.write(data)
        while not self._closing.is_set() and request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.2)
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                break
            if chunk:
                offset += len(chunk)
                await response.write(chunk)
            elif not self._running(*ref):
                break
