"""The scaling pass through reconcile.reconcile: scrapes become status, conditions, events, replica counts
and tuner overrides; the state it needs survives a restart because it lives in status."""
from __future__ import annotations

import json
from typing import Any, Callable

from pagedmodel.operator import names
from pagedmodel.operator.reconcile import Memory, reconcile
from pagedmodel.operator.scaling import iso

from pm_factory import make_pm
from test_reconcile import FakeKube

T0 = 1_800_000_000.0
AUTO = {"model": {"source": "builtin://smollm2"}, "engine": {"maxNumSeqs": 4, "device": "cpu"},
        "resources": {"gpus": 0},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetKVCacheUsage": 0.5,
                        "targetWaitingPerReplica": 2, "intervalSeconds": 10, "scaleDownStabilizationSeconds": 30}}
ENGINE_DEPLOYMENT = f"/apis/apps/v1/namespaces/ml/deployments/{names.engine_name('smollm2')}"


def metrics_text(kv: float, waiting: int, running: int, preemptions: int = 0, finished: int = 0,
                 prompt: int = 0, generation: int = 0, max_num_seqs: int = 4, block_size: int = 128) -> str:
    lbl = '{model_name="smollm2"}'
    return "\n".join([
        f"vllm:kv_cache_usage_perc{lbl} {kv}", f"vllm:num_requests_waiting{lbl} {waiting}",
        f"vllm:num_requests_running{lbl} {running}", f"pagedmodel:max_num_seqs{lbl} {max_num_seqs}",
        f"pagedmodel:block_size{lbl} {block_size}", "# TYPE vllm:num_preemptions counter",
        f"vllm:num_preemptions_total{lbl} {preemptions}", "# TYPE vllm:request_prompt_tokens histogram",
        f'vllm:request_prompt_tokens_bucket{{le="+Inf",model_name="smollm2"}} {finished}',
        f"vllm:request_prompt_tokens_count{lbl} {finished}", f"vllm:request_prompt_tokens_sum{lbl} {prompt}",
        "# TYPE vllm:request_generation_tokens histogram",
        f'vllm:request_generation_tokens_bucket{{le="+Inf",model_name="smollm2"}} {finished}',
        f"vllm:request_generation_tokens_count{lbl} {finished}",
        f"vllm:request_generation_tokens_sum{lbl} {generation}", ""])


class OperatorKilled(Exception):
    pass


