"""Where libbpf is missing, reaching a map says what to install instead of failing somewhere inside ctypes."""

from __future__ import annotations

import pytest

from qosagent.ebpf import libbpf


def test_no_libbpf_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libbpf, "_LIBRARIES", ("libqosagent-none.so.9",))
    libbpf.lib.cache_clear()
    try:
        with pytest.raises(libbpf.LibbpfMissing, match="install libbpf1"):
            libbpf.obj_get("/sys/fs/bpf/nothing")
    finally:
        libbpf.lib.cache_clear()


def test_the_library_found_here_has_the_whole_api() -> None:
    so = libbpf.lib()
    assert all(hasattr(so, f) for f in libbpf._SIGNATURES)
    assert libbpf.possible_cpus() >= 1
