"""Pure status: the PagedModel's phase and conditions from its engine Deployment and pods.

`compute_status` tells the story `kubectl get/describe pm` shows: how many engines are ready
of how many asked for, whether a rollout is under way, and why not Ready (a crash-looping or
unschedulable pod is named with its reason, a crashing one with the last line it printed before exiting).
lastTransitionTime moves only when a condition's
status flips, as Kubernetes conventions require.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Container waiting reasons that will not resolve by waiting: the model is Degraded until fixed.
BAD_WAITING = frozenset({"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                         "CreateContainerError", "CreateContainerConfigError", "RunContainerError"})
CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded")
MAX_TERMINATION_LINE = 400     # status.message stays readable in `kubectl get -o wide` and describe


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str
    message: str
    fatal: bool          # True: Degraded (crash loop, image); False: still Progressing (unschedulable, starting)

    def __str__(self) -> str:
        return f"pod {self.pod}: {self.reason}" + (f" ({self.message})" if self.message else "")


def termination_line(container_status: dict[str, Any]) -> str:
    """The last line the container said before it exited with an error (its termination message: with the
    engine's `terminationMessagePolicy: FallbackToLogsOnError`, the tail of its log, whose last line is the
    one `pagedmodel serve` prints for a startup failure); "" when it has said nothing or exited cleanly."""
    for state in (container_status.get("state") or {}, container_status.get("lastState") or {}):
        terminated = state.get("terminated") or {}
        if terminated.get("exitCode") == 0:
            continue
        lines = [line.strip() for line in str(terminated.get("message") or "").splitlines() if line.strip()]
        if lines:
            line = lines[-1]
            return line if len(line) <= MAX_TERMINATION_LINE else line[:MAX_TERMINATION_LINE - 3] + "..."
    return ""


def pod_problems(pods: list[dict[str, Any]]) -> list[PodProblem]:
    """What keeps each not-ready engine pod from serving, most severe first."""
    problems: list[PodProblem] = []
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        conds = {c.get("type"): c for c in st.get("conditions") or []}
        if (conds.get("Ready") or {}).get("status") == "True":
            continue
        sched = conds.get("PodScheduled") or {}
        if sched.get("status") == "False":
            problems.append(PodProblem(name, sched.get("reason") or "Unschedulable", sched.get("message") or "", False))
            continue
        if st.get("phase") == "Failed":
            problems.append(PodProblem(name, st.get("reason") or "Failed", st.get("message") or "", True))
            continue
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            last = ((cs.get("lastState") or {}).get("terminated") or {})
            said = termination_line(cs)
            if waiting.get("reason") in BAD_WAITING:
                # The engine's own last words beat the kubelet's back-off note, which changes every restart.
                detail = (f"exit code {last.get('exitCode', '?')}: {said}" if said else waiting.get("message")
                          or (f"last exit code {last['exitCode']}" if "exitCode" in last else ""))
                problems.append(PodProblem(name, waiting["reason"], detail, True))
                break
            if cs.get("restartCount", 0) > 0 and not cs.get("ready"):
                detail = f"{cs['restartCount']} restarts, last exit code {last.get('exitCode', '?')}"
                problems.append(PodProblem(name, "Restarting", detail + (f": {said}" if said else ""),
                                           cs["restartCount"] >= 3))
                break
    problems.sort(key=lambda p: (not p.fatal, p.pod))
    return problems


def describe(problems: list[PodProblem]) -> str:
    """One clause per distinct (reason, detail), naming its pods: many replicas failing alike stay readable."""
    groups: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        groups.setdefault((p.reason, p.message), []).append(p.pod)
    parts = []
    for (reason, message), pods in groups.items():
        who = f"pod {pods[0]}" if len(pods) == 1 else f"pods {', '.join(pods)}"
        parts.append(f"{who}: {reason}" + (f" ({message})" if message else ""))
    return "; ".join(parts)


def condition(previous: dict[str, dict[str, Any]], ctype: str, status: bool, reason: str, message: str,
               generation: int, now: str) -> dict[str, Any]:
    text = "True" if status else "False"
    prev = previous.get(ctype)
    moved = prev is None or prev.get("status") != text or not prev.get("lastTransitionTime")
    return {"type": ctype, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": now if moved else prev["lastTransitionTime"], "observedGeneration": generation}


def compute_status(pm: dict[str, Any], *, desired_replicas: int, selector: str, url: str,
                   engine: dict[str, Any] | None, deployment: dict[str, Any] | None, pods: list[dict[str, Any]],
                   invalid: list[str] | None = None, blocked: list[str] | None = None, now: str) -> dict[str, Any]:
    """The full .status of a PagedModel (without metrics, which the scraper owns).

    invalid: spec errors (phase Failed, nothing deployed); blocked: missing dependencies such as a
    PVC or pull secret (phase Failed, children kept so it recovers once they exist).
    """
    generation = int(pm["metadata"].get("generation") or 0)
    old = pm.get("status") or {}
    previous = {c.get("type"): c for c in old.get("conditions") or [] if isinstance(c, dict)}
    dep_status = (deployment or {}).get("status") or {}
    dep_spec = (deployment or {}).get("spec") or {}
    dep_gen_seen = int(dep_status.get("observedGeneration") or 0) >= int((deployment or {}).get("metadata", {})
                                                                          .get("generation") or 0)
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    live_pods = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    problems = pod_problems(live_pods)
    fatal = [p for p in problems if p.fatal]

    rolled_out = (deployment is not None and dep_gen_seen and int(dep_spec.get("replicas", desired_replicas))
                  == desired_replicas and updated >= desired_replicas and replicas <= desired_replicas)
    all_ready = rolled_out and ready >= desired_replicas

    if invalid:
        phase, reason, message = "Failed", "InvalidSpec", "; ".join(invalid)
    elif blocked:
        phase, reason, message = "Failed", "MissingDependency", "; ".join(blocked)
    elif deployment is None:
        phase, reason, message = "Pending", "Creating", "engine Deployment not created yet"
    elif fatal:
        phase, reason, message = "Degraded", fatal[0].reason, describe(fatal)
    elif desired_replicas == 0:
        phase, reason, message = "Pending", "ScaledToZero", "0 engine replicas requested"
    elif all_ready:
        phase, reason, message = "Ready", "AllReplicasReady", f"{ready}/{desired_replicas} engines ready"
    else:
        detail = describe(problems)
        phase, reason = "Progressing", ("RollingOut" if ready > 0 else "Starting")
        message = f"{ready}/{desired_replicas} engines ready, {updated} updated" + (f"; {detail}" if detail else "")

    available = ready > 0 and not invalid
    progressing = phase in ("Progressing", "Pending") and not invalid and not blocked
    conditions = [
        condition(previous, "Ready", phase == "Ready", reason, message, generation, now),
        condition(previous, "Available", available, "MinimumReplicasAvailable" if available else "NoReadyReplicas",
                   f"{ready} engine(s) serving", generation, now),
        condition(previous, "Progressing", progressing, reason if progressing else "Stable",
                   message if progressing else "no rollout in progress", generation, now),
        condition(previous, "Degraded", phase in ("Degraded", "Failed"),
                   reason if phase in ("Degraded", "Failed") else "AsExpected",
                   message if phase in ("Degraded", "Failed") else "no failing engine pods", generation, now),
    ]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "message": message,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "desiredReplicas": desired_replicas,
        "ready": f"{ready}/{desired_replicas}",
        "selector": selector,
        "url": url,
        "conditions": conditions,
    }
    if engine is not None:
        status["engine"] = engine
    return status
