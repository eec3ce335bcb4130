"""Raw-socket HTTP/1.1 for the limit tests: slow-loris clients, oversized heads, idle connections —
what httpx will not send. Shared by tests/api/test_limits.py and tests/router/test_limits.py."""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int | None          # None: the server closed without answering
    headers: dict[str, str]
    body: bytes
    elapsed: float              # seconds from the first byte sent to the answer's first byte (or the close)

    def json(self) -> Any:
        return json.loads(self.body)


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(sock: socket.socket, started: float) -> RawResponse:
    """Everything until the server closes (the limit answers all say `connection: close`)."""
    data = b""
    elapsed: float | None = None
    try:
        while chunk := sock.recv(65536):
            elapsed = elapsed if elapsed is not None else time.monotonic() - started
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    elapsed = elapsed if elapsed is not None else time.monotonic() - started
    sock.close()
    if not data:
        return RawResponse(None, {}, b"", elapsed)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body, elapsed)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + rest[:size], rest[size + 2:]
    return out


def trickle(port: int, first: bytes, drip: bytes, every: float, limit_s: float) -> RawResponse:
    """Send `first`, then one byte of `drip` every `every` seconds until the server answers or closes
    (or `limit_s` passes: the test then fails on the returned elapsed time)."""
    sock = connect(port, timeout=limit_s)
    started = time.monotonic()
    sock.sendall(first)
    sock.settimeout(every)
    data = b""
    for i in range(10**6):
        if time.monotonic() - started > limit_s:
            break
        try:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            sock.settimeout(limit_s)
            return _finish(sock, data, started)
        except socket.timeout:
            pass
        try:
            sock.sendall(drip[i % len(drip):i % len(drip) + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
    return _finish(sock, data, started)


def _finish(sock: socket.socket, data: bytes, started: float) -> RawResponse:
    class _Prefixed:
        def __init__(self) -> None:
            self.first = data

        def recv(self, n: int) -> bytes:
            if self.first:
                out, self.first = self.first, b""
                return out
            return sock.recv(n)

        def close(self) -> None:
            sock.close()
    return read_response(_Prefixed(), started)  # type: ignore[arg-type]


def send_raw(port: int, payload: bytes, timeout: float = 30.0) -> RawResponse:
    sock = connect(port, timeout=timeout)
    started = time.monotonic()
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return read_response(sock, started)


def post_head(path: str, content_length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n{extra}\r\n").encode()
