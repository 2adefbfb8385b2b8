"""The pre-cleanup action run when a GPU enters memory pressure, off the tick thread.

A command runs without a shell (argv as configured); an HTTP POST sends an empty body. Both have a timeout; the
outcome is logged and counted by result. One run at a time: a trigger while one runs is counted as skipped.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import threading
import urllib.error
import urllib.request

from qosagent.admission.config import PreCleanupConfig

log = logging.getLogger("qosagent.admission")

# Outcomes: the values of the metric label `result`.
OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped"


class PreCleanup:
    def __init__(self) -> None:
        self.results: collections.Counter[str] = collections.Counter()
        self.last: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def trigger(self, cfg: PreCleanupConfig, why: str) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._record(SKIPPED, "a previous pre-cleanup is still running", why)
                return
            self._thread = threading.Thread(target=self._run, args=(cfg, why), name="pre-cleanup", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self, cfg: PreCleanupConfig, why: str) -> None:
        if cfg.command is not None:
            result, detail = _run_command(cfg.command, cfg.timeout)
        else:
            result, detail = _post(str(cfg.http_post), cfg.timeout)
        with self._lock:
            self._record(result, detail, why)

    def _record(self, result: str, detail: str, why: str) -> None:
        self.results[result] += 1
        self.last = {"result": result, "detail": detail, "trigger": why}
        level = logging.INFO if result == OK else logging.WARNING
        log.log(level, "pre-cleanup %s: %s (trigger: %s)", result, detail, why)


def _run_command(argv: list[str], timeout: float) -> tuple[str, str]:
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return TIMEOUT, f"{argv[0]} still running after {timeout:g}s, killed"
    except OSError as e:
        return FAILED, f"{argv[0]}: {e.strerror}"
    tail = (p.stderr or p.stdout).decode(errors="replace").strip()[-200:]
    if p.returncode != 0:
        return FAILED, f"{argv[0]} exited {p.returncode}" + (f": {tail}" if tail else "")
    return OK, f"{argv[0]} exited 0"


def _post(url: str, timeout: float) -> tuple[str, str]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return OK, f"POST {url}: {resp.status}"
    except urllib.error.HTTPError as e:
        return FAILED, f"POST {url}: {e.code} {e.reason}"
    except TimeoutError:
        return TIMEOUT, f"POST {url}: no answer after {timeout:g}s"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            return TIMEOUT, f"POST {url}: no answer after {timeout:g}s"
        return FAILED, f"POST {url}: {reason}"
