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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB)?\s*$")
_BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "kB": 1000, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4}


def parse_size(value: object) -> int:
    """Bytes from "8GiB", "512MiB", "2GB" or a whole number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _BYTES[m.group(2) or "B"])
    raise ValueError(f"expected a size such as 512MiB or 8GiB, got {value!r}")


def format_size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _BYTES[unit] and n % _BYTES[unit] == 0:
            return f"{n // _BYTES[unit]}{unit}"
    return f"{n}B"


def approx_size(n: int) -> str:
    """A size in the largest unit it fills, whole where it is ("4GiB"), else to a tenth ("5.9GiB"): what the kernel
    reports (a cgroup's memory use) is rarely whole, and format_size would write it in KiB or bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _BYTES[unit]:
            return f"{n // _BYTES[unit]}{unit}" if n % _BYTES[unit] == 0 else f"{n / _BYTES[unit]:.1f}{unit}"
    return f"{n}B"
