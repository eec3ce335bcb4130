"""The bookkeeping around the pure autoscaler and tuner: one scrape in, status, events and overrides out.

Pure (no I/O, `now` passed in). Everything the policies must remember between passes -- the window of
observations, the autoscaler's recommendations and panic deadline, the tuner's cooldown and baseline --
lives in the PagedModel's status (status.autoscaler, status.tuning), so an operator restart neither
scales twice nor forgets a cooldown. The conditions it owns: MetricsAvailable, ScalingActive,
ScalingLimited.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .autoscaler import AutoscalerState, AutoscalingPolicy, ScaleDecision, decide, trim
from .scrape import PodScrape
from .observation import Observation
from .status import condition
from .tuner import TunerState, TuningPolicy, tune

HISTORY_LENGTH = 10            # status.scaleHistory entries kept
MAX_WINDOW_ENTRIES = 240       # bounds status size whatever the interval
STALE_AFTER_INTERVALS = 3      # no successful scrape for this many intervals: the data is stale
OWN_CONDITIONS = ("MetricsAvailable", "ScalingActive", "ScalingLimited")


@dataclass(frozen=True)
class ScrapeResult:
    """What this pass's scrape saw (None when no scrape was due this pass)."""

    ready: int                          # ready engine pods asked
    scrapes: list[PodScrape]
    observation: Observation | None     # None when no engine answered
    failed_routers: list[str] = field(default_factory=list)   # router pods whose queue could not be read


@dataclass
class ScalingOutcome:
    desired_replicas: int | None        # None: the autoscaler does not set the count (off, external HPA)
    tuned: dict[str, Any]               # engine overrides to apply (the tuner's annotation)
    status: dict[str, Any] = field(default_factory=dict)     # status fields to set
    conditions: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)   # (type, reason, message)
    decision: ScaleDecision | None = None          # the autoscaler's, when it ran this pass
    tuner_actions: list[str] = field(default_factory=list)   # "proposed", "applied", "reverted" this pass


def epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_window(status: dict[str, Any]) -> list[Observation]:
    out = []
    for raw in ((status.get("autoscaler") or {}).get("window") or []):
        try:
            out.append(Observation.from_json(raw))
        except (ValueError, TypeError, KeyError):
            continue            # one garbled entry must not discard the rest
    return sorted(out, key=lambda o: o.time)


def scrape_due(spec: dict[str, Any], status: dict[str, Any], now: float) -> bool:
    """Scrape on spec.autoscaling.intervalSeconds, whatever the refresh cadence of the operator."""
    window = load_window(status)
    last = window[-1].time if window else epoch((status.get("metrics") or {}).get("scrapedAt"))
    return last is None or now - last >= 0.95 * spec["autoscaling"]["intervalSeconds"] or now < last


def plan(spec: dict[str, Any], status: dict[str, Any], result: ScrapeResult | None, *, current: int,
         engine: dict[str, Any], tuned: dict[str, Any], now: float, generation: int, rolling_out: bool,
         external_hpa: str | None) -> ScalingOutcome:
    """Fold this pass's scrape into the window, run the autoscaler and the tuner, and say what changed."""
    auto = spec["autoscaling"]
    policy = AutoscalingPolicy.from_spec(auto, startup_timeout_s=spec["probes"]["startupTimeoutSeconds"])
    previous = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
    autoscaler_status = dict(status.get("autoscaler") or {})
    state = AutoscalerState.from_json(autoscaler_status.get("state"))
    window = load_window(status)
    out = ScalingOutcome(desired_replicas=current if auto["enabled"] and not external_hpa else None,
                         tuned=dict(tuned))
    now_iso = iso(now)
    if result is None:
        # No scrape this pass (a spec change, or the interval has not elapsed): decisions are made on fresh
        # data only, so the last ones stand; only their age can change what the conditions say.
        out.conditions = [c for t, c in previous.items() if t in OWN_CONDITIONS]
        last = window[-1].time if window else None
        interval = auto["intervalSeconds"]
        if last is not None and now - last > STALE_AFTER_INTERVALS * interval:
            out.conditions = [c for c in out.conditions if c.get("type") != "MetricsAvailable"]
            out.conditions.append(condition(previous, "MetricsAvailable", False, "Stale",
                                            f"last scrape {int(now - last)} s ago (interval {interval} s)",
                                            generation, now_iso))
        return out

    # ---- metrics: fold the scrape in, decide whether the data can be trusted
    stale_reason = _fold(result, window, current)
    tuning = (TuningPolicy.from_spec(spec["tuning"], spec["engine"], engine["device"])
              if spec["tuning"]["mode"] != "Off" else None)
    keep_s = max(policy.window_s(), tuning.window_s() if tuning else 0.0)
    window = [o for o in window if o.time >= now - keep_s][-MAX_WINDOW_ENTRIES:]
    available = stale_reason is None
    if available:
        metrics_reason, metrics_message = "Scraped", _scraped_message(result)
    else:
        metrics_reason, metrics_message = stale_reason
    out.conditions.append(condition(previous, "MetricsAvailable", available, metrics_reason, metrics_message,
                                    generation, now_iso))
    if not available and (previous.get("MetricsAvailable") or {}).get("status") != "False" and window:
        out.events.append(("Warning", "MetricsStale", f"{metrics_message}; scaling decisions frozen"))

    # ---- autoscaler
    decision = None
    if external_hpa:
        out.conditions.append(condition(previous, "ScalingActive", False, "ExternalAutoscaler",
                                        f"HorizontalPodAutoscaler {external_hpa} scales this PagedModel through "
                                        "spec.replicas; the built-in autoscaler is off", generation, now_iso))
    elif not auto["enabled"]:
        out.conditions.append(condition(previous, "ScalingActive", False, "Disabled",
                                        f"spec.autoscaling.enabled is false; spec.replicas ({spec['replicas']}) applies",
                                        generation, now_iso))
    else:
        decision = decide(policy, trim(window, policy, now), current, state, now, stale=not available)
        out.decision = decision
        out.desired_replicas = decision.desired
        state = decision.state
        active_reason = "Frozen" if decision.frozen else ("Panic" if decision.panic else "Scaling")
        out.conditions.append(condition(previous, "ScalingActive", not decision.frozen, active_reason,
                                        decision.reason, generation, now_iso))
        out.conditions.append(condition(previous, "ScalingLimited", decision.limited is not None,
                                        "Clamped" if decision.limited else "WithinRange",
                                        decision.limited or f"{decision.desired} replica(s) within "
                                        f"[{policy.min_replicas}, {policy.max_replicas}]", generation, now_iso))
        if decision.desired != current:
            change = {"time": now_iso, "from": current, "to": decision.desired, "reason": decision.reason}
            out.status["lastScale"] = change
            out.status["scaleHistory"] = ([*(status.get("scaleHistory") or [])][-(HISTORY_LENGTH - 1):] + [change])
            kind = "ScaledUp" if decision.desired > current else "ScaledDown"
            out.events.append(("Normal", kind, f"{current} -> {decision.desired} engine replicas: {decision.reason}"))
    if not auto["enabled"] or external_hpa:
        out.conditions.append(condition(previous, "ScalingLimited", False, "Disabled",
                                        "the built-in autoscaler is off", generation, now_iso))

    # ---- tuner
    tuning_status = _tune(tuning, status, window, engine, out, now, rolling_out,
                          panicking=bool(decision and decision.panic))
    if tuning_status is not None:
        out.status["tuning"] = tuning_status
    out.status["autoscaler"] = {"window": [o.to_json() for o in window], "state": state.to_json()}
    return out


