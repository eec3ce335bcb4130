"""The local kubelet: pods bound to our node become process groups on their own 127.x.y.z address."""
from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import environment, process
from .clock import now_iso
from .container import ContainerWorker
from .node import node_object
from .node_api import NodeApi

log = logging.getLogger("e2e.kubelet")
COMPONENT = "kubelet"
SHUTDOWN_GRACE_S = 2.0


def _gpu_count(container: dict[str, Any]) -> int:
    resources = container.get("resources") or {}
    amount = (resources.get("limits") or {}).get("nvidia.com/gpu") or (resources.get("requests") or {}).get(
        "nvidia.com/gpu") or 0
    try:
        return max(0, int(str(amount)))
    except ValueError:
        return 0


class PodRuntime:
    """The containers of one pod and the pod-level status derived from them."""

    def __init__(self, kubelet: "Kubelet", pod: dict[str, Any], ip: str) -> None:
        self.kubelet = kubelet
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.ip = ip
        self.start_time = now_iso()
        self.dir = kubelet.workdir / f"{self.namespace}_{self.name}_{self.uid}"
        self.terminating = False
        self.finished = False
        self._transitions: dict[str, tuple[str, str]] = {}
        self.workers: dict[str, ContainerWorker] = {}
        restart_policy = pod["spec"].get("restartPolicy", "Always")
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.tasks: list[asyncio.Task[None]] = []
        self.gpus: dict[str, list[int]] = {}
        for spec in pod["spec"].get("containers") or []:
            spec = dict(spec, _grace=grace)
            worker = ContainerWorker(
                spec, pod_ip=ip, cwd=str(self.dir), log_dir=self.dir / spec["name"], restart_policy=restart_policy,
                backoff_base_s=kubelet.restart_backoff_s, prepare=self._preparer(spec), notify=kubelet.wake,
                emit=self._emitter(spec["name"]))
            self.workers[spec["name"]] = worker
            self.gpus[spec["name"]] = kubelet.allocate_gpus(_gpu_count(spec))

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for worker in self.workers.values():
            self.tasks.append(asyncio.create_task(worker.run(), name=f"{self.name}/{worker.name}"))

    def _current(self) -> dict[str, Any]:
        pod = self.kubelet.node_api.get_pod(self.namespace, self.name)
        if pod is None or pod["metadata"]["uid"] != self.uid:
            raise ValueError("CreateContainerError: pod no longer exists")
        return pod

    def _preparer(self, spec: dict[str, Any]) -> Any:
        async def prepare() -> tuple[list[str], dict[str, str]]:
            pod = copy.deepcopy(self._current())
            pod.setdefault("status", {})["podIP"] = self.ip
            pod["status"]["hostIP"] = self.kubelet.node_ip
            node_api = self.kubelet.node_api
            lookup = await node_api.lookup_for(pod, spec)
            # A hidden directory: container names (log directories here) are DNS labels and never start with ".".
            kubeconfig = await node_api.credentials(pod, self.dir / ".serviceaccount")
            argv, env = environment.build(lookup, pod, spec, self.kubelet.api_host, self.kubelet.api_port,
                                          kubeconfig=kubeconfig)
            # The device plugin's part: a container sees exactly the GPUs assigned to it (none if it asked none).
            visible = ",".join(str(i) for i in self.gpus.get(spec["name"], []))
            env["CUDA_VISIBLE_DEVICES"] = visible
            env["NVIDIA_VISIBLE_DEVICES"] = visible or "void"
            return argv, env
        return prepare

    def _emitter(self, container: str) -> Any:
        def emit(etype: str, reason: str, message: str) -> None:
            pod = self.kubelet.node_api.get_pod(self.namespace, self.name)
            if pod is not None and pod["metadata"]["uid"] == self.uid:
                self.kubelet.node_api.record_event(pod, etype, reason, message)
        return emit

    def _transition(self, ctype: str, status: str) -> dict[str, Any]:
        prev = self._transitions.get(ctype)
        if prev is None or prev[0] != status:
            self._transitions[ctype] = (status, now_iso())
        return {"type": ctype, "status": status, "lastProbeTime": None,
                "lastTransitionTime": self._transitions[ctype][1]}

    def status(self, stored: dict[str, Any]) -> dict[str, Any]:
        workers = list(self.workers.values())
        statuses = [w.status() for w in workers]
        all_ready = bool(workers) and all(w.ready for w in workers) and not self.terminating
        policy = stored["spec"].get("restartPolicy", "Always")
        done = [w for w in workers if w.terminated]
        if workers and len(done) == len(workers) and (policy != "Always" or self.terminating):
            failed = any(w.state["terminated"]["exitCode"] != 0 for w in done)
            phase = "Failed" if failed else "Succeeded"
        elif any("running" in w.state or w.restart_count > 0 or "terminated" in w.state for w in workers):
            phase = "Running"
        else:
            phase = "Pending"
        old = stored.get("status") or {}
        scheduled = next((c for c in old.get("conditions") or [] if c.get("type") == "PodScheduled"),
                         {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                          "lastTransitionTime": self.start_time})
        conditions = [
            self._transition("PodReadyToStartContainers", "True"),
            self._transition("Initialized", "True"),
            self._transition("Ready", "True" if all_ready else "False"),
            self._transition("ContainersReady", "True" if all_ready else "False"),
            scheduled,
        ]
        for c in conditions[2:4]:
            if c["status"] == "False":
                unready = [w.name for w in workers if not w.ready]
                c["reason"] = "ContainersNotReady"
                c["message"] = f"containers with unready status: [{' '.join(unready)}]"
        status = {"phase": phase, "conditions": conditions, "hostIP": self.kubelet.node_ip,
                  "hostIPs": [{"ip": self.kubelet.node_ip}], "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                  "startTime": self.start_time, "containerStatuses": statuses,
                  "qosClass": old.get("qosClass", "BestEffort")}
        return status

    def release_gpus(self) -> None:
        for name, ids in self.gpus.items():
            self.kubelet.release_gpus(ids)
            self.gpus[name] = []

    async def stop(self, grace: float) -> None:
        self.terminating = True
        await asyncio.gather(*(w.stop(grace) for w in self.workers.values()), return_exceptions=True)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Kubelet:
    def __init__(self, node_api: NodeApi, *, node_name: str, capacity: dict[str, str], pod_network: str,
                 workdir: Path, restart_backoff_s: float = 1.0, kubelet_version: str = "v1.37.0",
                 kubelet_port: int = 0) -> None:
        self.node_api = node_api
        self.kubelet_port = kubelet_port   # where our log server listens (0: none)
        self.kubelet_version = kubelet_version
        self.node_name = node_name
        self.capacity = capacity
        self.pod_network = pod_network
        self.node_ip = f"{pod_network}.1"
        self.workdir = Path(workdir)
        self.restart_backoff_s = restart_backoff_s
        self.api_url = node_api.api_url
        parsed = urlparse(self.api_url or "http://127.0.0.1:0")
        self.api_host, self.api_port = parsed.hostname or "127.0.0.1", parsed.port or 0
        self.pods: dict[str, PodRuntime] = {}
        self._free_ips = [f"{pod_network}.{i}" for i in range(2, 255)]
        self._free_gpus = list(range(int(float(capacity.get("nvidia.com/gpu", "0") or 0))))
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping: dict[str, asyncio.Task[None]] = {}

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        body = node_object(self.node_name, self.capacity, self.node_ip, self.kubelet_version)
        if self.kubelet_port:
            body["status"]["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self.kubelet_port}}
        await self.node_api.start(body, self.wake)
        self._task = asyncio.create_task(self._loop(), name="kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(rt.stop(SHUTDOWN_GRACE_S) for rt in self.pods.values()), return_exceptions=True)
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        process.kill_all(grace_s=0.5)
        self.pods.clear()
        await self.node_api.stop()

    def allocate_gpus(self, count: int) -> list[int]:
        ids, self._free_gpus = self._free_gpus[:count], self._free_gpus[count:]
        return ids

    def release_gpus(self, ids: list[int]) -> None:
        self._free_gpus = sorted(set(self._free_gpus) | set(ids))

    def wake(self) -> None:
        self._wake.set()

    def log_path(self, namespace: str, name: str, container: str, previous: bool) -> str | None:
        for rt in self.pods.values():
            if rt.namespace == namespace and rt.name == name and container in rt.workers:
                path = rt.workers[container].log_path(previous)
                return str(path) if path is not None else None
        return None

    def container_running(self, namespace: str, name: str, container: str) -> bool:
        return any(rt.namespace == namespace and rt.name == name and container in rt.workers
                   and "running" in rt.workers[container].state for rt in self.pods.values())

    def exec_context(self, namespace: str, name: str, container: str) -> tuple[dict[str, str], str] | None:
        """(env, cwd) of a running container, for ``kubectl exec``; None when it is not running."""
        for rt in self.pods.values():
            if rt.namespace == namespace and rt.name == name and container in rt.workers:
                worker = rt.workers[container]
                if "running" in worker.state:
                    return dict(worker.env), worker.cwd
        return None

    # --- sync --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(0.02)
            self._wake.clear()
            try:
                self.sync()
            except Exception:
                log.exception("kubelet sync failed")

    def sync(self) -> None:
        mine = {p["metadata"]["uid"]: p for p in self.node_api.pods_on_node()}
        for uid, pod in mine.items():
            meta = pod["metadata"]
            runtime = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                if runtime is None:
                    self._finalize(pod)
                elif uid not in self._stopping:
                    grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                    self._stopping[uid] = asyncio.create_task(self._terminate(runtime, grace))
                continue
            if runtime is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                if not self._free_ips:
                    continue
                runtime = PodRuntime(self, pod, self._free_ips.pop(0))
                self.pods[uid] = runtime
                runtime.start()
        for uid in list(self.pods):
            if uid not in mine and uid not in self._stopping:   # force-deleted or removed with its namespace
                self._stopping[uid] = asyncio.create_task(self._terminate(self.pods[uid], 0.0, removed=True))
        for uid, runtime in self.pods.items():
            pod = mine.get(uid)
            if pod is None:
                continue
            status = runtime.status(pod)
            if status["phase"] in ("Succeeded", "Failed"):
                runtime.release_gpus()   # finished pods give their devices back, as the scheduler assumes
            self.node_api.write_status(pod, status)

    def _finalize(self, pod: dict[str, Any]) -> None:
        self.node_api.finalize(pod)

    async def _terminate(self, runtime: PodRuntime, grace: float, removed: bool = False) -> None:
        try:
            await runtime.stop(grace)
            if not removed:
                pod = self.node_api.get_pod(runtime.namespace, runtime.name)
                if pod is not None and pod["metadata"]["uid"] == runtime.uid:
                    self.sync_one_status(runtime, pod)
                    self._finalize(pod)
        finally:
            self.pods.pop(runtime.uid, None)
            self._stopping.pop(runtime.uid, None)
            self._free_ips.append(runtime.ip)
            runtime.release_gpus()

    def sync_one_status(self, runtime: PodRuntime, pod: dict[str, Any]) -> None:
        self.node_api.write_status(pod, runtime.status(pod))
