"""Noticing that the config file changed, so that an edit (or a Kubernetes ConfigMap update) reloads the agent the
way SIGHUP does, on every node, without anyone reaching a pod.

A ConfigMap volume updates by writing a new timestamped directory and swapping the `..data` symlink that
`config.yaml` resolves through; an editor either rewrites the file in place or renames a new one over it. Each
changes what stat() of the path (following links) reports, so a stat per poll notices all of them; the content is
read only then, and only a new content counts, so a touch or a swap to the same text reloads nothing.

An edit in place truncates the file before it writes the new text, so a poll can land between the two and see an
empty or half-written file (an empty one is a valid config: every default). A new content is therefore acted on only
once two polls in a row, an interval apart, read the same bytes: the first read is kept as pending, and the next poll
acts if it reads the same again. It is the text that has to stand still, not the stat: a file that a render loop or
a cron job touches, rewrites or renames over between every two polls still reloads an edit, at the second poll after
it. What is not guaranteed: a writer that stalls mid-write for longer than an interval, or one caught at the same
point of the same partial text by two polls in a row, is read half-written; only a rename over the file (editors
that save that way, ConfigMaps) makes a change whole at once.

A stat taken within RACY_NS of the file's mtime may share its mtime tick with a write of the same size still to come,
which no later stat would tell apart: while the mtime was that recent when the file was last read, each poll reads it
again. An mtime in the future (clock skew, `touch -d`, a copy that kept its mtime) is not recent: a local write from
now on gets a new mtime, so the stat tells it apart. Only a file server whose clock runs ahead of this node's could
still hide a same-size write in the same tick; that is left to the next change of the stat, or a SIGHUP.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable

log = logging.getLogger("qosagent.configwatch")

# Longer than any mtime tick a config file is likely to sit on (a jiffy, up to 10 ms; ext3 and NFS servers: 1 s).
RACY_NS = 2_000_000_000


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _racy(identity: tuple[int, int, int, int] | None) -> bool:
    """A write within the same mtime tick, of the same size, could still follow unseen. Not for an mtime ahead of
    the clock: reading the file at every poll until the clock catches up (a day, for `touch -d tomorrow`) buys
    nothing, as a local write from now on moves the mtime."""
    return identity is not None and 0 <= time.time_ns() - identity[2] < RACY_NS


def _digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).digest()
    except OSError:
        return None


class ConfigWatch:
    """changed() is True once for each new content of the file, at most once per `interval` seconds of `clock`."""

    def __init__(self, path: str, interval: float, clock: Callable[[], float]):
        self.path = path
        self.interval = interval
        self._clock = clock
        self._next = clock() + interval
        self._missing_logged = False
        self.seen()

    def seen(self) -> None:
        """The file as it is now counts as handled (a reload that SIGHUP or `qosagent reload` asked for read it)."""
        self._identity = _identity(self.path)
        self._racy = _racy(self._identity)
        self._digest = _digest(self.path)
        self._pending: bytes | None = None  # a new content read once: acted on if the next poll reads it again

    def changed(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval
        identity = _identity(self.path)
        if identity is None:
            # Between an unlink and a rename, or a ConfigMap being deleted: the running config stays.
            if not self._missing_logged:
                log.warning("config file %s is gone; the running config stays", self.path)
                self._missing_logged = True
            self._pending = None
            return False
        self._missing_logged = False
        if identity == self._identity and not self._racy and self._pending is None:
            return False
        digest = _digest(self.path)
        self._identity, self._racy = identity, _racy(identity)
        if digest is None or digest == self._digest:
            self._pending = None  # a touch, or back to the text running
            return False
        if digest != self._pending:
            self._pending = digest  # maybe mid-write: acted on if the next poll reads the same
            return False
        self._digest, self._pending = digest, None
        log.info("config file %s changed; reloading", self.path)
        return True
