"""One reconcile pass of a PagedModel: validate, apply children, read them back, compute and write status.

It does I/O only through `Kube` (kube_client.py) and returns the status it wrote and the events to post,
so kopf's handlers stay thin and the pass runs in tests against a fake. Never raises for a bad spec:
that becomes phase Failed with an InvalidSpec event.

A pass computes the defaulted spec, its model source and the engine's effective flags once and passes them
down (`Resolved`); the engine's flags are computed again only when the tuner changed its overrides in the
pass. Status has one channel, `Kube.patch_status`: the autoscaler's decision ahead of the resize, then what
changed at the end of the pass.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from . import names
from .adapter_plan import adapter_status
from .adapters import adapter_claims, desired_adapters, lora_enabled
from .engine_adapters import AdapterAPI, sync_pods
from .kube_client import Kube
from .scrape import EngineSample, Fetch, aggregate, observe, parse_router_metrics, ready_pods, router_totals, scrape
from .desired_state import Observed, Resolved, desired_state, effective_engine, engine_replicas, service_url
from .pass_report import PassReport, pass_report
from .scaling import ScalingOutcome, ScrapeResult, epoch, plan, scrape_due
from .spec import ModelSource, parse_source, validate, with_defaults
from .status import compute_status, condition


@dataclass(frozen=True)
class Event:
    type: str          # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    status: dict[str, Any]                                        # the whole status; its changes are written
    events: list[Event] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)    # to set on the PagedModel (tuner overrides)
    report: PassReport = field(default_factory=PassReport)      # what the operator's metrics count


@dataclass
class Memory:
    """What one operator process keeps between passes that need not survive it: per-pod counter
    baselines (a restart loses one interval of counter increments, nothing else)."""

    baselines: dict[str, dict[str, EngineSample]] = field(default_factory=dict)    # PagedModel uid -> pod -> sample


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def observed_from(pm: dict[str, Any], router_enabled: bool, bind_host: str = "0.0.0.0") -> Observed:
    """What the desired state depends on besides the spec: tuner overrides and the autoscaler's count."""
    meta, status = pm.get("metadata") or {}, pm.get("status") or {}
    tuned: dict[str, Any] = {}
    raw = (meta.get("annotations") or {}).get(names.ANNOTATION_TUNED)
    if raw:
        try:
            parsed = json.loads(raw)
            tuned = parsed if isinstance(parsed, dict) else {}
        except ValueError:
            tuned = {}     # a garbled annotation must not stop serving; the spec alone still applies
    auto = ((pm.get("spec") or {}).get("autoscaling") or {}).get("enabled")
    replicas = status.get("desiredReplicas") if auto else None
    return Observed(engine_replicas=replicas if isinstance(replicas, int) else None, tuned=tuned,
                    router_enabled=router_enabled, bind_host=bind_host)


def missing_dependencies(kube: Kube, namespace: str, spec: dict[str, Any], source: ModelSource) -> list[str]:
    """Objects the spec names that do not exist: the pods could never start, so say which."""
    missing = []
    if source.scheme == "pvc" and not kube.exists(namespace, "persistentvolumeclaims", source.name):
        missing.append(f"PersistentVolumeClaim {source.name!r} (spec.model.source) not found")
    for claim in adapter_claims(spec):
        if not kube.exists(namespace, "persistentvolumeclaims", claim):
            missing.append(f"PersistentVolumeClaim {claim!r} (spec.adapters) not found")
    for secret in spec.get("imagePullSecrets") or []:
        if not kube.exists(namespace, "secrets", secret):
            missing.append(f"Secret {secret!r} (spec.imagePullSecrets) not found")
    return missing


def _engine_change(previous: dict[str, Any] | None, engine: dict[str, Any]) -> str:
    before = {}
    if previous:
        try:
            before = json.loads((previous.get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_ENGINE)
                                or "{}")
        except ValueError:
            before = {}
    changes = [f"{k} {before.get(k)!r} -> {engine.get(k)!r}" for k in sorted(set(before) | set(engine))
               if before.get(k) != engine.get(k)]
    return ", ".join(changes)


def _invalid(pm: dict[str, Any], errors: list[str], selector: str, now: str) -> Outcome:
    """A spec that breaks a rule: phase Failed, nothing applied, one InvalidSpec event per new message."""
    old_status = pm.get("status") or {}
    status = compute_status(pm, desired_replicas=0, selector=selector, url="", engine=None,
                            deployment=None, pods=[], invalid=errors, now=now)
    events = []
    if old_status.get("message") != status["message"] or old_status.get("phase") != "Failed":
        events.append(Event("Warning", "InvalidSpec", status["message"]))
    return Outcome(status, events, report=PassReport(error_kind="invalid_spec"))


