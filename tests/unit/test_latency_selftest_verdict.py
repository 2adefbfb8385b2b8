"""The latency self-test's verdict from run counts (fakes for the kernel), and its loopback exchange for real; the
verification by traffic where the self-test cannot run."""

from __future__ import annotations

import errno
import os

import pytest

from qosagent.capability import State, Verdict
from qosagent.latency import hooks, selftest
from qosagent.latency.model import Plan


class Counts:
    """Run counts per program fd; `fires` says which programs the traffic runs."""

    def __init__(self, fires: set[int]) -> None:
        self.n = {fd: 10 for fd in (1, 2, 3)}
        self.fires = fires
        self.stats_open = False

    def traffic(self, _avoid: object) -> None:
        assert self.stats_open, "counts only move while the statistics are on"
        for fd in self.fires:
            self.n[fd] += 2

    def enable(self) -> int:
        import os

        self.stats_open = True
        return os.open("/dev/null", os.O_RDONLY)  # closed by check(), as the real stats fd is


PROGS = {"kp_tcp_read": 1, "kp_tcp_sendmsg": 2, "lat_egress": 3}


def test_every_hook_ran_is_no_reason() -> None:
    c = Counts({1, 2, 3})
    assert selftest.check(PROGS, traffic=c.traffic, run_count=c.n.__getitem__, enable_stats=c.enable) is None


def test_a_hook_that_did_not_run_is_named(monkeypatch) -> None:
    monkeypatch.setattr(selftest, "SETTLE_S", 0.1)
    c = Counts({1, 2})
    why = selftest.check(PROGS, traffic=c.traffic, run_count=c.n.__getitem__, enable_stats=c.enable)
    assert why is not None and "lat_egress did not run" in why and "kp_tcp" not in why


def test_a_learner_that_ran_but_failed_its_tail_call_is_a_reason() -> None:
    """The kernel counts lat_egress_learn's runs whether or not its tail call to lat_egress ran: the run counts all
    move, and only the learner's count of unread packets tells an empty slot."""
    c = Counts({1, 2, 3})
    unread = {"n": 5}  # moved before the exchange: not the self-test's

    def traffic(avoid: object) -> None:
        c.traffic(avoid)
        unread["n"] += 3

    why = selftest.check(PROGS, traffic=traffic, run_count=c.n.__getitem__, enable_stats=c.enable,
                         unread=lambda: unread["n"])
    assert why is not None and "tail call to lat_egress failed for 3 packets" in why
    c = Counts({1, 2, 3})
    assert selftest.check(PROGS, traffic=c.traffic, run_count=c.n.__getitem__, enable_stats=c.enable,
                          unread=lambda: 5) is None


def test_an_unreadable_count_is_a_reason_and_the_statistics_are_closed() -> None:
    """A batch map read or a program's run count can fail (OSError): check() says so as a reason, where start's
    caller can still act on it, rather than raising past start's own clean-up (links and programs left loaded)."""
    def refused(*_: object) -> int:
        raise OSError(errno.EFAULT, "Bad address")

    for where in ("unread", "run_count"):
        c = Counts({1, 2, 3})
        opened: list[int] = []

        def enable() -> int:
            opened.append(c.enable())
            return opened[-1]

        why = selftest.check(PROGS, traffic=c.traffic, enable_stats=enable,
                             run_count=refused if where == "run_count" else c.n.__getitem__,
                             unread=refused if where == "unread" else lambda: 0)
        assert why is not None and "counts could not be read" in why and "Bad address" in why, where
        with pytest.raises(OSError):
            os.fstat(opened[0])  # closed by check()


def test_no_run_statistics_is_unverifiable_not_a_pass() -> None:
    def refuse() -> int:
        raise OSError(errno.EPERM, "Operation not permitted")

    with pytest.raises(selftest.Unverifiable, match="not verified.*Operation not permitted"):
        selftest.check(PROGS, traffic=lambda _: None, run_count=lambda _: 0, enable_stats=refuse)


