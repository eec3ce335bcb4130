"""status.py: phase and conditions follow the engine Deployment and pods; transition times move only on flips."""
from __future__ import annotations

from typing import Any

from pagedmodel.operator.status import compute_status, pod_problems

from pm_factory import make_pm

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(replicas: int = 1, ready: int = 1, updated: int = 1, spec_replicas: int = 1,
               generation: int = 1, observed: int = 1) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": spec_replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated}}


def pod(name: str, ready: bool = True, **status: Any) -> dict[str, Any]:
    conds = status.pop("conditions", [{"type": "Ready", "status": "True" if ready else "False"}])
    return {"metadata": {"name": name}, "status": {"phase": "Running", "conditions": conds, **status}}


def crashing(name: str) -> dict[str, Any]:
    return pod(name, ready=False, containerStatuses=[{
        "name": "engine", "ready": False, "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 8s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1}}}])


def unschedulable(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]}}


def status_of(pm=None, desired: int = 1, dep=None, pods=(), now: str = T0, **kw: Any) -> dict[str, Any]:
    return compute_status(pm or make_pm(), desired_replicas=desired, selector="s", url="u", engine={"maxNumSeqs": 4},
                          deployment=dep, pods=list(pods), now=now, **kw)


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_ready_when_every_desired_engine_is_ready_and_updated():
    s = status_of(dep=deployment(), pods=[pod("a")])
    assert s["phase"] == "Ready" and s["ready"] == "1/1" and s["readyReplicas"] == 1
    assert [c["type"] for c in s["conditions"]] == ["Ready", "Available", "Progressing", "Degraded"]
    assert [c["status"] for c in s["conditions"]] == ["True", "True", "False", "False"]
    assert s["observedGeneration"] == 1 and s["engine"] == {"maxNumSeqs": 4}


def test_pending_before_the_deployment_exists():
    s = status_of(dep=None)
    assert s["phase"] == "Pending" and cond(s, "Ready")["reason"] == "Creating"


def test_unschedulable_pod_is_progressing_with_the_schedulers_reason():
    s = status_of(dep=deployment(ready=0), pods=[unschedulable("a")])
    assert s["phase"] == "Progressing"
    assert "pod a: Unschedulable (0/1 nodes are available: 1 Insufficient nvidia.com/gpu.)" in s["message"]
    assert cond(s, "Progressing")["status"] == "True" and cond(s, "Degraded")["status"] == "False"


def test_crash_looping_pod_is_degraded_even_while_others_serve():
    s = status_of(desired=2, dep=deployment(replicas=2, ready=1, updated=2, spec_replicas=2),
                  pods=[pod("a"), crashing("b")])
    assert s["phase"] == "Degraded" and cond(s, "Degraded")["reason"] == "CrashLoopBackOff"
    assert "pod b: CrashLoopBackOff (back-off 8s restarting failed container)" in s["message"]
    assert cond(s, "Available")["status"] == "True"       # one engine still answers


def test_rollout_in_progress_is_progressing_not_ready():
    # New generation not yet observed by the Deployment controller.
    s = status_of(dep=deployment(generation=2, observed=1), pods=[pod("a")])
    assert s["phase"] == "Progressing" and cond(s, "Progressing")["reason"] == "RollingOut"
    # Surge pod exists: 2 pods for 1 desired.
    s = status_of(dep=deployment(replicas=2, ready=1, updated=1), pods=[pod("a"), pod("b", ready=False)])
    assert s["phase"] == "Progressing"


def test_scaled_to_zero_is_pending():
    s = status_of(desired=0, dep=deployment(replicas=0, ready=0, updated=0, spec_replicas=0))
    assert s["phase"] == "Pending" and cond(s, "Ready")["reason"] == "ScaledToZero"


def test_invalid_spec_is_failed_and_names_the_field():
    s = status_of(dep=None, invalid=["spec.autoscaling.minReplicas: minReplicas (5) must not exceed maxReplicas (2)"])
    assert s["phase"] == "Failed" and cond(s, "Ready")["reason"] == "InvalidSpec"
    assert "spec.autoscaling.minReplicas" in s["message"] and cond(s, "Degraded")["status"] == "True"


def test_missing_dependency_is_failed_with_the_object_named():
    s = status_of(dep=deployment(ready=0), pods=[], blocked=["PersistentVolumeClaim 'w' (spec.model.source) not found"])
    assert s["phase"] == "Failed" and cond(s, "Ready")["reason"] == "MissingDependency" and "'w'" in s["message"]


def test_transition_time_moves_only_when_status_flips():
    first = status_of(dep=deployment(ready=0), pods=[pod("a", ready=False)], now=T0)
    same = status_of(pm=make_pm(status=first), dep=deployment(ready=0), pods=[pod("a", ready=False)], now=T1)
    assert [c["lastTransitionTime"] for c in same["conditions"]] == [T0] * 4
    flipped = status_of(pm=make_pm(status=same), dep=deployment(), pods=[pod("a")], now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": T1, "Available": T1, "Progressing": T1, "Degraded": T0}


def test_pods_failing_alike_are_named_in_one_clause():
    s = status_of(desired=3, dep=deployment(replicas=3, ready=0, updated=3, spec_replicas=3),
                  pods=[unschedulable("a"), unschedulable("b"), pod("c", ready=False)])
    assert s["message"] == ("0/3 engines ready, 3 updated; pods a, b: Unschedulable "
                            "(0/1 nodes are available: 1 Insufficient nvidia.com/gpu.)")


def test_status_is_a_pure_function():
    args = dict(dep=deployment(), pods=[pod("a")])
    assert status_of(**args) == status_of(**args)


def test_pod_problems_ignore_ready_and_terminating_pods_and_rank_fatal_first():
    terminating = crashing("z")
    terminating["metadata"]["deletionTimestamp"] = T0
    problems = pod_problems([pod("ok"), unschedulable("a"), crashing("b"), terminating])
    assert [(p.pod, p.reason, p.fatal) for p in problems] == [("b", "CrashLoopBackOff", True),
                                                               ("a", "Unschedulable", False)]


def failed_start(name: str, message: str, restarts: int = 1, waiting: str = "CrashLoopBackOff") -> dict[str, Any]:
    return pod(name, ready=False, containerStatuses=[{
        "name": "engine", "ready": False, "restartCount": restarts,
        "state": {"waiting": {"reason": waiting, "message": f"back-off {10 * restarts}s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": message}}}])


LOG_TAIL = ("2026-01-01 00:00:01 INFO pagedmodel: loading\n"
            "pagedmodel serve: error: cannot load the model: /models/x/model.safetensors is corrupt\n\n")


def test_a_crashing_engine_is_explained_by_the_last_line_it_printed():
    """Guards: the engine's one-line startup error (its termination message, the tail of its log under
    FallbackToLogsOnError) is what status.message, the Degraded condition and so `kubectl describe pm` show,
    not the kubelet's back-off note, which changes every restart."""
    s = status_of(dep=deployment(ready=0), pods=[failed_start("a", LOG_TAIL)])
    assert s["phase"] == "Degraded"
    want = ("pod a: CrashLoopBackOff (exit code 2: pagedmodel serve: error: cannot load the model: "
            "/models/x/model.safetensors is corrupt)")
    assert s["message"] == want and cond(s, "Degraded")["message"] == want
    # The next restarts say the same: one clause for many pods, and a message that does not flap.
    again = status_of(desired=2, dep=deployment(replicas=2, ready=0, spec_replicas=2),
                      pods=[failed_start("a", LOG_TAIL, restarts=3), failed_start("b", LOG_TAIL, restarts=5)])
    assert again["message"] == want.replace("pod a", "pods a, b")


def test_restarting_engine_names_its_last_words_and_long_ones_are_cut():
    s = status_of(dep=deployment(ready=0), pods=[failed_start("a", "x" * 5000, waiting="ContainerCreating")])
    assert s["phase"] == "Progressing"
    assert "pod a: Restarting (1 restarts, last exit code 2: " in s["message"]
    assert len(s["message"]) < 600 and s["message"].endswith("...)")


def test_without_a_termination_message_the_exit_code_or_back_off_is_said():
    quiet = failed_start("a", "")
    s = status_of(dep=deployment(ready=0), pods=[quiet])
    assert s["message"] == "pod a: CrashLoopBackOff (back-off 10s restarting failed container)"
    clean = failed_start("b", "bye", waiting="ContainerCreating")
    clean["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = 0   # a clean exit says nothing
    assert status_of(dep=deployment(ready=0), pods=[clean])["message"].endswith(
        "pod b: Restarting (1 restarts, last exit code 0)")
