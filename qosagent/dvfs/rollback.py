"""Originals of every knob DVFS touches, saved before the first write and persisted, so a crash can be undone.

The file (state_dir/dvfs-originals.json) lists knobs in first-write order. Each entry keeps the original value
and the values that are ours: the last value read back after our write, plus the value of a write in flight (a
crash between write and bookkeeping must still count as ours). Restoring walks the entries in reverse, writes the
original back only where the value is still ours, and leaves alone (and reports) a value someone else set.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Protocol

from qosagent import statefile
from qosagent.capability import CapabilityError

log = logging.getLogger("qosagent.dvfs")

FILE_NAME = "dvfs-originals.json"
VERSION = 1


class KnobIO(Protocol):
    """Reads and writes a knob by key ("file:/sys/...", "gpu:0:power_limit"); raises OSError or GpuError.

    read() returns None for a knob that cannot be read back at all (NVML's locked clocks): it is taken as ours."""

    def read(self, key: str) -> str | None: ...

    def write(self, key: str, value: str) -> None: ...


@dataclass
class Entry:
    original: str
    ours: list[str] = field(default_factory=list)


class Originals:
    def __init__(self, state_dir: str | None, host_root: str):
        # None: kept in memory only (dry-run never writes, so it never needs to restore).
        self.path = os.path.join(state_dir, FILE_NAME) if state_dir else None
        self.host_root = host_root
        self.entries: dict[str, Entry] = {}

    @classmethod
    def load(cls, state_dir: str, host_root: str) -> "Originals":
        """What a previous agent left; raises ValueError for a file that cannot be ours (it is then kept)."""
        o = cls(state_dir, host_root)
        assert o.path is not None
        data = statefile.load_json(o.path)
        if data is None:
            return o
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise statefile.StateFileError(f"{o.path}: not a version {VERSION} DVFS originals file")
        if data.get("host_root") != host_root:
            raise statefile.StateFileError(
                f"{o.path}: saved for host root {data.get('host_root')!r}, not {host_root!r}")
        for e in data.get("entries", []):
            o.entries[str(e["key"])] = Entry(str(e["original"]), [str(v) for v in e.get("ours", [])])
        return o

    def __bool__(self) -> bool:
        return bool(self.entries)

    def _persist(self) -> None:
        if self.path is None:
            return
        if not self.entries:
            statefile.remove(self.path)
            return
        statefile.save_json(self.path, {
            "version": VERSION, "host_root": self.host_root,
            "entries": [{"key": k, "original": e.original, "ours": e.ours} for k, e in self.entries.items()]})

    def original(self, key: str) -> str | None:
        e = self.entries.get(key)
        return e.original if e else None

    def is_ours(self, key: str, current: str) -> bool:
        """Whether current is what we left (or the original); False: someone else changed the knob."""
        e = self.entries.get(key)
        return e is None or current == e.original or current in e.ours

    def before_write(self, key: str, current: str, value: str) -> None:
        e = self.entries.setdefault(key, Entry(current))
        if value not in e.ours:
            e.ours.append(value)
        self._persist()

    def after_write(self, key: str, read_back: str) -> None:
        self.entries[key].ours = [read_back]
        self._persist()

    def restore(self, io: KnobIO) -> list[str]:
        """Put originals back, newest first. Knobs that could not be read or written stay for a later try."""
        lines: list[str] = []
        kept: dict[str, Entry] = {}
        for key in reversed(list(self.entries)):
            e = self.entries[key]
            try:
                current = io.read(key)
            except Exception as exc:  # noqa: BLE001 - OSError or GpuError: report and keep for a later try
                if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
                    # The knob is gone (CPU unplugged, driver unloaded): its value went with it.
                    lines.append(f"dvfs: {key}: gone, nothing to restore")
                    continue
                lines.append(f"dvfs: {key}: cannot read ({exc}); original {e.original} kept for a later restore")
                kept[key] = e
                continue
            if current == e.original or (current is None and e.ours == [e.original]):
                continue
            if current is not None and current not in e.ours:
                lines.append(f"dvfs: {key}: left alone, changed by someone else since our write "
                             f"(now {current}, ours {'/'.join(e.ours)}, original {e.original})")
                continue
            try:
                io.write(key, e.original)
            except Exception as exc:  # noqa: BLE001
                lines.append(f"dvfs: {key}: restoring {e.original} failed ({exc}); kept for a later restore")
                kept[key] = e
                continue
            lines.append(f"dvfs: {key}: restored {e.original} (was {current or '/'.join(e.ours)})")
        self.entries = dict(reversed(list(kept.items())))
        self._persist()
        return lines


def recover(state_dir: str, host_root: str, io: KnobIO) -> None:
    """A previous agent died with our values in place: the host put back before starting over. CapabilityError
    where originals could not be saved (state_dir not writable) or not all of those left could be restored."""
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        raise CapabilityError(
            f"state_dir {state_dir}: {e.strerror}; originals must be saved before any write") from None
    if not os.access(state_dir, os.W_OK):
        raise CapabilityError(f"state_dir {state_dir} is not writable; originals must be saved before any write")
    try:
        left = Originals.load(state_dir, host_root)
    except ValueError as e:
        raise CapabilityError(f"{e}; move it away (or run `qosagent detach`) before enforcing") from None
    if left:
        for line in left.restore(io):
            log.warning("recovering after an unclean stop: %s", line.removeprefix("dvfs: "))
        if left:
            raise CapabilityError("originals left by a previous agent could not all be restored; "
                                  f"see {left.path}")
