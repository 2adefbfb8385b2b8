"""qosagent.syscall: the one way the agent makes a system call by number."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from qosagent import syscall

GETPID = {"x86_64": 39, "aarch64": 172}
CLOSE = {"x86_64": 3, "aarch64": 57}


def test_the_result_of_a_call_by_this_machines_number() -> None:
    assert syscall.call("getpid", GETPID) == os.getpid()


def test_a_failed_call_raises_its_errno_naming_what_it_was_for() -> None:
    with pytest.raises(OSError) as e:
        syscall.call("close of no fd", CLOSE, ctypes.c_int(-1))
    assert e.value.errno == errno.EBADF and "close of no fd" in str(e.value)


def test_an_architecture_without_a_number_is_enosys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(syscall.platform, "machine", lambda: "sparc64")
    with pytest.raises(OSError) as e:
        syscall.call("getpid", GETPID)
    assert e.value.errno == errno.ENOSYS and "sparc64" in str(e.value)
