"""Output kinds: a streamed request gets deltas (each output its news), any other one output, whole, at the
end; both add up to what the cumulative outputs say, and every step's progress is reported either way."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pagedmodel.server.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.outputs import RequestOutputKind
from pagedmodel.server.engine.sampling_params import SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=8, max_model_len=256).engine


def run(engine, params: SamplingParams, rid: str) -> tuple[list, list]:
    """Every output and progress record of one request, step by step."""
    engine.add_request(rid, PROMPT, params)
    outputs, progress = [], []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
        progress += [p for p in engine.step_progress if p.request_id == rid]
    return outputs, progress


@pytest.mark.parametrize("extra", [
    {},
    {"n": 2, "seed": 3, "temperature": 1.0},
    {"stop": ["ab", "the"], "logprobs": 2},   # stop strings hold text back while streaming
], ids=["greedy", "n=2", "stop-strings+logprobs"])
def test_deltas_add_up_to_the_whole_and_final_only_is_one_whole_output(engine, extra):
    base = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra})
    whole, whole_progress = run(engine, base, "cumulative")
    final = {o.index: o for o in whole[-1].outputs}
    deltas, progress = run(engine, replace(base, output_kind=DELTA), "delta")
    assert len(deltas) == len(whole) == 12   # one output per step with news, as the cumulative kind
    for index, expected in final.items():
        pieces = [o for out in deltas for o in out.outputs if o.index == index]
        assert "".join(o.text for o in pieces) == expected.text
        assert [t for o in pieces for t in o.token_ids] == expected.token_ids
        assert sum(o.finished for o in pieces) == 1 and pieces[-1].finish_reason == expected.finish_reason
        if base.logprobs is not None:
            assert [lp for o in pieces for lp in o.logprobs] == expected.logprobs
        # a delta never repeats a token: each piece holds that step's token(s) only
        assert all(len(o.token_ids) <= 1 for o in pieces)
    only, final_progress = run(engine, replace(base, output_kind=FINAL_ONLY), "final")
    assert len(only) == 1 and only[0].finished
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in only[0].outputs] == \
        [(o.index, o.text, o.token_ids, o.finish_reason) for o in whole[-1].outputs]
    # metrics see every step whatever the kind: the same progress, token for token
    for got in (progress, final_progress):
        assert [p.new_tokens for p in got] == [p.new_tokens for p in whole_progress]
        assert got[-1].finished and got[-1].output_lengths == tuple(len(o.token_ids) for o in whole[-1].outputs)
    assert sum(p.new_tokens for p in progress) == sum(len(o.token_ids) for o in whole[-1].outputs)


def test_best_of_and_beams_give_one_output_whatever_the_kind(engine):
    for params in (SamplingParams(n=1, best_of=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
                   SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True)):
        for kind in (DELTA, FINAL_ONLY):
            outputs, progress = run(engine, replace(params, output_kind=kind), f"{kind.name}-{params.best_of}")
            assert len(outputs) == 1 and outputs[0].finished
            assert all(len(o.token_ids) == 6 for o in outputs[0].outputs)
            assert progress[-1].output_lengths == (6,) * params.n


def test_prompt_logprobs_ride_on_a_streams_first_output_only(engine):
    outputs, _ = run(engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1,
                                            output_kind=DELTA), "plp")
    assert outputs[0].prompt_logprobs is not None and len(outputs[0].prompt_logprobs) > 1
    assert all(o.prompt_logprobs is None for o in outputs[1:])


@pytest.mark.parametrize("request_cls,body", [
    (CompletionRequest, {"prompt": PROMPT}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_the_api_streams_deltas_and_answers_the_rest_in_one_output(engine, request_cls, body):
    """What the API submits: a stream's outputs are one per step, a non-streamed request's exactly one."""
    for stream, expected in ((True, 8), (False, 1)):
        req = request_cls(model="m", max_tokens=8, temperature=0, ignore_eos=True, stream=stream, **body)
        params = req.to_sampling_params(engine.vocab_size)
        assert params.output_kind is (DELTA if stream else FINAL_ONLY)
        outputs, _ = run(engine, params, f"api-{request_cls.__name__}-{stream}")
        assert len(outputs) == expected


def test_the_offline_llm_collects_one_whole_output_per_request(tiny_llama_dir, engine):
    llm = LLM.__new__(LLM)   # the module's engine, without loading the model twice
    llm.engine, llm._ids = engine, iter(range(10**6))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=DELTA)
    out = llm.generate([PROMPT], params)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 5
    assert params.output_kind is DELTA   # the caller's params are left as given