def _scrape_pass(kube: Kube, pm: dict[str, Any], pods: list[dict[str, Any]], observed: Observed, fetch: Fetch,
                 memory: Memory, clock: float) -> ScrapeResult:
    """The ready engines' metrics (and the routers' queue) folded into one observation."""
    meta = pm["metadata"]
    model, namespace, key = meta["name"], meta["namespace"], meta.get("uid", meta["name"])
    ready = ready_pods(pods)
    scrapes = scrape(ready, names.ENGINE_PORT, fetch)
    queue, arrival_rate, routers_read, failed_routers = None, 0.0, 0, []
    if observed.router_enabled:
        routers = ready_pods(kube.pods(namespace, names.selector_string(model, names.ROUTER)))
        router_scrapes = scrape(routers, names.ENGINE_PORT, fetch, parse=parse_router_metrics)
        queue, arrival_rate, routers_read = router_totals(router_scrapes)
        failed_routers = [r.pod for r in router_scrapes if r.sample is None]
    observation, memory.baselines[key] = observe(scrapes, memory.baselines.get(key, {}), clock, router_queue=queue,
                                                 arrival_rate=arrival_rate, routers=routers_read)
    return ScrapeResult(len(ready), scrapes, observation, failed_routers=failed_routers)


def _apply(kube: Kube, pm: dict[str, Any], observed: Observed, resolved: Resolved, events: list[Event]) -> None:
    """Server-side apply the desired state; say what was created or updated (and why the engines roll)."""
    model = pm["metadata"]["name"]
    applied = [kube.apply(m) for m in desired_state(pm, observed, resolved)]
    created = [f"{a.kind}/{a.name}" for a in applied if a.action == "created"]
    updated = [a for a in applied if a.action == "updated"]
    if created:
        events.append(Event("Normal", "Created", "created " + ", ".join(created)))
    if updated:
        events.append(Event("Normal", "Updated", "updated " + ", ".join(f"{a.kind}/{a.name}" for a in updated)))
    tuner_said = any(e.reason == "EngineArgsChanged" for e in events)
    for a in updated:
        if a.kind == "Deployment" and a.name == names.engine_name(model) and not tuner_said:
            change = _engine_change(a.previous, resolved.engine)
            if change:
                events.append(Event("Normal", "EngineArgsChanged", f"rolling engines: {change}"))


def _carry_status(status: dict[str, Any], old_status: dict[str, Any], scaling: ScalingOutcome,
                  result: ScrapeResult | None, now: str) -> None:
    """The scaling pass's status fields, what it did not touch this pass, and status.metrics."""
    status["conditions"] += scaling.conditions
    status.update(scaling.status)
    for key in ("lastScale", "scaleHistory", "autoscaler", "tuning"):
        if key not in status and key in old_status:
            status[key] = old_status[key]
    if result is not None:
        samples = [s.sample for s in result.scrapes if s.sample is not None]
        metrics = aggregate(samples, old_status.get("metrics"), now)
        if metrics is not None:
            status["metrics"] = metrics
    elif old_status.get("metrics"):
        stale = any(c["type"] == "MetricsAvailable" and c["status"] == "False" for c in scaling.conditions)
        status["metrics"] = {**old_status["metrics"], "stale": stale or bool(old_status["metrics"].get("stale"))}


