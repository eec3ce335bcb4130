"""Pod behaviour on the local kubelet (or a real node): env sources, restart policies, probes, logs."""
from __future__ import annotations

import json
import time

import yaml

from .helpers import wait_until

IMAGE = "python:3.11-slim"


def _pod(name: str, code: str, **spec) -> dict:
    container = {"name": "c", "image": IMAGE, "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [container], **spec}}


def _get(cluster, namespace, name):
    return cluster.kubectl_json("get", "pod", name, namespace=namespace)


def _phase(cluster, namespace, name, *phases):
    return wait_until(lambda: (lambda p: p if p["status"].get("phase") in phases else None)(
        _get(cluster, namespace, name)), timeout=30, what=f"{name} in {phases}")


def test_env_sources_and_command_expansion(cluster, namespace):
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"mode": "fast", "k2": "v2"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"token": "t0k"}},
        _pod("envy", "import os,sys; print(sys.argv[1:]); "
                     "print({k: os.environ[k] for k in ('MODE','TOKEN','NAME','NS','GREETING','CFG_k2')})",
             restartPolicy="Never",
             container={"args": ["$(GREETING)", "$$(GREETING)"], "envFrom": [{"configMapRef": {"name": "cfg"},
                                                                              "prefix": "CFG_"}],
                        "env": [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
                                {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                {"name": "GREETING", "value": "hi-$(NAME)"}]}),
    ]
    docs[2]["spec"]["containers"][0]["command"] = ["python", "-c", docs[2]["spec"]["containers"][0]["command"][2], "x"]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs), namespace=namespace)
    pod = _phase(cluster, namespace, "envy", "Succeeded", "Failed")
    assert pod["status"]["phase"] == "Succeeded"
    out = cluster.kubectl("logs", "envy", namespace=namespace).stdout.splitlines()
    assert out[0] == "['x', 'hi-envy', '$(GREETING)']"   # command + args, $(VAR) expanded, $$ escaped
    assert out[1] == repr({"MODE": "fast", "TOKEN": "t0k", "NAME": "envy", "NS": namespace, "GREETING": "hi-envy",
                           "CFG_k2": "v2"})


def test_restart_policies_and_phases(cluster, namespace):
    pods = [_pod("ok", "print('done')", restartPolicy="Never"),
            _pod("fails", "raise SystemExit(4)", restartPolicy="Never"),
            _pod("retries", "import os,pathlib,sys; p=pathlib.Path('/tmp/%s-n' % os.environ['HOSTNAME'] + "
                            "os.environ['UID_HINT']); n=int(p.read_text()) if p.exists() else 0; "
                            "p.write_text(str(n+1)); sys.exit(0 if n >= 1 else 1)",
                 restartPolicy="OnFailure",
                 container={"env": [{"name": "UID_HINT", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]})]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(pods), namespace=namespace)
    assert _phase(cluster, namespace, "ok", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    failed = _phase(cluster, namespace, "fails", "Succeeded", "Failed")
    assert failed["status"]["phase"] == "Failed"
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 4
    retried = _phase(cluster, namespace, "retries", "Succeeded", "Failed")
    assert retried["status"]["phase"] == "Succeeded"
    assert retried["status"]["containerStatuses"][0]["restartCount"] == 1


def test_liveness_failure_restarts_and_exec_readiness(cluster, namespace):
    sleeper = "import os,pathlib,time; time.sleep(1); pathlib.Path('/tmp/%s-ready' % os.environ['HOSTNAME'])" \
              ".touch(); time.sleep(3600)"
    ready_check = ["python", "-c", "import os,sys; sys.exit(0 if os.path.exists('/tmp/%s-ready' % "
                                   "os.environ['HOSTNAME']) else 1)"]
    pods = [
        _pod("unlive", "import time; time.sleep(3600)",
             container={"livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}}),
        _pod("gated", sleeper, container={"readinessProbe": {"exec": {"command": ready_check}, "periodSeconds": 1}}),
    ]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(pods), namespace=namespace)
    gated = wait_until(lambda: (lambda p: p if any(c["type"] == "Ready" and c["status"] == "True"
                                                   for c in p["status"].get("conditions", [])) else None)(
        _get(cluster, namespace, "gated")), what="exec readiness")
    assert gated["status"]["containerStatuses"][0]["restartCount"] == 0
    unlive = wait_until(lambda: (lambda p: p if p["status"]["containerStatuses"][0]["restartCount"] >= 1
                                 else None)(_get(cluster, namespace, "unlive")), timeout=40, what="liveness restart")
    assert unlive["status"]["phase"] == "Running"
    events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=unlive",
                             namespace=namespace).stdout
    assert "Unhealthy" in events and "Liveness probe failed" in events


def test_logs_follow_and_tail(cluster, namespace):
    ticker = "import time\nfor i in range(1000):\n    print('tick', i, flush=True)\n    time.sleep(0.2)\n"
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(_pod("ticker", ticker)), namespace=namespace)
    wait_until(lambda: "tick 3" in cluster.kubectl("logs", "ticker", namespace=namespace, check=False).stdout,
               what="first ticks")
    tail = cluster.kubectl("logs", "ticker", "--tail=2", namespace=namespace).stdout.splitlines()
    assert len(tail) == 2 and all(line.startswith("tick") for line in tail)
    with cluster.kubectl_stream("logs", "-f", "ticker", namespace=namespace) as proc:
        assert proc.stdout is not None
        seen = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(seen) < 25:
            seen.append(proc.stdout.readline().strip())
        numbers = [int(line.split()[1]) for line in seen if line.startswith("tick")]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and len(numbers) >= 25


