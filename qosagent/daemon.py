"""The agent: probe → start → tick (collect, decide, apply, publish) → stop, with signals and a status socket.

The loop knows capabilities only through their common face. A capability that fails at start is reported
unavailable and the rest run on; one that fails in a tick is counted and degraded, never fatal.
"""

from __future__ import annotations

import collections
import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, Sequence

from qosagent import capabilities
from qosagent import config as config_mod
from qosagent import features as features_mod
from qosagent import sandbox
from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict
from qosagent.config import Config, ConfigError
from qosagent.configbase import restart_changes
from qosagent.configwatch import ConfigWatch
from qosagent.gpu.backend import DISABLED, SAMPLE_FAILED, GpuBackend, GpuError, GpuState, NoGpu
from qosagent.gpu.choose import make_backend
from qosagent.hostfs import HostFS
from qosagent.schedule import Every, Pace
from qosagent.wakepipe import WakePipe
from qosagent.services import Service
from qosagent.snapshot import Decision, Snapshot

log = logging.getLogger("qosagent.daemon")


@dataclass
class SelfStats:
    """The agent's own health, exported as self-metrics."""

    ticks: int = 0
    tick_seconds_last: float = 0.0
    tick_seconds_max: float = 0.0
    tick_overruns: int = 0
    collect_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    apply_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    reloads_ok: int = 0
    reloads_failed: int = 0
    last_reload_error: str = ""
    started_monotonic: float = 0.0
    ready_seconds: float | None = None


class Endpoint(Protocol):
    """What serves the agent's state to the outside (the status socket, /metrics), closed when the agent stops."""

    def close(self) -> None: ...


def gpu_backend(cfg: Config) -> GpuBackend:
    """The configured GPU backend, or NoGpu with the reason where it cannot be opened (the agent runs on)."""
    try:
        return make_backend(cfg.gpu.backend, cfg.gpu.fake_file)
    except GpuError as e:
        log.warning("GPU backend %s unavailable: %s", cfg.gpu.backend, e)
        return NoGpu(str(e), e.kind)