def _sync_adapters(spec: dict[str, Any], pm: dict[str, Any], pods: list[dict[str, Any]], api: AdapterAPI | None,
                   status: dict[str, Any], events: list[Event], now: str) -> None:
    """Load and unload spec.adapters on every ready engine that runs with --enable-lora (pods of an older
    template without it are left to the rollout), then report per adapter. Without LoRA the adapter
    fields are cleared (None: the handler's merge patch deletes them)."""
    if not lora_enabled(spec):
        status.update({k: None for k in ("adapters", "adaptersReady") if k in (pm.get("status") or {})})
        return
    if api is None:
        return
    lora_pods = [p for p in pods if "--enable-lora" in _engine_args(p)]
    desired = desired_adapters(spec)
    report = adapter_status(desired, sync_pods(api, ready_pods(lora_pods), desired), pm.get("status") or {})
    status.update(report.status)
    previous = {c.get("type"): c for c in (pm.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}
    ok, reason, message = report.condition
    status["conditions"].append(condition(previous, "AdaptersReady", ok, reason, message,
                                          int(pm["metadata"].get("generation") or 0), now))
    events += [Event(e.type, e.reason, e.message) for e in report.events]


def _engine_args(pod: dict[str, Any]) -> list[str]:
    containers = (pod.get("spec") or {}).get("containers") or []
    return list((containers[0].get("args") or []) if containers else [])


def reconcile(kube: Kube, pm: dict[str, Any], *, router_enabled: bool, now: str | None = None,
              fetch: Fetch | None = None, bind_host: str = "0.0.0.0", memory: Memory | None = None,
              clock: float | None = None, adapters: AdapterAPI | None = None) -> Outcome:
    """One pass, its status changes written. With `fetch` (URL -> text) the ready engines are scraped when
    spec.autoscaling.intervalSeconds has passed since the last scrape, and the autoscaler and tuner decide on
    the fresh observation. With `adapters` (the engines' adapter API) spec.adapters is loaded into every ready
    engine."""
    clock = clock if clock is not None else (epoch(now) if now else time.time())
    outcome = _pass(kube, pm, router_enabled=router_enabled, now=now or now_iso(), fetch=fetch,
                    bind_host=bind_host, memory=memory if memory is not None else Memory(), clock=clock,
                    adapters=adapters)
    _write_status(kube, pm, outcome.status)
    return outcome


def _write_status(kube: Kube, pm: dict[str, Any], status: dict[str, Any]) -> None:
    """The fields that differ from the status the pass started from, as one merge patch (None deletes)."""
    old = pm.get("status") or {}
    changed = {k: v for k, v in status.items() if old.get(k) != v}
    if changed:
        kube.patch_status(pm["metadata"]["namespace"], pm["metadata"]["name"], changed)


def _pass(kube: Kube, pm: dict[str, Any], *, router_enabled: bool, now: str, fetch: Fetch | None, bind_host: str,
          memory: Memory, clock: float, adapters: AdapterAPI | None) -> Outcome:
    """The pass itself; reconcile() writes the status it returns."""
    meta = pm["metadata"]
    model, namespace = meta["name"], meta["namespace"]
    old_status = pm.get("status") or {}
    selector = names.selector_string(model, names.ENGINE)
    spec = with_defaults(pm.get("spec"))
    errors = [str(e) for e in validate(spec, model)]
    if errors:
        return _invalid(pm, errors, selector, now)

    observed = observed_from(pm, router_enabled, bind_host)
    source = parse_source(spec["model"]["source"])      # validate() accepted it
    blocked = missing_dependencies(kube, namespace, spec, source)
    engine_path = kube.path("Deployment", namespace, names.engine_name(model))
    before = kube.get(engine_path)
    pods = kube.pods(namespace, selector)

    # ---- scrape, autoscale, tune: decide the replica count and overrides before applying the children
    result = None
    if fetch is not None and scrape_due(spec, old_status, clock):
        result = _scrape_pass(kube, pm, pods, observed, fetch, memory, clock)
    # An HPA matters where it decides the count (autoscaling on) or what the conditions say (a scrape pass).
    external_hpa = (kube.external_autoscaler(namespace, model)
                    if spec["autoscaling"]["enabled"] or result is not None else None)
    observed = replace(observed, external_autoscaler=external_hpa is not None)
    current = engine_replicas(spec, observed)
    engine = effective_engine(spec, observed)
    scaling = plan(spec, old_status, result, current=current, engine=engine,
                   tuned=observed.tuned, now=clock, generation=int(meta.get("generation") or 0),
                   rolling_out=_rolling_out(before), external_hpa=external_hpa)
    annotations, old_tuned = {}, observed.tuned
    if scaling.tuned != observed.tuned:
        annotations[names.ANNOTATION_TUNED] = json.dumps(scaling.tuned, sort_keys=True)
    observed = replace(observed, tuned=scaling.tuned, engine_replicas=(
        scaling.desired_replicas if scaling.desired_replicas is not None else observed.engine_replicas))
    events = [Event(*e) for e in scaling.events]
    if scaling.desired_replicas is not None and scaling.desired_replicas != current:
        _record_scale(kube, meta, scaling)

    if scaling.tuned != old_tuned:
        engine = effective_engine(spec, observed)      # the tuner's new overrides are new input
    _apply(kube, pm, observed, Resolved(spec, source, engine), events)
    status = compute_status(pm, desired_replicas=engine_replicas(spec, observed), selector=selector,
                            url=service_url(pm, spec), engine={k: v for k, v in sorted(engine.items())},
                            deployment=kube.get(engine_path), pods=pods, blocked=blocked, now=now)
    _carry_status(status, old_status, scaling, result, now)
    _sync_adapters(spec, pm, pods, adapters, status, events, now)
    if blocked and (old_status.get("message") != status["message"]):
        events.append(Event("Warning", "MissingDependency", status["message"]))
    if old_status.get("phase") != status["phase"] and not blocked:
        kind = "Warning" if status["phase"] in ("Degraded", "Failed") else "Normal"
        events.append(Event(kind, status["phase"], status["message"]))
    return Outcome(status, events, annotations, report=pass_report(spec, status, scaling, result, current))


def _record_scale(kube: Kube, meta: dict[str, Any], scaling: ScalingOutcome) -> None:
    """Write the autoscaler's decision to status before the Deployment is resized. An operator killed between
    the two then restarts from the decision (desiredReplicas, lastScale, the cooldown in status.autoscaler) and
    finishes it; the other order would leave the Deployment resized while status still holds the old count,
    and the restart's first pass (no scrape) would resize it back: a flap, then a second scale-up event."""
    fields = {"desiredReplicas": scaling.desired_replicas}
    fields.update({k: v for k, v in scaling.status.items() if k in ("lastScale", "scaleHistory", "autoscaler")})
    kube.patch_status(meta["namespace"], meta["name"], fields)


def _rolling_out(deployment: dict[str, Any] | None) -> bool:
    """The engine Deployment is still converging on its template or replica count."""
    if deployment is None:
        return True
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    want = int(spec.get("replicas") or 0)
    return (int(st.get("observedGeneration") or 0) < int((deployment.get("metadata") or {}).get("generation") or 0)
            or int(st.get("updatedReplicas") or 0) < want or int(st.get("readyReplicas") or 0) < want
            or int(st.get("replicas") or 0) > want)
