"""Engine pods as an operator of the cluster meets them (issue #46): `kubectl exec`, `kubectl logs` and
`kubectl port-forward` into one, and one OOM-killed by its memory limit under load through the router.

A PagedModel of two engines (the chart's image on the real node, SmolLM2-135M on CPU) behind the router,
under a real `pagedmodel operator`. The OOM kill is the kernel's: a process exec'd into one engine's
container allocates until the container's cgroup crosses its memory limit, having first marked the
engine (the container's PID 1) as the kernel's preferred victim, as a leaking engine would be. The
container ends OOMKilled (137), the kubelet restarts it, the router takes it back once Ready again.

No request that had not started its response is lost: a non-streamed completion sends nothing until it
is done, so each one in flight on the killed engine must be retried by the router on the other replica
and answered 200. A streamed one whose 200 and headers were out may end with the router's error event;
one that never got its headers must not fail either.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Iterator

import httpx
import pytest

from e2e.target import ClusterTarget

from .helpers import wait_until
from .test_operator_autoscaling import Load, ready
from .test_operator_pagedmodel import operator, pagedmodel_crd  # noqa: F401  (pagedmodel_crd: fixture)
from .test_zero_loss_scaling import manifest, router_health

pytestmark = pytest.mark.slow

NAME = "pods"
ENGINE_PORT = 8000
PROMPT = "The capital of France is"
MAX_TOKENS = 24
PLAIN_CLIENTS, STREAM_CLIENTS = 4, 1
# Runs inside the engine's container (uid 1000, as the engine): make PID 1 the OOM killer's choice, then
# grow until the cgroup's limit is crossed. The engine dies first, and this process with its PID namespace.
HOG = ("open('/proc/1/oom_score_adj', 'w').write('1000')\n"
       "hoard = []\n"
       "while True:\n"
       "    hoard.append(bytearray(64 << 20))\n")


def engine_pods(cluster: ClusterTarget, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]


def router_retries(url: str) -> float:
    lines = [ln for ln in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
             if ln.startswith("pagedmodel_router_retries_total")]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.fixture(scope="module")
def served(cluster: ClusterTarget, pagedmodel_crd, tmp_path_factory) -> Iterator[tuple[str, str]]:   # noqa: F811
    """(namespace, router URL): the PagedModel Ready with both engines, the router routing to both."""
    namespace = cluster.new_namespace("pods")
    try:
        with operator(cluster, namespace, tmp_path_factory.mktemp("pods") / "operator.log", router="enabled"):
            cluster.kubectl("apply", "-f", "-", stdin=manifest(NAME), namespace=namespace)
            wait_until(lambda: (lambda st: st.get("phase") == "Ready" and st.get("readyReplicas") == 2)(
                cluster.kubectl_json("get", "pm", NAME, namespace=namespace).get("status") or {}),
                timeout=300, interval=1, what="PagedModel Ready with 2 engines")
            with cluster.service_url(namespace, NAME, 80) as url:
                wait_until(lambda: router_health(url).get("upstreams_ready") == 2, timeout=180, interval=1,
                           what="router routing to both engines")
                yield namespace, url
    finally:
        cluster.delete_namespace(namespace)


def test_exec_logs_and_port_forward_into_an_engine_pod(cluster: ClusterTarget, served: tuple[str, str]):
    namespace, _ = served
    name = engine_pods(cluster, namespace)[0]["metadata"]["name"]

    # exec: a process beside the engine, in its container (uid 1000, read-only root), reaching it on loopback.
    probe = ("import json, os, urllib.request; "
             "print(os.getuid(), json.load(urllib.request.urlopen('http://127.0.0.1:8000/v1/models'))['data'][0]['id'])")
    out = cluster.kubectl("exec", name, "-c", "engine", "--", "python3", "-c", probe, namespace=namespace).stdout
    assert out.split() == ["1000", "smollm2"], out
    denied = cluster.kubectl("exec", name, "-c", "engine", "--", "touch", "/opt/x", namespace=namespace, check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied.stderr

    # logs: what the engine printed as it started, from its first line to where it serves.
    tail = cluster.kubectl("logs", name, "-c", "engine", "--tail=1", namespace=namespace).stdout
    logs = cluster.kubectl("logs", name, "-c", "engine", namespace=namespace).stdout
    assert "starting: loading torch and the engine" in logs and "serving smollm2 on http://" in logs, logs[-2000:]
    assert len(tail.splitlines()) == 1 and tail in logs, tail

    # port-forward: the engine's OpenAI API on a local port, through the kubelet's streaming server.
    with cluster.kubectl_stream("port-forward", f"pod/{name}", f":{ENGINE_PORT}", namespace=namespace) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()   # "Forwarding from 127.0.0.1:NNNNN -> 8000"
        local = line.split("->")[0].strip().rsplit(":", 1)[-1]
        reply = httpx.post(f"http://127.0.0.1:{local}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text


class MixedLoad(Load):
    """Clients sending completions back to back through the router until stopped (started and joined as
    the autoscaling scenario's load is): PLAIN_CLIENTS non-streamed, STREAM_CLIENTS streamed. Each
    outcome is kept: "ok", or what went wrong."""

    def __init__(self, url: str) -> None:
        super().__init__(url, 0, PROMPT, MAX_TOKENS)
        self.outcomes: dict[str, list[str]] = {"plain": [], "stream": []}
        self.threads = [threading.Thread(target=self.run_kind, args=(kind,), daemon=True)
                        for kind in ["plain"] * PLAIN_CLIENTS + ["stream"] * STREAM_CLIENTS]

    def plain(self, client: httpx.Client) -> str:
        body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        try:
            reply = client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return f"no answer: {exc!r}"
        if reply.status_code != 200:
            return f"HTTP {reply.status_code}: {reply.text[:300]}"
        done = reply.json()["usage"]["completion_tokens"]
        return "ok" if done == MAX_TOKENS else f"incomplete: {done} tokens"

    def streamed(self, client: httpx.Client) -> str:
        body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    return f"HTTP {reply.status_code}: {reply.read().decode()[:300]}"
                events = [ln[6:] for ln in reply.iter_lines() if ln.startswith("data: ")]
        except httpx.HTTPError as exc:
            return f"no answer: {exc!r}"
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        if any("error" in c for c in chunks):
            return "started, then the router's error event"   # allowed: its response had begun
        usage = (chunks[-1].get("usage") if chunks else None) or {}
        return "ok" if events[-1:] == ["[DONE]"] and usage.get("completion_tokens") == MAX_TOKENS else \
            f"incomplete: {events[-2:]}"

    def run_kind(self, kind: str) -> None:
        with httpx.Client(timeout=300) as client:   # as long as the router may queue a retried request
            while not self.stop.is_set():
                outcome = self.plain(client) if kind == "plain" else self.streamed(client)
                with self.lock:
                    self.outcomes[kind].append(outcome)

    def count_ok(self) -> int:
        with self.lock:
            return sum(o == "ok" for found in self.outcomes.values() for o in found)


def running_requests(cluster: ClusterTarget, namespace: str, pod: str) -> float:
    ip = cluster.kubectl_json("get", "pod", pod, namespace=namespace)["status"]["podIP"]
    text = httpx.get(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("vllm:num_requests_running"))


def oom_killed_and_back(cluster: ClusterTarget, namespace: str, name: str, url: str):
    def check():
        pod = cluster.kubectl_json("get", "pod", name, namespace=namespace)
        status = pod["status"]["containerStatuses"][0]
        last = (status.get("lastState") or {}).get("terminated") or {}
        back = ready(pod) and router_health(url).get("upstreams_ready") == 2
        return status if status["restartCount"] >= 1 and last.get("reason") == "OOMKilled" and back else None
    return check


def test_an_engine_oom_killed_by_its_limit_restarts_and_the_router_loses_no_unstarted_request(
        cluster: ClusterTarget, served: tuple[str, str]):
    namespace, url = served
    victim = engine_pods(cluster, namespace)[0]
    name = victim["metadata"]["name"]
    assert victim["spec"]["containers"][0]["resources"]["limits"]["memory"] == "2Gi"
    retries_before = router_retries(url)
    with MixedLoad(url) as load:
        wait_until(lambda: load.count_ok() >= PLAIN_CLIENTS, timeout=180, what="load flowing")
        # The kill lands while the victim holds requests (both engines take turns at the router's picks).
        wait_until(lambda: running_requests(cluster, namespace, name) >= 2, timeout=120, interval=0.2,
                   what=f"{name} running requests")
        hog = cluster.kubectl("exec", name, "-c", "engine", "--", "python3", "-c", HOG, namespace=namespace,
                              check=False, timeout=120)
        assert hog.returncode != 0   # it died with the container
        status = wait_until(oom_killed_and_back(cluster, namespace, name, url), timeout=300, interval=1,
                            what=f"{name} OOMKilled, restarted and routed to again")
        served_after = load.count_ok()
        wait_until(lambda: load.count_ok() >= served_after + PLAIN_CLIENTS, timeout=180, what="load after the restart")
    retries = router_retries(url) - retries_before
    print(f"outcomes: { {k: {o: v.count(o) for o in set(v)} for k, v in load.outcomes.items()} }; "
          f"router retries {retries:.0f}; victim {status['lastState']['terminated']}")

    assert status["lastState"]["terminated"]["exitCode"] == 137
    # The requests the victim held were taken over by the other engine: the router retried at least one.
    assert retries >= 1
    lost = [o for o in load.outcomes["plain"] if o != "ok"]
    assert not lost, lost[:5]
    unstarted = [o for o in load.outcomes["stream"] if o not in ("ok", "started, then the router's error event")]
    assert not unstarted, unstarted[:5]
