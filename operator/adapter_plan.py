"""Pure adapter reconciliation: what to load into and unload from one engine, and what the results of a
pass mean for the PagedModel's status, conditions and events.

The I/O (engine_adapters.py) lists each ready engine's adapters, runs `plan_sync`'s calls and hands back
one `PodSync` per engine; `adapter_status` turns those into status.adapters, status.adaptersReady, the
AdaptersReady condition and the events. A failed load is simply still missing on the next pass, so it is
retried then (every status interval) without any bookkeeping here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .adapters import Adapter

MAX_MESSAGE = 300      # an engine's error text, trimmed so status stays readable in describe


@dataclass(frozen=True)
class SyncPlan:
    unload: list[str]            # adapter names, in name order
    load: list[Adapter]          # in spec order


@dataclass
class PodSync:
    """What one pass did on one engine pod and what it holds afterwards."""

    pod: str
    loaded: set[str] = field(default_factory=set)           # names of spec adapters it now serves
    loaded_now: list[str] = field(default_factory=list)
    unloaded_now: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # adapter name -> why it is not loaded
    error: str = ""                                          # the engine could not be listed at all


@dataclass(frozen=True)
class AdapterEvent:
    type: str
    reason: str
    message: str


@dataclass
class AdapterReport:
    status: dict[str, Any]                      # adapters, adaptersReady
    condition: tuple[bool, str, str]            # AdaptersReady: (status, reason, message)
    events: list[AdapterEvent]


def plan_sync(desired: list[Adapter], loaded: dict[str, str]) -> SyncPlan:
    """Calls that make an engine serving `loaded` (name -> path) serve exactly `desired`. An adapter whose
    path changed is unloaded and loaded again; adapters the spec does not list are unloaded."""
    want = {a.name: a for a in desired}
    unload = sorted(n for n, path in loaded.items() if n not in want or want[n].path != path)
    keep = set(loaded) - set(unload)
    return SyncPlan(unload=unload, load=[a for a in desired if a.name not in keep])


def trim(message: str) -> str:
    line = " ".join(message.split())
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "..."


def _adapter_message(adapter: Adapter, results: list[PodSync], ready: int) -> str:
    """Why an adapter is not on every ready engine; "" when it is."""
    if not results:
        return "waiting for a ready engine"
    failed = [(r.pod, r.failures[adapter.name]) for r in results if adapter.name in r.failures]
    if failed:
        pods = ", ".join(p for p, _ in failed)
        return f"load failed on {pods}: {failed[0][1]}"
    unreachable = [r for r in results if r.error]
    if unreachable:     # an engine that does not answer may hold it or not: say so rather than guess
        return f"not confirmed on {', '.join(r.pod for r in unreachable)}: {unreachable[0].error}"
    return "" if ready == len(results) else "loading"


def adapter_status(desired: list[Adapter], results: list[PodSync], old_status: dict[str, Any]) -> AdapterReport:
    """status.adapters (per adapter: on how many ready engines it is loaded, and why not on the others),
    status.adaptersReady ("loaded everywhere/listed", the printer column), the AdaptersReady condition and
    the events: AdapterLoaded/AdapterUnloaded per pass that did something, AdapterLoadFailed (Warning)
    once per distinct message."""
    old_messages = {a.get("name"): a.get("message", "") for a in old_status.get("adapters") or []
                    if isinstance(a, dict)}
    entries, events = [], []
    everywhere = 0
    for adapter in desired:
        ready = sum(1 for r in results if adapter.name in r.loaded)
        message = _adapter_message(adapter, results, ready)
        everywhere += bool(results) and ready == len(results)
        entries.append({"name": adapter.name, "source": adapter.source, "readyReplicas": ready, "message": message})
        if message.startswith("load failed") and old_messages.get(adapter.name) != message:
            events.append(AdapterEvent("Warning", "AdapterLoadFailed", f"adapter {adapter.name}: {message}"))
    events += _action_events(results)
    summary = f"{everywhere}/{len(desired)}"
    return AdapterReport({"adapters": entries, "adaptersReady": summary},
                         _condition(desired, results, entries, everywhere), events)


def _action_events(results: list[PodSync]) -> list[AdapterEvent]:
    loads: dict[str, list[str]] = {}
    unloads: dict[str, list[str]] = {}
    for r in results:
        for name in r.loaded_now:
            loads.setdefault(name, []).append(r.pod)
        for name in r.unloaded_now:
            unloads.setdefault(name, []).append(r.pod)
    return ([AdapterEvent("Normal", "AdapterLoaded", f"adapter {n} loaded on {', '.join(p)}")
             for n, p in sorted(loads.items())] +
            [AdapterEvent("Normal", "AdapterUnloaded", f"adapter {n} unloaded from {', '.join(p)}")
             for n, p in sorted(unloads.items())])


def _condition(desired: list[Adapter], results: list[PodSync], entries: list[dict[str, Any]],
               everywhere: int) -> tuple[bool, str, str]:
    if not desired:
        return True, "NoAdapters", "spec.adapters is empty"
    if not results:
        return False, "NoReadyEngines", "no ready engine to load adapters into"
    if everywhere == len(desired):
        return True, "AllAdaptersLoaded", f"{len(desired)} adapter(s) loaded on {len(results)} ready engine(s)"
    failed = [e for e in entries if e["message"].startswith("load failed")]
    if failed:
        return False, "LoadFailed", "; ".join(f"{e['name']}: {e['message']}" for e in failed)
    pending = [e["name"] for e in entries if e["readyReplicas"] < len(results)]
    return False, "Loading", f"not yet on every ready engine: {', '.join(pending)}"
