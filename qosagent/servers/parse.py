"""A metrics exposition → the fields admission reads (pure: text in, values and reasons out).

Parsed with prometheus_client's own parser. A field is a number or absent with a reason, never a made-up zero:
a server that does not export a field, a NaN, an infinity or a value out of range leave that field unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qosagent.servers import kinds
from qosagent.servers.kinds import KV

# A server process exports its start time (prometheus_client's process collector does so for vLLM, SGLang and
# TGI's Python shards): a new value means a restart even when the pid could not be seen.
START_TIME = "process_start_time_seconds"


class ExpositionError(Exception):
    """The body is not a metrics exposition (HTML, garbage, a truncated line); the message says what was seen."""


@dataclass(frozen=True)
class Parsed:
    kind: str  # the kind whose names were read (an auto or generic server's kind found from its names)
    values: dict[str, float] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # field -> why unknown
    start_time: float | None = None


def _valid(name: str, v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "infinite"
    if v < 0:
        return f"negative ({v:g})"
    if name == KV and v > 1.0 + 1e-6:
        return f"above 1 ({v:g})"
    return ""


def _wanted(kind_name: str) -> tuple[str, ...]:
    ks = [kinds.kind(kind_name)] if kinds.kind(kind_name) is not kinds.GENERIC else list(kinds.KINDS.values())
    names = {src.sample for k in ks for sources in k.fields.values() for src in sources}
    return tuple(sorted(n + sep for n in names | {START_TIME} for sep in ("{", " ")))


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    # Imported on the first reading: an agent that reads no server's metrics never loads the parser.
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
    except (ValueError, TypeError, IndexError) as e:
        raise ExpositionError(f"not a metrics exposition: {e}") from None
    return samples


def parse(text: str, kind_name: str, kv_capacity: float | None = None) -> Parsed:
    """Raises ExpositionError when the text is not an exposition at all. kv_capacity: the KV pool in tokens, for a
    kind that reports its usage in tokens (TGI)."""
    head = text.lstrip()[:64].lower()
    if head.startswith(("<!doctype", "<html", "<?xml", "{", "[")):
        raise ExpositionError(f"not a metrics exposition (starts {text.lstrip()[:24]!r})")
    # Only the lines of the samples read go through the parser: a vLLM exposition is mostly histogram buckets, and
    # parsing all of it every second costs ~40x more (docs/servers.md, "Cost").
    wanted = _wanted(kind_name)
    samples = _samples("\n".join(line for line in text.splitlines() if line.startswith(wanted)) + "\n")
    if not samples:
        # None of the names read: garbage, empty, or an exposition without them (its names then tell the kind).
        samples = _samples(text)
        if not samples:
            raise ExpositionError("empty exposition")
        found = kinds.from_exposition(set(samples)) if kinds.kind(kind_name) is kinds.GENERIC else None
        if found:
            return parse(text, found, kv_capacity)
    name = kind_name
    if kinds.kind(name) is kinds.GENERIC:
        name = kinds.from_exposition(set(samples)) or kinds.GENERIC.name
    k = kinds.kind(name)
    values: dict[str, float] = {}
    missing: dict[str, str] = {}
    for fld in kinds.FIELDS:
        sources = k.fields.get(fld)
        if not sources:
            missing[fld] = f"not exported by {k.name}"
            continue
        got: list[float] | None = None
        for src in sources:
            rows = samples.get(src.sample)
            if rows is None:
                continue
            if src.label is not None:
                rows = [r for r in rows if r[0].get(src.label[0]) == src.label[1]]
                if not rows:
                    continue
            got = [v for _, v in rows]
            break
        if got is None:
            missing[fld] = f"{sources[0].sample} absent"
            continue
        if fld == KV and k.kv_capacity is not None:
            if not kv_capacity or kv_capacity <= 0:
                missing[fld] = f"{k.kv_capacity[1]} unknown (read from {k.kv_capacity[0]})"
                continue
            got = [v / kv_capacity for v in got]
        bad = next((why for v in got if (why := _valid(fld, v))), "")
        if bad:
            missing[fld] = f"{bad} from the server"
            continue
        # Several series (models, engines, data-parallel ranks): the fullest cache decides, requests add up.
        values[fld] = max(got) if fld == KV else sum(got)
    start = samples.get(START_TIME)
    start_time = start[0][1] if start and not math.isnan(start[0][1]) else None
    return Parsed(k.name, values, missing, start_time)
