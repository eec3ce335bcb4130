"""kopf wiring, kept thin: every trigger runs the same reconcile pass (reconcile.py).

create/update/resume react at once to spec changes and operator restarts; a timer re-runs the pass so
status follows the children (pods becoming ready, crash loops, rollouts) without watching them.
Children carry owner references, so deleting them is the garbage collector's job; no delete handler
exists. kopf does put its own finalizer on each PagedModel, because it stops a resource's timer before
letting it go: with the operator running, a deletion completes within a second or so (the timer is
polled every CANCELLATION_POLL_S, not kopf's default minute); with the operator stopped it waits for it
(or for `kubectl patch pm NAME --type=merge -p '{"metadata":{"finalizers":null}}'`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from . import names
from .engine_adapters import HTTPAdapterAPI
from .kube_client import Kube
from .reconcile import Memory, reconcile
from .scrape import http_fetch
from .telemetry import OperatorMetrics


RETRY_BACKOFF_S = 5.0
CANCELLATION_POLL_S = 1.0     # how often kopf checks that a deleted PagedModel's timer has stopped


@dataclass
class OperatorConfig:
    status_interval_s: float = 5.0
    router: str = "auto"            # auto (= enabled: the router ships in the same image) | enabled | disabled
    bind: str = "all"               # all: pods listen on 0.0.0.0 | pod-ip: on $(POD_IP) only


def _api_client() -> k8s.ApiClient:
    try:
        k8s_config.load_incluster_config()
        return k8s.ApiClient()
    except k8s_config.ConfigException:
        return k8s_config.new_client_from_config()   # $KUBECONFIG or ~/.kube/config


def register(registry: kopf.OperatorRegistry, cfg: OperatorConfig, metrics: OperatorMetrics | None = None) -> None:
    """Attach the PagedModel handlers to `registry` (a fresh one per operator run); each pass is counted
    in `metrics` when given."""
    state: dict[str, Any] = {}
    memory = Memory()
    adapter_api = HTTPAdapterAPI()
    if cfg.router not in ("auto", "enabled", "disabled"):
        raise ValueError(f"router must be auto, enabled or disabled, not {cfg.router!r}")
    router_enabled = cfg.router != "disabled"

    bind_host = {"all": "0.0.0.0", "pod-ip": "$(POD_IP)"}[cfg.bind]

    def kube() -> Kube:
        if "kube" not in state:
            state["kube"] = Kube(_api_client())
        return state["kube"]

    def startup(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
        # Progress and diff-base in annotations: the CRD's structural schema would prune a status.kopf field.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration")
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 60
        # A timer caught mid-pass by a deletion is re-checked after this long; kopf's default (60 s) makes
        # `kubectl delete pm` wait a minute whenever a pass was running.
        settings.background.cancellation_polling = CANCELLATION_POLL_S
        logger.info("router %s", "enabled" if router_enabled else "disabled: the Service selects the engines")

    def run_pass(body: Any, patch: kopf.Patch, logger: logging.Logger, scrape: bool) -> None:
        pm = {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
              "status": dict(body.get("status") or {})}
        started = time.monotonic()
        try:
            outcome = reconcile(kube(), _plain(pm), router_enabled=router_enabled,
                                fetch=http_fetch if scrape else None, bind_host=bind_host, memory=memory,
                                adapters=adapter_api)
        except Exception as exc:     # counted, then kopf retries the handler after its backoff
            if metrics is not None:
                metrics.record(pm["metadata"].get("namespace", ""), pm["metadata"].get("name", ""),
                               time.monotonic() - started, None, exc)
            raise
        if metrics is not None:
            metrics.record(pm["metadata"]["namespace"], pm["metadata"]["name"], time.monotonic() - started,
                           outcome.report)
        for key, value in outcome.annotations.items():
            patch.metadata.annotations[key] = value
        for event in outcome.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
            logger.info("%s: %s", event.reason, event.message)
        # status is not patched here: reconcile wrote it through Kube.patch_status, its one channel

    def on_change(body: Any, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
        run_pass(body, patch, logger, scrape=False)     # react fast; the timer scrapes

    def on_timer(body: Any, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
        run_pass(body, patch, logger, scrape=True)

    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A fresh registry has none of kopf's default login handlers: in-cluster first, then $KUBECONFIG.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(startup)
    resource = (names.GROUP, names.VERSION, names.PLURAL)
    # API errors (a 409 from a concurrent writer, a flaky connection) retry soon, not after kopf's default minute.
    kopf.on.create(*resource, registry=registry, id="create", backoff=RETRY_BACKOFF_S)(on_change)
    kopf.on.update(*resource, registry=registry, id="update", field="spec", backoff=RETRY_BACKOFF_S)(on_change)
    kopf.on.resume(*resource, registry=registry, id="resume", backoff=RETRY_BACKOFF_S)(on_change)
    kopf.timer(*resource, registry=registry, id="status", interval=cfg.status_interval_s,
               initial_delay=cfg.status_interval_s)(on_timer)


def _plain(value: Any) -> Any:
    """kopf's bodies are mapping views; the pure code wants plain dicts and lists."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
