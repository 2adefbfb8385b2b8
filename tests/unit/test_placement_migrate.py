"""migrate(): which nodes are asked, and how moved pages are counted, on a fake numa_maps (no NUMA machine here)."""

from __future__ import annotations

import pytest

from qosagent import config
from qosagent.capability import AgentContext, CapabilityError
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.placement import applier
from qosagent.placement.capability import Placement
from qosagent.statefile import StateFileError
from testkit.placement_trees import proc_entry

BEFORE = "7f00 default anon=300 N0=100 N1=150 N2=50\n7f10 default file=/lib/x N1=10\n"
AFTER = "7f00 default anon=300 N0=10 N1=290\n7f10 default file=/lib/x N1=10\n"


def test_pages_moved_are_counted_from_numa_maps(tmp_path, monkeypatch) -> None:
    proc_entry(tmp_path, 42, ["vllm", "serve"], "vllm", numa_maps=BEFORE)
    calls = []

    def fake_syscall(pid: int, old, new) -> int:
        calls.append((pid, list(old), list(new)))
        (tmp_path / "proc/42/numa_maps").write_text(AFTER)
        return 10  # the kernel could not move 10 pages

    monkeypatch.setattr(applier, "migrate_pages_syscall", fake_syscall)
    res = applier.migrate(HostFS(tmp_path), 42, 1, [0, 1, 2])
    assert calls == [(42, [0, 2], [1])], "only the other memory nodes are sources"
    assert (res.noop, res.moved, res.not_moved) == (False, 140, 10)  # 150 off node 1 before, 10 after
    assert res.pages == {0: 10, 1: 300}


def test_all_pages_local_is_a_noop_without_a_syscall(tmp_path, monkeypatch) -> None:
    proc_entry(tmp_path, 42, ["vllm"], "vllm", numa_maps="7f00 default N1=5\n")
    monkeypatch.setattr(applier, "migrate_pages_syscall", lambda *a: pytest.fail("no syscall expected"))
    assert applier.migrate(HostFS(tmp_path), 42, 1, [0, 1]).noop
    assert applier.migrate(HostFS(tmp_path), 42, 0, [0]).noop, "one memory node"


def test_exit_during_migration(tmp_path, monkeypatch) -> None:
    proc_entry(tmp_path, 42, ["vllm"], "vllm", numa_maps=BEFORE)

    def gone(*_a: object) -> int:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(applier, "migrate_pages_syscall", gone)
    with pytest.raises(applier.Exited):
        applier.migrate(HostFS(tmp_path), 42, 1, [0, 1])


def test_originals_survive_a_round_trip(tmp_path) -> None:
    store = applier.OriginalsStore(str(tmp_path / "state"))
    store.entries[7] = applier.Original(99, {7: frozenset({0, 1}), 8: frozenset({3})}, frozenset({0, 1}))
    store.save()
    again = applier.OriginalsStore(str(tmp_path / "state"))
    again.load()
    assert again.entries == store.entries
    store.entries = {}
    store.save()
    assert not (tmp_path / "state" / "placement-originals.json").exists()


@pytest.mark.parametrize("text", ["{not json", '{"7": {"threads": {}}}', '["a list"]'])
def test_a_damaged_originals_file_is_kept_and_stops_placement(tmp_path, text: str) -> None:
    """Never forgotten: dropping it would leave the pins a crashed agent made with no way back."""
    path = tmp_path / "state" / "placement-originals.json"
    path.parent.mkdir()
    path.write_text(text)
    store = applier.OriginalsStore(str(tmp_path / "state"))
    with pytest.raises(StateFileError, match="placement-originals.json"):
        store.load()
    store.save()  # with no entries: would remove a readable file
    assert applier.restore_all(HostFS(tmp_path), store) == []
    assert path.read_text() == text
    cfg = config.parse({"state_dir": str(tmp_path / "state"), "latency": {"enabled": False},
                        "placement": {"enabled": True, "mode": "enforce"}}, "t")
    ctx = AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=NoGpu())
    with pytest.raises(CapabilityError, match="move it away"):
        Placement(ctx).start()
    assert "kept" in Placement.detach(ctx)[0]
    assert path.read_text() == text