def test_a_failed_exchange_is_a_reason() -> None:
    def broken(_avoid: object) -> None:
        raise OSError("refused")

    c = Counts(set())
    why = selftest.check(PROGS, traffic=broken, run_count=c.n.__getitem__, enable_stats=c.enable)
    assert why is not None and "refused" in why


def test_the_exchange_is_real_and_avoids_watched_ports() -> None:
    class FirstTwoWatched:
        """Says the first two ports the exchange is given are watched."""

        def __init__(self) -> None:
            self.asked: list[int] = []

        def __contains__(self, port: object) -> bool:
            self.asked.append(int(port))  # type: ignore[call-overload]
            return len(self.asked) <= 2

    avoid = FirstTwoWatched()
    selftest.loopback_exchange(avoid)  # type: ignore[arg-type]
    assert len(avoid.asked) == 3, "two ports refused, the third used"


OPEN = {b"adopted"}  # a connection open at start: adopted, counted only at its next request


def test_traffic_the_programs_counted_verifies_at_once_even_before_connections_are_listed() -> None:
    t = selftest.ByTraffic(counted=5, open_now=OPEN)
    assert t.observe(0.0, 0.0, 5, OPEN, within=30) is None
    seen = t.observe(1.0, 1796175123.0, 8, None, within=30)
    assert seen == selftest.Seen(True, "hooks verified at 2026-12-02T01:32:03Z by traffic "
                                       "(3 connections and requests counted)")


def test_new_connections_with_nothing_counted_are_silent_after_within_then_verified_when_counts_move() -> None:
    t = selftest.ByTraffic(counted=0, open_now=OPEN)
    assert t.observe(0.0, 0.0, 0, OPEN, within=30) is None, "the connections open at start are no traffic"
    assert t.observe(10.0, 0.0, 0, OPEN | {b"new"}, within=30) is None
    assert t.traffic_since == 10.0
    assert t.observe(39.0, 0.0, 0, None, within=30) is None, "not yet 30 s since the first new connection"
    seen = t.observe(40.0, 0.0, 0, None, within=30)
    assert seen is not None and not seen.verified
    assert "connections came on the tracked ports for 30 s and no program counted one" in seen.reason
    assert t.observe(41.0, 0.0, 0, None, within=30) is None, "said once"
    later = t.observe(50.0, 0.0, 1, None, within=30)
    assert later is not None and later.verified and not t.silent


def test_no_new_connection_is_never_silent() -> None:
    t = selftest.ByTraffic(counted=0, open_now=OPEN)
    for now in (0.0, 100.0, 10_000.0):
        assert t.observe(now, 0.0, 0, OPEN, within=30) is None


def test_a_failed_tail_call_of_the_learner_is_lost_for_good_whatever_the_count_does() -> None:
    """sockops mode without the run statistics: the learner's runs move the count whether or not its tail call ran,
    so an empty or wrong slot would be verified by the count alone; the unread count degrades it, for good."""
    t = selftest.ByTraffic(counted=0, open_now=OPEN, unread=4)  # 4 before start: not traffic's since
    assert t.observe(0.0, 0.0, 0, OPEN, within=30, unread=4) is None
    seen = t.observe(1.0, 0.0, 0, None, within=30, unread=7)
    assert seen is not None and not seen.verified and t.done
    assert seen.reason == ("lat_egress_learn's tail call to lat_egress failed for 3 packets since start: responses "
                           "would go unread, their time to first token and inter-token latency lost")

    t = selftest.ByTraffic(counted=0, open_now=OPEN, unread=0)
    first = t.observe(0.0, 1796175123.0, 2, None, within=30, unread=0)
    assert first is not None and first.verified and not t.done, "watched still: the responses may come later"
    assert t.observe(1.0, 0.0, 5, None, within=30, unread=0) is None
    later = t.observe(2.0, 0.0, 5, None, within=30, unread=1)
    assert later is not None and not later.verified and t.done
    assert later.reason.startswith("hooks verified at 2026-12-02T01:32:03Z by traffic (2 connections")
    assert "tail call to lat_egress failed for 1 packets since start" in later.reason