class ClusterSim:
    """A FakeKube whose engine Deployment's pods all turn ready at once, each answering `load()`."""

    def __init__(self, spec: dict[str, Any], hpas: list[dict[str, Any]] | None = None, router: bool = False) -> None:
        self.hpas = hpas or []
        self.router = router
        sim = self

        class Kube(FakeKube):
            def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
                component = "router" if "component=router" in label_selector else "engine"
                dep = self.store.get(ENGINE_DEPLOYMENT.replace("-engine", f"-{component}"))
                n = dep["spec"]["replicas"] if dep else 0
                net = "10.0.0" if component == "engine" else "10.0.9"
                return [{"metadata": {"name": f"{component}-{i}"},
                         "status": {"podIP": f"{net}.{i + 1}", "phase": "Running",
                                    "conditions": [{"type": "Ready", "status": "True"}]}} for i in range(n)]

            def _call(self, method: str, path: str, body: Any = None, query: Any = None,
                      content_type: str = "application/json") -> Any:
                if method == "GET" and path.endswith("/horizontalpodautoscalers"):
                    return {"items": sim.hpas}
                if sim.killed_before_resize and method == "PATCH" and path == ENGINE_DEPLOYMENT and \
                        body["spec"]["replicas"] != self.store[path]["spec"]["replicas"]:
                    raise OperatorKilled       # SIGKILL between the pass's status write and the resize
                out = super()._call(method, path, body, query, content_type)
                if method == "PATCH" and path == ENGINE_DEPLOYMENT:    # the Deployment controller, instantly
                    r = out["spec"]["replicas"]
                    self.store[path]["status"] = {"observedGeneration": 1, "replicas": r, "readyReplicas": r,
                                                  "updatedReplicas": r, "availableReplicas": r}
                    self.store[path]["metadata"]["generation"] = 1
                return out

        self.killed_before_resize = False
        self.kube = Kube()
        self.memory = Memory()
        self.pm = make_pm(spec)
        self.events: list[tuple[str, str]] = []
        self.load: Callable[[str], str] = lambda url: metrics_text(0.2, 0, 1)
        self.step(T0 - 1, scrape=False)      # the create event: children applied, no pod ready before it

    def step(self, t: float, scrape: bool = True) -> dict[str, Any]:
        out = reconcile(self.kube, self.pm, router_enabled=self.router, now=iso(t), clock=t,
                        fetch=self.load if scrape else None, memory=self.memory)
        self.pm["status"] = out.status
        self.pm["metadata"]["annotations"].update(out.annotations)
        self.events += [(e.reason, e.message) for e in out.events]
        return out.status

    def replicas(self) -> int:
        return self.kube.store[ENGINE_DEPLOYMENT]["spec"]["replicas"]


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_high_kv_usage_scales_the_engine_deployment_and_says_why():
    sim = ClusterSim(AUTO)
    st = sim.step(T0)
    assert sim.replicas() == 1 and conditions(st)["MetricsAvailable"]["status"] == "True"
    assert conditions(st)["ScalingActive"]["status"] == "True"
    sim.load = lambda url: metrics_text(0.95, 6, 4)
    for i in range(1, 4):
        st = sim.step(T0 + 10 * i)
    assert sim.replicas() >= 2 and st["desiredReplicas"] == sim.replicas()
    assert st["scaleHistory"][0]["from"] == 1 and st["scaleHistory"][0]["to"] >= 2 and st["lastScale"]["reason"]
    assert st["scaleHistory"][-1] == st["lastScale"] and st["lastScale"]["to"] == sim.replicas()
    up = [m for r, m in sim.events if r == "ScaledUp"]
    assert up and up[0].startswith("1 -> ")
    assert st["metrics"]["kvCachePercent"] == 95 and st["metrics"]["engines"] >= 1


def test_max_replicas_binds_and_scaling_limited_says_so():
    sim = ClusterSim(AUTO)
    sim.load = lambda url: metrics_text(1.0, 40, 4)
    for i in range(8):
        st = sim.step(T0 + 10 * i)
    assert sim.replicas() == 3
    limited = conditions(st)["ScalingLimited"]
    assert limited["status"] == "True" and "3" in limited["message"]


def test_failed_scrapes_freeze_scaling_and_warn_once():
    sim = ClusterSim(AUTO)
    sim.step(T0)

    def down(url: str) -> str:
        raise ConnectionError("connection refused")
    sim.load = down
    for i in range(1, 5):
        st = sim.step(T0 + 10 * i)
    cond = conditions(st)["MetricsAvailable"]
    assert cond["status"] == "False" and cond["reason"] == "ScrapeFailed" and "connection refused" in cond["message"]
    assert [r for r, _ in sim.events].count("MetricsStale") == 1
    assert st["metrics"]["stale"] is True and sim.replicas() == 1
    assert conditions(st)["ScalingActive"]["status"] == "False"
    sim.load = lambda url: metrics_text(0.2, 0, 1)
    st = sim.step(T0 + 50)
    assert conditions(st)["MetricsAvailable"]["status"] == "True" and st["metrics"]["stale"] is False


def test_scrapes_follow_the_interval_not_every_refresh():
    sim = ClusterSim(AUTO)
    asked: list[str] = []
    sim.load = lambda url: asked.append(url) or metrics_text(0.2, 0, 1)
    for t in (0, 1, 2, 5, 9.4, 9.6, 12, 19.9):
        sim.step(T0 + t)
    # due at 0, then once >= 0.95 x 10 s later: 9.6 and 19.9
    assert len(asked) == 3
    assert len(sim.pm["status"]["autoscaler"]["window"]) == 3


