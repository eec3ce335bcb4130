"""operator/validation.py: the shared checks refuse bools as numbers, non-finite numbers and values under
their bound, with one wording."""
from __future__ import annotations

import math

import pytest

from pagedmodel.operator.validation import check_int, check_number, failer, finite, is_int, is_num


def test_predicates() -> None:
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_num(3) and is_num(2.5) and not is_num(False) and not is_num("1")
    assert finite(1e300) and not finite(math.inf) and not finite(math.nan) and not finite(True)


@pytest.mark.parametrize("value", [True, -1, 2.0, "3", None])
def test_check_int_refuses(value) -> None:
    with pytest.raises(ValueError, match=r"^policy: n must be an integer >= 0, not "):
        check_int(failer("policy"), "n", value, 0)


@pytest.mark.parametrize("value,positive", [(0, True), (-0.5, False), (math.inf, False), (math.nan, True),
                                            (True, False), ("1", False)])
def test_check_number_refuses(value, positive) -> None:
    with pytest.raises(ValueError, match=r"^policy: x must be a number (> 0|>= 0), not "):
        check_number(failer("policy"), "x", value, positive=positive)


def test_checks_accept_what_is_in_bounds() -> None:
    check_int(failer("p"), "n", 0, 0)
    check_number(failer("p"), "x", 0, positive=False)
    check_number(failer("p"), "x", 0.1, positive=True)
