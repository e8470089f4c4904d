"""The form a round's record is kept and written in: times to 0.1 ms, and values computed in
float32 (a loss or a statistic of a float32 tensor) as the shortest decimal that reads back as the
same float32. Neither loses information: a clock's digits below 0.1 ms are noise, and a float32
has no more digits to give. Printing every float with the 17 digits of a float64 instead made a
packed cell 14-30 % larger."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: time fields (seconds) are kept to this many decimals
TIME_DECIMALS = 4


def recorded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` in the form pflkit keeps and writes (a new dict; nested dicts and lists too)."""
    return {key: _value(key.endswith("seconds"), value) for key, value in record.items()}


def _value(is_time: bool, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _value(is_time, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_value(is_time, v) for v in value]
    if type(value) is not float or not math.isfinite(value) or value == int(value):
        return value
    if is_time:
        return round(value, TIME_DECIMALS)
    single = np.float32(value)
    if float(single) != value:
        return value  # a float64 value: every digit counts
    return float(str(single))  # the shortest decimal of that float32
