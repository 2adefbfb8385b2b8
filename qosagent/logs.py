"""Logging to stderr in a form journald understands: "<level>" prefixes become priorities."""

from __future__ import annotations

import logging
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        component = record.name.split(".", 1)[1] if "." in record.name else "agent"
        text = f"<{prio}>{component}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter())
    root = logging.getLogger("qosagent")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
