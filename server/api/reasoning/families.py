"""The `--reasoning-parser` names served here, and the rest of vLLM's, which are refused by name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .think_markers import ThinkFormat

if TYPE_CHECKING:
    from pagedmodel.server.engine.reasoning_config import ReasoningConfig

# DeepSeek-R1: its template ends the prompt with <think>, so the output is thinking up to </think>.
DEEPSEEK_R1 = ThinkFormat("deepseek_r1")
# Qwen3: the same markers; a <tool_call> also ends thinking, a repeated </think> is dropped, and a prompt
# that already closed thinking (enable_thinking false) means the whole output is the answer.
QWEN3 = ThinkFormat("qwen3", implicit_ends=("<tool_call>",), drop_late_end=True, turn_start="<|im_start|>")

REASONING_PARSERS: dict[str, ThinkFormat] = {f.name: f for f in (DEEPSEEK_R1, QWEN3)}

# vLLM 0.33's other parser names: a command line naming one must fail loudly, never run without it.
VLLM_REASONING_PARSERS = (
    "beam", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3",
    "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse", "muse_glimmer", "musespark1x", "nemotron_v3",
    "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "seed_oss", "step3", "step3p5", "step5",
)


def check_reasoning_parser(name: str | None, where: str | None = None) -> None:
    """ValueError with the served names when ``name`` is not one of them; ``where`` names the setting (by
    default the flag with its value)."""
    if name is None or name in REASONING_PARSERS:
        return
    known = ", ".join(sorted(REASONING_PARSERS))
    what = "vLLM's reasoning parser" if name in VLLM_REASONING_PARSERS else "reasoning parser"
    raise ValueError(f"{where or f'--reasoning-parser {name}'}: {what} {name!r} is not served here; served: {known}")


def engine_reasoning_config(parser: str | None, config: "ReasoningConfig | None") -> "ReasoningConfig | None":
    """The engine's reasoning config, as vLLM builds it: --reasoning-parser alone makes one of the parser's
    markers (thinking budgets then work without --reasoning-config), and names the parser of a given one,
    whose empty strings the parser's markers fill. ValueError for a parser not served here."""
    from pagedmodel.server.engine.reasoning_config import ReasoningConfig

    name = parser or (config.reasoning_parser if config is not None else "")
    if not name:
        return config
    if parser is None:   # named in --reasoning-config only: the same rule as the flag's
        check_reasoning_parser(name, "--reasoning-config reasoning_parser")
    fmt = REASONING_PARSERS[name]
    return (config or ReasoningConfig()).with_parser(name, fmt.start, fmt.end)
