"""tenant_ports' writer without a kernel: what is written, what is zeroed, and what it remembers on a failure."""

from __future__ import annotations

import pytest

from qosagent.ebpf.tenant_ports import PortTenant, TenantPorts


class Recording(TenantPorts):
    def __init__(self, written=None, fail_at: int | None = None):
        super().__init__(-1, written)
        self.writes: list[tuple[int, int, int]] = []
        self.fail_at = fail_at

    def _write(self, port: int, value: PortTenant) -> None:
        if port == self.fail_at:
            raise OSError(28, "No space left on device")
        self.writes.append((port, value.tenant, value.slot))


def test_only_changes_are_written_and_dropped_claims_are_zeroed() -> None:
    t = Recording({8000: (7, 1), 8100: (9, 2)})
    assert t.sync({8000: (7, 1), 8200: (9, 2)})
    assert t.writes == [(8100, 0, 0), (8200, 9, 2)]
    assert t.written == {8000: (7, 1), 8200: (9, 2)}
    t.writes.clear()
    assert not t.sync({8000: (7, 1), 8200: (9, 2)})
    assert t.writes == []
    assert t.sync({8000: (7, 3), 8200: (9, 2)})  # a new slot for the same tenant is a change
    assert t.writes == [(8000, 7, 3)]


def test_a_failed_write_leaves_what_is_remembered_true_to_the_kernel() -> None:
    t = Recording({8000: (7, 1)}, fail_at=8200)
    with pytest.raises(OSError):
        t.sync({8100: (9, 2), 8200: (9, 2)})
    assert t.written == {8100: (9, 2)}  # 8000 zeroed, 8100 written, 8200 not
    t.fail_at = None
    assert t.sync({8100: (9, 2), 8200: (9, 2)})
    assert t.writes[-1] == (8200, 9, 2)
