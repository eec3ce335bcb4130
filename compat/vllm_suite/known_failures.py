"""Why each of vLLM's HTTP tests that fails against pagedmodel fails (run.py reports any other as NEW).

Keys are test ids or their prefixes (a file, or a test without its parameters). Each reason starts with its
kind: ``model`` (the test asserts what its own, larger model answers, or counts its tokenizer's tokens:
SmolLM2-135M stands in for every model here), ``feature`` (a vLLM feature we do not serve; the server
refuses the flag or field at start or with a 400), ``multimodal``, ``wording`` (the same refusal, other
words) or ``shim`` (an artefact of serving SmolLM2 under another model's name).
"""

_F = "tests/entrypoints/openai/"
_CHAT = _F + "chat_completion/"
_COMP = _F + "completion/"

MODEL = "model: asserts what its own, larger model answers; SmolLM2-135M answers otherwise"
TOKENIZER = "model: counts its own tokenizer's tokens (SmolLM2's tokenizer gives another count)"
THINKING = "model: needs a model that thinks (<think>...</think>); SmolLM2 answers without, so all is reasoning"
TOOL_MODEL = "model: needs a model trained to call tools (Qwen3); SmolLM2 does not emit a <tool_call> unforced"
THINKING_TOOLS = (THINKING + "; and here a forced call's grammar holds from the first token, where vLLM's starts "
                  "after </think> (docs/vllm_compat.md)")

KNOWN: dict[str, str] = {
    # model size
    _CHAT + "test_chat.py::test_more_than_one_prompt_logprobs_chat": MODEL + " (prompt token 3 outside its top 1)",
    _CHAT + "test_chat.py::test_single_chat_session": TOKENIZER,
    _CHAT + "test_chat.py::test_structured_outputs_choice_chat": MODEL + " (expects a different pick on the second ask)",
    _CHAT + "test_chat.py::test_structured_outputs_regex_chat": MODEL + " (expects a different match on the second ask)",
    _CHAT + "test_chat.py::test_response_format_json_schema": MODEL + " (expects {'result': 2})",
    _CHAT + "test_chat.py::test_complex_message_content": MODEL + " (expects exactly '2')",
    _CHAT + "test_include_reasoning.py::test_include_reasoning_": THINKING,
    _CHAT + "test_completion_with_function_calling.py::test_function_tool_use[plain-False-auto-": TOOL_MODEL,
    _CHAT + "test_completion_with_function_calling.py::test_function_tool_use[plain-True-": THINKING_TOOLS,
    # the same tests under --watermark-config fail as their plain twins do
    _CHAT + "test_completion_with_function_calling.py::test_function_tool_use[watermarked-False-auto-": TOOL_MODEL,
    _CHAT + "test_completion_with_function_calling.py::test_function_tool_use[watermarked-True-": THINKING_TOOLS,
    _CHAT + "test_thinking_token_budget.py::test_thinking_token_budget_limits_reasoning":
        THINKING + " (SmolLM2's template opens no <think> and the model writes none: no section to count)",
    _CHAT + "test_completion_with_function_calling.py::test_named_tool_use":
        MODEL + " (SmolLM2 fills a string argument until max_tokens, so the JSON is cut)",
    _CHAT + "test_completion_with_function_calling.py::test_no_args_tool_call": TOOL_MODEL,
    _F + "test_return_token_ids.py::test_chat_completion_with_tool_use": TOOL_MODEL,
    _F + "test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs":
        MODEL + " (SmolLM2 ends within 20 tokens: the EOS token is in token_ids, not in the text, as in vLLM)",
    _COMP + "test_completion.py::test_single_completion": TOKENIZER,
    _COMP + "test_completion.py::test_completion_streaming": MODEL + " (SmolLM2 stops before max_tokens)",
    _COMP + "test_completion.py::test_parallel_": MODEL + " (SmolLM2 ends two of three samples at once)",
    _COMP + "test_completion_with_prompt_embeds.py::test_completions_with_prompt_embeds[use-lora-facebook/opt-125m]":
        MODEL + " (SmolLM2 ends 'What is an LLM?' at once, as embeddings and as text alike: EOS first)",
    _COMP + "test_completion_with_prompt_embeds.py::test_completions_with_logprobs_and_prompt_embeds[use-lora-facebook/":
        MODEL + " (SmolLM2 ends 'What is an LLM?' at once, so 1 logprob where 5 are expected; the adapter's pass)",
    # features we do not serve
    _COMP + "test_tensorizer_entrypoint.py": (
        "feature: tensorizer weights (--load-format tensorizer, CoreWeave's format), refused at start; its fixture "
        "writes them with vLLM's own engine (tensorize_vllm_model, a vLLM-internal Python API) and its one test "
        "then counts Llama-3.2's tokens (6 for 'Hello, my name is'; SmolLM2's tokenizer gives 5)"),
    # multimodal
    _CHAT + "test_extra_content_fields.py": "multimodal: an image-text model (translategemma)",
    _F + "test_openai_schema.py": "multimodal: the whole API of a vision model (SmolVLM)",
    # the shim
}

NOT_OVER_HTTP: dict[str, str] = {}
