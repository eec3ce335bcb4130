"""`--reasoning-parser`: the thinking part of a chat answer goes to `reasoning`, the rest to `content`.

think_markers.py splits text (whole or streamed), families.py names the formats served, request_plan.py
decides per request where the output starts and whether the reasoning is returned.
"""
from __future__ import annotations

from .families import REASONING_PARSERS, VLLM_REASONING_PARSERS, check_reasoning_parser, engine_reasoning_config
from .request_plan import ReasoningPlan, plan_reasoning
from .think_markers import Split, StartMode, ThinkFormat, ThinkSplitter, split_text

__all__ = ["REASONING_PARSERS", "VLLM_REASONING_PARSERS", "ReasoningPlan", "Split", "StartMode", "ThinkFormat",
           "ThinkSplitter", "check_reasoning_parser", "engine_reasoning_config", "plan_reasoning",
           "split_text"]
