"""kubectl 1.37 against the cluster: apply, get (tables, columns, yaml, -w), describe, delete, wait, create."""
from __future__ import annotations

import base64
import json
import re
import time
from datetime import datetime, timezone

import yaml
from kubernetes import client as k8s

from .helpers import wait_until

GROUP = "e2e.pagedmodel.io"


def _deployment(image: str = "busybox:1.36", env_value: str = "1") -> str:
    return yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "app", "labels": {"app": "app"}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "app"}},
                 "template": {"metadata": {"labels": {"app": "app"}}, "spec": {"containers": [{
                     "name": "main", "image": image, "command": ["sleep", "3600"],
                     "env": [{"name": "A", "value": env_value}, {"name": "B", "value": "b"}]}]}}}})


def test_apply_creates_then_updates_with_strategic_merge(cluster, namespace):
    out = cluster.kubectl("apply", "-f", "-", stdin=_deployment(), namespace=namespace).stdout
    assert "deployment.apps/app created" in out
    again = cluster.kubectl("apply", "-f", "-", stdin=_deployment(), namespace=namespace).stdout
    assert "deployment.apps/app unchanged" in again
    manifest = yaml.safe_load(_deployment(image="busybox:1.37", env_value="2"))
    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "2"}]
    changed = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest), namespace=namespace).stdout
    assert "deployment.apps/app configured" in changed
    live = cluster.kubectl_json("get", "deployment", "app", namespace=namespace)
    container = live["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "busybox:1.37" and container["env"] == [{"name": "A", "value": "2"}]
    assert live["metadata"]["generation"] == 2
    assert "kubectl.kubernetes.io/last-applied-configuration" in live["metadata"]["annotations"]


def test_apply_rejects_unknown_fields_of_builtin_kinds(cluster, namespace):
    manifest = yaml.safe_load(_deployment())
    manifest["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    rejected = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest), namespace=namespace, check=False)
    assert rejected.returncode != 0
    assert 'strict decoding error: unknown field "spec.template.spec.containers[0].imagePullPolicyy"' \
        in rejected.stderr
    lenient = cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest),
                              namespace=namespace)
    assert "deployment.apps/app created" in lenient.stdout
    stored = cluster.kubectl_json("get", "deployment", "app", namespace=namespace)
    assert "imagePullPolicyy" not in stored["spec"]["template"]["spec"]["containers"][0]


