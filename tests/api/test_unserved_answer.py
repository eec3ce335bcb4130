"""The engine's refusals of a request it has not started carry X-PagedModel-Unserved, so a router
retries them on another replica; the draining one also tells a direct client when to come back."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedmodel.server.api.errors import UNSERVED_HEADER, APIError
from pagedmodel.server.api.serving import OpenAIServing


@pytest.mark.parametrize("draining, healthy, code", [(True, True, "shutting_down"), (False, False, "engine_dead")])
def test_refusals_before_start_are_marked_unserved(draining, healthy, code):
    state = SimpleNamespace(draining=draining, async_engine=SimpleNamespace(is_healthy=healthy, dead_reason="x"))
    with pytest.raises(APIError) as exc:
        OpenAIServing.check_accepting(state)   # type: ignore[arg-type]
    assert exc.value.status == 503 and exc.value.code == code
    assert exc.value.headers[UNSERVED_HEADER] == code


def test_an_accepting_engine_raises_nothing():
    state = SimpleNamespace(draining=False, async_engine=SimpleNamespace(is_healthy=True, dead_reason=None))
    OpenAIServing.check_accepting(state)   # type: ignore[arg-type]
