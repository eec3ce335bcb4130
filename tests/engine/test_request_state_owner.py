"""A request's state has one owner, its SequenceGroup: the sampler keeps no registry, so once a request
finishes or is aborted nothing in the engine holds it (or its generators, grammar matchers, beams)."""
from __future__ import annotations

import gc
import weakref

import pytest

from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams

CASES = {
    "seeded-n2": SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4),
    "grammar": SamplingParams(temperature=1.0, seed=1, max_tokens=4,
                              structured_outputs=StructuredOutputsParams(regex="[ab]+")),
    "beams": SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=8, max_model_len=128).engine


def test_the_sampler_holds_configuration_only(engine):
    assert set(vars(engine.sampler)) == {"device", "watermark", "eos_token_ids", "thinking"}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("end", ["finish", "abort"])
def test_nothing_holds_a_request_once_it_ended(engine, name, end):
    rid = f"{name}-{end}"
    engine.add_request(rid, [1, 504, 3458, 282], CASES[name])
    while rid in engine._compiling:   # a grammar compiles off the engine thread first
        engine.step()
    engine.step()
    group = engine.requests[rid]
    assert group.sample_states or group.beams is not None   # the state lives on the request
    ref = weakref.ref(group)
    del group
    if end == "abort":
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