def test_an_operator_restart_does_not_scale_twice():
    sim = ClusterSim(AUTO)
    sim.load = lambda url: metrics_text(0.95, 6, 4)
    for i in range(4):
        sim.step(T0 + 10 * i)
    scaled = sim.replicas()
    ups = [r for r, _ in sim.events].count("ScaledUp")
    # New process: no memory, same status. The engines now carry the load comfortably.
    sim.memory = Memory()
    sim.load = lambda url: metrics_text(0.5, 0, 3)
    for i in range(4, 7):
        sim.step(T0 + 10 * i)
    assert sim.replicas() == scaled and [r for r, _ in sim.events].count("ScaledUp") == ups
    # and the scale-down stabilization it had begun still applies (30 s of low load before it may shrink)
    assert "ScaledDown" not in [r for r, _ in sim.events]


def test_an_operator_killed_between_deciding_and_resizing_finishes_the_scale_up_once():
    """Guards: an operator SIGKILLed mid scale-up (decision made, Deployment not yet resized) restarts from the
    decision it wrote to status first: the restart's first pass (no scrape) resizes the Deployment to it, no
    second ScaledUp, and the cooldown (status.autoscaler.state.lastScaleTime) is the one decided before the kill."""
    sim = ClusterSim(AUTO)
    sim.load = lambda url: metrics_text(0.95, 6, 4)
    sim.killed_before_resize = True
    t = T0
    while True:
        sim.kube.status_patches.clear()      # every pass writes status: keep the killed pass's writes only
        try:
            sim.step(t)
        except OperatorKilled:
            break
        t += 10
        assert t < T0 + 100, "the load never asked for a scale-up"
    assert sim.replicas() == 1 and len(sim.kube.status_patches) == 1
    written = sim.kube.status_patches[0]
    assert written["desiredReplicas"] >= 2 and written["lastScale"]["to"] == written["desiredReplicas"]
    # What the API server holds after the kill: the last full status plus the decision written ahead.
    sim.pm["status"] = {**sim.pm["status"], **written}
    sim.killed_before_resize, sim.memory = False, Memory()
    st = sim.step(t + 1, scrape=False)                           # kopf's resume handler on the new process
    assert sim.replicas() == written["desiredReplicas"] == st["desiredReplicas"]
    sim.load = lambda url: metrics_text(0.5, 0, 3)               # the engines now carry the load
    for i in range(1, 4):
        st = sim.step(t + 10 * i)
    # Not decided twice: no scaling event after the restart (the killed pass's ScaledUp died with it; the
    # decision's record is status.lastScale and scaleHistory).
    assert not {"ScaledUp", "ScaledDown"} & {r for r, _ in sim.events}
    assert st["scaleHistory"] == [written["lastScale"]] and st["lastScale"] == written["lastScale"]
    assert st["autoscaler"]["state"]["lastScaleTime"] == written["autoscaler"]["state"]["lastScaleTime"]


def test_an_hpa_on_the_pagedmodel_turns_the_autoscaler_off():
    hpa = {"metadata": {"name": "by-hand"},
           "spec": {"scaleTargetRef": {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "name": "smollm2"}}}
    sim = ClusterSim({**AUTO, "replicas": 2}, hpas=[hpa])      # spec.replicas: what the HPA wrote
    sim.load = lambda url: metrics_text(1.0, 40, 4)
    for i in range(4):
        st = sim.step(T0 + 10 * i)
    active = conditions(st)["ScalingActive"]
    assert active["status"] == "False" and active["reason"] == "ExternalAutoscaler" and "by-hand" in active["message"]
    assert sim.replicas() == 2 and st["desiredReplicas"] == 2 and "ScaledUp" not in [r for r, _ in sim.events]
    sim.pm["spec"]["replicas"] = 3                              # the HPA scales through the scale subresource
    sim.step(T0 + 41, scrape=False)
    assert sim.replicas() == 3


