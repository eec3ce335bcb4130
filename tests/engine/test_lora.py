"""LoRA adapters in the engine: greedy tokens equal HF transformers + peft for a batch mixing two
adapters and the base model, prefix-cache entries never cross adapters, adapters wait for a slot
instead of evicting one in use, and bad adapters are clear errors that hold nothing.

A tiny random Llama (untied head) with adapters made by peft itself (random non-zero lora_B, fixed
seeds, rank 8 on every projection and rank 16 on q/v/down); SmolLM2 is covered in
test_lora_smollm2.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from lora_adapters import hf_peft_greedy_all, make_peft_adapter
from pagedmodel import LLM, LoRARequest, SamplingParams
from pagedmodel.server.engine.args import ConfigError, EngineArgs
from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.lora.adapter import LoRAError, load_adapter
from pagedmodel.server.engine.lora.slots import LoRASlots
from pagedmodel.server.engine.model_config import ModelConfig
from tiny_models import make_tiny_model_dir

PROMPTS = ["The capital of France is", "Hi there", "One two three four five six seven eight nine ten", "Hello"]
NEW = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-base"), "llama", tokenizer_dir=smollm2_dir,
                               tie_word_embeddings=False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, base_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {"a8": make_peft_adapter(base_dir, root / "a8", rank=8, seed=1),
            "a16": make_peft_adapter(base_dir, root / "a16", rank=16, targets=("q_proj", "v_proj", "down_proj"), seed=2)}


@pytest.fixture(scope="module")
def prompt_ids(base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(base_dir, adapters, prompt_ids):
    """HF (+ peft) greedy tokens: name (None = base) -> one list per prompt."""
    return hf_peft_greedy_all(base_dir, {None: None, **adapters}, prompt_ids, NEW)


def _llm(base_dir, **kw) -> LLM:
    opts = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8,
                max_model_len=128, num_gpu_blocks_override=64)
    opts.update(kw)
    return LLM(model=str(base_dir), **opts)


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _run(llm, prompt_ids, names, reqs):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY,
                        lora_request=[reqs[n] if n else None for n in names])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_adapters_change_outputs(reference):
    """Guards the test itself: an adapter that changed nothing would make the comparisons below vacuous."""
    assert reference["a8"] != reference[None] and reference["a16"] != reference[None]


def test_mixed_batch_matches_hf_peft(base_dir, adapters, prompt_ids, reference):
    """Rows of two adapters and of the base model in the same steps, with chunked prefills sharing steps
    (an 8-token budget): every request's tokens equal HF + peft's for its adapter."""
    llm = _llm(base_dir, max_num_batched_tokens=8)
    reqs = _requests(adapters)
    names = ["a8", None, "a16", "a8", "a16", None, "a8", "a16"]
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(len(names))]
    got = _run(llm, ids, names, reqs)
    want = [reference[n][i % len(prompt_ids)] for i, n in enumerate(names)]
    assert got == want
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_blocks


def test_prefix_cache_never_crosses_adapters(base_dir, adapters, prompt_ids, reference):
    """The same prompt first under the base model, then under each adapter: a cache hit across adapters
    would reuse K/V computed without the adapter and change the adapter's tokens."""
    llm = _llm(base_dir, enable_prefix_caching=True)
    reqs = _requests(adapters)
    long_prompt = [prompt_ids[2] * 3]   # several full blocks
    want = hf_peft_greedy_all(base_dir, {None: None, **adapters}, long_prompt, NEW)
    for name in (None, "a8", "a16"):
        assert _run(llm, long_prompt, [name], reqs) == want[name]
    # and within one adapter the cache is used: the repeat hits
    hits = llm.engine.scheduler.block_manager.prefix_hits
    assert _run(llm, long_prompt, ["a8"], reqs) == want["a8"]
    assert llm.engine.scheduler.block_manager.prefix_hits > hits


def test_one_slot_makes_other_adapters_wait(base_dir, adapters, prompt_ids, reference):
    """--max-loras 1 with two adapters requested at once: the second adapter's requests wait (base rows
    keep running), the slot is reloaded only once the first adapter is idle, and all tokens stay exact."""
    llm = _llm(base_dir, max_loras=1)
    reqs = _requests(adapters)
    engine = llm.engine
    names = ["a8", "a16", None, "a8", "a16"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_ids[i % 4]}, GREEDY,
                           lora_request=reqs[name] if name else None)
    results, seen = {}, []
    while engine.has_unfinished_requests():
        seen.append(engine.stats().running_lora_adapters)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.outputs[0].token_ids)
    assert all(len(running) <= 1 for running in seen)
    assert ("a8",) in seen and ("a16",) in seen
    assert [results[f"r{i}"] for i in range(len(names))] == [reference[n][i % 4] for i, n in enumerate(names)]
    assert engine.stats().max_lora == 1


