"""Resource quantities ("500m", "2", "64Gi") as numbers, for the scheduler's fit check."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIX = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: str | int | float) -> Decimal:
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    m = re.fullmatch(r"\s*([+-]?[0-9.]+(?:[eE][+-]?\d+)?)\s*(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\s*", str(value))
    if not m:
        raise ValueError(f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
                         f": {value!r}")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation:
        raise ValueError(f"invalid quantity {value!r}") from None
