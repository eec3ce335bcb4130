"""Which of vLLM's tests (tests/entrypoints/openai/ in its source distribution) start an HTTP server and
talk to it: the files run.py runs. The rest test vLLM's Python objects and are listed, with why, in
known_failures.NOT_OVER_HTTP."""

SUITE = [
    "tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py",
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion_with_prompt_embeds.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py",
    "tests/entrypoints/openai/chat_completion/test_extra_content_fields.py",
    "tests/entrypoints/openai/chat_completion/test_include_reasoning.py",
    "tests/entrypoints/openai/chat_completion/test_logprob_token_ids.py",
    "tests/entrypoints/openai/chat_completion/test_root_path.py",
    "tests/entrypoints/openai/chat_completion/test_thinking_token_budget.py",
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/completion/test_completion_with_prompt_embeds.py",
    "tests/entrypoints/openai/completion/test_prompt_validation.py",
    "tests/entrypoints/openai/completion/test_tensorizer_entrypoint.py",
    "tests/entrypoints/openai/completion/test_token_in_token_out.py",
    "tests/entrypoints/openai/models/test_models.py",
    "tests/entrypoints/openai/test_chunked_prompt.py",
    "tests/entrypoints/openai/test_openai_schema.py",
    "tests/entrypoints/openai/test_return_token_ids.py",
    "tests/entrypoints/openai/test_return_tokens_as_ids.py",
]
