"""The control loop's contract with capabilities, driven with scripted capabilities (no BPF here)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from typing import Any

import pytest

from testkit.agent import AgentThread

from qosagent import capabilities, config, daemon
from qosagent.capability import Capability, CapabilityError, Change, State, Verdict
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.services import Service
from qosagent.snapshot import Decision
from qosagent.status import StatusServer, request

EVENTS: list[str] = []


def make_cap(name: str, *, fail_start: bool = False, fail_collect: bool = False, fail_stop: bool = False,
             refuse: bool = False, fail_commit: bool = False) -> type:
    class Scripted(Capability):
        def prepare(self, config: Any) -> Change:
            EVENTS.append(f"prepare {name}")
            if refuse:
                raise CapabilityError("out of slots")

            def commit() -> None:
                EVENTS.append(f"commit {name}")
                if fail_commit:
                    raise CapabilityError("map write failed")

            return Change(commit, lambda: EVENTS.append(f"undo {name}"))

        def probe(self, features: Any) -> Verdict:
            return Verdict(State.ACTIVE, plan=("planned", name))

        def begin(self, features: Any) -> None:
            EVENTS.append(f"begin {name}")

        def start(self, plan: Any) -> None:
            assert plan == ("planned", name), "start gets what its probe planned"
            EVENTS.append(f"start {name}")
            if fail_start:
                raise CapabilityError("no luck")

        def collect(self) -> Any:
            if fail_collect:
                raise OSError("map read failed")
            return {"n": 1}

        def decide(self, snapshot: Any) -> list[Decision]:
            return [Decision(name, "t", "set", 0, snapshot.seq, "because")]

        def stop(self) -> None:
            EVENTS.append(f"stop {name}")
            if fail_stop:
                raise RuntimeError("stop broke")

        @classmethod
        def enabled(cls, cfg: Any) -> bool:
            return True

    Scripted.name = name
    return Scripted


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch):
    EVENTS.clear()

    def install(*caps: type) -> None:
        monkeypatch.setattr(capabilities, "CAPABILITIES", tuple(caps))
        monkeypatch.setattr("qosagent.daemon.features_mod.ensure_mounted", lambda fs: [])

    return install


def agent(tmp_path, text: str = "") -> Agent:
    path = tmp_path / "cfg.yaml"
    path.write_text(text or "latency: {enabled: false}\n")
    return Agent(config.load(str(path)), HostFS(tmp_path), str(path), gpu=NoGpu())


def test_failed_start_leaves_others_running_and_is_reported(scripted, tmp_path) -> None:
    scripted(make_cap("a"), make_cap("b", fail_start=True), make_cap("c"))
    a = agent(tmp_path)
    a.start()
    assert [c.name for c in a.capabilities] == ["a", "c"]
    assert a.verdicts["b"] == Verdict(State.UNAVAILABLE, "no luck")
    # The failed one was still asked to undo what it may have half done.
    assert "stop b" in EVENTS


def test_each_capability_begins_before_the_first_starts_unless_refused(scripted, tmp_path, monkeypatch) -> None:
    """What a start can run beside the starts before it (a compile child) is begun before any starts; a capability
    the sandbox refuses begins nothing."""
    refused = make_cap("b")
    refused.sandbox_needs = classmethod(lambda cls, cfg: ["refused"])  # type: ignore[attr-defined]
    monkeypatch.setattr("qosagent.daemon.sandbox.refusal",
                        lambda needs, hostfs: "not here" if needs == ["refused"] else None)
    scripted(make_cap("a"), refused, make_cap("c"))
    a = agent(tmp_path)
    a.start()
    assert EVENTS == ["begin a", "begin c", "start a", "start c"]
    assert a.verdicts["b"] == Verdict(State.UNAVAILABLE, "not here")


def test_stop_runs_in_reverse_even_when_one_fails(scripted, tmp_path) -> None:
    scripted(make_cap("a"), make_cap("b", fail_stop=True), make_cap("c"))
    a = agent(tmp_path)
    a.start()
    EVENTS.clear()
    a.stop()
    assert EVENTS == ["stop c", "stop b", "stop a"]


def test_collect_failure_is_counted_and_degrades_without_stopping(scripted, tmp_path) -> None:
    scripted(make_cap("a", fail_collect=True), make_cap("b"))
    a = agent(tmp_path)
    a.start()
    snap = a.tick()
    a.tick()
    assert a.stats.collect_errors["a"] == 2
    assert a.verdicts["a"].state is State.DEGRADED
    assert snap.part("b") == {"n": 1} and snap.part("a") is None
    assert len(a.decisions) == 4


def test_a_capability_degraded_by_tick_errors_recovers_when_they_stop(scripted, tmp_path) -> None:
    failing = {"collect": True}

    class Flaky(make_cap("a")):  # type: ignore[misc, valid-type]
        def collect(self) -> Any:
            if failing["collect"]:
                raise OSError("map read failed")
            return {"n": 1}

    scripted(Flaky)
    a = agent(tmp_path)
    a.start()
    a.tick()
    assert a.verdicts["a"] == Verdict(State.DEGRADED, "collect failed: map read failed")
    failing["collect"] = False
    a.tick()
    assert a.verdicts["a"] == Verdict(State.ACTIVE)
    assert a.stats.collect_errors["a"] == 1


def test_a_verdict_a_capability_changes_while_it_runs_is_reported_unless_a_tick_error_stands(scripted,
                                                                                                   tmp_path) -> None:
    state = {"verdict": Verdict(State.ACTIVE, "hooks not verified at start"), "fail": False}

    class Verifying(make_cap("a")):  # type: ignore[misc, valid-type]
        def collect(self) -> Any:
            if state["fail"]:
                raise OSError("map read failed")
            self.verdict = state["verdict"]
            return {"n": 1}

    scripted(Verifying)
    a = agent(tmp_path)
    a.start()
    a.tick()
    assert a.verdicts["a"] == Verdict(State.ACTIVE, "hooks not verified at start")
    state["verdict"] = Verdict(State.DEGRADED, "hooks not seen running")
    a.tick()
    assert a.verdicts["a"] == Verdict(State.DEGRADED, "hooks not seen running")
    state["fail"] = True
    a.tick()
    assert a.verdicts["a"] == Verdict(State.DEGRADED, "collect failed: map read failed")
    # The failure's recovery returns to the capability's latest verdict, not the one it started with.
    state["fail"], state["verdict"] = False, Verdict(State.ACTIVE, "hooks verified by traffic")
    a.tick()
    assert a.verdicts["a"] == Verdict(State.ACTIVE, "hooks verified by traffic")


def test_reload_keeps_old_config_on_error(scripted, tmp_path) -> None:
    scripted(make_cap("a"))
    a = agent(tmp_path, "interval: 200ms\nlatency: {enabled: false}\n")
    (tmp_path / "cfg.yaml").write_text("interval: fast\n")
    ok, why = a.reload()
    assert not ok and "interval" in why
    assert a.config.interval == pytest.approx(0.2)
    assert a.status()["self"]["last_reload_error"] == why
    (tmp_path / "cfg.yaml").write_text("interval: 50ms\nlatency: {enabled: false}\n")
    assert a.reload() == (True, "reloaded")
    assert a.config.interval == pytest.approx(0.05)


def test_a_reload_one_capability_refuses_writes_nothing_anywhere(scripted, tmp_path) -> None:
    scripted(make_cap("a"), make_cap("b", refuse=True), make_cap("c"))
    a = agent(tmp_path, "interval: 200ms\nlatency: {enabled: false}\n")
    a.start()
    EVENTS.clear()
    (tmp_path / "cfg.yaml").write_text("interval: 50ms\nlatency: {enabled: false}\n")
    assert a.reload() == (False, "b: out of slots")
    assert EVENTS == ["prepare a", "prepare b"]
    assert a.config.interval == pytest.approx(0.2)


def test_a_failed_commit_puts_the_ones_before_it_back(scripted, tmp_path) -> None:
    scripted(make_cap("a"), make_cap("b"), make_cap("c", fail_commit=True))
    a = agent(tmp_path, "interval: 200ms\nlatency: {enabled: false}\n")
    a.start()
    EVENTS.clear()
    (tmp_path / "cfg.yaml").write_text("interval: 50ms\nlatency: {enabled: false}\n")
    assert a.reload() == (False, "c: map write failed")
    assert EVENTS == ["prepare a", "prepare b", "prepare c", "commit a", "commit b", "commit c", "undo b", "undo a"]
    assert a.config.interval == pytest.approx(0.2)


def test_a_restart_only_key_is_refused_by_name(scripted, tmp_path) -> None:
    scripted(make_cap("a"))
    a = agent(tmp_path, "latency: {enabled: false}\n")
    a.start()
    EVENTS.clear()
    (tmp_path / "cfg.yaml").write_text("latency: {enabled: false, mode: tracepoint, socket_slots: 1024}\n"
                                       "quota: {tc_prio: 7}\n")
    ok, why = a.reload()
    assert not ok and why == "changing latency.mode, latency.socket_slots, quota.tc_prio needs a restart"
    assert EVENTS == []
    (tmp_path / "cfg.yaml").write_text("latency: {enabled: true}\n")
    assert a.reload() == (False, "changing latency.enabled needs a restart")


def test_loop_stops_on_request_and_notifies(scripted, tmp_path) -> None:
    scripted(make_cap("a"))
    a = agent(tmp_path, "interval: 10ms\nlatency: {enabled: false}\n")
    notes: list[str] = []
    with AgentThread(a, timeout=5, notify=notes.append):  # its exit fails when the loop does not stop
        while a.stats.ticks < 5:
            threading.Event().wait(0.01)
    assert notes[0] == "READY=1" and "WATCHDOG=1" in notes


def test_status_socket_is_root_only_and_answers(scripted, tmp_path) -> None:
    scripted(make_cap("a"))
    a = agent(tmp_path)
    a.start()
    a.tick()
    path = str(tmp_path / "run" / "status.sock")
    srv = StatusServer(a, path)
    srv.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        st = request(path, {"cmd": "status", "decisions": True})
        assert st["capabilities"]["a"]["state"] == "active"
        assert st["decisions"][0]["reason"] == "because"
        json.dumps(st)
        assert "error" in request(path, {"cmd": "nonsense"})
    finally:
        srv.close()
    assert not os.path.exists(path)


class Counted(Service):
    """A service that counts its ticks: what the daemon makes, reads into the Snapshot, shows and stops."""

    name = "counted"
    made = 0

    @classmethod
    def make(cls, fs: Any, clock: Any) -> "Counted":
        cls.made += 1
        return cls()

    def __init__(self) -> None:
        self.asked = 0

    def collect(self) -> Any:
        return {"asked": self.asked}

    def metrics(self, part: Any, cfg: Any) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("qosagent_counted_asked", "Times asked", value=part["asked"])

    def status(self, part: Any) -> Any:
        return part

    @staticmethod
    def render(status: Any) -> str:
        return f"asked {status['asked']} times"

    def stop(self) -> None:
        EVENTS.append("stop counted")


def test_services_are_made_at_start_read_into_the_snapshot_and_stopped_last(scripted, tmp_path) -> None:
    from prometheus_client import generate_latest

    from qosagent.metrics import make_registry
    from qosagent.status import render

    user = make_cap("a")

    class Asks(user):  # type: ignore[misc, valid-type]
        uses = (Counted,)

        def start(self, plan: Any) -> None:
            super().start(plan)
            assert Counted.made == 1, "made before the first capability that uses it starts"

        def maintain(self) -> None:
            self.ctx.service(Counted).asked += 1

    Counted.made = 0
    scripted(Asks, make_cap("b"))
    a = agent(tmp_path)
    a.start()
    snap = a.tick()
    assert snap.part("counted") == {"asked": 1} and Counted.made == 1
    a.ctx.service(Counted).asked += 10  # after the tick: what it shows is the tick's, not the live service's
    assert "qosagent_counted_asked 1.0" in generate_latest(make_registry(a)).decode()
    st = a.status()
    assert st["counted"] == {"asked": 1}
    assert "asked 1 times" in render(st)
    EVENTS.clear()
    a.stop()
    assert EVENTS == ["stop b", "stop a", "stop counted"]


def test_a_service_no_enabled_capability_uses_is_not_made(scripted, tmp_path) -> None:
    Counted.made = 0
    scripted(make_cap("b"))
    a = agent(tmp_path)
    a.start()
    a.tick()
    assert Counted.made == 0 and "counted" not in a.status()


def test_a_decision_reads_as_its_change() -> None:
    from qosagent.snapshot import Decision

    assert Decision("placement", "pid 1 (x)", "forget", "0-3", None, "exited").change() == "0-3 -> -"
    d = Decision("admission", "acme", "shed", None, 0.0, "gpu_memory_pressure", shown="unlimited -> 0/s burst 0")
    assert d.change() == "unlimited -> 0/s burst 0" and d.as_dict()["change"] == d.change()
    assert d.as_dict()["old"] is None  # the JSON keeps the number (none: unlimited) for machines


def _until(check: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_the_loop_rests_while_every_capability_is_quiet_and_a_reload_or_stop_waits_for_no_rest(scripted,
                                                                                                tmp_path) -> None:
    quiet = {"a": True}

    class Resting(make_cap("a")):  # type: ignore[misc, valid-type]
        def decide(self, snapshot: Any) -> list[Decision]:
            return []

        def quiet(self) -> bool:
            return quiet["a"]

    scripted(Resting)
    a = agent(tmp_path, "interval: 20ms\nrest_interval: 1s\nlatency: {enabled: false}\n")

    def fresh_tick() -> Any:
        """The snapshot of a tick just run: the next one, resting, is rest_interval away."""
        seq = a.latest.seq
        assert _until(lambda: a.latest.seq != seq, 5.0)
        return a.latest

    thread = AgentThread(a)
    thread.__enter__()
    try:
        # Quiet from the first tick: at interval for rest_interval, then resting.
        assert _until(lambda: a.pace.resting, 5.0)
        assert a.status()["self"]["resting"] is True and a.status()["rest_interval_s"] == 1.0
        # A reload is answered by a tick of its own at once, not at the next rest tick.
        last = fresh_tick()
        assert a.reload_and_wait(timeout=5.0) == (True, "reloaded")
        assert time.monotonic() < last.monotonic + 1.0 and not a.pace.resting
        # What a capability finds keeps the loop awake from its next tick.
        assert _until(lambda: a.pace.resting, 5.0)
        quiet["a"] = False
        assert _until(lambda: not a.pace.resting, 5.0)
        assert a.status()["self"]["awake_by"] == ["a"]
        quiet["a"] = True
        assert _until(lambda: a.pace.resting, 5.0)
        # A stop ends the wait at once: no tick runs after it (one at the end of the rest would).
        last = fresh_tick()
    finally:
        thread.__exit__()
    assert a.latest.seq == last.seq


def test_a_tick_with_a_decision_or_a_capability_that_cannot_say_is_never_quiet(scripted, tmp_path) -> None:
    class Silent(make_cap("b")):  # type: ignore[misc, valid-type]
        def decide(self, snapshot: Any) -> list[Decision]:
            return []

    class Deciding(make_cap("a")):  # type: ignore[misc, valid-type]
        def quiet(self) -> bool:
            return True  # but it decides something every tick (make_cap's decide)

    for caps, awake in (((Deciding,), ["decisions"]), ((Silent,), ["b"]), ((Silent, Deciding), ["b", "decisions"])):
        scripted(*caps)
        a = agent(tmp_path, "interval: 10ms\nrest_interval: 50ms\nlatency: {enabled: false}\n")
        a.start()
        for _ in range(20):
            a.tick()
            assert not a.quiet and list(a.awake_by) == awake
        a.stop()


def test_the_watchdog_is_widened_to_three_of_the_longest_ticks_and_again_after_a_reload(scripted, tmp_path) -> None:
    """The loop pings systemd once a tick, every rest_interval while resting: a unit's WatchdogSec under three of
    those would kill a healthy agent; a reload that lengthens the ticks asks again."""
    assert daemon.watchdog_usec(config.parse({"interval": "100ms", "rest_interval": "500ms"}, "t"), 1_000_000) \
        == 1_500_000
    assert daemon.watchdog_usec(config.parse({"interval": "100ms"}, "t"), 30_000_000) is None
    assert daemon.watchdog_usec(config.parse({}, "t"), None) is None  # no unit watches
    scripted(make_cap("a"))
    a = agent(tmp_path, "rest_interval: 100ms\nlatency: {enabled: false}\n")
    a.unit_watchdog_us = 1_000_000
    sent: list[str] = []
    thread = AgentThread(a, notify=sent.append)
    thread.__enter__()
    try:
        (tmp_path / "cfg.yaml").write_text("rest_interval: 1s\nlatency: {enabled: false}\n")
        assert a.reload_and_wait(timeout=5.0) == (True, "reloaded")
        assert _until(lambda: "WATCHDOG_USEC=3000000" in sent, 5.0), sent
    finally:
        thread.__exit__()
