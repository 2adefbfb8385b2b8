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


def test_an_older_libbpf_without_test_run_opts_still_serves_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ubuntu 22.04's libbpf 0.5 predates bpf_prog_test_run_opts (0.7), which only tests and benchmarks use: the
    library is taken, and only that call is refused, by name."""
    real = libbpf.ctypes.CDLL

    class Older:
        def __init__(self, name: str, use_errno: bool = False):
            self._so = real(name, use_errno=use_errno)

        def __getattr__(self, fn: str):
            if fn == "bpf_prog_test_run_opts":
                raise AttributeError(fn)
            return getattr(self._so, fn)

    monkeypatch.setattr(libbpf.ctypes, "CDLL", Older)
    libbpf.lib.cache_clear()
    try:
        assert libbpf.possible_cpus() >= 1
        with pytest.raises(libbpf.LibbpfMissing, match="bpf_prog_test_run_opts is not in this libbpf"):
            libbpf.prog_test_run(-1, libbpf.TestRunOpts())
    finally:
        libbpf.lib.cache_clear()