def test_slots_are_lru_and_never_evict_a_held_adapter():
    slots = LoRASlots(2)
    assert slots.acquire(1) == (0, True)
    assert slots.acquire(2) == (1, True)
    assert slots.acquire(3) is None and not slots.can_acquire(3)     # both held
    slots.release(1)
    assert slots.acquire(1) == (0, False)                             # still resident: no reload
    slots.release(1)
    slots.release(2)
    assert slots.acquire(3) == (1, True)                              # 2 is least recently used
    assert slots.resident() == [1, 3]
    with pytest.raises(AssertionError):
        slots.release(1)


@pytest.fixture
def engine_args(base_dir):
    return dict(model=str(base_dir), device="cpu", dtype="float32", block_size=8, max_model_len=128,
                num_gpu_blocks_override=64)


def test_bad_adapters_are_clear_errors(base_dir, adapters, tmp_path, smollm2_dir):
    mc = ModelConfig.from_args(EngineArgs(model=str(base_dir), device="cpu"))
    cfg = mc.hf_config
    with pytest.raises(LoRAError, match="not a directory"):
        load_adapter("x", 1, tmp_path / "missing", cfg, 16)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter("x", 1, tmp_path, cfg, 16)
    with pytest.raises(LoRAError, match="rank 16, above --max-lora-rank 8"):
        load_adapter("x", 1, adapters["a16"], cfg, 8)
    other = make_tiny_model_dir(tmp_path / "wider", "llama", tokenizer_dir=smollm2_dir, hidden_size=96)
    with pytest.raises(LoRAError, match="this model needs A"):
        load_adapter("x", 1, make_peft_adapter(other, tmp_path / "wider-lora", rank=8), cfg, 16)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["a8"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter("x", 1, dora, cfg, 16)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps(config))
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LoRAError, match="cannot read"):
        load_adapter("x", 1, broken, cfg, 16)


def test_a_bad_lora_request_holds_nothing(base_dir, tmp_path):
    llm = _llm(base_dir)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="no adapter_config.json") as info:
        engine.add_request("bad", "Hello", GREEDY, lora_request=LoRARequest("nope", 7, str(tmp_path)))
    assert info.value.param == "model"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_lora_needs_enable_lora(base_dir, adapters, engine_args):
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        EngineArgs(**engine_args, lora_modules=[f"a8={adapters['a8']}"])
    with pytest.raises(ConfigError, match="name=path"):
        EngineArgs(**engine_args, enable_lora=True, lora_modules=["no-path"])
    llm = LLM(**engine_args)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        llm.engine.add_request("r", "Hello", GREEDY, lora_request=LoRARequest("a8", 1, str(adapters["a8"])))


def test_lora_modules_at_start(engine_args, adapters, tmp_path):
    from pagedmodel.server.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(**engine_args, enable_lora=True, lora_modules=[f"a8={adapters['a8']}"]))
    assert [a.name for a in engine.lora_registry.adapters()] == ["a8"]
    with pytest.raises(ConfigError, match="--lora-modules: .*no adapter_config.json"):
        LLMEngine(EngineArgs(**engine_args, enable_lora=True, lora_modules=[f"bad={tmp_path}"]))


def test_hf_adapter_sources_are_fetched_from_the_hub(base_dir, adapters, monkeypatch):
    """``hf://org/name`` (the operator's hub source, the API's lora_path) is fetched through the Hub client,
    its PEFT files only, and is served exactly as the same directory given as a path; the Hub's refusals
    are clear LoRAErrors (the API's 400)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from pagedmodel.server.engine.model_store import ADAPTER_FILES

    cfg = ModelConfig.from_args(EngineArgs(model=str(base_dir), device="cpu")).hf_config
    calls = []

    def snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        if repo_id != "acme/sql-lora":
            raise LocalEntryNotFoundError("offline")
        return str(adapters["a8"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    fetched = load_adapter("sql", 1, "hf://acme/sql-lora", cfg, 16)
    local = load_adapter("sql", 2, adapters["a8"], cfg, 16)
    assert calls == [("acme/sql-lora", ADAPTER_FILES)]
    assert fetched.path == "hf://acme/sql-lora" and fetched.rank == local.rank == 8
    assert fetched.weights.keys() == local.weights.keys()
    for key, (a, b) in fetched.weights.items():
        assert torch.equal(a, local.weights[key][0]) and torch.equal(b, local.weights[key][1])
    with pytest.raises(LoRAError, match="the Hub is unreachable"):
        load_adapter("x", 3, "hf://acme/missing", cfg, 16)
    with pytest.raises(LoRAError, match="not a Hugging Face Hub id"):
        load_adapter("x", 4, "hf://acme/a/b", cfg, 16)
    assert len(calls) == 2    # a malformed id never reaches the Hub