def settle_heap() -> None:
    """What a start or a reload made (the config and its tenants, every capability's tables) lives until the next
    reload: moved out of the cyclic collector's reach (gc.freeze), so that the full collections a tick's allocations
    set off every few seconds do not walk it: with 4,000 tenants each took ~9 ms of a tick (bench/scale_tenants.py).
    What was frozen before is let go first and the garbage collected, so that no cycle a reload left behind is kept
    for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()

def watchdog_usec(cfg: Config, unit_us: int | None) -> int | None:
    """The WATCHDOG_USEC to ask systemd for, where the unit's (unit_us) is shorter than three of the loop's longest
    ticks: it pings once a tick, every rest_interval while resting, and would be killed healthy; None where it is long
    enough or no unit watches."""
    if unit_us is None:
        return None
    want = int(3 * max(cfg.interval, cfg.rest_interval) * 1e6)
    return want if want > unit_us else None


class Agent:
    def __init__(self, cfg: Config, hostfs: HostFS, config_path: str | None = None, gpu: GpuBackend | None = None):
        self.config = cfg
        self.config_path = config_path
        # Metrics keys the command line set (config.with_metrics): applied again to each reloaded config.
        self.metrics_overrides: dict[str, str | None] = {}
        self.hostfs = hostfs
        self.gpu = gpu if gpu is not None else gpu_backend(cfg)
        # A backend the agent chose itself and could not open is tried again (a driver that loads after the agent,
        # a container that got its devices late); one handed in (tests, rehearsals) is kept as it is.
        self._gpu_retry = Every(cfg.gpu.reprobe_interval) if gpu is None else None
        if self._gpu_retry is not None:
            self._gpu_retry.due(time.monotonic())  # just opened: the first retry is a period away
        self.ctx = AgentContext(config=cfg, hostfs=hostfs, gpu=self.gpu)
        # Every capability there is, in start and tick order (qosagent/capabilities.py); those running, started.
        self.kinds: Sequence[type[Capability]] = capabilities.CAPABILITIES
        self.capabilities: list[Capability] = []
        # The services the enabled capabilities use, made at start, stopped after the last capability.
        self.services: list[Service] = []
        self.verdicts: dict[str, Verdict] = self.ctx.verdicts
        self.stats = SelfStats(started_monotonic=time.monotonic())
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=cfg.status.decisions_kept)
        self.latest: Snapshot = Snapshot.build(0, time.monotonic(), time.time(), {})
        self.ready = threading.Event()
        # A stop or reload asked for: plain flags and a pipe's ring, which a signal handler may set and ring where it
        # could not take an Event's lock (qosagent/wakepipe.py); the ring ends the wait between ticks at once.
        self._stopping = False
        self._reload_asked = False
        self._bell = WakePipe()
        self.pace = Pace(cfg.interval, cfg.rest_interval)
        # What kept the last tick from being quiet (Capability.quiet): the capabilities not quiet, a decision, a
        # tick error; none, a quiet tick.
        self.awake_by: tuple[str, ...] = ()
        # The unit's WatchdogSec (WATCHDOG_USEC), where systemd watches the loop: widened to three of its longest
        # ticks at start and after a reload that lengthens them (watchdog_usec).
        self.unit_watchdog_us: int | None = None
        self._reload_done = threading.Condition()
        self._reload_result: tuple[int, tuple[bool, str]] = (0, (True, ""))
        self.features: features_mod.Features | None = None
        # What each capability started as, and which are degraded only by errors in ticks: those get their verdict
        # back at the first tick without one (a map read that failed once is not a standing fault).
        self._started: dict[str, Verdict] = {}
        self._tick_degraded: set[str] = set()
        self._endpoints: list[Endpoint] = []
        self._watch: ConfigWatch | None = None
        self._settle_pending = False  # start(settle=False) left settle_heap() to run(), after ready
        self._config_changed()  # from the content just loaded: an edit made while the agent starts is seen

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def add_endpoint(self, endpoint: Endpoint) -> None:
        """endpoint (the status socket, the metrics server) is closed when the agent stops."""
        self._endpoints.append(endpoint)

    def start(self, settle: bool = True) -> None:
        """Probe and start every enabled capability; then settle_heap(), unless `settle` is False: then run() does
        it a tick after ready (~20 ms that a restart's ready need not wait for)."""
        enabled = capabilities.enabled(self.config, self.kinds)
        if any(cls.loads_bpf for cls in enabled):
            try:
                mounted = features_mod.ensure_mounted(self.hostfs)
                if mounted:
                    log.info("mounted %s", ", ".join(mounted))
            except OSError as e:
                log.warning("could not mount tracefs, bpffs or cgroup2: %s", e)
        nvml_state = f"{self.gpu.name}: {'no GPU data' if isinstance(self.gpu, NoGpu) else 'open'}"
        self.features = features_mod.probe(self.hostfs, nvml_state)
        self.services = [self.ctx.service(kind) for kind in capabilities.services(enabled)]
        # What the sandbox (the unit, a container) refuses a capability is said before it tries.
        refusals = {cls: sandbox.refusal(cls.sandbox_needs(self.config), hostfs=self.hostfs)
                    for cls in enabled}
        made = {cls: cls(self.ctx) for cls in enabled}
        for cls, cap in made.items():
            if refusals[cls] is None:
                cap.begin(self.features)
        for cls in self.kinds:
            if cls not in enabled:
                self.verdicts[cls.name] = Verdict(State.DISABLED, "disabled in config")
                continue
            cap, refused = made[cls], refusals[cls]
            verdict = Verdict(State.UNAVAILABLE, refused) if refused is not None else cap.probe(self.features)
            if verdict.state is State.UNAVAILABLE:
                log.warning("%s unavailable: %s", cls.name, verdict.reason)
                self.verdicts[cls.name] = verdict
                continue
            cap.verdict = verdict
            try:
                cap.start(verdict.plan)
            except CapabilityError as e:
                log.error("%s could not start: %s", cls.name, e)
                self.verdicts[cls.name] = Verdict(State.UNAVAILABLE, str(e))
                cap.stop()
                continue
            verdict = cap.verdict  # start may have found less than probe promised
            self.ctx.record(cls, verdict)
            self._started[cls.name] = verdict
            self.capabilities.append(cap)
            log.info("%s %s%s", cls.name, verdict.state.value, f" ({verdict.reason})" if verdict.reason else "")
        if settle:
            settle_heap()
        self._settle_pending = not settle

    def stop(self) -> None:
        """Undo every capability in reverse start order, then stop the services they shared; each stop runs even
        when another fails."""
        for cap in reversed(self.capabilities):
            try:
                cap.stop()
            except Exception:  # noqa: BLE001 - a failing stop must not keep the others from rolling back
                log.exception("%s: stop failed", cap.name)
        self.capabilities = []
        for svc in reversed(self.services):
            try:
                svc.stop()
            except Exception:  # noqa: BLE001 - as a capability's: the rest still stop
                log.exception("%s: stop failed", svc.name)
            self.ctx.services.pop(svc.name, None)
        self.services = []
        for endpoint in self._endpoints:
            endpoint.close()
        self._endpoints = []
        self.gpu.close()

    # ---- one tick ----------------------------------------------------------------------------------------
    def tick(self) -> Snapshot:
        t0 = time.monotonic()
        self._reprobe_gpu()
        parts: dict[str, Any] = {"gpu": self._sample_gpu()}
        self.ctx.gpu_state = parts["gpu"]
        failed: set[str] = set()
        for cap in self.capabilities:
            try:
                cap.maintain()
            except Exception as e:  # noqa: BLE001 - a side effect that failed is a failed write: counted as one
                self.stats.apply_errors[cap.name] += 1
                failed.add(cap.name)
                self._degrade(cap, f"maintenance failed: {e}", transient=True)
                log.warning("%s: maintenance failed: %s", cap.name, e)
            try:
                parts[cap.name] = cap.collect()
            except Exception as e:  # noqa: BLE001 - counted and reported; the loop goes on
                self.stats.collect_errors[cap.name] += 1
                failed.add(cap.name)
                self._degrade(cap, f"collect failed: {e}", transient=True)
                log.debug("%s collect failed", cap.name, exc_info=True)
        for svc in self.services:
            try:
                parts[svc.name] = svc.collect()
            except Exception:  # noqa: BLE001 - as a capability's: counted, the tick goes on without its part
                self.stats.collect_errors[svc.name] += 1
                log.debug("%s collect failed", svc.name, exc_info=True)
        snap = Snapshot.build(self.latest.seq + 1, t0, time.time(), parts)
        decided: list[Decision] = []
        for cap in self.capabilities:
            try:
                decisions = cap.decide(snap)
                cap.apply(decisions)
            except Exception as e:  # noqa: BLE001
                self.stats.apply_errors[cap.name] += 1
                failed.add(cap.name)
                self._degrade(cap, f"decide/apply failed: {e}", transient=True)
                log.warning("%s: %s", cap.name, e, exc_info=log.isEnabledFor(logging.DEBUG))
                continue
            for d in decisions:
                log.info("decision %s %s %s: %s (%s)%s", d.capability, d.target, d.action, d.change(), d.reason,
                         "" if d.applied else " [dry-run]")
            decided.extend(decisions)
        self._recover(failed)
        self._restate()
        self.awake_by = tuple(sorted({cap.name for cap in self.capabilities if not cap.quiet()}
                                     | ({"decisions"} if decided else set()) | self._tick_degraded))
        self.decisions.extend(decided)
        for cap in self.capabilities:
            if cap.name not in failed:
                parts[cap.name] = cap.settled(parts.get(cap.name))
        snap = Snapshot(snap.seq, snap.monotonic, snap.wall_time, MappingProxyType(parts), tuple(decided))
        elapsed = time.monotonic() - t0
        self.stats.ticks += 1
        self.stats.tick_seconds_last = elapsed
        self.stats.tick_seconds_max = max(self.stats.tick_seconds_max, elapsed)
        self.latest = snap  # last: the exposition built for this snapshot carries this tick's stats
        return snap

    def _sample_gpu(self) -> GpuState:
        try:
            return self.gpu.sample()
        except Exception as e:  # noqa: BLE001 - a backend bug must not stop the loop; GPU state is unknown
            self.stats.collect_errors["gpu"] += 1
            return GpuState(available=False, reason=f"sample failed: {e}", cause=SAMPLE_FAILED)

    def _reprobe_gpu(self) -> None:
        """While the agent has no GPU backend by failure (not by config), open it again every
        gpu.reprobe_interval. Readings (admission, placement, metrics) follow from the next tick; what a capability
        planned at start without GPUs (dvfs' GPU bands) waits for a restart, as its status says."""
        if self._gpu_retry is None or not isinstance(self.gpu, NoGpu) or self.gpu.kind == DISABLED:
            return
        if not self._gpu_retry.due(time.monotonic()):
            return
        cfg = self.config.gpu
        try:
            # "auto" falls back to NoGpu inside make_backend, logging each time: ask NVML itself, quietly.
            found = make_backend("nvml" if cfg.backend == "auto" else cfg.backend, cfg.fake_file)
        except GpuError as e:
            self.gpu = self.ctx.gpu = NoGpu(str(e), e.kind)  # the latest reason, for status and the metric
            return
        log.info("GPU data available: %s opened after start (%d GPU(s))", found.name, len(found.devices()))
        self.gpu = self.ctx.gpu = found

    def _degrade(self, cap: Capability, reason: str, transient: bool = False) -> None:
        self.verdicts[cap.name] = Verdict(State.DEGRADED, reason)
        if transient:
            self._tick_degraded.add(cap.name)
        else:
            self._tick_degraded.discard(cap.name)

    def _recover(self, failed: set[str]) -> None:
        for name in sorted(self._tick_degraded - failed):
            self._tick_degraded.discard(name)
            self.verdicts[name] = self._started[name]
            log.info("%s recovered: %s", name, self._started[name].state.value)

    def _restate(self) -> None:
        """A capability's own verdict changed while it ran (latency's hooks verified by traffic, or found silent):
        reported from now on, unless a failure of the agent's (degraded above) is what stands."""
        for cap in self.capabilities:
            was = self._started[cap.name]
            if cap.verdict == was:
                continue
            self._started[cap.name] = cap.verdict
            if self.verdicts.get(cap.name) == was:
                self.verdicts[cap.name] = cap.verdict
            v = cap.verdict
            log.info("%s %s%s", cap.name, v.state.value, f" ({v.reason})" if v.reason else "")

    # ---- reload ------------------------------------------------------------------------------------------
    def reload(self) -> tuple[bool, str]:
        """Re-read the config file, as one transaction over every capability: all of them prepare against the new
        config before any writes, and a refusal or a failed commit leaves every one on the old config."""
        if self._watch is not None:
            self._watch.seen()  # what this reload reads is not reloaded again by the watch
        try:
            new = config_mod.with_metrics(config_mod.load(self.config_path), self.metrics_overrides)
        except (ConfigError, ValueError) as e:
            return self._reload_failed(str(e))
        restart = restart_changes(self.config, new)
        if restart:
            return self._reload_failed(f"changing {', '.join(restart)} needs a restart")
        prepared: list[tuple[Capability, Change]] = []
        for cap in self.capabilities:
            try:
                prepared.append((cap, cap.prepare(new)))
            except CapabilityError as e:
                return self._reload_failed(f"{cap.name}: {e}")
        for i, (cap, change) in enumerate(prepared):
            try:
                change.commit()
            except CapabilityError as e:
                self._undo(prepared[:i])
                return self._reload_failed(f"{cap.name}: {e}")
        self.config = new
        self.ctx.config = new
        self.stats.reloads_ok += 1
        self.stats.last_reload_error = ""
        settle_heap()
        log.info("config reloaded from %s", self.config_path or config_mod.DEFAULT_SOURCE)
        return True, "reloaded"

    def _undo(self, committed: list[tuple[Capability, Change]]) -> None:
        for cap, change in reversed(committed):
            try:
                change.undo()
            except Exception as e:  # noqa: BLE001 - the others are still put back; this one says it is not
                log.exception("%s: putting the old config back failed", cap.name)
                self._degrade(cap, f"a failed reload could not be undone: {e}")

    def _reload_failed(self, why: str) -> tuple[bool, str]:
        self.stats.reloads_failed += 1
        self.stats.last_reload_error = why
        log.error("reload refused, old config stays: %s", why)
        return False, why

    # ---- the loop ----------------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """The last tick found nothing new and left nothing pending."""
        return not self.awake_by

    def request_stop(self, *_: Any) -> None:
        self._stopping = True
        self._bell.ring()

    def request_reload(self, *_: Any) -> None:
        self._reload_asked = True
        self._bell.ring()

    def run(self, notify: Any = None) -> None:
        """Tick until asked to stop, every `interval`, or every `rest_interval` while resting (schedule.Pace).
        `notify(state)` receives READY=1 and WATCHDOG=1 for systemd."""
        next_at = time.monotonic()
        self.tick()
        self.ready.set()
        self.stats.ready_seconds = time.monotonic() - self.stats.started_monotonic
        log.info("ready in %.2fs: %s", self.stats.ready_seconds,
                 ", ".join(f"{n}={v.state.value}" for n, v in self.verdicts.items()))
        if notify:
            notify("READY=1")
        while not self._stopping:
            next_at += self.pace.after(self.latest.monotonic, self.quiet)
            delay = next_at - time.monotonic()
            if delay < 0:
                # Overran: skip the missed ticks rather than bursting to catch up.
                self.stats.tick_overruns += 1
                next_at = time.monotonic()
            elif self._bell.wait(delay):
                self._bell.clear()
                if self._stopping:
                    break
                next_at = time.monotonic()  # a reload asked for: now, and the ticks after it paced from here
            if self._settle_pending:
                # A tick after ready, not at once: its collection holds the interpreter for ~20 ms, which the
                # first readiness checks (the status socket, /readyz) would otherwise wait for.
                settle_heap()
                self._settle_pending = False
            if self._config_changed():
                self._reload_asked = True
            if self._reload_asked:
                self._reload_asked = False  # before the file is read: a request from now on reloads again
                result = self.reload()
                self.pace.again(self.config.interval, self.config.rest_interval)
                widened = watchdog_usec(self.config, self.unit_watchdog_us)
                if notify and widened:
                    notify(f"WATCHDOG_USEC={widened}")
                with self._reload_done:
                    self._reload_result = (self._reload_result[0] + 1, result)
                    self._reload_done.notify_all()
            self.tick()
            if notify:
                notify("WATCHDOG=1")

    def _config_changed(self) -> bool:
        """The config file changed since it was last read (config_watch): a reload is due. The watch follows the
        config as it now stands, so a reload that turns the watch off or changes its interval takes effect."""
        want = self.config_path is not None and self.config.config_watch.enabled
        if not want:
            self._watch = None
            return False
        if self._watch is None or self._watch.interval != self.config.config_watch.interval:
            self._watch = ConfigWatch(self.config_path, self.config.config_watch.interval, time.monotonic)
            return False
        return self._watch.changed()

    def reload_and_wait(self, timeout: float = 10.0) -> tuple[bool, str]:
        """Ask the loop to reload (it does so between ticks) and wait for its answer."""
        with self._reload_done:
            seen = self._reload_result[0]
            self._reload_asked = True
            self._bell.ring()
            if not self._reload_done.wait_for(lambda: self._reload_result[0] != seen, timeout):
                return False, "the control loop did not answer in time"
            return self._reload_result[1]

    def install_signal_handlers(self) -> None:
        """From the main thread, which runs the loop: the handlers set a flag and ring the loop's bell, and the
        interpreter rings it too, for a signal that reached another thread (WakePipe.ring_on_signals)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self._bell.ring_on_signals()

    # ---- what the status socket serves -------------------------------------------------------------------
    def status(self, decisions: bool = False) -> dict[str, Any]:
        snap = self.latest
        out: dict[str, Any] = {
            "version": __import__("qosagent").__version__,
            "seq": snap.seq,
            "time": snap.wall_time,
            "config": self.config_path or config_mod.DEFAULT_SOURCE,
            "interval_s": self.config.interval,
            "rest_interval_s": self.config.rest_interval,
            "capabilities": {n: v.as_dict() for n, v in self.verdicts.items()},
            "self": {
                "ticks": self.stats.ticks,
                "tick_seconds_last": self.stats.tick_seconds_last,
                "tick_seconds_max": self.stats.tick_seconds_max,
                "tick_overruns": self.stats.tick_overruns,
                "resting": self.pace.resting,
                "awake_by": list(self.awake_by),
                "reloads_ok": self.stats.reloads_ok,
                "reloads_failed": self.stats.reloads_failed,
                "last_reload_error": self.stats.last_reload_error,
                "ready_seconds": self.stats.ready_seconds,
            },
        }
        for svc in self.services:
            try:
                shown = svc.status(snap.part(svc.name))
            except Exception as e:  # noqa: BLE001 - status must answer even when one part is broken
                shown = {"error": str(e)}
            if shown:
                out[svc.name] = shown
        for cap in self.capabilities:
            try:
                out[cap.name] = cap.status(snap)
            except Exception as e:  # noqa: BLE001 - status must answer even when one part is broken
                out[cap.name] = {"error": str(e)}
        recent = list(self.decisions)
        out["decisions"] = [d.as_dict() for d in (recent if decisions else recent[-10:])]
        return out
