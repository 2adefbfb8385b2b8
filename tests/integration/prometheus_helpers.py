"""testkit's Prometheus for the tests: a missing prometheus binary skips outside CI and fails in it."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator

from tests.conftest import require
from testkit import prometheus
from testkit.prometheus import DEADLINE_S, api, query, running, stop, wait_for

__all__ = ["DEADLINE_S", "api", "query", "run_prometheus", "running", "stop", "wait_for"]


@contextlib.contextmanager
def run_prometheus(d: Path, scrape_configs: list[dict[str, Any]], **kw: Any) -> Iterator[str]:
    require(shutil.which("prometheus") is not None, "prometheus not installed (make setup-test)")
    with prometheus.run_prometheus(d, scrape_configs, **kw) as url:
        yield url
