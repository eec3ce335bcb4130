"""WATCH through the `kubernetes` client: event types, selectors, bookmarks, initial events, 410 Gone."""
from __future__ import annotations

import threading
import time

import pytest
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException


def _cm(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "data": {}}


def _collect(stream, stop_after: int, timeout: float = 20) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    for event in stream:
        obj = event["object"]
        name = obj.metadata.name if hasattr(obj, "metadata") and obj.metadata is not None else ""
        seen.append((event["type"], name))
        if len(seen) >= stop_after or time.monotonic() > deadline:
            break
    return seen


def test_watch_from_resource_version_sees_added_modified_deleted(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    rv = core.list_namespaced_config_map(namespace).metadata.resource_version

    def writer():
        time.sleep(0.3)
        core.create_namespaced_config_map(namespace, _cm("w1", app="x"))
        core.patch_namespaced_config_map("w1", namespace, {"data": {"k": "v"}})
        core.delete_namespaced_config_map("w1", namespace)

    threading.Thread(target=writer, daemon=True).start()
    w = watch.Watch()
    events = _collect(w.stream(core.list_namespaced_config_map, namespace, resource_version=rv,
                               timeout_seconds=10), 3)
    w.stop()
    assert events == [("ADDED", "w1"), ("MODIFIED", "w1"), ("DELETED", "w1")]


def test_label_selector_watch_sees_objects_enter_and_leave(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    rv = core.list_namespaced_config_map(namespace).metadata.resource_version
    core.create_namespaced_config_map(namespace, _cm("sel", tier="other"))
    core.patch_namespaced_config_map("sel", namespace, {"metadata": {"labels": {"tier": "web"}}})
    core.patch_namespaced_config_map("sel", namespace, {"metadata": {"labels": {"tier": "db"}}})
    w = watch.Watch()
    events = _collect(w.stream(core.list_namespaced_config_map, namespace, resource_version=rv,
                               label_selector="tier=web", timeout_seconds=3), 2)
    w.stop()
    assert events == [("ADDED", "sel"), ("DELETED", "sel")]


def test_initial_events_end_with_annotated_bookmark(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    core.create_namespaced_config_map(namespace, _cm("i1"))
    core.create_namespaced_config_map(namespace, _cm("i2"))
    w = watch.Watch()
    seen = []
    for event in w.stream(core.list_namespaced_config_map, namespace, send_initial_events=True,
                          resource_version_match="NotOlderThan", allow_watch_bookmarks=True, timeout_seconds=10):
        seen.append(event)
        if event["type"] == "BOOKMARK":
            break
    w.stop()
    added = sorted(e["object"].metadata.name for e in seen if e["type"] == "ADDED")
    assert {"i1", "i2"} <= set(added)
    bookmark = seen[-1]
    assert bookmark["type"] == "BOOKMARK"
    annotations = bookmark["raw_object"]["metadata"].get("annotations") or {}
    assert annotations.get("k8s.io/initial-events-end") == "true"


def test_periodic_bookmarks_carry_progress(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    rv = core.list_namespaced_config_map(namespace).metadata.resource_version
    w = watch.Watch()
    start = time.monotonic()
    bookmark = None
    for event in w.stream(core.list_namespaced_config_map, namespace, resource_version=rv,
                          allow_watch_bookmarks=True, timeout_seconds=90):
        if event["type"] == "BOOKMARK":
            bookmark = event
            break
    w.stop()
    assert bookmark is not None and time.monotonic() - start < 90
    assert int(bookmark["raw_object"]["metadata"]["resourceVersion"]) >= int(rv)


def test_timeout_seconds_ends_the_stream(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    rv = core.list_namespaced_config_map(namespace).metadata.resource_version
    start = time.monotonic()
    events = list(watch.Watch().stream(core.list_namespaced_config_map, namespace, resource_version=rv,
                                       timeout_seconds=1, _request_timeout=30))
    assert events == [] and time.monotonic() - start < 10


def test_expired_resource_version_is_410(cluster, api_client, namespace, local_only):
    core = k8s.CoreV1Api(api_client)
    old_rv = core.create_namespaced_config_map(namespace, _cm("old")).metadata.resource_version
    core.create_namespaced_config_map(namespace, _cm("new"))
    cluster.local.call(cluster.local.api.store.compact)   # what etcd compaction does to history
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(core.list_namespaced_config_map, namespace, resource_version=old_rv,
                                      timeout_seconds=5):
            pass
    assert gone.value.status == 410
