"""Decode through captured graphs gives what eager decode gives (torch backend, CPU stand-in).

The stand-in (``EmulatedGraphBackend``) records the captured callable and re-runs it on replay; the
callable sees only the runner's static buffers and the metadata fixed at capture, so these tests
check the ladder, the copies into static buffers, padding and fallbacks for real. What only a GPU
can check (stream capture itself, the shared memory pool) is left to benchmarks/gpu_kernels.py;
the Triton-backend variant of the parity test is tests/kernels/test_cuda_graph_triton_parity.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import TORCH_BACKEND
from pagedmodel.server.engine.cuda_graph_runner import (
    GRAPHS_ENV, CudaGraphBackend, CUDAGraphRunner, EmulatedGraphBackend, capture_sizes, select_graph_backend,
)
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.model_runner import ModelRunner
from pagedmodel.server.engine.sampling_params import SamplingParams
from tiny_models import make_tiny_model_dir

BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
# five requests of different lengths: the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1, so it runs
# the graphs of 8, 4 (twice: once with a padding row a 4-row step left behind), 2 and 1 rows
PROMPTS = [
    "The capital of France is",
    "Hi",
    "One two three four five six seven eight nine",
    "a b",
    "Once upon a time there was",
]
MAX_TOKENS = [14, 11, 9, 6, 4]   # long enough that decode crosses block boundaries (tables grow)


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory, smollm2_dir):
    # untied lm_head: the next token depends on the context, not just the last token's embedding
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-graphs"), "llama",
                               tokenizer_dir=smollm2_dir, tie_word_embeddings=False)


def _llm(model_dir, graphs: str, monkeypatch, backend: str = "torch", **overrides) -> LLM:
    monkeypatch.setenv(GRAPHS_ENV, graphs)
    monkeypatch.setenv("PAGEDMODEL_ATTENTION_BACKEND", backend)
    kwargs = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_gpu_blocks_override=96,
                  max_num_batched_tokens=16)
    return LLM(**{**kwargs, **overrides})


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    return [(list(o.outputs[0].token_ids), [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _assert_same(reference, candidate) -> None:
    assert [len(tokens) for tokens, _ in reference] == MAX_TOKENS
    assert [tokens for tokens, _ in candidate] == [tokens for tokens, _ in reference]
    for (_, ref_lps), (_, cand_lps) in zip(reference, candidate):
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(ref_lps, cand_lps))


@pytest.fixture(scope="module")
def eager_reference(untied_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        llm = _llm(untied_llama_dir, "off", mp)
        assert llm.engine.runner.graph_runner is None
        return _generate(llm)


# ---- the ladder and the choice of graphs ---------------------------------------------------

def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    ladder = capture_sizes(256)
    assert ladder[:7] == [1, 2, 4, 8, 16, 24, 32] and ladder[-1] == 256 and len(ladder) == 35
    assert all(b - a == 8 for a, b in zip(ladder[4:], ladder[5:]))
    assert capture_sizes(4096)[-1] == 512 and capture_sizes(100, limit=40)[-1] == 40
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_select_graph_backend():
    assert select_graph_backend("cpu", TORCH_BACKEND, False, env="") is None            # CPU: eager
    assert isinstance(select_graph_backend("cpu", TORCH_BACKEND, False, env="emulate"), EmulatedGraphBackend)
    assert select_graph_backend("cpu", TORCH_BACKEND, True, env="emulate") is None      # --enforce-eager wins
    assert select_graph_backend("cpu", TORCH_BACKEND, False, env="off") is None
    # the torch path filters slots on the host, which a capture cannot do: CUDA + torch stays eager
    assert select_graph_backend("cuda", TORCH_BACKEND, False, env="auto") is None
    with pytest.raises(ValueError, match=GRAPHS_ENV):
        select_graph_backend("cpu", TORCH_BACKEND, False, env="always")
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphBackend("cpu")


def test_enforce_eager_and_cpu_default_capture_nothing(untied_llama_dir, monkeypatch):
    assert _llm(untied_llama_dir, "emulate", monkeypatch, enforce_eager=True).engine.runner.graph_runner is None
    monkeypatch.delenv(GRAPHS_ENV)
    assert _llm(untied_llama_dir, "auto", monkeypatch).engine.runner.graph_runner is None


def test_model_runner_takes_an_injected_graph_backend(untied_llama_dir, monkeypatch):
    engine = _llm(untied_llama_dir, "off", monkeypatch).engine
    parts = (engine.model, engine.kv_cache, engine.backend, engine.device)
    runner = ModelRunner(*parts, max_model_len=MAX_MODEL_LEN, graph_backend=EmulatedGraphBackend(), graph_sizes=[1, 3])
    assert runner.graph_runner is not None and runner.graph_runner.sizes == [1, 3]
    assert runner.graph_runner.stats.capture_seconds > 0   # captured at construction
    assert ModelRunner(*parts, max_model_len=MAX_MODEL_LEN, graph_backend=EmulatedGraphBackend(),
                       enforce_eager=True).graph_runner is None
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(*parts, graph_backend=EmulatedGraphBackend())
    with pytest.raises(ValueError, match="graph_backend"):
        ModelRunner(*parts, max_model_len=MAX_MODEL_LEN, graph_backend="cuda")


def test_a_failed_capture_falls_back_to_eager_instead_of_failing(untied_llama_dir, eager_reference, monkeypatch,
                                                                  caplog):
    class Broken(EmulatedGraphBackend):
        def new_graph(self):
            graph = super().new_graph()

            def capture(fn):
                raise RuntimeError("operation not permitted when stream is capturing")
            graph.capture = capture
            return graph

    llm = _llm(untied_llama_dir, "off", monkeypatch)
    engine = llm.engine
    with caplog.at_level("ERROR"):
        engine.runner = ModelRunner(engine.model, engine.kv_cache, engine.backend, engine.device,
                                    max_model_len=MAX_MODEL_LEN, graph_backend=Broken())
    assert engine.runner.graph_runner is None
    assert "stream is capturing" in engine.runner.graph_capture_error
    assert "CUDA graph capture failed" in caplog.text
    _assert_same(eager_reference, _generate(llm))


# ---- engine parity -------------------------------------------------------------------------

def test_graph_decode_matches_eager(untied_llama_dir, eager_reference, monkeypatch):
    llm = _llm(untied_llama_dir, "emulate", monkeypatch)
    runner = llm.engine.runner.graph_runner
    assert runner is not None and runner.sizes == [1, 2, 4, 8]
    calls: list[tuple[list[int], bool]] = []   # (query lengths, replayed?) per step
    run = runner.run

    def spy(input_ids, positions, meta):
        hidden = run(input_ids, positions, meta)
        calls.append((list(meta.query_lens_cpu), hidden is not None))
        return hidden

    monkeypatch.setattr(runner, "run", spy)
    _assert_same(eager_reference, _generate(llm))
    # a step mixing decode rows with a prefill chunk ran eagerly; every pure decode step replayed
    assert any(1 in q and max(q) > 1 and not replayed for q, replayed in calls), calls
    assert all(replayed == (max(q) == 1) for q, replayed in calls), calls
    stats = runner.stats
    # 5 -> padded to 8, 4 and 3 -> 4, 2 -> 2, 1 -> 1; the first steps mix prefill chunks with decodes
    assert set(stats.replays) == {8, 4, 2, 1}, stats
    assert stats.replays[4] >= 2
    assert stats.eager_steps["not a pure decode step"] >= 2, stats
    assert set(stats.eager_steps) == {"not a pure decode step"}


def test_batches_above_the_ladder_run_eagerly(untied_llama_dir, eager_reference, monkeypatch):
    llm = _llm(untied_llama_dir, "emulate", monkeypatch)
    engine = llm.engine
    # a ladder topping out at 2: the 5-, 4- and 3-row decode steps must fall back to eager
    small = CUDAGraphRunner(engine.model, engine.kv_cache.layers, engine.backend, EmulatedGraphBackend(),
                            block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, sizes=[1, 2], device="cpu")
    small.capture()
    engine.runner.graph_runner = small
    _assert_same(eager_reference, _generate(llm))
    assert small.stats.eager_steps["batch above the largest graph"] >= 3, small.stats
    assert set(small.stats.replays) == {1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_match_eager(untied_llama_dir, monkeypatch):
    """The one test here that captures real CUDA graphs (Triton backend, shared pool); it only
    runs on a machine with a GPU."""
    from pagedmodel.kernels.triton_launch import interpreting

    if interpreting():
        pytest.skip("this session interprets the Triton kernels (TRITON_INTERPRET=1): they can't be captured")
    eager = _llm(untied_llama_dir, "off", monkeypatch, backend="triton", device="cuda")
    assert eager.engine.runner.graph_runner is None
    reference = _generate(eager)
    del eager
    llm = _llm(untied_llama_dir, "auto", monkeypatch, backend="triton", device="cuda")
    runner = llm.engine.runner.graph_runner
    assert runner is not None and runner.graphs.name == "cuda" and runner.stats.capture_bytes is not None
    _assert_same(reference, _generate(llm))
    assert set(runner.stats.replays) == {8, 4, 2, 1}, runner.stats


# ---- the runner on hand-made steps ---------------------------------------------------------

@pytest.fixture
def engine(untied_llama_dir, monkeypatch):
    engine = _llm(untied_llama_dir, "off", monkeypatch).engine
    gen = torch.Generator().manual_seed(0)
    for layer in engine.kv_cache.layers:  # random everywhere: a stray write or read shows
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return engine


def _decode_meta(tables: list[list[int]], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    positions = [n - 1 for n in seq_lens]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
    ids = torch.tensor([(7919 * (i + 1) + p) % 49152 for i, p in enumerate(positions)])
    meta = AttentionMetadata.build([1] * len(tables), seq_lens, tables, slots)
    return ids, torch.tensor(positions), meta


def test_padding_rows_never_touch_the_cache_and_tables_may_grow(engine):
    runner = CUDAGraphRunner(engine.model, engine.kv_cache.layers, engine.backend, EmulatedGraphBackend(),
                             block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, sizes=[1, 2, 4, 8], device="cpu")
    before_capture = [layer.clone() for layer in engine.kv_cache.layers]
    runner.capture()
    assert all(torch.equal(a, b) for a, b in zip(before_capture, engine.kv_cache.layers)), \
        "capture's warm-up runs wrote to the KV cache"
    steps = [
        # 4 rows on the 4-row graph: leaves real slots in every static row
        ([[3, 9], [4], [11, 12], [20]], [12, 5, 16, 3]),
        # 3 rows on the same graph: row 3 must be padding again, not the 4-row step's last row
        ([[3, 9], [4], [11, 12]], [13, 6, 9]),
        # tables grow by a block (and one sequence jumps to a 4-block table): widths 2 -> 4
        ([[3, 9, 30], [4, 31], [11, 12, 40, 41], [20], [50]], [17, 9, 26, 4, 1]),
        # a 1-row step on the 1-row graph after wider steps
        ([[11, 12, 40, 41]], [27]),
    ]
    for tables, seq_lens in steps:
        ids, positions, meta = _decode_meta(tables, seq_lens)
        before = [layer.clone() for layer in engine.kv_cache.layers]
        reference = [layer.clone() for layer in engine.kv_cache.layers]   # the eager step runs on a copy
        with torch.inference_mode():
            expected = engine.model(ids, positions, reference, meta, engine.backend)
            got = runner.run(ids, positions, meta)
        assert got is not None and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        written = meta.slot_mapping
        for layer, ref, old in zip(engine.kv_cache.layers, reference, before):
            flat, flat_ref, flat_old = (t.view(2, -1, *t.shape[3:]) for t in (layer, ref, old))
            # this step's slots hold what eager wrote (layer 2's K/V differ by rounding: the graph's
            # attention sums over max-model-len-wide padded contexts) ...
            torch.testing.assert_close(flat[:, written], flat_ref[:, written], rtol=1e-5, atol=1e-5)
            # ... and every other slot is untouched: padding rows wrote nothing
            others = torch.ones(flat.shape[1], dtype=torch.bool)
            others[written] = False
            assert torch.equal(flat[:, others], flat_old[:, others]), \
                f"a slot outside the step's changed after a {len(tables)}-row step"
    assert dict(runner.stats.replays) == {4: 2, 8: 1, 1: 1}


def test_ineligible_steps_fall_back(engine):
    runner = CUDAGraphRunner(engine.model, engine.kv_cache.layers, engine.backend, EmulatedGraphBackend(),
                             block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, sizes=[1, 2], device="cpu")
    runner.capture()
    ids, positions, meta = _decode_meta([[1], [2], [3]], [2, 3, 4])
    assert runner.run(ids, positions, meta) is None                          # 3 rows > 2
    mixed = AttentionMetadata.build([1, 3], [5, 3], [[1], [2]], [8 + 4, 16, 17, 18])
    assert runner.run(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), mixed) is None
    wide = AttentionMetadata.build([1], [2], [[1] * (MAX_MODEL_LEN // BLOCK_SIZE + 1)], [9])
    assert runner.run(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), wide) is None
    assert dict(runner.stats.eager_steps) == {"batch above the largest graph": 1, "not a pure decode step": 1,
                                              "block table wider than max-model-len": 1}
    assert not runner.stats.replays
    with pytest.raises(ValueError, match="one token per row"):
        runner.run(torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long), _decode_meta([[1]], [2])[2])


def test_runner_rejects_bad_configuration(engine):
    def make(**kw):
        args = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, sizes=[1, 2], device="cpu")
        return CUDAGraphRunner(engine.model, engine.kv_cache.layers, engine.backend, EmulatedGraphBackend(),
                               **{**args, **kw})

    for sizes in ([], [0, 1], [2, 1], [1, 1, 2]):
        with pytest.raises(ValueError, match="capture sizes"):
            make(sizes=sizes)
    with pytest.raises(ValueError, match="max_model_len"):
        make(max_model_len=0)
    runner = make()
    ids, positions, meta = _decode_meta([[1]], [2])
    with pytest.raises(RuntimeError, match="before capture"):
        runner.run(ids, positions, meta)
    runner.capture()
    with pytest.raises(RuntimeError, match="already captured"):
        runner.capture()


def test_emulated_graph_replays_what_it_recorded():
    graph = EmulatedGraphBackend().new_graph()
    with pytest.raises(RuntimeError, match="before capture"):
        graph.replay()
    buf = torch.zeros(1)
    graph.capture(lambda: buf.add_(1))   # capture runs it once, like the CUDA path's warm-up
    graph.replay()
    graph.replay()
    assert buf.item() == 3
    with pytest.raises(RuntimeError, match="already captured"):
        graph.capture(lambda: None)