def test_missing_command_and_config_are_reported(cluster, namespace, local_node):
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nocmd"},
             "spec": {"containers": [{"name": "c", "image": "nginx:1.27"}]}},
            _pod("nocfg", "0", container={"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {
                "name": "absent", "key": "k"}}}]})]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(pods), namespace=namespace)

    def waiting_reason(name):
        statuses = _get(cluster, namespace, name)["status"].get("containerStatuses") or []
        return statuses and statuses[0]["state"].get("waiting", {}).get("reason")

    assert wait_until(lambda: waiting_reason("nocmd") == "CreateContainerError", what="nocmd waiting")
    assert wait_until(lambda: waiting_reason("nocfg") == "CreateContainerConfigError", what="nocfg waiting")
    message = _get(cluster, namespace, "nocfg")["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert message == 'configmap "absent" not found'


def test_jobs_complete_or_fail(cluster, namespace):
    ok = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "count"},
          "spec": {"completions": 2, "parallelism": 1, "template": {"spec": {
              "restartPolicy": "Never", "containers": [{"name": "c", "image": IMAGE,
                                                        "command": ["python", "-c", "print('counted')"]}]}}}}
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "doomed"},
           "spec": {"backoffLimit": 1, "template": {"spec": {
               "restartPolicy": "Never", "containers": [{"name": "c", "image": IMAGE,
                                                         "command": ["python", "-c", "raise SystemExit(1)"]}]}}}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([ok, bad]), namespace=namespace)
    cluster.kubectl("wait", "--for=condition=Complete", "job/count", "--timeout=60s", namespace=namespace,
                    timeout=70)
    job = cluster.kubectl_json("get", "job", "count", namespace=namespace)
    assert job["status"]["succeeded"] == 2 and job["status"].get("completionTime")
    assert "counted" in cluster.kubectl("logs", "job/count", namespace=namespace).stdout
    cluster.kubectl("wait", "--for=condition=Failed", "job/doomed", "--timeout=60s", namespace=namespace,
                    timeout=70)
    doomed = cluster.kubectl_json("get", "job", "doomed", namespace=namespace)
    assert doomed["status"]["failed"] == 2
    failed = {c["type"]: c for c in doomed["status"]["conditions"]}["Failed"]
    assert failed["reason"] == "BackoffLimitExceeded"
    table = cluster.kubectl("get", "jobs", namespace=namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]


def test_gpu_pods_see_only_their_devices(cluster, namespace, local_node):
    show = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    pods = [_pod("gpu", show, restartPolicy="Never", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}}),
            _pod("cpu", show, restartPolicy="Never")]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(pods), namespace=namespace)
    for name in ("gpu", "cpu"):
        _phase(cluster, namespace, name, "Succeeded")
    assert cluster.kubectl("logs", "gpu", namespace=namespace).stdout.strip() == "'0'"
    assert cluster.kubectl("logs", "cpu", namespace=namespace).stdout.strip() == "''"
