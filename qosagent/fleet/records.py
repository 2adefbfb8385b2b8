"""What agents and the allocator write under the fleet prefix in etcd, and how a record read back is checked.

    <prefix>/fleet/leader          the elected allocator (its id), on the leader's etcd lease
    <prefix>/fleet/nodes/<node>    a node's report: per tenant demand and the rate it enforces, on the node's
                                   etcd lease (a node gone frees its share when that lease expires)
    <prefix>/fleet/grants/<node>   the allocator's grant to a node: per tenant its rate; written when it changes,
                                   on the leader's lease, fenced by the leader key's create revision
    <prefix>/fleet/round           the leader's id and round, rewritten every round after the round's grants: a
                                   move of its revision is every grant's renewal (1 write, not one per node)

Reports and grants are packed binary (the allocator reads 1,000 reports of 100 tenants and may write as many
grants a round: as JSON, decoding and encoding them was two thirds of its CPU), little-endian:

    report   b"QFR" version:u8  node:str  tenants:names  demand:f64[n]  held:f64[n]
    grant    b"QFG" version:u8  leader:str  round:u64  tenants:names  rate:f64[n]
    str      length:u16 then UTF-8;  names: count:u32, length:u32, then the names in UTF-8 joined by "\\n"

The leader record is the leader's id, the round record a small JSON object with a version "v". Anything else
under the prefix (another program's keys, a record of another version, one that does not parse, a rate that is
not a finite number >= 0) is foreign or malformed: counted and skipped, never fatal.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple, Sequence

if TYPE_CHECKING:
    import numpy as np  # imported where used: only the allocator decodes reports, and an agent never loads numpy

VERSION = 2  # of the packed reports and grants; v1 was JSON (a v1 record is refused: docs/fleet.md, upgrades)
ROUND_VERSION = 1
REPORT_MAGIC = b"QFR"
GRANT_MAGIC = b"QFG"
_STR = struct.Struct("<H")
_NAMES = struct.Struct("<II")
_ROUND = struct.Struct("<Q")


class Want(NamedTuple):
    """One node's report for one tenant: request starts per second it saw (admitted + dropped) and the rate it
    enforces now (its grant, or its safe share)."""

    demand: float
    held: float


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


def _str(s: str) -> bytes:
    b = s.encode()
    return _STR.pack(len(b)) + b


def names_block(names: Sequence[str]) -> bytes:
    """The tenants' names as records carry them (the same for every grant of a round: built once)."""
    b = "\n".join(names).encode()
    return _NAMES.pack(len(names), len(b)) + b


class _Reader:
    """A packed record read front to back; every short or bad field is Malformed, never an IndexError."""

    def __init__(self, raw: bytes, magic: bytes):
        if raw[:3] != magic:
            raise Malformed(f"not a packed record (starts {raw[:4]!r}, expected {magic!r})")
        if len(raw) < 4 or raw[3] != VERSION:
            raise Malformed(f"version {raw[3] if len(raw) > 3 else None}, expected {VERSION}")
        self.raw, self.at = raw, 4

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.raw):
            raise Malformed("truncated")
        b = self.raw[self.at:self.at + n]
        self.at += n
        return b

    def str(self) -> str:
        try:
            return self.take(_STR.unpack(self.take(_STR.size))[0]).decode()
        except UnicodeDecodeError:
            raise Malformed("a name is not UTF-8") from None

    def names(self) -> tuple[int, bytes]:
        """The count and the block as written (the allocator's cache key: its bytes, not parsed again)."""
        start = self.at
        n, length = _NAMES.unpack(self.take(_NAMES.size))
        self.take(length)
        return n, self.raw[start:self.at]

    def end(self) -> None:
        if self.at != len(self.raw):
            raise Malformed(f"{len(self.raw) - self.at} bytes past the end")


def _not_rates(names: Sequence[str], good: Iterable[bool]) -> Malformed:
    bad = [t for t, ok in zip(names, good) if not ok]
    return Malformed(f"tenants {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}: a rate that is not a finite "
                     "number >= 0")


def _parse_names(block: bytes, n: int) -> list[str]:
    try:
        names = block[_NAMES.size:].decode().split("\n") if n else []
    except UnicodeDecodeError:
        raise Malformed("tenant names are not UTF-8") from None
    if len(names) != n or len(set(names)) != n:
        raise Malformed(f"{n} tenants announced, {len(set(names))} distinct names")
    return names


