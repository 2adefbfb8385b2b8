"""Parsing of the human units used in config: durations ("100ms", "10s") and sizes."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)\s*$")
_SCALE = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from "100ms", "2.5s", "1m". A bare number is refused: its unit would be a guess."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _SCALE[m.group(2)]
    raise ValueError(f"expected a duration such as 100ms, 10s or 2m, got {value!r}")


def format_duration(seconds: float) -> str:
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    ms = seconds * 1e3
    if ms >= 1 and abs(ms - round(ms)) < 1e-9:
        return f"{int(round(ms))}ms"
    return f"{seconds * 1e6:g}us"
