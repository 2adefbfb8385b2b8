"""The kernel's cpulist notation ("0-3,8,10-11"), used by sysfs, /proc/PID/status and cgroup cpusets.

cpufreq's related_cpus lists CPUs separated by spaces ("0 1 2 3"); the same parser reads both."""

from __future__ import annotations

from typing import Iterable


def parse_cpulist(text: str) -> frozenset[int]:
    """CPUs of a cpulist; an empty string is the empty set. Raises ValueError on anything else."""
    out: set[int] = set()
    for part in text.replace(" ", ",").strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r}") from None
        if a < 0 or b < a:
            raise ValueError(f"not a cpulist: {text!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int] | None) -> str:
    if cpus is None:
        return "-"
    xs = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)
