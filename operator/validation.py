"""The operator's value checks, in one place: the spec validator, the autoscaling and tuning policies and
the state read back from status all ask the same questions (an int that is not a bool, a finite number)
and word their errors the same way."""
from __future__ import annotations

import math
from typing import Any, Callable, NoReturn

Fail = Callable[[str], NoReturn]


def is_int(v: Any) -> bool:
    """An int and not a bool (True is an int subclass; as a replica count it is a bug upstream)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v: Any) -> bool:
    return is_num(v) and math.isfinite(v)


def failer(what: str) -> Fail:
    """A function that raises ValueError("<what>: <message>")."""
    def fail(msg: str) -> NoReturn:
        raise ValueError(f"{what}: {msg}")
    return fail


def check_int(fail: Fail, name: str, v: Any, lo: int) -> None:
    if not (is_int(v) and v >= lo):
        fail(f"{name} must be an integer >= {lo}, not {v!r}")


def check_number(fail: Fail, name: str, v: Any, *, positive: bool = False) -> None:
    """A finite number >= 0 (> 0 when `positive`)."""
    if not (finite(v) and (v > 0 if positive else v >= 0)):
        fail(f"{name} must be a number {'> 0' if positive else '>= 0'}, not {v!r}")
