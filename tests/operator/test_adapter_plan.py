"""adapter_plan: the per-engine diff and what a pass's results mean for status, the condition and events."""
from __future__ import annotations

from pagedmodel.operator.adapter_plan import PodSync, adapter_status, plan_sync
from pagedmodel.operator.adapters import Adapter

SQL = Adapter("sql", "pvc://a/sql", "/adapters/a/sql")
CHAT = Adapter("chat", "pvc://a/chat", "/adapters/a/chat")


def test_plan_loads_what_is_missing_and_unloads_what_the_spec_dropped():
    plan = plan_sync([SQL, CHAT], {"chat": "/adapters/a/chat", "old": "/x", "zzz": "/y"})
    assert plan.unload == ["old", "zzz"] and plan.load == [SQL]
    assert plan_sync([SQL, CHAT], {}).load == [SQL, CHAT]          # a fresh or restarted engine gets all
    nothing = plan_sync([SQL], {"sql": "/adapters/a/sql"})
    assert nothing.unload == [] and nothing.load == []


def test_a_changed_source_is_unloaded_and_loaded_again():
    plan = plan_sync([SQL], {"sql": "/adapters/a/sql-v1"})
    assert plan.unload == ["sql"] and plan.load == [SQL]


def test_status_counts_replicas_per_adapter_and_summarises_for_the_printer_column():
    results = [PodSync("e-1", loaded={"sql", "chat"}, loaded_now=["chat"]),
               PodSync("e-2", loaded={"sql"}, failures={"chat": "HTTP 400: rank 32 above --max-lora-rank 16"})]
    report = adapter_status([SQL, CHAT], results, {})
    assert report.status["adapters"] == [
        {"name": "sql", "source": "pvc://a/sql", "readyReplicas": 2, "message": ""},
        {"name": "chat", "source": "pvc://a/chat", "readyReplicas": 1,
         "message": "load failed on e-2: HTTP 400: rank 32 above --max-lora-rank 16"}]
    assert report.status["adaptersReady"] == "1/2"
    ok, reason, message = report.condition
    assert (ok, reason) == (False, "LoadFailed") and "rank 32" in message
    assert [(e.type, e.reason, e.message) for e in report.events] == [
        ("Warning", "AdapterLoadFailed",
         "adapter chat: load failed on e-2: HTTP 400: rank 32 above --max-lora-rank 16"),
        ("Normal", "AdapterLoaded", "adapter chat loaded on e-1")]


def test_the_same_failure_warns_once_and_a_new_one_warns_again():
    failing = [PodSync("e-1", failures={"sql": "HTTP 400: no adapter_config.json"})]
    first = adapter_status([SQL], failing, {})
    again = adapter_status([SQL], failing, first.status)
    assert [e.reason for e in first.events] == ["AdapterLoadFailed"] and again.events == []
    other = adapter_status([SQL], [PodSync("e-1", failures={"sql": "HTTP 400: bad shapes"})], first.status)
    assert [e.reason for e in other.events] == ["AdapterLoadFailed"]


def test_all_loaded_is_ready_and_no_engines_is_not():
    done = adapter_status([SQL, CHAT], [PodSync("e-1", loaded={"sql", "chat"})], {})
    assert done.condition[:2] == (True, "AllAdaptersLoaded") and done.status["adaptersReady"] == "2/2"
    assert done.events == []
    none = adapter_status([SQL], [], {})
    assert none.condition[:2] == (False, "NoReadyEngines") and none.status["adaptersReady"] == "0/1"
    assert none.status["adapters"][0]["message"] == "waiting for a ready engine"
    empty = adapter_status([], [PodSync("e-1")], {})
    assert empty.condition[:2] == (True, "NoAdapters") and empty.status == {"adapters": [], "adaptersReady": "0/0"}


def test_an_engine_that_does_not_answer_is_not_counted_and_is_named():
    results = [PodSync("e-1", loaded={"sql"}), PodSync("e-2", error="GET /v1/models: ConnectTimeout")]
    report = adapter_status([SQL], results, {})
    entry = report.status["adapters"][0]
    assert entry["readyReplicas"] == 1 and entry["message"] == "not confirmed on e-2: GET /v1/models: ConnectTimeout"
    assert report.condition[:2] == (False, "Loading") and report.events == []


def test_unloads_are_reported_per_adapter():
    report = adapter_status([SQL], [PodSync("e-1", loaded={"sql"}, unloaded_now=["old"]),
                                    PodSync("e-2", loaded={"sql"}, unloaded_now=["old"])], {})
    assert [(e.reason, e.message) for e in report.events] == [("AdapterUnloaded", "adapter old unloaded from e-1, e-2")]
