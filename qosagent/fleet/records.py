"""What agents and the allocator write under the fleet prefix in etcd, and how a record read back is checked.

    <prefix>/fleet/leader          the elected allocator (its id), on the leader's etcd lease
    <prefix>/fleet/nodes/<node>    a node's report: per tenant [demand, rate it enforces], on the node's
                                   etcd lease (a node gone frees its share when that lease expires)
    <prefix>/fleet/grants/<node>   the allocator's grant to a node: per tenant its rate; written when it changes,
                                   on the leader's lease, fenced by the leader key's create revision
    <prefix>/fleet/round           the leader's id and round, rewritten every round after the round's grants: a
                                   move of its revision is every grant's renewal (1 write, not one per node)

Records are JSON objects with a version "v". Anything else under the prefix (another program's keys, a record
of another version, a value that does not parse) is foreign or malformed: counted and skipped, never fatal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Mapping, Sequence

from qosagent.fleet.alloc import NUMBERS, Want, clean

VERSION = 1


def leader_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/fleet/leader"


def nodes_prefix(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/fleet/nodes/"


def grants_prefix(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/fleet/grants/"


def round_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/fleet/round"


class Malformed(ValueError):
    """A record under the prefix that is not one of ours, or is but does not parse: the message says why."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a rate")


def _load(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise Malformed(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise Malformed("not a JSON object")
    if doc.get("v") != VERSION:
        raise Malformed(f"version {doc.get('v')!r}, expected {VERSION}")
    return doc


@dataclass(frozen=True)
class Report:
    node: str
    tenants: Mapping[str, tuple[float, float]]  # (demand, held), as alloc.Want


def encode_report(node: str, tenants: Mapping[str, Want]) -> bytes:
    """Per tenant [demand, held]: pairs, not objects, since the allocator parses 100,000 of them a round."""
    return json.dumps({"v": VERSION, "node": node, "tenants": {
        t: [round(w.demand, 3), round(w.held, 3)] for t, w in sorted(tenants.items())}},
        separators=(",", ":")).encode()


def decode_report(key_node: str, raw: bytes, quotas: Mapping[str, float]) -> tuple[Report, list[str]]:
    """A node's report, its values clamped to [0, quota]; tenants without a fleet quota here are skipped (listed in
    the second value). Raises Malformed when the record cannot be trusted at all."""
    doc = _load(raw)
    if doc.get("node") != key_node:
        raise Malformed(f"node {doc.get('node')!r} under the key of {key_node!r}")
    tenants = doc.get("tenants")
    if not isinstance(tenants, dict):
        raise Malformed("no tenants object")
    if tenants.keys() == quotas.keys():
        fast = _pairs(tenants, quotas)
        if fast is not None:
            return Report(key_node, fast), []
    out, foreign = {}, []
    for name, v in tenants.items():
        quota = quotas.get(name)
        if quota is None:
            foreign.append(name)
            continue
        # clean() inlined, and pairs kept as the tuples JSON gave (a Want's fields, by position): this loop runs
        # 100,000 times a round for 1,000 nodes x 100 tenants. NaN and infinities were refused by the parser.
        if v.__class__ is not list or len(v) != 2:
            raise Malformed(f"tenant {name!r}: expected [demand, held]")
        d, h = v
        if d.__class__ not in NUMBERS or h.__class__ not in NUMBERS or d < 0 or h < 0:
            raise Malformed(f"tenant {name!r}: demand and held must be finite numbers >= 0")
        out[name] = (d if d < quota else quota, h if h < quota else quota)
    return Report(key_node, out), foreign


def _pairs(tenants: dict[str, Any], quotas: Mapping[str, float]) -> dict[str, tuple[float, float]] | None:
    """A report naming exactly the tenants with a fleet quota, checked and clamped column-wise (map() over
    built-ins: 100,000 pairs a round for 1,000 nodes x 100 tenants); None when any pair is not two numbers >= 0,
    for the loop of decode_report to name it."""
    pairs = list(tenants.values())
    if set(map(type, pairs)) != {list} or set(map(len, pairs)) != {2}:
        return None
    d, h = [p[0] for p in pairs], [p[1] for p in pairs]
    if not set(map(type, d)) | set(map(type, h)) <= _NUMBER_TYPES or min(d) < 0 or min(h) < 0:
        return None
    q = [quotas[t] for t in tenants]
    return dict(zip(tenants, zip(map(min, d, q), map(min, h, q))))


_NUMBER_TYPES = set(NUMBERS)


@dataclass(frozen=True)
class Grant:
    leader: str
    round: int
    tenants: Mapping[str, float]  # tenant -> rps on this node


def encode_grant(leader: str, round_: int, tenants: Sequence[str], rates: Sequence[float]) -> bytes:
    """tenants and rates in the same order (the allocator's columns, zipped)."""
    return json.dumps({"v": VERSION, "leader": leader, "round": round_,
                       "tenants": dict(zip(tenants, map(round, rates, repeat(3))))},
                      separators=(",", ":"), sort_keys=True).encode()


def encode_round(leader: str, round_: int) -> bytes:
    return json.dumps({"v": VERSION, "leader": leader, "round": round_}, separators=(",", ":")).encode()


def decode_round(raw: bytes) -> tuple[str, int]:
    """The leader's id and round number of a round record."""
    doc = _load(raw)
    if not isinstance(doc.get("leader"), str) or not isinstance(doc.get("round"), int):
        raise Malformed("expected leader and round")
    return doc["leader"], doc["round"]


def decode_grant(raw: bytes) -> Grant:
    doc = _load(raw)
    tenants = doc.get("tenants")
    if not isinstance(tenants, dict) or not isinstance(doc.get("round"), int):
        raise Malformed("expected tenants and round")
    out = {}
    for name, r in tenants.items():
        v = clean(r, 1e9)
        if v is None:
            raise Malformed(f"tenant {name!r}: rate must be a finite number >= 0")
        out[str(name)] = v
    return Grant(str(doc.get("leader")), doc["round"], out)