def test_without_the_learner_watched_the_count_alone_ends_it() -> None:
    t = selftest.ByTraffic(counted=0, open_now=OPEN)
    seen = t.observe(0.0, 0.0, 1, None, within=30, unread=99)
    assert seen is not None and seen.verified and t.done, "tracepoint and kprobe modes: no learner to watch"


class _Dp:
    """What Upkeep reads of the datapath for its verdict."""

    def __init__(self, unread: int, refuse: bool = False) -> None:
        self.unread, self.refuse = unread, refuse
        self.listed: list[int] = []  # one per listing of the connections on the tracked ports

    def fds(self, names: list[str]) -> dict[str, int]:
        return {n: i for i, n in enumerate(names)}

    def traced(self) -> list[str]:
        return []

    def counted(self) -> int:
        return 0

    def egress_unread(self) -> int:
        if self.refuse:
            raise OSError(errno.EFAULT, "Bad address")
        return self.unread


class _Watch:
    def rooted(self) -> list[str]:
        return ["lat_ingress_learn", "lat_egress_learn"]


def _unverified_upkeep(monkeypatch: pytest.MonkeyPatch, dp: _Dp) -> hooks.Upkeep:
    def no_stats(*_: object, **__: object) -> None:
        raise selftest.Unverifiable("hooks not verified at start (BPF run statistics: Operation not permitted)")

    monkeypatch.setattr(hooks.selftest, "check", no_stats)
    monkeypatch.setattr(hooks.Upkeep, "_open_on", lambda self, tracked: dp.listed.append(1) or set())
    up = hooks.Upkeep(dp, None, lambda: 0.0, Plan("sockops", True, True, False), lambda ports: [])  # type: ignore[arg-type]
    up.watch = _Watch()  # type: ignore[assignment]
    return up


def test_least_privilege_sockops_start_degrades_when_the_learner_loses_responses(monkeypatch) -> None:
    """The shipped unit (no CAP_SYS_ADMIN): the self-test is unverifiable, and the capability must not go active on
    the count alone while the learner's tail call fails."""
    up = _unverified_upkeep(monkeypatch, _Dp(unread=2))
    v = up.verified(Verdict(State.ACTIVE, ""), {8080})
    assert v.state is State.ACTIVE and v.reason.endswith("awaiting traffic")
    assert up.verified_by_traffic(0, 0.0, {8080}, 30, unread=2) is None, "2 were before start"
    v = up.verified_by_traffic(3, 1.0, {8080}, 30, unread=12)
    assert v is not None and v.state is State.DEGRADED, v
    assert "tail call to lat_egress failed for 10 packets since start" in v.reason
    assert up.verified_by_traffic(9, 2.0, {8080}, 30, unread=20) is None, "degraded for good: nothing more to say"


def test_a_refused_count_read_at_start_is_a_degraded_verdict_not_an_error(monkeypatch) -> None:
    up = _unverified_upkeep(monkeypatch, _Dp(unread=0, refuse=True))
    v = up.verified(Verdict(State.ACTIVE, ""), {8080})
    assert v.state is State.DEGRADED and "counts could not be read" in v.reason and "Bad address" in v.reason
    assert up.verified_by_traffic(1, 1.0, {8080}, 30, unread=0) is None


def test_once_the_counts_verified_sockops_watches_the_learner_without_listing_connections(monkeypatch) -> None:
    dp = _Dp(unread=0)
    up = _unverified_upkeep(monkeypatch, dp)
    up.verified(Verdict(State.ACTIVE, ""), {8080})
    v = up.verified_by_traffic(1, 1.0, {8080}, 30, unread=0)
    assert v is not None and v.state is State.ACTIVE and "by traffic" in v.reason
    listed = len(dp.listed)
    for t in (3.0, 5.0, 7.0):
        assert up.verified_by_traffic(1, t, {8080}, 30, unread=0) is None
    assert len(dp.listed) == listed, "the connections are listed only until the counts verified the hooks"
    v = up.verified_by_traffic(1, 9.0, {8080}, 30, unread=1)
    assert v is not None and v.state is State.DEGRADED and "failed for 1 packets since start" in v.reason
