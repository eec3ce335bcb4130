"""``pods/exec`` over WebSockets (the ``v5.channel.k8s.io`` / ``v4.channel.k8s.io`` protocols kubectl speaks).

Each binary message starts with a channel byte: 0 stdin, 1 stdout, 2 stderr, 3 the final
Status, 255 (v5) "close this channel". The command runs as a local process with the
container's environment and working directory; TTYs are not emulated.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from aiohttp import WSMsgType, web

from .errors import ApiError, bad_request

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
# (namespace, pod, container) -> (env, cwd) of the running container, or None.
ExecLocator = Callable[[str, str, str], "tuple[dict[str, str], str] | None"]


def _status(code: int) -> dict[str, Any]:
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "message": f"command terminated with non-zero exit code: error executing command, exit status {code}",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}


async def serve(request: web.Request, pod: dict[str, Any], locate: ExecLocator | None,
                resolve: Callable[[list[str]], list[str]]) -> web.StreamResponse:
    q = request.query
    command = q.getall("command", [])
    if not command:
        raise bad_request("you must specify at least 1 command")
    containers = [c["name"] for c in pod.get("spec", {}).get("containers") or []]
    container = q.get("container") or (containers[0] if containers else "")
    if container not in containers:
        raise bad_request(f"container {container} is not valid for pod {pod['metadata']['name']}")
    context = locate(pod["metadata"]["namespace"], pod["metadata"]["name"], container) if locate else None
    if context is None:
        raise bad_request(f'unable to upgrade connection: container not found ("{container}")')
    env, cwd = context
    try:
        argv = resolve(list(command))
    except ValueError as exc:
        raise ApiError(500, "InternalError", str(exc).partition(": ")[2] or str(exc)) from None
    ws = web.WebSocketResponse(protocols=PROTOCOLS, autoping=True)
    if not ws.can_prepare(request).ok:
        raise bad_request("pods/exec needs a WebSocket upgrade (SPDY is not supported by the emulator)")
    await ws.prepare(request)
    want_stdin = q.get("stdin") in ("1", "true")
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=cwd, start_new_session=True,
        stdin=asyncio.subprocess.PIPE if want_stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

    async def pump(stream: asyncio.StreamReader, channel: int) -> None:
        while chunk := await stream.read(65536):
            await ws.send_bytes(bytes([channel]) + chunk)

    async def feed() -> None:
        assert proc.stdin is not None
        async for msg in ws:
            if msg.type != WSMsgType.BINARY or not msg.data:
                continue
            channel, data = msg.data[0], msg.data[1:]
            if channel == STDIN and data:
                proc.stdin.write(data)
                await proc.stdin.drain()
            elif channel == CLOSE and data[:1] == bytes([STDIN]):
                proc.stdin.close()

    feeder = asyncio.create_task(feed()) if want_stdin else None
    try:
        assert proc.stdout is not None and proc.stderr is not None
        await asyncio.gather(pump(proc.stdout, STDOUT), pump(proc.stderr, STDERR))
        code = await proc.wait()
        await ws.send_bytes(bytes([ERROR]) + json.dumps(_status(code)).encode())
    finally:
        if feeder is not None:
            feeder.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await ws.close()
    return ws
