"""One container's lifecycle: start, probe, restart with back-off, stop gracefully."""
from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from .clock import now_iso
from . import process
from .probes import ProbeState, run_probe

MAX_BACKOFF_S = 60.0
TERMINATION_MESSAGE_LINES, TERMINATION_MESSAGE_BYTES = 80, 2048     # the kubelet's log-fallback limits


class ContainerWorker:
    def __init__(self, spec: dict[str, Any], *, pod_ip: str, cwd: str, log_dir: Path, restart_policy: str,
                 backoff_base_s: float, prepare: Callable[[], Any],
                 notify: Callable[[], None], emit: Callable[[str, str, str], None]) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.pod_ip = pod_ip
        self.cwd = cwd
        self.log_dir = log_dir
        self.restart_policy = restart_policy
        self.backoff_base_s = backoff_base_s
        self.prepare = prepare      # raises ValueError with a reason/message when config is missing
        self.notify = notify
        self.emit = emit            # (type, reason, message) -> pod Event
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.ready = False
        self.started = False
        self.restart_count = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self._kill_reason: str | None = None
        self._stopping = asyncio.Event()
        self.done = asyncio.Event()

    # --- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                               "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                               "state": self.state, "lastState": self.last_state}
        if self.proc is not None:
            out["containerID"] = f"local://{self.proc.pid}"
        return out

    def log_path(self, previous: bool) -> Path | None:
        n = self.restart_count - (1 if previous else 0)
        if n < 0:
            return None
        return self.log_dir / f"{n}.log"

    @property
    def terminated(self) -> bool:
        return "terminated" in self.state and self.done.is_set()

    # --- lifecycle ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.done.set()
            self.notify()

    async def _run(self) -> None:
        backoff_exp = 0
        while not self._stopping.is_set():
            try:
                prepared = self.prepare()
                # The real-API kubelet fetches ConfigMaps, Secrets and a token first: prepare may be async.
                argv, env = await prepared if inspect.isawaitable(prepared) else prepared
            except ValueError as exc:
                reason, _, message = str(exc).partition(": ")
                self._set_state({"waiting": {"reason": reason, "message": message}})
                self.emit("Warning", "Failed", f"Error: {message}")
                if await self._sleep(2.0):
                    return
                continue
            self.env = env
            started = time.monotonic()
            code, reason, message = await self._run_once(argv, env)
            if not message and code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                message = self._log_tail()
            finished = now_iso()
            self.ready = self.started = False
            self.state = {"terminated": {"exitCode": code, "reason": reason, "startedAt": self._started_at,
                                         "finishedAt": finished, "containerID": f"local://{self._pid}"}}
            if message:
                self.state["terminated"]["message"] = message
            self.notify()
            if self._stopping.is_set():
                return
            if self.restart_policy == "Never" or (self.restart_policy == "OnFailure" and code == 0):
                return
            if time.monotonic() - started > 60:
                backoff_exp = 0
            delay = min(self.backoff_base_s * (2 ** backoff_exp), MAX_BACKOFF_S)
            backoff_exp += 1
            self.last_state = self.state
            self.restart_count += 1
            self._set_state({"waiting": {"reason": "CrashLoopBackOff",
                                         "message": f"back-off {delay:g}s restarting failed container={self.name}"}})
            self.emit("Warning", "BackOff", "Back-off restarting failed container " + self.name)
            if await self._sleep(delay):
                return

    def _log_tail(self) -> str:
        """The termination message a kubelet takes from the log under FallbackToLogsOnError (there is no
        termination-log file here): its last 80 lines, at most 2 KiB, as the kubelet's limits are."""
        path = self.log_path(False)
        try:
            data = path.read_bytes()[-TERMINATION_MESSAGE_BYTES:] if path is not None else b""
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-TERMINATION_MESSAGE_LINES:])

    async def _run_once(self, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
        self._kill_reason = None
        self._started_at = now_iso()
        self._pid = 0
        log_file = self.log_path(False)
        assert log_file is not None
        try:
            self.proc = process.spawn(argv, env, self.cwd, log_file)
        except OSError as exc:
            self.emit("Warning", "Failed", f"Error: failed to start container {self.name!r}: {exc}")
            return 128, "StartError", str(exc)
        self._pid = self.proc.pid
        self.emit("Normal", "Created", f"Created container: {self.name}")
        self.emit("Normal", "Started", f"Started container {self.name}")
        self._set_state({"running": {"startedAt": self._started_at}})
        probes = asyncio.create_task(self._probe_loop())
        try:
            while self.proc.poll() is None and self._kill_reason is None and not self._stopping.is_set():
                await asyncio.sleep(0.1)
            if self.proc.poll() is None and self._kill_reason is not None:
                await self._stop_process(float(self.spec.get("_grace", 30)))
        finally:
            probes.cancel()
            try:
                await probes
            except asyncio.CancelledError:
                pass
        while self.proc.poll() is None:   # when stopping, stop() is ending it
            await asyncio.sleep(0.05)
        rc = self.proc.poll()
        process.forget(self.proc)
        if rc is None:
            return 137, "Error", ""
        code = 128 - rc if rc < 0 else rc
        return code, "Completed" if code == 0 else "Error", ""

    async def _probe_loop(self) -> None:
        pod_ip, spec = self.pod_ip, self.spec
        startup = ProbeState(spec["startupProbe"], False) if spec.get("startupProbe") else None
        readiness = ProbeState(spec["readinessProbe"], False) if spec.get("readinessProbe") else None
        liveness = ProbeState(spec["livenessProbe"], True) if spec.get("livenessProbe") else None
        t0 = time.monotonic()
        if startup is not None:
            next_at = t0 + startup.initial_delay
            while not startup.result:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at = time.monotonic() + startup.period
                ok, msg = await run_probe(startup.probe, spec, pod_ip, self.env, self.cwd)
                startup.record(ok)
                if not ok:
                    self.emit("Warning", "Unhealthy", f"Startup probe failed: {msg}")
                    if startup.failures >= int(startup.probe.get("failureThreshold", 3)):
                        self.emit("Normal", "Killing", f"Container {self.name} failed startup probe, will be "
                                                       "restarted")
                        self._kill_reason = "startup probe failed"
                        return
        self.started = True
        if readiness is None:
            self.ready = True
        self.notify()
        t1 = time.monotonic()
        due = {}
        if readiness is not None:
            due["readiness"] = t1 + readiness.initial_delay
        if liveness is not None:
            due["liveness"] = t1 + liveness.initial_delay
        while due:
            kind = min(due, key=due.get)   # type: ignore[arg-type]
            await asyncio.sleep(max(0.0, due[kind] - time.monotonic()))
            state = readiness if kind == "readiness" else liveness
            assert state is not None
            due[kind] = time.monotonic() + state.period
            ok, msg = await run_probe(state.probe, spec, pod_ip, self.env, self.cwd)
            flipped = state.record(ok)
            if not ok:
                self.emit("Warning", "Unhealthy", f"{kind.capitalize()} probe failed: {msg}")
            if kind == "readiness" and flipped:
                self.ready = state.result
                self.notify()
            if kind == "liveness" and not state.result:
                self.emit("Normal", "Killing", f"Container {self.name} failed liveness probe, will be restarted")
                self._kill_reason = "liveness probe failed"
                return

    async def _stop_process(self, grace: float) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        process.signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            process.signal_group(proc, signal.SIGKILL)
        while proc.poll() is None:
            await asyncio.sleep(0.02)
        # Children of the container's shell may linger in the group after the leader exits.
        process.signal_group(proc, signal.SIGKILL)

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; no restart afterwards."""
        self._stopping.set()
        self.ready = False
        if self.proc is not None and self.proc.poll() is None:
            self.emit("Normal", "Killing", f"Stopping container {self.name}")
            await self._stop_process(grace)
        await self.done.wait()

    def _set_state(self, state: dict[str, Any]) -> None:
        self.state = state
        self.notify()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True when stopping."""
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
            return True
        except asyncio.TimeoutError:
            return False
