"""An original affinity is forgotten only once it is back: a failed restore keeps it, on disk too, for a retry."""

from __future__ import annotations

import errno

import pytest

from qosagent import config
from qosagent.capability import AgentContext
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.placement import applier
from qosagent.placement.capability import Placement
from qosagent.placement.discovery import ProcInfo
from qosagent.placement.model import Drop, Place, Record
from qosagent.placement.planner import Target
from qosagent.snapshot import Decision
from testkit.placement_trees import proc_entry

ORIG = applier.Original(1000, {42: frozenset({0, 1, 2, 3})}, frozenset({0, 1, 2, 3}))


class FlakyRestore:
    """applier.restore that fails with `errors` first, then succeeds."""

    def __init__(self, *errors: OSError):
        self.errors = list(errors)
        self.calls: list[tuple[int, applier.Original]] = []

    def __call__(self, fs: HostFS, pid: int, orig: applier.Original) -> applier.AffinityResult:
        self.calls.append((pid, orig))
        if self.errors:
            raise self.errors.pop(0)
        return applier.AffinityResult(threads=len(orig.threads))


def _placement(tmp_path) -> Placement:
    cfg = config.parse({"state_dir": str(tmp_path / "state"), "latency": {"enabled": False},
                        "placement": {"enabled": True, "mode": "enforce",
                                      "selectors": [{"name": "vllm"}]}}, "t")
    cap = Placement(AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=NoGpu()))
    cap.start()
    return cap


def _release(cap: Placement) -> None:
    cap.apply([Decision("placement", "pid 42 (vllm)", "release", "4", None, "no longer selected",
                        command=Drop(42, release=True))])


def _saved(tmp_path) -> dict[int, applier.Original]:
    store = applier.OriginalsStore(str(tmp_path / "state"))
    store.load()
    return store.entries


@pytest.fixture
def pinned(tmp_path) -> Placement:
    proc_entry(tmp_path, 42, ["vllm", "serve"], "vllm", start=ORIG.start)
    store = applier.OriginalsStore(str(tmp_path / "state"))
    store.entries[42] = ORIG
    store.save()
    cap = _placement(tmp_path)
    assert cap.store.entries == {42: ORIG}, "adopted from the state file"
    cap.records[42] = Record(42, ORIG.start, "vllm", "vllm", cpus=frozenset({4}), applied=True)
    return cap


def test_a_failed_release_keeps_the_original_and_retries(tmp_path, monkeypatch, pinned: Placement) -> None:
    restore = FlakyRestore(PermissionError(errno.EPERM, "Operation not permitted"))
    monkeypatch.setattr(applier, "restore", restore)
    _release(pinned)
    assert pinned.counters["errors"]["permission"] == 1
    assert pinned.store.entries == {42: ORIG} and _saved(tmp_path) == {42: ORIG}
    assert pinned.records[42].last_action == "error", "kept, so that a later reconcile releases it again"

    # A restarted agent still has it, and puts it back on stop.
    again = _placement(tmp_path)
    assert again.store.entries == {42: ORIG}
    again.stop()
    assert restore.calls == [(42, ORIG), (42, ORIG)]
    assert again.store.entries == {} and _saved(tmp_path) == {}


def test_the_retry_on_a_later_tick_forgets_it(tmp_path, monkeypatch, pinned: Placement) -> None:
    restore = FlakyRestore(PermissionError(errno.EPERM, "Operation not permitted"))
    monkeypatch.setattr(applier, "restore", restore)
    _release(pinned)
    _release(pinned)
    assert len(restore.calls) == 2
    assert pinned.store.entries == {} and 42 not in pinned.records and _saved(tmp_path) == {}


@pytest.mark.parametrize("code", [errno.ESRCH, errno.ENOENT])
def test_a_process_gone_during_release_is_forgotten(tmp_path, monkeypatch, pinned: Placement, code: int) -> None:
    monkeypatch.setattr(applier, "restore", FlakyRestore(OSError(code, "gone")))
    _release(pinned)
    assert pinned.counters["errors"]["exited"] == 1
    assert pinned.store.entries == {} and 42 not in pinned.records and _saved(tmp_path) == {}


def test_a_failed_restore_of_a_selected_process_is_retried(tmp_path, monkeypatch, pinned: Placement) -> None:
    """The plan stops pinning it (its GPU's node unknown): the same keep-until-written rule as a release."""
    restore = FlakyRestore(PermissionError(errno.EPERM, "Operation not permitted"))
    monkeypatch.setattr(applier, "restore", restore)
    proc = ProcInfo(42, ORIG.start, "vllm", "vllm serve", "/", None, "selectors[0]")
    place = Place("restore", proc, Target(42, None, None, "GPU node unknown"), "GPU node unknown")
    decision = Decision("placement", "pid 42 (vllm)", "restore", "4", None, "GPU node unknown", command=place)
    pinned.apply([decision])
    assert pinned.counters["errors"]["permission"] == 1
    assert pinned.store.entries == {42: ORIG} and _saved(tmp_path) == {42: ORIG}
    assert pinned.records[42].cpus == frozenset({4}), "still pinned, so the next reconcile decides restore again"
    pinned.apply([decision])
    assert len(restore.calls) == 2
    assert pinned.store.entries == {} and _saved(tmp_path) == {}
    assert pinned.records[42].last_action == "restore" and pinned.records[42].cpus is None
