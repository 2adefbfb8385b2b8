"""Latency's hooks beyond the datapath's tracepoints and kprobes, kept attached while cgroups and connections come and
go: sockops mode's cgroup watch (cgroupwatch.py), lat_egress on the cgroup2 root in tracepoint and kprobe modes
(links.py), and the adopter of connections open before their port was tracked (adopt.py); with the self-test that
the ones on every socket's path run (selftest.py; where it cannot run, real traffic's counts) and the view of them the
part carries (`model.Hooks`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from qosagent.capability import State, Verdict
from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_EGRESS
from qosagent.latency import adopt, links, selftest
from qosagent.latency.cgroupwatch import CgroupWatch
from qosagent.latency.model import Hooks, Plan
from qosagent.schedule import Every

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS
    from qosagent.latency.datapath import Datapath
    from qosagent.netns import ServingNs

log = logging.getLogger("qosagent.latency")

LIST_S = 1.0  # how often, until traffic verified the hooks, the connections on the tracked ports are listed


class Upkeep:
    """The hooks one start of the capability links on the host, and their upkeep each maintain. `serving(ports)`:
    the other network namespaces where one of ports listens (pods), whose processes' sockets and cgroups count too."""

    def __init__(self, dp: "Datapath", fs: "HostFS", clock: Callable[[], float], plan: Plan,
                 serving: Callable[[set[int]], list["ServingNs"]]):
        self.dp = dp
        self.fs = fs
        self.clock = clock
        self.mode = plan.mode
        self.egress = plan.egress  # responses are read as they leave (TTFT, inter-token): a cgroup_skb egress program
        self.egress_error = "no cgroup v2 hierarchy for the egress program"  # why not, when not
        self.egress_lost = False  # probe promised it, start could not attach it
        self.serving = serving
        self.watch: CgroupWatch | None = None  # sockops mode: the hooks on the cgroup2 root and serving cgroups
        self.adopter: adopt.Adopter | None = None  # connections open before their port was tracked
        self._root_link: int | None = None  # tracepoint and kprobe modes: lat_egress on the cgroup2 root
        # Where the self-test could not run: the hooks verified by real traffic instead (selftest.ByTraffic), and
        # the verdict the self-test left, which what traffic shows replaces.
        self._by_traffic: selftest.ByTraffic | None = None
        self._unverified: Verdict | None = None
        self._traffic_listed = Every(LIST_S)

    def start(self, tracked: set[int], write: Callable[[], None]) -> None:
        """write() the maps, then link the hooks and adopt the connections already open on tracked. Maps first,
        hooks last: a connection established before the tenant maps were written would be resolved against empty
        ones. On a CapabilityError, close() undoes what was linked."""
        adopt.set_listing(self.dp.prog, True)
        write()
        root = None
        if self.mode == "sockops":
            self.watch = CgroupWatch(self.dp.prog, self.fs, links.cgroup_root(self.fs), self.clock)
            self.watch.start(tracked, [p for ns in self.serving(tracked) for p in ns.pids])
        elif self.egress:
            root = self._attach_egress_root()
        self.adopter = adopt.Adopter(self.dp.prog, self.fs, self.clock, self.watch, root, elsewhere=self._serving_pids)
        self.adopter.open(tracked)

    def _serving_pids(self, ports: set[int]) -> list[int]:
        """A process in each serving namespace (pods), whose /proc entries list the namespace's sockets."""
        return [ns.pid for ns in self.serving(ports)]

    def _attach_egress_root(self) -> str | None:
        """lat_egress on the cgroup2 root, for the whole run: in tracepoint and kprobe modes it finds a response's
        socket by the packet's addresses, whichever cgroup sends it; the root, or None where it could not be linked.
        Where it cannot be (a verifier of another kernel refusing the parser, say), the send hooks still time the
        headers and responses: TTFT and inter-token latency are unavailable, with the reason, and nothing else."""
        try:
            root = links.cgroup_root(self.fs)
            self._root_link = links.link_root(self.fs, root, links.load_egress(self.dp.prog),
                                              ATTACH_CGROUP_INET_EGRESS)
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when loading
            self.egress = False
            self.egress_lost = True
            self.egress_error = f"the egress program could not be attached: {e}"
            log.warning("%s; time to first token and inter-token latency unavailable", self.egress_error)
            return None
        return root

    def verified(self, verdict: Verdict, tracked: set[int]) -> Verdict:
        """verdict as what started bears out: lowered where the egress program could not be attached, or where a
        hook attached on every socket's path was not seen running."""
        if self.egress_lost:
            why = f"time to first token and inter-token latency unavailable: {self.egress_error}"
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, why) if r))
        # Active only once the hooks were seen running (qosagent/latency/selftest.py): those on every socket's path.
        rooted = self.watch.rooted() if self.watch is not None else []
        rooted += ["lat_egress"] if self._root_link is not None else []
        try:
            silent = selftest.check(self.dp.fds(rooted + self.dp.traced()), tracked,
                                    unread=self.dp.egress_unread if self.watch is not None else None)
        except selftest.Unverifiable as e:
            # Said, not degraded: the documented unit runs without CAP_SYS_ADMIN, and a capability degraded on every
            # such host would be a false alarm (and an agent never ready). Real traffic verifies the hooks later.
            log.info("%s; verifying them by traffic on ports %s", e, sorted(tracked))
            self._unverified = verdict
            try:
                unread = self.dp.egress_unread() if self.watch is not None else None
                self._by_traffic = selftest.ByTraffic(self.dp.counted(), self._open_on(tracked), unread)
            except OSError as err:  # the counts' batch read refused: never expected, said rather than raised past start
                why = f"hooks not verified: the programs' counts could not be read ({err})"
                log.warning("%s", why)
                return Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, why) if r))
            return Verdict(verdict.state, "; ".join(r for r in (verdict.reason, f"{e}, awaiting traffic") if r))
        if silent:
            log.warning("%s", silent)
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, silent) if r))
        return verdict

    def _open_on(self, tracked: set[int]) -> set[bytes]:
        return {c.key for c in adopt.established(self.fs, tracked, elsewhere=self._serving_pids(tracked))}

    def verified_by_traffic(self, counted: int, now: float, tracked: set[int], within: float,
                            unread: int = 0) -> Verdict | None:
        """Where the self-test could not run, the hooks verified or found silent by what real traffic made the
        programs count (counted: connections tracked and requests started on the tracked ports, every tenant's, as of
        this tick's read), and in sockops mode degraded for good once the egress learner's tail calls were seen
        failing (unread, as of this tick's read): the capability's new verdict, or None while it stands."""
        check, base = self._by_traffic, self._unverified
        if check is None or base is None:
            return None
        # Connections are listed at most once a second, and only until the first new one was seen or the counts
        # verified the hooks (sockops mode keeps watching the learner's tail calls after that, which needs no list).
        listing = check.traffic_since is None and not check.verified
        listed = self._open_on(tracked) if listing and self._traffic_listed.due(now) else None
        seen = check.observe(now, time.time(), counted, listed, within, unread)
        if seen is None:
            return None
        if check.done:
            self._by_traffic = None
        if seen.verified:
            log.info("latency %s", seen.reason)
            state = base.state
        else:
            log.warning("latency %s", seen.reason)
            state = State.DEGRADED
        return Verdict(state, "; ".join(r for r in (base.reason, seen.reason) if r))

    def write_adopting(self, added: set[int], write: Callable[[], None]) -> None:
        """write() (a reload's maps), then the connections already open on the ports it newly tracks, added, taken
        under observation; connections that start meanwhile are listed by the kernel (lat_fresh), so none is taken
        for one open before."""
        assert self.adopter is not None
        try:
            adopt.set_listing(self.dp.prog, bool(added))
            write()
            if added:
                self.adopter.open(added)
        finally:
            adopt.set_listing(self.dp.prog, False)

    def maintain(self, tracked: set[int]) -> None:
        """Connections awaiting adoption followed; sockops mode's links of cgroups gone pruned, its learners ended."""
        assert self.adopter is not None
        self.adopter.maintain(tracked)
        if self.watch is not None:
            self.watch.maintain()

    def attached(self) -> int:
        n = self.watch.attached() if self.watch is not None else 0
        n += 1 if self._root_link is not None else 0
        return n + (self.adopter.attached() if self.adopter is not None else 0)

    def found(self) -> int:
        return self.adopter.found if self.adopter is not None else 0

    def unobserved(self) -> dict[str, int]:
        return self.adopter.unobserved() if self.adopter is not None else {}

    def view(self, attached: int, programs: list[dict[str, Any]], egress_unread: int = 0) -> Hooks:
        """What the part shows of the hooks: attached counts the datapath's too; egress_unread as the tick read it."""
        w = self.watch
        return Hooks(
            mode=self.mode, attached=attached, programs=tuple((p["name"], p["id"]) for p in programs),
            ttft=("measured: responses read as they leave" if self.egress else f"unavailable: {self.egress_error}"),
            cgroups=tuple(w.cgroups()) if w is not None else (), learning=w is not None and w.learning,
            cgroup_errors=w.errors if w is not None else 0, egress_unread=egress_unread if w is not None else 0)

    def close(self) -> None:
        """Undo start(), in reverse: the adopter's link, the cgroup watcher and its links, the egress link on the
        root."""
        if self.adopter is not None:
            self.adopter.close()
            self.adopter = None
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        links.close(self._root_link)
        self._root_link = None
        self._by_traffic = self._unverified = None
