"""Prompts given as input embeddings (--enable-prompt-embeds): the model's own embeddings of a prompt give
the tokens that prompt gives, on every scheduling path (chunked prefill, prefix caching, preemption by
recompute); other embeddings give other tokens and never share cached KV with the text they stand in for."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.prompt_embeds import EmbedSpan, PromptEmbeds
from pagedmodel.server.engine.sampling_params import SamplingParams

PROMPT = list(range(10, 47))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def make_llm(model_dir, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "block_size": 8, "max_model_len": 128, **kw}
    return LLM(str(model_dir), enable_prompt_embeds=True, **kw)


def embeddings_of(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llm.engine.model.embed_tokens(torch.tensor(ids)).clone()


def tokens(llm: LLM, prompt: object, params: SamplingParams = GREEDY) -> list[tuple[int, float]]:
    """Each generated token with its logprob (4 decimals): a random model repeats tokens, the logprobs differ."""
    out = llm.generate([prompt], params)[0].outputs[0]
    return [(t, round(lp[t], 4)) for t, lp in zip(out.token_ids, out.logprobs)]


@pytest.mark.parametrize("budget", [None, 8], ids=["one-step", "chunked"])
def test_own_embeddings_give_the_tokens_of_the_text(wordlevel_llama_dir, budget):
    llm = make_llm(wordlevel_llama_dir, max_num_batched_tokens=budget)
    expected = tokens(llm, PROMPT)
    assert tokens(llm, {"prompt_embeds": embeddings_of(llm, PROMPT)}) == expected
    # a batch of one (1, n, hidden) is accepted as vLLM accepts it
    assert tokens(llm, {"prompt_embeds": embeddings_of(llm, PROMPT)[None]}) == expected


def test_mixed_text_and_embedding_spans_match_the_text(wordlevel_llama_dir):
    llm = make_llm(wordlevel_llama_dir, max_num_batched_tokens=8)
    expected = tokens(llm, PROMPT)
    ids = list(PROMPT)
    spans = (EmbedSpan(3, embeddings_of(llm, PROMPT[3:9])), EmbedSpan(20, embeddings_of(llm, PROMPT[20:31])))
    for span in spans:
        ids[span.start:span.end] = [0] * (span.end - span.start)
    assert tokens(llm, {"prompt_token_ids": ids, "prompt_embeds": PromptEmbeds(spans)}) == expected
    # the placeholders alone (without their embeddings) are another prompt: the spans did the work
    assert tokens(llm, ids) != expected


def test_other_embeddings_change_the_answer_and_share_no_cache(wordlevel_llama_dir):
    llm = make_llm(wordlevel_llama_dir, enable_prefix_caching=True)
    text_tokens = tokens(llm, PROMPT)
    bm = llm.engine.scheduler.block_manager
    hits = bm.prefix_hits
    noisy = embeddings_of(llm, PROMPT) + 0.5 * torch.randn(len(PROMPT), llm.engine.model.config.hidden_size,
                                                             generator=torch.Generator().manual_seed(0))
    first = tokens(llm, {"prompt_embeds": noisy})
    assert bm.prefix_hits == hits, "embeddings reused KV cached for other inputs"
    assert first != text_tokens
    # the same embeddings again hit their own cached blocks and answer the same
    assert tokens(llm, {"prompt_embeds": noisy.clone()}) == first
    assert bm.prefix_hits > hits


def test_recompute_preemption_refeeds_the_embeddings(wordlevel_llama_dir):
    # 10 blocks of 8 tokens: four 37-token prompts growing to 49 cannot all stay resident
    llm = make_llm(wordlevel_llama_dir, num_gpu_blocks_override=10, preemption_mode="recompute", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[t + 7 * k for t in PROMPT] for k in range(4)]
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert len({tuple(e) for e in expected}) > 1
    preempted = llm.engine.scheduler.num_preemptions
    outs = llm.generate([{"prompt_embeds": embeddings_of(llm, p)} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > preempted, "the scenario must preempt"
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(4), "2-D"),
    (torch.zeros(4, 3), "hidden size 3"),
    (torch.zeros(0, 64), "at least one row"),
    (torch.zeros(4, 64, dtype=torch.int32), "floating point"),
    (torch.full((4, 64), float("nan")), "NaN"),
    (torch.zeros(200, 64), "context is 128"),
    ([[0.0] * 64], "must be a tensor"),
])
def test_bad_embeddings_are_refused_and_hold_nothing(wordlevel_llama_dir, bad, message):
    llm = make_llm(wordlevel_llama_dir)
    free = llm.engine.scheduler.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request("bad", {"prompt_embeds": bad}, GREEDY)
    assert "bad" not in llm.engine.requests
    assert llm.engine.scheduler.block_manager.num_free_blocks == free


def test_refused_without_the_flag_and_with_prompt_logprobs(wordlevel_llama_dir):
    plain = LLM(str(wordlevel_llama_dir), device="cpu", dtype="float32", block_size=8, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds"):
        plain.engine.add_request("a", {"prompt_embeds": torch.zeros(3, 64)}, GREEDY)
    llm = make_llm(wordlevel_llama_dir)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs is not compatible"):
        llm.engine.add_request("b", {"prompt_embeds": torch.zeros(3, 64)},
                               SamplingParams(max_tokens=2, prompt_logprobs=1))
