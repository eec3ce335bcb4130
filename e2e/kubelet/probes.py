"""Container probes: httpGet, tcpSocket and exec, with the kubelet's success/failure thresholds."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from .environment import resolve_command


def _port(port: Any, container: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} not found in container {container.get('name')}")


async def run_probe(probe: dict[str, Any], container: dict[str, Any], pod_ip: str,
                    env: dict[str, str], cwd: str) -> tuple[bool, str]:
    """One probe attempt: (success, failure message worded like the kubelet's)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    target = ""
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host = spec.get("host") or pod_ip
            url = f"{spec.get('scheme', 'HTTP').lower()}://{host}:{_port(spec.get('port'), container)}" \
                  f"{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            headers.setdefault("User-Agent", "kube-probe/1.37")
            target = f'Get "{url}"'
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
                async with session.get(url, headers=headers, allow_redirects=False) as resp:
                    await resp.read()
                    if 200 <= resp.status < 400:
                        return True, ""
                    return False, f"HTTP probe failed with statuscode: {resp.status}"
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            port = _port(spec.get("port"), container)
            target = f"dial tcp {spec.get('host') or pod_ip}:{port}"
            _, writer = await asyncio.wait_for(asyncio.open_connection(spec.get("host") or pod_ip, port), timeout)
            writer.close()
            return True, ""
        if "exec" in probe:
            command = resolve_command(list(probe["exec"].get("command") or []))
            proc = await asyncio.create_subprocess_exec(*command, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), timeout)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                return False, f"command timed out after {timeout:g}s"
            if proc.returncode == 0:
                return True, ""
            return False, out.decode(errors="replace")[-500:] or f"exit status {proc.returncode}"
        return False, "unsupported probe handler (the local kubelet runs httpGet, tcpSocket and exec)"
    except asyncio.TimeoutError:
        return False, f"{target or 'probe'}: context deadline exceeded (Client.Timeout exceeded while awaiting " \
                      "headers)"
    except aiohttp.ClientConnectorError as exc:
        refused = "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else str(exc.os_error)
        return False, f"{target}: dial tcp {exc.host}:{exc.port}: connect: {refused}"
    except ConnectionRefusedError:
        return False, f"{target}: connect: connection refused"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return False, f"{target or 'probe'}: {exc}"


class ProbeState:
    """Consecutive success/failure counting, per probe, as the kubelet's prober does."""

    def __init__(self, probe: dict[str, Any], initial: bool) -> None:
        self.probe = probe
        self.result = initial
        self.successes = 0
        self.failures = 0

    @property
    def period(self) -> float:
        return float(self.probe.get("periodSeconds", 10))

    @property
    def initial_delay(self) -> float:
        return float(self.probe.get("initialDelaySeconds", 0))

    def record(self, ok: bool) -> bool:
        """Count one attempt; returns True when the aggregated result flipped."""
        before = self.result
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.result = False
        return before != self.result