def _fold(result: ScrapeResult, window: list[Observation], current: int) -> tuple[str, str] | None:
    """Append this pass's observation; (reason, message) when the data is not fit to decide on."""
    failed = [s for s in result.scrapes if s.sample is None]
    detail = "; ".join(f"pod {s.pod}: {s.error}" for s in failed[:3]) + (
        f"; {len(failed) - 3} more" if len(failed) > 3 else "")
    if result.ready == 0:
        if current == 0 and result.observation is not None:
            window.append(result.observation)     # scaled to zero: the router's queue is the whole signal
            return None
        return "NoReadyEngines", "no ready engine pod to scrape"
    if result.observation is None or result.observation.engines == 0:
        return "ScrapeFailed", f"no engine answered /metrics ({detail})"
    window.append(result.observation)
    if 2 * result.observation.engines < result.ready:
        return "PartialScrape", f"only {result.observation.engines} of {result.ready} ready engines answered ({detail})"
    return None


def _scraped_message(result: ScrapeResult) -> str:
    assert result.observation is not None
    if result.ready == 0:
        return f"no engine; {result.observation.waiting} request(s) queued at the router"
    failed = [s.pod for s in result.scrapes if s.sample is None]
    text = f"{result.observation.engines}/{result.ready} ready engines answered"
    return text + (f" (no answer from {', '.join(failed)})" if failed else "")


def _tune(policy: TuningPolicy | None, status: dict[str, Any], window: list[Observation], engine: dict[str, Any],
          out: ScalingOutcome, now: float, rolling_out: bool, panicking: bool) -> dict[str, Any] | None:
    """status.tuning for this pass; `policy` None: tuning is Off (its state is kept for when it comes back)."""
    old = dict(status.get("tuning") or {})
    if policy is None:
        return {"mode": "Off", "state": old.get("state")} if old.get("state") else None
    mode = policy.mode
    state = TunerState.from_json(old.get("state"))
    d = tune(policy, window, engine, state, now, rolling_out=rolling_out, panicking=panicking)
    rec = dict(d.recommendation)
    new = {"mode": mode, "recommendation": rec, "reason": d.reason, "held": d.held or "", "state": d.state.to_json()}
    changed_rec = rec and rec != (old.get("recommendation") or {})
    if rec and d.apply:         # a revert is applied only when allowed now, like any change
        out.tuned.update(rec)
        verb = "reverting" if d.revert else "applying"
        out.tuner_actions += ["proposed"] * bool(changed_rec) + ["reverted" if d.revert else "applied"]
        new["lastApplied"] = {"time": iso(now), "change": rec, "reason": d.reason, "revert": d.revert}
        out.events.append(("Normal", "EngineArgsChanged", f"tuner {verb} {_fmt(rec)}: {d.reason}"))
    elif changed_rec:
        out.tuner_actions.append("proposed")
        held = f" (not applied: {d.held})" if d.held else ""
        out.events.append(("Normal", "EngineArgsRecommended", f"{_fmt(rec)}: {d.reason}{held}"))
    if "lastApplied" in old and "lastApplied" not in new:
        new["lastApplied"] = old["lastApplied"]
    return new


def _fmt(change: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(change.items()))