def test_get_prints_tables_and_yaml(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", stdin=_deployment(), namespace=namespace)
    table = cluster.kubectl("get", "deployments", namespace=namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert table[1].split()[:4] == ["app", "0/0", "0", "0"]
    wide = cluster.kubectl("get", "deploy", "-o", "wide", namespace=namespace).stdout.splitlines()[0].split()
    assert wide[-2:] == ["CONTAINERS", "IMAGES"]
    doc = yaml.safe_load(cluster.kubectl("get", "deploy", "app", "-o", "yaml", namespace=namespace).stdout)
    assert doc["kind"] == "Deployment" and doc["metadata"]["namespace"] == namespace
    names = cluster.kubectl("get", "all", "-o", "name", namespace=namespace).stdout.split()
    assert "deployment.apps/app" in names


def test_custom_resources_through_kubectl(cluster, namespace, widget_crd):
    good = yaml.safe_dump({"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "gear"},
                           "spec": {"size": 4}})
    assert "widget.e2e.pagedmodel.io/gear created" in cluster.kubectl("apply", "-f", "-", stdin=good,
                                                                      namespace=namespace).stdout
    table = cluster.kubectl("get", "wdg", namespace=namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "COLOR", "READY", "AGE"]
    assert table[1].split()[:3] == ["gear", "4", "red"]
    bad = yaml.safe_dump({"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "broken"},
                          "spec": {"size": 0, "color": "green"}})
    rejected = cluster.kubectl("apply", "-f", "-", stdin=bad, namespace=namespace, check=False)
    assert rejected.returncode != 0
    assert 'The Widget "broken" is invalid' in rejected.stderr
    assert "spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1" in rejected.stderr
    assert 'spec.color: Unsupported value: "green": supported values: "red", "blue"' in rejected.stderr
    unknown = yaml.safe_dump({"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "odd"},
                              "spec": {"size": 1, "wheels": 3}})
    strict = cluster.kubectl("apply", "-f", "-", stdin=unknown, namespace=namespace, check=False)
    assert strict.returncode != 0 and 'unknown field "spec.wheels"' in strict.stderr
    cluster.kubectl("scale", "widget/gear", "--replicas=3", namespace=namespace)
    assert cluster.kubectl_json("get", "widget", "gear", namespace=namespace)["spec"]["replicas"] == 3


def test_get_watch_streams_changes(cluster, namespace):
    with cluster.kubectl_stream("get", "configmaps", "-w", "--output-watch-events", namespace=namespace) as proc:
        time.sleep(1.0)
        cluster.kubectl("create", "configmap", "watched", "--from-literal=k=v", namespace=namespace)
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "watched" in line:
                break
        assert any(line.split()[:2] == ["ADDED", "watched"] for line in lines), lines


def test_describe_shows_events(cluster, api_client, namespace, widget_crd):
    custom = k8s.CustomObjectsApi(api_client)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    widget = custom.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", {
        "apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "noted"}, "spec": {"size": 2}})
    k8s.CoreV1Api(api_client).create_namespaced_event(namespace, {
        "metadata": {"generateName": "noted."}, "type": "Warning", "reason": "TooSmall",
        "message": "size 2 is below the comfortable minimum", "source": {"component": "e2e"},
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        "involvedObject": {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": "noted", "namespace": namespace,
                           "uid": widget["metadata"]["uid"]}})
    out = cluster.kubectl("describe", "widget", "noted", namespace=namespace).stdout
    assert re.search(r"^Name:\s+noted$", out, re.M) and re.search(r"^\s+Size:\s+2$", out, re.M)
    events = out.split("Events:")[1]
    assert re.search(r"Warning\s+TooSmall\s+\d+s\s+e2e\s+size 2 is below the comfortable minimum", events), events


def test_delete_waits_for_finalizers(cluster, namespace):
    manifest = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "held", "finalizers": ["e2e.pagedmodel.io/hold"]}}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest), namespace=namespace)
    with cluster.kubectl_stream("delete", "configmap", "held", "--timeout=60s", namespace=namespace) as proc:
        wait_until(lambda: cluster.kubectl_json("get", "configmap", "held", namespace=namespace)["metadata"]
                   .get("deletionTimestamp"), what="deletionTimestamp set by kubectl delete")
        time.sleep(1.0)
        assert proc.poll() is None, "kubectl delete returned before the finalizer was removed"
        cluster.kubectl("patch", "configmap", "held", "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                        namespace=namespace)
        assert proc.wait(timeout=30) == 0
    assert cluster.kubectl("get", "configmap", "held", namespace=namespace, check=False).returncode != 0


def test_wait_for_condition(cluster, api_client, namespace, widget_crd):
    custom = k8s.CustomObjectsApi(api_client)
    custom.create_namespaced_custom_object(GROUP, "v1", namespace, "widgets", {
        "apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "slow"}, "spec": {"size": 1}})
    with cluster.kubectl_stream("wait", "--for=condition=Ready", "widget/slow", "--timeout=60s",
                                namespace=namespace) as proc:
        time.sleep(1.0)
        assert proc.poll() is None
        custom.patch_namespaced_custom_object_status(GROUP, "v1", namespace, "widgets", "slow", {
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None and "condition met" in proc.stdout.read()


def test_typed_create_commands(cluster, namespace):
    """kubectl's create generators send protobuf bodies; they must land intact."""
    cluster.kubectl("create", "configmap", "proto", "--from-literal=greeting=hello", namespace=namespace)
    cluster.kubectl("create", "secret", "generic", "creds", "--from-literal=token=s3cr3t", namespace=namespace)
    cm = cluster.kubectl_json("get", "configmap", "proto", namespace=namespace)
    assert cm["data"] == {"greeting": "hello"}
    token = cluster.kubectl("get", "secret", "creds", "-o", "jsonpath={.data.token}", namespace=namespace).stdout
    assert base64.b64decode(token).decode() == "s3cr3t"
    wait_until(lambda: cluster.kubectl("get", "sa", "default", namespace=namespace, check=False).returncode == 0,
               what="default service account")
    assert cluster.kubectl("auth", "can-i", "create", "deployments", namespace=namespace).stdout.strip() == "yes"
    cluster.kubectl("create", "deployment", "gen", "--image=nginx:1.27", "--port=8080", "--replicas=0",
                    namespace=namespace)
    dep = cluster.kubectl_json("get", "deployment", "gen", namespace=namespace)
    assert dep["spec"]["replicas"] == 0 and dep["spec"]["selector"] == {"matchLabels": {"app": "gen"}}
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert (container["image"], container["ports"][0]["containerPort"]) == ("nginx:1.27", 8080)
    cluster.kubectl("create", "service", "clusterip", "gen", "--tcp=80:http", namespace=namespace)
    port = cluster.kubectl_json("get", "service", "gen", namespace=namespace)["spec"]["ports"][0]
    assert (port["port"], port["targetPort"]) == (80, "http")
    cluster.kubectl("create", "role", "reader", "--verb=get,list", "--resource=pods", namespace=namespace)
    rules = cluster.kubectl_json("get", "role", "reader", namespace=namespace)["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
