"""reconcile() with spec.adapters against the in-memory API and in-memory engines: adapters reach every ready
LoRA engine, later additions and removals go through the engines' API without touching the Deployment, a
restarted engine gets them back, and a load failure is a Warning, a status message and a condition that
clears once a later pass succeeds. Plus the HTTP client against an HTTP server speaking the engine's shapes."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pagedmodel.operator.engine_adapters import AdapterCallError, HTTPAdapterAPI, sync_pod
from pagedmodel.operator.adapters import Adapter
from pagedmodel.operator.reconcile import reconcile

from pm_factory import make_pm
from test_reconcile import FakeKube

DEPLOYMENT = "/apis/apps/v1/namespaces/ml/deployments/smollm2-engine"
SPEC = {"model": {"source": "builtin://smollm2", "servedName": "smollm2"}, "engine": {"device": "cpu"},
        "resources": {"gpus": 0}, "replicas": 2,
        "adapters": [{"name": "sql", "source": "pvc://adapters/sql"}, {"name": "chat", "source": "file:///opt/chat"}]}


class FakeEngines:
    """AdapterAPI over in-memory engines keyed by IP; `broken` paths fail to load as the engine would."""

    def __init__(self, ips: list[str]) -> None:
        self.loaded: dict[str, dict[str, str]] = {ip: {} for ip in ips}
        self.broken: dict[str, str] = {}
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []

    def listed(self, ip: str) -> dict[str, str]:
        if ip in self.down:
            raise AdapterCallError("GET /v1/models: ConnectError: refused")
        return dict(self.loaded[ip])

    def load(self, ip: str, name: str, path: str) -> None:
        self.calls.append(("load", ip, name))
        if path in self.broken:
            raise AdapterCallError(f"HTTP 400: {self.broken[path]}")
        self.loaded[ip][name] = path

    def unload(self, ip: str, name: str) -> None:
        self.calls.append(("unload", ip, name))
        self.loaded[ip].pop(name)


def pod(name: str, ip: str, ready: bool = True, lora: bool = True) -> dict[str, Any]:
    args = ["--model", "smollm2"] + (["--enable-lora", "--max-loras", "4"] if lora else [])
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "engine", "args": args}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class PodsKube(FakeKube):
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        super().__init__(existing={"persistentvolumeclaims/adapters"})
        self.pod_list = pods

    def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.pod_list


def run(kube, engines, spec, status=None, generation=1):
    return reconcile(kube, make_pm(spec, status=status, generation=generation), router_enabled=False,
                     adapters=engines, now="2026-12-02T10:00:00Z")


def adapters_condition(out):
    return next(c for c in out.status["conditions"] if c["type"] == "AdaptersReady")


def test_adapters_reach_every_ready_lora_engine_and_only_those():
    kube = PodsKube([pod("e-1", "10.0.0.1"), pod("e-2", "10.0.0.2"), pod("e-3", "10.0.0.3", ready=False),
                     pod("old", "10.0.0.4", lora=False)])
    engines = FakeEngines(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"])
    out = run(kube, engines, SPEC)
    want = {"sql": "/adapters/adapters/sql", "chat": "/opt/chat"}
    assert engines.loaded == {"10.0.0.1": want, "10.0.0.2": want, "10.0.0.3": {}, "10.0.0.4": {}}
    assert out.status["adaptersReady"] == "2/2"
    assert [a["readyReplicas"] for a in out.status["adapters"]] == [2, 2]
    assert adapters_condition(out)["status"] == "True"
    assert {(e.reason, e.message) for e in out.events} >= {("AdapterLoaded", "adapter sql loaded on e-1, e-2"),
                                                           ("AdapterLoaded", "adapter chat loaded on e-1, e-2")}
    engines.calls.clear()
    again = run(kube, engines, SPEC, status=out.status)
    assert engines.calls == [] and not [e for e in again.events if e.reason.startswith("Adapter")]


def test_adding_and_removing_adapters_never_rewrites_the_deployment():
    kube = PodsKube([pod("e-1", "10.0.0.1"), pod("e-2", "10.0.0.2")])
    engines = FakeEngines(["10.0.0.1", "10.0.0.2"])
    first = run(kube, engines, SPEC)
    template = kube.store[DEPLOYMENT]["spec"]["template"]
    kube.writes.clear()
    three = {**SPEC, "adapters": SPEC["adapters"] + [{"name": "math", "source": "pvc://adapters/math"}]}
    out = run(kube, engines, three, status=first.status, generation=2)
    assert kube.writes == [] and kube.store[DEPLOYMENT]["spec"]["template"] == template
    assert all(e["math"] == "/adapters/adapters/math" for e in engines.loaded.values())
    assert out.status["adaptersReady"] == "3/3"
    assert ("AdapterLoaded", "adapter math loaded on e-1, e-2") in {(e.reason, e.message) for e in out.events}
    only_math = {**SPEC, "adapters": [{"name": "math", "source": "pvc://adapters/math"}]}
    out = run(kube, engines, only_math, status=out.status, generation=3)
    assert kube.writes == [] and all(set(e) == {"math"} for e in engines.loaded.values())
    assert out.status["adaptersReady"] == "1/1"
    assert ("AdapterUnloaded", "adapter chat unloaded from e-1, e-2") in {(e.reason, e.message) for e in out.events}


def test_a_restarted_engine_gets_its_adapters_back():
    kube = PodsKube([pod("e-1", "10.0.0.1")])
    engines = FakeEngines(["10.0.0.1"])
    first = run(kube, engines, SPEC)
    engines.loaded["10.0.0.1"] = {}                  # the container restarted: it starts without adapters
    out = run(kube, engines, SPEC, status=first.status)
    assert set(engines.loaded["10.0.0.1"]) == {"sql", "chat"} and out.status["adaptersReady"] == "2/2"


def test_a_load_failure_warns_once_reports_and_is_retried_until_it_loads():
    kube = PodsKube([pod("e-1", "10.0.0.1"), pod("e-2", "10.0.0.2")])
    engines = FakeEngines(["10.0.0.1", "10.0.0.2"])
    engines.broken["/opt/chat"] = "LoRA adapter path '/opt/chat' is not a directory"
    first = run(kube, engines, SPEC)
    warnings = [e for e in first.events if e.type == "Warning"]
    assert [e.reason for e in warnings] == ["AdapterLoadFailed"]
    assert warnings[0].message == ("adapter chat: load failed on e-1, e-2: HTTP 400: LoRA adapter path "
                                   "'/opt/chat' is not a directory")
    chat = first.status["adapters"][1]
    assert chat["readyReplicas"] == 0 and "is not a directory" in chat["message"]
    cond = adapters_condition(first)
    assert (cond["status"], cond["reason"]) == ("False", "LoadFailed")
    assert first.status["phase"] != "Degraded"        # the base model and sql still serve
    second = run(kube, engines, SPEC, status=first.status)
    assert not [e for e in second.events if e.type == "Warning"]            # same message: no new Warning
    assert engines.calls.count(("load", "10.0.0.1", "chat")) == 2            # but it was retried
    del engines.broken["/opt/chat"]                                          # the directory appears
    third = run(kube, engines, SPEC, status=second.status)
    assert third.status["adaptersReady"] == "2/2" and third.status["adapters"][1]["message"] == ""
    assert adapters_condition(third)["status"] == "True"


def test_an_unreachable_engine_is_named_not_counted():
    kube = PodsKube([pod("e-1", "10.0.0.1"), pod("e-2", "10.0.0.2")])
    engines = FakeEngines(["10.0.0.1", "10.0.0.2"])
    engines.down.add("10.0.0.2")
    out = run(kube, engines, SPEC)
    assert [a["readyReplicas"] for a in out.status["adapters"]] == [1, 1]
    assert out.status["adapters"][0]["message"].startswith("not confirmed on e-2")
    assert adapters_condition(out)["reason"] == "Loading"


def test_missing_adapter_claim_is_a_missing_dependency():
    kube = PodsKube([])
    kube.existing = set()
    out = run(kube, FakeEngines([]), SPEC)
    assert out.status["phase"] == "Failed"
    assert "PersistentVolumeClaim 'adapters' (spec.adapters) not found" in out.status["message"]


def test_dropping_spec_adapters_clears_the_adapter_status():
    kube = PodsKube([pod("e-1", "10.0.0.1")])
    engines = FakeEngines(["10.0.0.1"])
    first = run(kube, engines, SPEC)
    plain = {k: v for k, v in SPEC.items() if k != "adapters"}
    out = run(kube, engines, plain, status=first.status, generation=2)
    assert out.status["adapters"] is None and out.status["adaptersReady"] is None     # merge patch: delete
    assert not any(c["type"] == "AdaptersReady" for c in out.status["conditions"])
    args = kube.store[DEPLOYMENT]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" not in args


def test_invalid_adapters_fail_the_spec_without_calling_engines():
    engines = FakeEngines(["10.0.0.1"])
    bad = {**SPEC, "adapters": [{"name": "smollm2", "source": "pvc://adapters/sql"}]}
    out = run(PodsKube([pod("e-1", "10.0.0.1")]), engines, bad)
    assert out.status["phase"] == "Failed" and "spec.adapters[0].name" in out.status["message"]
    assert engines.calls == []


# ---- the HTTP client, against a server answering as `pagedmodel serve --enable-lora` does


class EngineLike(BaseHTTPRequestHandler):
    adapters: dict[str, str] = {}

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        cards = [{"id": "smollm2", "object": "model", "root": "/m", "parent": None}] + [
            {"id": n, "object": "model", "root": p, "parent": "smollm2"} for n, p in self.adapters.items()]
        self._send(200, {"object": "list", "data": cards})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["lora_name"]
        if self.path == "/v1/load_lora_adapter":
            if name in self.adapters:
                return self._send(400, {"error": {"message": f"adapter {name!r} is already loaded",
                                                  "type": "BadRequestError", "param": "lora_name", "code": 400}})
            if not body["lora_path"].startswith("/ok"):
                return self._send(400, {"error": {"message": "not a directory", "type": "BadRequestError",
                                                  "param": "lora_path", "code": 400}})
            self.adapters[name] = body["lora_path"]
            return self._send(200, f"Success: LoRA adapter '{name}' added successfully.")
        if name not in self.adapters:
            return self._send(404, {"error": {"message": "cannot be found", "type": "NotFoundError",
                                              "param": "lora_name", "code": 404}})
        del self.adapters[name]
        self._send(200, "Success")


@pytest.fixture
def engine_like():
    EngineLike.adapters = {"stale": "/ok/stale"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), EngineLike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_http_client_lists_loads_unloads_and_reports_engine_errors(engine_like):
    api = HTTPAdapterAPI(port=engine_like)
    assert api.listed("127.0.0.1") == {"stale": "/ok/stale"}           # the base model is not an adapter
    result = sync_pod(api, "e-1", "127.0.0.1", [Adapter("sql", "file:///ok/sql", "/ok/sql"),
                                                Adapter("bad", "file:///nope", "/nope")])
    assert result.unloaded_now == ["stale"] and result.loaded_now == ["sql"] and result.loaded == {"sql"}
    assert result.failures == {"bad": "HTTP 400: not a directory"}
    assert EngineLike.adapters == {"sql": "/ok/sql"}
    api.load("127.0.0.1", "sql", "/ok/sql")       # already loaded (another pass won the race): not an error
    api.unload("127.0.0.1", "gone")              # already unloaded: not an error
    down = HTTPAdapterAPI(port=1)
    with pytest.raises(AdapterCallError, match="GET /v1/models"):
        down.listed("127.0.0.1")
    assert sync_pod(down, "e-2", "127.0.0.1", []).error.startswith("GET /v1/models")
