"""The engine's prefix-cache event log (kv_events.py): stored/removed/cleared batches with sequence
numbers, replay from the ring, the snapshot, and salts, on the word-level tiny Llama."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.block_manager import block_hash
from pagedmodel.server.engine.kv_events import HASH_SCHEME, KVEventLog
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.sampling_params import SamplingParams

BS = 8
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("enable_prefix_caching", True)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("num_gpu_blocks_override", 64)   # a small cache builds in a fraction of a second
    return LLMEngine(EngineArgs(model=str(model_dir), device="cpu", block_size=BS, **kw))


def run(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None = None) -> None:
    engine.add_request(rid, prompt, ONE, cache_salt=salt)
    while engine.has_unfinished_requests():
        engine.step()


def chain(tokens: list[int], salt: bytes = b"") -> list[str]:
    """What a subscriber computes: the hashes of the full blocks before the last token."""
    out, parent = [], None
    for i in range((len(tokens) - 1) // BS):
        parent = block_hash(parent, tuple(tokens[i * BS:(i + 1) * BS]), salt)
        out.append(parent.hex())
    return out


def stored(batches) -> list[str]:
    return [h for b in batches for e in b.events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def removed(batches) -> list[str]:
    return [h for b in batches for e in b.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


def test_committed_blocks_are_published_as_one_chain_with_the_engines_hashes(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir)
    log = engine.kv_events
    prompt = list(range(10, 35))            # 25 tokens: three full blocks
    run(engine, "a", prompt)
    batches = log.since(0)
    assert batches and [b.seq for b in batches] == list(range(1, len(batches) + 1))
    first = next(e for b in batches for e in b.events if e["type"] == "BlockStored")
    assert first["parent_block_hash"] is None and first["block_size"] == BS
    assert stored(batches)[:3] == chain(prompt)     # the router can recompute exactly these
    snap = log.snapshot()
    assert snap["seq"] == log.seq == batches[-1].seq
    assert snap["hash_scheme"] == HASH_SCHEME and snap["block_size"] == BS
    assert set(chain(prompt)) <= set(snap["block_hashes"])
    assert set(snap["block_hashes"]) == {h.hex() for h in engine.scheduler.block_manager.pool.cached_blocks()}


def test_evicted_blocks_are_published_removed_and_leave_the_snapshot(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir, num_gpu_blocks_override=8, max_model_len=64)
    log = engine.kv_events
    a = list(range(10, 35))
    run(engine, "a", a)
    seq_a = log.seq
    for i in range(3):   # other prompts recycle every free block
        run(engine, f"x{i}", list(range(100 + 40 * i, 125 + 40 * i)))
    gone = removed(log.since(seq_a))
    assert set(chain(a)) <= set(gone)
    snap = set(log.snapshot()["block_hashes"])
    assert not snap & set(chain(a))
    assert snap == {h.hex() for h in engine.scheduler.block_manager.pool.cached_blocks()}


def test_a_salted_prompt_publishes_salted_hashes_only(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir)
    prompt = list(range(10, 35))
    run(engine, "s", prompt, salt="tenant-a")
    published = set(stored(engine.kv_events.since(0)))
    assert set(chain(prompt, b"tenant-a")) <= published
    assert not published & set(chain(prompt))   # an unsalted chain never matches a salted block


def test_reset_publishes_all_blocks_cleared(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir)
    run(engine, "a", list(range(10, 35)))
    before = engine.kv_events.seq
    assert engine.reset_prefix_cache()
    (batch,) = engine.kv_events.since(before)
    assert batch.events == ({"type": "AllBlocksCleared"},)
    assert engine.kv_events.snapshot()["block_hashes"] == []


def test_no_log_without_prefix_caching(wordlevel_llama_dir):
    assert make_engine(wordlevel_llama_dir, enable_prefix_caching=False).kv_events is None


def test_replay_window_instance_and_wakeups():
    log = KVEventLog(block_size=4, ring_size=2)
    woken = []
    unsubscribe = log.subscribe(lambda: woken.append(log.seq))
    assert log.publish() is None and log.seq == 0      # nothing changed: no batch, no wake-up
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))
    log.stored(h1, None)
    log.stored(h2, h1)        # same chain: merged into one BlockStored
    log.stored(h3, None)      # a new chain: its own event
    b1 = log.publish()
    assert [e["block_hashes"] for e in b1.events] == [[h1.hex(), h2.hex()], [h3.hex()]]
    log.removed(h2)
    log.publish()
    log.removed(h3)
    log.publish()
    assert woken == [1, 2, 3]
    assert [b.seq for b in log.since(1)] == [2, 3]
    assert log.since(3) == []
    assert log.since(0) is None                       # batch 1 fell out of the ring of 2
    assert log.since(9) is None                       # a number from the future: resync
    assert log.since(2, instance="another-engine") is None
    assert log.snapshot()["block_hashes"] == [h1.hex()]
    unsubscribe()
    log.cleared()
    log.publish()
    assert woken == [1, 2, 3] and log.num_subscribers == 0
    with pytest.raises(ValueError):
        KVEventLog(block_size=4, ring_size=0)
