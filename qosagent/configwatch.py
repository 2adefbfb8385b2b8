"""Noticing that the config file changed, so that an edit (or a Kubernetes ConfigMap update) reloads the agent the
way SIGHUP does, on every node, without anyone reaching a pod.

A ConfigMap volume updates by writing a new timestamped directory and swapping the `..data` symlink that
`config.yaml` resolves through; an editor either rewrites the file in place or renames a new one over it. Each
changes what stat() of the path (following links) reports, so a stat per poll notices all of them; the content is
read only then, and only a new content counts, so a touch or a swap to the same text reloads nothing.

An edit in place truncates the file before it writes the new text, so a poll can land between the two and see an
empty or half-written file (an empty one is a valid config: every default). A change is therefore acted on only once
the stat has stayed the same over a whole interval: at the second poll after the write, not the first. And a stat
taken within RACY_NS of the file's mtime may share its mtime tick with a write of the same size still to come, which
no later stat would tell apart: until the mtime is older than that, each poll reads the content as well.
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
    """A write within the same mtime tick, of the same size, could still follow unseen."""
    return identity is not None and time.time_ns() - identity[2] < RACY_NS


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
        self._identity = self._polled = _identity(self.path)
        self._racy = _racy(self._identity)
        self._digest = _digest(self.path)

    def changed(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval
        identity = _identity(self.path)
        settled, self._polled = identity == self._polled, identity
        if identity == self._identity and not self._racy:
            return False
        if identity is None:
            # Between an unlink and a rename, or a ConfigMap being deleted: the running config stays.
            if not self._missing_logged:
                log.warning("config file %s is gone; the running config stays", self.path)
                self._missing_logged = True
            return False
        self._missing_logged = False
        if not settled:
            return False  # maybe mid-write: looked at again next poll
        self._identity, self._racy = identity, _racy(identity)
        digest = _digest(self.path)
        if digest is None or digest == self._digest:
            return False
        self._digest = digest
        log.info("config file %s changed; reloading", self.path)
        return True
