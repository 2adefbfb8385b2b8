"""The real engine in the tests: llama-server with the tiny model (testkit/llamacpp.py), started for a test and
stopped after it, skipped (or, under CI=true, failed) where it is not built."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from tests.conftest import require
from tests.integration.latency_helpers import free_port
from testkit import llamacpp


def built() -> Path:
    """The engine's cache directory; a skip, or under CI=true a failure, when make setup-test has not built it."""
    where = llamacpp.engine()
    require(where is not None, llamacpp.NOT_BUILT)
    assert where is not None
    return where


@contextlib.contextmanager
def engine(tmp: Path, port: int | None = None, name: str = "server", **kw: Any) -> Iterator[llamacpp.LlamaServer]:
    """A llama-server on port (a free one by default) with the model written once into tmp; kw: LlamaServer's."""
    where = built()
    model = tmp / "tiny-llama.gguf"
    if not model.exists():  # a running engine maps the file: never write it under one
        llamacpp.model(where, tmp)
    with llamacpp.LlamaServer(where, model, port or free_port(), tmp / f"{name}.log", **kw) as srv:
        yield srv
