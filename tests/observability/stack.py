"""A small real monitoring stack on 127.0.0.1: a `pagedmodel serve` engine (tiny model, CPU), a
`pagedmodel router` in front of it, the operator's metrics endpoint fed by real reconcile passes, and a
real Prometheus scraping all three every second with the labels the chart's PodMonitors give them.

The operator runs its real reconcile pass and telemetry against the operator tests' in-memory API
(tests/operator/test_scaling.ClusterSim, no Kubernetes here); its engine pod is the real engine: the
pass scrapes the engine's /metrics through the operator's own http_fetch. Used by
tests/observability/test_real_prometheus.py and benchmarks/observability_snapshot.py.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from support import free_port, stop_process, wait_healthy, wait_until

NAMESPACE, MODEL = "ml", "smollm2"
# What the chart's PodMonitors make of each target (prometheus-operator adds namespace and pod; the
# relabelings add pagedmodel and component; the operator's samples keep their own labels: honorLabels).
TARGET_LABELS = {
    "engine": {"namespace": NAMESPACE, "pagedmodel": MODEL, "pod": f"{MODEL}-engine-0", "component": "engine"},
    "router": {"namespace": NAMESPACE, "pagedmodel": MODEL, "pod": f"{MODEL}-router-0", "component": "router"},
    "operator": {"namespace": "pm-system", "pod": "pm-pagedmodel-0", "component": "operator"},
}


class Process:
    def __init__(self, args: list[str], log: Path):
        self.log = log
        self._out = open(log, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        stop_process(self.proc, 20)
        self._out.close()


class OperatorLoop:
    """Reconcile passes of one PagedModel every `period` s (policy clock 10 s per pass), counted by the
    operator's telemetry and served on its metrics port. The first pass's scrape fails on purpose, so
    the scrape-failure counter has a sample; at pass BUMP_AT a user raises minReplicas to 2, so the
    desired replicas change (the dashboard's scale-event annotation)."""

    BUMP_AT = 8

    def __init__(self, engine_url: str, period: float = 0.5):
        from pagedmodel.operator.reconcile import reconcile
        from pagedmodel.operator.scaling import iso
        from pagedmodel.operator.scrape import http_fetch
        from pagedmodel.operator.telemetry import OperatorMetrics
        from test_scaling import AUTO, T0, ClusterSim

        self.metrics = OperatorMetrics()
        self.port = free_port()
        self.server = self.metrics.serve(self.port, addr="127.0.0.1")
        sim = ClusterSim(AUTO)
        first = [True]

        def fetch(url: str) -> str:
            if first[0]:
                first[0] = False
                raise ConnectionError("refused (the first pass fails on purpose)")
            return http_fetch(engine_url + "/metrics")      # every engine pod is the one real engine

        def one(i: int, t: float) -> None:
            if i == self.BUMP_AT:
                sim.pm["spec"]["autoscaling"] = {**sim.pm["spec"]["autoscaling"], "minReplicas": 2}
                sim.pm["metadata"]["generation"] += 1
            started = time.monotonic()
            out = reconcile(sim.kube, sim.pm, router_enabled=False, now=iso(t), clock=t, fetch=fetch,
                            memory=sim.memory)
            sim.pm["status"] = out.status
            self.metrics.record(NAMESPACE, MODEL, time.monotonic() - started, out.report)

        self._stop = threading.Event()

        def loop() -> None:
            for i in itertools.count():
                if self._stop.wait(period if i else 0):
                    return
                one(i, T0 + 10 * i)
        self.thread = threading.Thread(target=loop, daemon=True, name="operator-passes")
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.server.shutdown()


class Stack:
    def __init__(self, model_dir: Path, prometheus: Path, workdir: Path):
        self.workdir = workdir
        self.procs: list[Process] = []
        self.operator: OperatorLoop | None = None
        try:
            self._start(model_dir, prometheus)
        except BaseException:
            self.stop()
            raise

    def _start(self, model_dir: Path, prometheus: Path) -> None:
        py = [sys.executable, "-m", "pagedmodel.cli"]
        self.engine_port, self.router_port, self.prom_port = free_port(), free_port(), free_port()
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.prom_url = f"http://127.0.0.1:{self.prom_port}"
        engine = Process(py + ["serve", "--model", str(model_dir), "--device", "cpu", "--host", "127.0.0.1",
                               "--port", str(self.engine_port), "--served-model-name", MODEL,
                               "--max-model-len", "256", "--max-num-seqs", "4", "--enable-prefix-caching",
                               "--kv-cache-memory", str(8 << 20)],
                         self.workdir / "engine.log")
        self.procs.append(engine)
        # A global limit of 1 request/s (burst 2): a quick burst through the router meets 429s.
        router = Process(py + ["router", "--upstream", self.engine_url, "--host", "127.0.0.1",
                               "--port", str(self.router_port), "--rate-limit", "1", "--burst", "2",
                               "--scrape-interval", "1"], self.workdir / "router.log")
        self.procs.append(router)
        wait_healthy(self.engine_url, engine.proc, 180, engine.log)
        wait_healthy(self.router_url, router.proc, 60, router.log)
        self.operator = OperatorLoop(self.engine_url)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.scrape_config()))
        prom = Process([str(prometheus), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn"],
                       self.workdir / "prometheus.log")
        self.procs.append(prom)
        ready = wait_until(lambda: self._ready(prom), timeout=60, interval=0.2)
        if not ready:
            raise RuntimeError(f"Prometheus not ready:\n{prom.log.read_text(errors='replace')}")
        if not wait_until(lambda: len(self.query("up == 1")) == 3, timeout=30, interval=0.2):
            raise RuntimeError(f"not every target is up: {self.query('up')}")

    def _ready(self, prom: Process) -> bool:
        if prom.proc.poll() is not None:
            raise RuntimeError(f"Prometheus exited:\n{prom.log.read_text(errors='replace')}")
        try:
            return httpx.get(self.prom_url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def scrape_config(self) -> dict[str, Any]:
        assert self.operator is not None
        ports = {"engine": self.engine_port, "router": self.router_port, "operator": self.operator.port}
        jobs = [{"job_name": name, "honor_labels": name == "operator",
                 "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": TARGET_LABELS[name]}]}
                for name, port in ports.items()]
        return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": jobs}

    def traffic(self, rounds: int = 6, pause: float = 0.5) -> dict[str, int]:
        """Requests straight to the engine (repeated prefixes: prefix-cache hits) and bursts through
        the router (its limit answers some with 429). Returns the status codes seen."""
        codes: dict[str, int] = {}
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            for i in range(rounds):
                prompt = "The paged KV cache keeps every sequence in fixed-size blocks; " * 3 + f"request {i}"
                r = client.post(self.engine_url + "/v1/completions", json={**body, "prompt": prompt})
                codes[f"engine {r.status_code}"] = codes.get(f"engine {r.status_code}", 0) + 1
                for _ in range(3):
                    r = client.post(self.router_url + "/v1/completions", json={**body, "prompt": prompt})
                    codes[f"router {r.status_code}"] = codes.get(f"router {r.status_code}", 0) + 1
                time.sleep(pause)
        return codes

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr, **({"time": at} if at is not None else {})}
        got = httpx.get(self.prom_url + "/api/v1/query", params=params, timeout=30).json()
        if got.get("status") != "success":
            raise ValueError(f"{expr!r}: {got.get('errorType')}: {got.get('error')}")
        return got["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        got = httpx.get(self.prom_url + "/api/v1/query_range",
                        params={"query": expr, "start": start, "end": end, "step": step}, timeout=60).json()
        if got.get("status") != "success":
            raise ValueError(f"{expr!r}: {got.get('errorType')}: {got.get('error')}")
        return got["data"]["result"]

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        for p in reversed(self.procs):
            p.stop()
