"""Per-request generation parameters, with the validation the HTTP API turns into 400s."""
from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import RequestOutputKind
from .params_error import SamplingParamsError
from .structured_outputs_params import StructuredOutputsParams

MAX_N = 16          # samples (or beams) per request; more is a 400, not an OOM
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20   # the server's default --max-logprobs; the flag may raise it up to the vocabulary


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False   # True, False or "never" (HF's meanings)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 / 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16   # None = up to max-model-len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None   # top-k logprobs per generated token (0 = only the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: "StructuredOutputsParams | None" = None   # constrained decoding (structured_outputs.md)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (OpenAI's)
    allowed_token_ids: list[int] | None = None   # vLLM's: only these tokens may be drawn
    logprob_token_ids: list[int] | None = None   # vLLM's: report these tokens' logprobs (not the top-k)
    # vLLM's: at most this many tokens per thinking section, then the end marker is forced (thinking_budget.py);
    # -1 means unlimited, as None does
    thinking_token_budget: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # what each output holds (outputs.py)
    watermarking: bool | None = None   # vLLM's: False opts out of the engine's --watermark-config (None: on)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            self.thinking_token_budget = None   # vLLM's "unlimited"
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def fail(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail(f"n must be an integer between 1 and {MAX_N}, got {self.n!r}", "n")
        if not is_int(self.best_of) or not self.n <= self.best_of <= MAX_N:
            fail(f"best_of must be an integer between n ({self.n}) and {MAX_N}, got {self.best_of!r}", "best_of")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):
            if not is_num(getattr(self, name)):
                fail(f"{name} must be a finite number, got {getattr(self, name)!r}", name)
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            fail(f"top_k must be -1 (off) or a non-negative integer, got {self.top_k!r}", "top_k")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0 < self.repetition_penalty <= 2:
            fail(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            fail(f"seed must be a non-negative 64-bit integer, got {self.seed!r}", "seed")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens must not exceed max_tokens", "min_tokens")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                fail(f"each stop string must be a non-empty string of at most {MAX_STOP_STRING_LEN} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be at most {MAX_STOP_STRINGS} non-negative integers", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            # no ceiling here: the server caps it (--max-logprobs, up to the vocabulary, as vLLM does)
            if v is not None and (not is_int(v) or v < 0):
                fail(f"{name} must be a non-negative integer, got {v!r}", name)
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict)
                and all(is_int(t) and t >= 0 and is_num(b) for t, b in self.logit_bias.items())):
            fail("logit_bias must map token ids to finite numbers", "logit_bias")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids)):
                fail(f"{name} must be a non-empty list of token ids", name)
        if self.logprob_token_ids is not None and self.use_beam_search:
            fail("logprob_token_ids is not supported with beam search", "logprob_token_ids")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", "output_kind")
        if self.watermarking not in (None, True, False):
            fail(f"watermarking must be true, false or null, got {self.watermarking!r}", "watermarking")
        if self.early_stopping not in (True, False, "never"):
            fail(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}", "early_stopping")
        if self.use_beam_search:
            if self.temperature != 0 and self.temperature != 1.0:
                fail("beam search is deterministic: temperature must be 0 (or left at 1)", "temperature")
            if self.best_of < 2:
                fail("beam search needs a width (best_of, or n) of at least 2", "best_of")
        elif self.greedy and self.best_of > 1:
            fail("greedy sampling (temperature 0) with n or best_of > 1 would return identical samples", "n")
        self._validate_structured_outputs()
        self._validate_thinking_token_budget()

    def _validate_thinking_token_budget(self) -> None:
        budget = self.thinking_token_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise SamplingParamsError(f"thinking_token_budget must be a non-negative integer or -1 (unlimited), "
                                      f"got {budget!r}", "thinking_token_budget")
        if self.use_beam_search:   # beams are scored over free draws; a forced marker has no place there
            raise SamplingParamsError("thinking_token_budget is not supported with beam search",
                                      "thinking_token_budget")

    def _validate_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams", "structured_outputs")
        if self.use_beam_search:
            raise SamplingParamsError("beam search cannot be combined with structured outputs", so.param)
        if self.min_tokens:   # the grammar alone decides where the output may end
            raise SamplingParamsError("min_tokens cannot be combined with structured outputs", "min_tokens")