def test_a_model_scaled_to_zero_comes_back_when_requests_queue_at_the_router():
    sim = ClusterSim({**AUTO, "autoscaling": {**AUTO["autoscaling"], "minReplicas": 0}}, router=True)
    queued = {"n": 0}

    def load(url: str) -> str:
        assert "10.0.9." in url, "no engine exists to be scraped"
        return f"# TYPE pagedmodel_router_queue_length gauge\npagedmodel_router_queue_length {queued['n']}\n"
    sim.load = load
    st = sim.step(T0)
    assert sim.replicas() == 0 and conditions(st)["MetricsAvailable"]["status"] == "True"
    assert conditions(st)["ScalingActive"]["status"] == "False"          # nothing to decide on
    queued["n"] = 3
    st = sim.step(T0 + 10)
    assert sim.replicas() == 1 and st["lastScale"]["reason"].startswith("3 requests queued at the router")
    assert ("ScaledUp", "0 -> 1 engine replicas: 3 requests queued at the router with no engine: 0 -> 1") in sim.events


def test_the_router_queue_counts_as_waiting():
    sim = ClusterSim(AUTO, router=True)

    def load(url: str) -> str:
        if "10.0.9." in url:
            return "pagedmodel_router_queue_length 30\n"
        return metrics_text(0.3, 0, 4)          # engines look calm: the router holds the overflow
    sim.load = load
    for i in range(4):
        st = sim.step(T0 + 10 * i)
    assert sim.replicas() >= 2 and "waiting" in st["scaleHistory"][0]["reason"], st.get("scaleHistory")


def test_autoscaling_off_reports_disabled():
    sim = ClusterSim({**AUTO, "autoscaling": {"enabled": False}, "replicas": 2})
    sim.load = lambda url: metrics_text(1.0, 40, 4)
    st = sim.step(T0)
    assert sim.replicas() == 2 and conditions(st)["ScalingActive"]["reason"] == "Disabled"
    assert conditions(st)["ScalingLimited"]["status"] == "False"


def _tuning_load(step: int) -> Callable[[str], str]:
    """Slots, not memory, are the bottleneck: all 4 slots busy, KV mostly free, requests waiting; long requests."""
    finished = 40 * step
    return lambda url: metrics_text(0.2, 6, 4, finished=finished, prompt=1800 * finished, generation=200 * finished)


def test_recommend_mode_proposes_without_applying_and_says_so_once():
    spec = {**AUTO, "autoscaling": {"enabled": False}, "tuning": {"mode": "Recommend"}}
    sim = ClusterSim(spec)
    for i in range(12):
        sim.load = _tuning_load(i)
        st = sim.step(T0 + 10 * i)
    rec = st["tuning"]["recommendation"]
    assert rec.get("maxNumSeqs", 4) > 4 or rec.get("blockSize", 128) != 128, st["tuning"]
    assert st["tuning"]["held"], st["tuning"]
    recommended = [m for r, m in sim.events if r == "EngineArgsRecommended"]
    assert 1 <= len(recommended) <= 2, recommended          # once per distinct proposal, not every pass
    assert names.ANNOTATION_TUNED not in sim.pm["metadata"]["annotations"]
    dep = sim.kube.store[ENGINE_DEPLOYMENT]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "4"


def test_auto_mode_applies_through_the_annotation_and_rolls_the_engines():
    spec = {**AUTO, "autoscaling": {"enabled": False}, "tuning": {"mode": "Auto", "cooldownSeconds": 600}}
    sim = ClusterSim(spec)
    for i in range(12):
        sim.load = _tuning_load(i)
        sim.step(T0 + 10 * i)
    tuned = json.loads(sim.pm["metadata"]["annotations"][names.ANNOTATION_TUNED])
    assert tuned, sim.pm["status"]["tuning"]
    dep = sim.kube.store[ENGINE_DEPLOYMENT]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    for field, flag in (("maxNumSeqs", "--max-num-seqs"), ("blockSize", "--block-size")):
        if field in tuned:
            assert args[args.index(flag) + 1] == str(tuned[field])
    changed = [m for r, m in sim.events if r == "EngineArgsChanged"]
    assert changed and changed[0].startswith("tuner applying"), sim.events
    assert sim.pm["status"]["tuning"]["lastApplied"]["change"]
    assert sim.pm["status"]["engine"] == {**sim.pm["status"]["engine"], **tuned}