def encode_report(node: str, tenants: Mapping[str, Want]) -> bytes:
    names = sorted(tenants)
    return b"".join((REPORT_MAGIC, bytes((VERSION,)), _str(node), names_block(names),
                     struct.pack(f"<{2 * len(names)}d", *(tenants[t].demand for t in names),
                                 *(tenants[t].held for t in names))))


@dataclass(frozen=True)
class Report:
    """A node's report in the decoder's tenants' order: 0 for a tenant it does not name."""

    node: str
    demand: np.ndarray
    held: np.ndarray


class Reports:
    """Decodes reports against the tenants with a fleet quota (in `names`' order). A names block seen before
    costs one dict lookup: every report of a fleet with the same config carries the same one."""

    def __init__(self, quotas: Mapping[str, float]):
        import numpy as np

        self.names = sorted(quotas)
        self.quota = np.array([quotas[t] for t in self.names], dtype=float)
        self._blocks: dict[bytes, tuple[np.ndarray | None, list[str], list[str]]] = {}

    def _layout(self, block: bytes, n: int) -> tuple[np.ndarray | None, list[str], list[str]]:
        """Where each named tenant goes in names' order (None: it is names itself), the foreign names, and the
        names as written (for messages)."""
        got = self._blocks.get(block)
        if got is None:
            import numpy as np

            names = _parse_names(block, n)
            where = {t: i for i, t in enumerate(self.names)}
            idx = None if names == self.names else np.array([where.get(t, -1) for t in names], dtype=np.intp)
            got = idx, [t for t in names if t not in where], names
            if len(self._blocks) > 64:  # configs in a rolling change: a handful; anything more is noise
                self._blocks.clear()
            self._blocks[block] = got
        return got

    def decode(self, key_node: str, raw: bytes) -> tuple[Report, list[str]]:
        """The report, its rates clamped to [0, quota]; tenants without a fleet quota here are skipped (the second
        value). Raises Malformed when the record cannot be trusted at all."""
        import numpy as np

        r = _Reader(raw, REPORT_MAGIC)
        node = r.str()
        if node != key_node:
            raise Malformed(f"node {node!r} under the key of {key_node!r}")
        n, block = r.names()
        idx, foreign, names = self._layout(block, n)
        both = np.frombuffer(r.take(16 * n), dtype="<f8").reshape(2, n)
        ok = (both >= 0) & (both < np.inf)  # NaN fails both
        if not ok.all():
            raise _not_rates(names, ok.all(axis=0))
        r.end()
        demand, held = both
        if idx is not None:
            known = idx >= 0
            d, h = np.zeros(len(self.names)), np.zeros(len(self.names))
            d[idx[known]], h[idx[known]] = demand[known], held[known]
            demand, held = d, h
        return Report(node, np.minimum(demand, self.quota), np.minimum(held, self.quota)), foreign


@dataclass(frozen=True)
class Grant:
    leader: str
    round: int
    tenants: Mapping[str, float]  # tenant -> rps on this node


def grant_head(leader: str, round_: int) -> bytes:
    """What every grant of a round starts with (then names_block, then the node's rates)."""
    return GRANT_MAGIC + bytes((VERSION,)) + _str(leader) + _ROUND.pack(round_)


def decode_grant(raw: bytes) -> Grant:
    r = _Reader(raw, GRANT_MAGIC)
    leader = r.str()
    (round_,) = _ROUND.unpack(r.take(_ROUND.size))
    n, block = r.names()
    names = _parse_names(block, n)
    rates = struct.unpack(f"<{n}d", r.take(8 * n))
    good = [0 <= x < math.inf for x in rates]  # NaN fails
    if not all(good):
        raise _not_rates(names, good)
    r.end()
    return Grant(leader, round_, dict(zip(names, rates)))


def _load(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise Malformed(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise Malformed("not a JSON object")
    if doc.get("v") != ROUND_VERSION:
        raise Malformed(f"version {doc.get('v')!r}, expected {ROUND_VERSION}")
    return doc


def encode_round(leader: str, round_: int) -> bytes:
    return json.dumps({"v": ROUND_VERSION, "leader": leader, "round": round_}, separators=(",", ":")).encode()


def decode_round(raw: bytes) -> tuple[str, int]:
    """The leader's id and round number of a round record."""
    doc = _load(raw)
    if not isinstance(doc.get("leader"), str) or not isinstance(doc.get("round"), int):
        raise Malformed("expected leader and round")
    return doc["leader"], doc["round"]
