"""Adapter affinity: which upstreams may take a request for a given `model`, best first. Pure functions.

An engine serves its base model and the LoRA adapters loaded into it (`/v1/models` lists them, each
adapter with `parent`); a request names one in `model`. Only upstreams that list the name can serve
it; the rest would answer 404 after a wasted round trip. Among those, an upstream where the adapter is
resident (`vllm:lora_requests_info` names it among the adapters of running or waiting requests, so it
holds a slot or is about to) serves it without loading weights into a slot; next best is one with a
free slot (fewer distinct adapters in use than `max_lora`), which loads it without waiting for another
adapter's requests to finish; last, one whose slots are all in use, where the request queues for a slot.

Affinity narrows the candidates and the router's `--strategy` then picks among them by its own
load/KV/prefix score, so affinity composes with every strategy. A resident upstream holding more than
the bounded-load share of the model's traffic (`strategies.bounded_load` over the upstreams serving it)
stops counting as resident, so a hot adapter spills to other replicas (which load it) instead of piling
onto the first one that had it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pagedmodel import metrics_contract as mc
from .strategies import UpstreamView, bounded_load


@dataclass(frozen=True)
class ModelServing:
    """What one upstream serves, as the router last saw it."""

    served: frozenset[str] | None = None      # every name /v1/models lists; None until fetched
    base: str | None = None                   # the card without a parent (the engine's own model)
    running: frozenset[str] = frozenset()     # adapters of its running requests (vllm:lora_requests_info)
    waiting: frozenset[str] = frozenset()     # adapters of its waiting requests
    max_lora: int | None = None               # its --max-loras, when exported

    @property
    def resident(self) -> frozenset[str]:
        return self.running | self.waiting

    def has_free_slot(self) -> bool:
        return self.max_lora is None or self.max_lora <= 0 or len(self.resident) < self.max_lora


class Served(Enum):
    YES = "yes"           # some upstream lists the name
    NO = "no"             # upstreams have answered /v1/models and none lists it
    UNKNOWN = "unknown"   # no upstream's list is known yet (starting, unreachable, /v1/models refused)


class Outcome(str, Enum):
    """How a pick for a named model went (the router's adapter-routing counter uses the values)."""

    BASE = "base"             # the base model: every upstream serving it is equal
    HIT = "hit"               # an adapter, sent where it is resident
    FREE_SLOT = "free_slot"   # an adapter, sent where it must be loaded into a free slot
    NO_SLOT = "no_slot"       # an adapter, sent where every slot is in use (it waits for one)
    UNVERIFIED = "unverified"   # no upstream's model list known: sent anywhere, the engine's answer decides
    NONE = "none"             # no upstream available serves it now (the request waits in the queue)


@dataclass(frozen=True)
class Affinity:
    candidates: list[UpstreamView]
    outcome: Outcome


def parse_models(body: Any) -> tuple[frozenset[str], str | None]:
    """(every served name, the base model's name) from an OpenAI `/v1/models` list; ValueError if malformed."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("a /v1/models answer must be an object with a `data` list")
    names, base = set(), None
    for card in data:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise ValueError("every /v1/models card needs a string `id`")
        names.add(card["id"])
        if card.get("parent") is None and base is None:
            base = card["id"]
    return frozenset(names), base


def parse_lora_info(metrics_text: str) -> tuple[frozenset[str], frozenset[str], int | None]:
    """(running, waiting, max_lora) from an engine's `vllm:lora_requests_info`; empty when it has none.

    vLLM may export several samples (one per change, the value being its time): the newest counts.
    """
    newest = None
    for sample in mc.parse(metrics_text):
        if sample.name == mc.LORA_REQUESTS_INFO.name and (newest is None or sample.value >= newest.value):
            newest = sample
    if newest is None:
        return frozenset(), frozenset(), None

    def names(label: str) -> frozenset[str]:
        return frozenset(n for n in newest.labels.get(label, "").split(",") if n)
    try:
        max_lora = int(float(newest.labels.get("max_lora", "")))
    except ValueError:
        max_lora = None
    return names("running_lora_adapters"), names("waiting_lora_adapters"), max_lora


def served_names(servings: Mapping[str, ModelServing]) -> list[str]:
    """The union of what the upstreams serve, sorted (the router's /v1/models, and its 404 message)."""
    return sorted({name for s in servings.values() if s.served is not None for name in s.served})


def is_served(model: str, servings: Mapping[str, ModelServing]) -> Served:
    known = [s for s in servings.values() if s.served is not None]
    if any(model in s.served for s in known):   # type: ignore[operator]
        return Served.YES
    return Served.NO if known else Served.UNKNOWN


def choose(model: str | None, views: Sequence[UpstreamView], servings: Mapping[str, ModelServing],
           load_factor: float = 1.25) -> Affinity:
    """The upstreams among `views` (those that can take a request now) the strategy should pick from."""
    if model is None:
        return Affinity(list(views), Outcome.BASE)
    serving = [v for v in views if _lists(servings.get(v.url), model)]
    if not serving:
        # Upstreams whose list is unknown might serve it; only when none is known at all (a fresh start):
        # the request is not refused, the engine's own answer decides.
        if any(s.served is not None for s in servings.values()):
            return Affinity([], Outcome.NONE)
        return Affinity(list(views), Outcome.UNVERIFIED if views else Outcome.NONE)
    if all(servings[v.url].base == model for v in serving):
        return Affinity(serving, Outcome.BASE)
    cap = bounded_load(serving, load_factor)
    resident = [v for v in serving if model in servings[v.url].resident and v.inflight < cap]
    if resident:
        return Affinity(resident, Outcome.HIT)
    free = [v for v in serving if servings[v.url].has_free_slot()]
    if free:
        return Affinity(free, Outcome.FREE_SLOT)
    return Affinity(serving, Outcome.NO_SLOT)


def _lists(serving: ModelServing | None, model: str) -> bool:
    return serving is not None and serving.served is not None and model in serving.served
