"""The classifier's kernel side: pinned maps adopted or replaced, the program loaded and attached, maps written
from config, counters read back.

Everything lives under <bpf.pin_root>/quota-v<QUOTA_LAYOUT>/ (qosagent/ebpf/pins.py) so that an agent of another
layout never adopts these pins; the directory an agent of another layout left is taken over at attach (its filters
replaced, its pins removed).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from qosagent.config import Config
from qosagent.hostfs import HostFS
from qosagent.ebpf import mapsize, pinned, pins
from qosagent.ebpf.libbpf import obj_pin, pinned_map_info
from qosagent.ebpf.maps import GEN_SIZE, RUN_SLOTS, ArrayRange, Generations, Map, runs, sync
from qosagent.ebpf.tenant_ports import TenantPorts, sync_cidrs
from qosagent.quota import layout, tc
from qosagent.quota.layout import AttachKey, AttachVal, QuotaConf, QuotaLimit
from qosagent.quota.rules import Bucket, rules
from qosagent.tenants import FLEET_NO_END, UNMATCHED_ID, tenant_id

log = logging.getLogger("qosagent.quota")

PROG_PIN = "quota_classify"
HEADER_PROG_PIN = "quota_header"


def pin_dir(cfg: Config) -> str:
    return pins.quota_dir(cfg.bpf.pin_root)


def other_layouts(pin_root: str) -> list[str]:
    """Pin directories of agents of other layouts (quota-v<N>, N not ours) under pin_root."""
    try:
        names = os.listdir(pin_root)
    except FileNotFoundError:
        return []
    ours = os.path.basename(pins.quota_dir(pin_root))
    return sorted(os.path.join(pin_root, n) for n in names
                  if n != ours and re.fullmatch(r"quota-v\d+", n) and os.path.isdir(os.path.join(pin_root, n)))


def incompatible_pins(path: str, flow_entries: int) -> list[str]:
    """Why the pins at path cannot be adopted ([] when they can, or when there are none)."""
    problems = []
    for name, (spec, max_entries) in layout.map_specs(flow_entries).items():
        p = os.path.join(path, name)
        if not os.path.exists(p):
            continue  # a map added later is created next to the adopted ones
        try:
            info = pinned_map_info(p)
        except OSError as e:
            problems.append(f"{name}: {e.strerror}")
            continue
        got = (info.type, info.key_size, info.value_size, info.max_entries)
        want = (spec.type, spec.key_size, spec.value_size, max_entries)
        if got != want:
            problems.append(f"{name}: type/key/value/entries {got}, expected {want}")
    return problems


def read_attach(path: str) -> list[tuple[int, int, bool]]:
    """(ifindex, netns inode, created_clsact) from a pinned quota_attach, without a loaded program."""
    p = os.path.join(path, "quota_attach")
    if not os.path.exists(p):
        return []
    with Map.pinned(p, AttachKey, AttachVal) as m:
        return [(k.ifindex, k.netns_ino, bool(v.created_clsact)) for k, v in m.items()]


def remove_attachments(path: str, prio: int, handle: int, ifnames: Iterable[str] = ()) -> list[str]:
    """Our filters and the clsacts we created, from the record in the pins (and by name on ifnames as well)."""
    done: list[str] = []
    here = tc.netns_ino()
    with tc.IPRoute() as ipr:
        seen: set[int] = set()
        try:
            recorded = read_attach(path) if os.path.isdir(path) else []
        except (OSError, ValueError) as e:  # a record of another layout: fall back to the names
            done.append(f"cannot read {path}/quota_attach ({e}); looking for our filter by name")
            recorded = []
        for idx, ino, created in recorded:
            if ino != here:
                done.append(f"skipped ifindex {idx}: attached in another network namespace (inode {ino})")
                continue
            links = ipr.get_links(idx) if ipr.link_lookup(index=idx) else []
            if not links:
                continue
            seen.add(idx)
            done += tc.remove(ipr, idx, links[0].get_attr("IFLA_IFNAME"), prio, handle, created)
        for name in ifnames:
            idx = tc.ifindex(ipr, name)
            if idx is not None and idx not in seen:
                done += tc.remove(ipr, idx, name, prio, handle, False)
    return done


def remove_pins(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    shutil.rmtree(path)
    out = [f"removed pins {path}"]
    parent = os.path.dirname(path)
    try:
        os.rmdir(parent)  # the pin root, when nothing else of ours is left in it
        out.append(f"removed {parent}")
    except OSError:
        pass
    return out


FLOW_L1_ENTRY = 48  # sizeof(struct flow_l1), bpf/quota.c
FLOW_L1_BITS = (6, 12)  # the flow front's entries per CPU: 64 to 4096


def flow_l1_bits(flow_entries: int, cpus: int) -> int:
    """log2 of the flow front's entries per CPU: room for each CPU's share of the flow cache (flows spread over
    CPUs by RSS), so that the front's memory follows quota.flow_entries rather than the CPU count."""
    lo, hi = FLOW_L1_BITS
    return max(lo, min(hi, (max(flow_entries // cpus, 1) - 1).bit_length()))


def map_sizes(cfg: Config, cpus: int) -> list[mapsize.MapSize]:
    """The classifier's maps as `qosagent check` counts them (qosagent/ebpf/mapsize.py)."""
    kinds = {layout.ARRAY: mapsize.ARRAY, layout.PERCPU_ARRAY: mapsize.PERCPU_ARRAY, layout.HASH: mapsize.HASH,
             layout.LRU_HASH: mapsize.HASH}
    out = [mapsize.MapSize(name, kinds[spec.type], n, spec.key_size, spec.value_size)
           for name, (spec, n) in layout.map_specs(cfg.quota.flow_entries).items() if spec.type in kinds]
    scan = 4 * 9 + 4 * 6 + 8 + cfg.quota.header_scan_bytes  # struct scan_buf
    return out + [mapsize.MapSize("quota_flow_l1", mapsize.PERCPU_ARRAY,
                                  1 << flow_l1_bits(cfg.quota.flow_entries, cpus), 4, FLOW_L1_ENTRY),
                  mapsize.MapSize("quota_scan", mapsize.PERCPU_ARRAY, 1, 4, scan),
                  mapsize.MapSize("quota_gen", mapsize.ARRAY, layout.SLOTS + layout.GEN_LINE * cpus, 4, GEN_SIZE)]


def spec(cfg: Config, path: str, cpus: int) -> pinned.Spec:
    """The classifier's build, kept under path (its maps pinned there by the C, BPF_TABLE_PINNED): the next agent
    of the same source and settings opens it rather than compiling it again."""
    defines = {"QOS_PIN_DIR": f'"{path}"', "QOS_FLOWS": cfg.quota.flow_entries,
               "QOS_HDR_SCAN": cfg.quota.header_scan_bytes,
               "QOS_FLOW_L1_BITS": flow_l1_bits(cfg.quota.flow_entries, cpus), "QOS_GEN_CPUS": cpus}
    shared = {n: os.path.join(path, n) for n in layout.map_specs(cfg.quota.flow_entries)}
    return pinned.Spec("quota", ("quota",), defines, dict.fromkeys((PROG_PIN, HEADER_PROG_PIN), pinned.SCHED_CLS),
                       shared=shared)


@dataclass(frozen=True)
class Reading:
    """One read of the maps."""

    ktime_ns: int
    counts: Mapping[int, tuple[int, int, int, int]]  # tenant id (0: none) -> req admitted, dropped, conn adm., dropped
    stats: Mapping[str, int]
    limits: Mapping[int, Any]  # tenant id -> QuotaLimit
    buckets: Mapping[int, tuple[int, int]]  # tenant id -> (req_tat, conn_tat)
    heartbeat_ns: int
    rows_read: int = 0  # slots whose counts and buckets were read (only they are in counts and buckets)


class Datapath:
    """Loaded program + maps for one config; attach() puts it on the hook, close() only drops our fds."""

    def __init__(self, cfg: Config, fs: HostFS | None = None):
        self.cfg = cfg
        self.path = pin_dir(cfg)
        problems = incompatible_pins(self.path, cfg.quota.flow_entries)
        if problems:
            log.warning("pins at %s have another layout, replacing them: %s", self.path, "; ".join(problems))
            for line in remove_attachments(self.path, cfg.quota.tc_prio, cfg.quota.tc_handle,
                                           cfg.quota.interfaces or ["lo"]):
                log.info("%s", line)
            remove_pins(self.path)
        self.adopted = os.path.exists(os.path.join(self.path, "quota_limits"))
        # An agent of another layout may still be enforcing: its filters are replaced by ours at attach (same prio
        # and handle, no gap), taking over its record of the clsacts it created; then its pins go.
        self.older = other_layouts(cfg.bpf.pin_root)
        self.inherited: dict[tuple[int, int], bool] = {}
        for old in self.older:
            try:
                for idx, ino, created in read_attach(old):
                    self.inherited[(idx, ino)] = self.inherited.get((idx, ino), False) or created
            except (OSError, ValueError) as e:
                log.warning("cannot read %s/quota_attach (%s): only its filters on our interfaces are replaced",
                            old, e)
        os.makedirs(self.path, exist_ok=True)
        cpus = mapsize.possible_cpus(fs or HostFS("/"))
        try:
            self.program = pinned.load(spec(cfg, self.path, cpus), self.path)
            self.prog = self.program.fd(PROG_PIN)
            self.header_prog = self.program.fd(HEADER_PROG_PIN)
            self.maps = {n: self.program.map(n) for n in layout.map_specs(cfg.quota.flow_entries)}
            self.maps["quota_progs"].update(0, self.header_prog)
            self._pin_prog(PROG_PIN, self.prog)
            self._pin_prog(HEADER_PROG_PIN, self.header_prog)
        except Exception:
            # Pins created for a program that never ran go; adopted ones stay with the program still enforcing.
            if not self.adopted:
                remove_pins(self.path)
            raise
        self.overrides: dict[int, Bucket] = {}
        self.fleet: dict[int, tuple[Bucket, int]] = {}
        self.slots: dict[int, int] = {}  # tenant id -> index in the quota arrays
        self.hooked: set[tuple[int, str]] = set()  # (ifindex, hook) this program was attached to
        self.links: tc.Links | None = None  # the netlink sockets, opened at the first attach
        # The hooks attach() last put in place and the links' gen they were looked up in: the same again is a no-op.
        self._attached_as: tuple[list[tuple[str, str]], int] | None = None
        self._netns: dict[tuple[int, int], int] | None = None  # quota_netns as last written (None: as adopted)
        self.heartbeat_ns = 0  # as last written (write_config writes the first)
        self._limits: dict[int, bytes] = {}  # slot -> its quota_limits entry as written
        self._limits_whole = False  # the last walk of quota_limits wrote every slot (one that raised did not)
        self._written: dict[int, QuotaLimit] = {}  # tenant id -> the same, as the tick's reading carries it
        self._by_slot: dict[int, int] = {0: UNMATCHED_ID}  # slot -> tenant id, as of the last assignment
        # Which slots' counts to read each tick; every one at the first (adopted pins hold counts already).
        self._gens = Generations(self.program.map("quota_gen").fd, 0, 1, everything=True)
        # The packets passed unchecked, by reason: every entry in one BPF_MAP_LOOKUP_BATCH, read only when a CPU's
        # stats generation moved (past the slots' in quota_gen, qos_quota.h; at rest the tick asks the kernel
        # nothing) and summed only when the bytes moved (the same dict is handed on).
        self._stat_gens = Generations(self.program.map("quota_gen").fd, layout.SLOTS, layout.GEN_LINE * cpus,
                                      everything=True)
        st = self.maps["quota_stats"]
        self._stats_range = ArrayRange(st.fd, 0, len(layout.STAT_REASONS), ctypes.sizeof(st.value))
        self._stats_raw = b""
        self._stats: dict[str, int] = {}
        fd = self.maps["tenant_ports"].fd
        self.ports = TenantPorts.adopt(fd) if self.adopted else TenantPorts(fd)
        # The moved slots' counters (per CPU) and buckets, a batch read per run of consecutive slots, in buffers kept
        # for runs of up to RUN_SLOTS (the first read's, of every slot, has its own).
        counters, buckets = self.maps["quota_counters"], self.maps["quota_buckets"]
        self._count_words = ctypes.sizeof(counters.value) // 8  # a slot: every CPU's QuotaCount, back to back
        self._counts_run = ArrayRange(counters.fd, 0, RUN_SLOTS, ctypes.sizeof(counters.value))
        self._buckets_run = ArrayRange(buckets.fd, 0, RUN_SLOTS, ctypes.sizeof(buckets.value))

    def _pin_prog(self, name: str, fd: int) -> None:
        p = os.path.join(self.path, name)
        if os.path.exists(p):
            os.unlink(p)
        obj_pin(fd, p)

    # ---- config -> maps ----------------------------------------------------------------------------------
    def write_config(self, cfg: Config, limits: Mapping[int, tuple[Bucket | None, Bucket | None]]) -> None:
        """Sync every rule and baseline map with cfg in place (stale keys deleted); the flow cache is emptied and
        its per-CPU front invalidated (rules_gen) when the rules changed, since a cached tenant may no longer be
        right."""
        self.cfg = cfg
        r = rules(cfg)
        m = self.maps
        # Claims that go or change tenant are released before slots move, so that no port points at a slot
        # handed to another tenant; the claims' new values (with their slots) follow the assignment.
        changed = self.ports.sync({p: c for p, c in self.ports.written.items() if r.ports.get(p) == c[0]})
        self._assign_slots([tenant_id(t.name) for t in cfg.tenants])
        changed |= self.ports.sync({p: (t, self.slots[t]) for p, t in r.ports.items()})
        changed |= sync_cidrs(m["tenant_cidrs"], r.cidrs)
        headers, watched = m["quota_headers"], m["watched_ports"]
        changed |= sync(headers, ((headers.key(h), headers.value(t)) for h, t in r.headers.items()))
        changed |= sync(watched, ((watched.key(p), watched.value(1)) for p in r.watched))
        if changed:
            # Then the generation, last: the classifier reads it before any flow state and tags what it puts in
            # its per-CPU flow front with it. Bumped before the sync or the clear, a packet in between would read
            # the new generation and still resolve by the old rules or an old tenant_flows entry, and that stale
            # copy would outlive the reload.
            m["tenant_flows"].clear()
            self._bump_rules_gen()
        self.baseline = dict(limits)
        self._write_limits()
        if self.older and not self.adopted:
            self._inherit_buckets()
        self.heartbeat(cfg, self._flags(cfg, bool(r.headers)))

    def _inherit_buckets(self) -> None:
        """An upgrade of layout starts each tenant's buckets where the old agent's stood (its quota_slots and
        quota_buckets, where their layout is ours), so that taking over grants no tenant a fresh burst. Called
        before attach: what the old program admits until then is at most a token or two more."""
        want = layout.map_specs(self.cfg.quota.flow_entries)
        ours = self.maps["quota_buckets"]
        for old in self.older:
            paths = {n: os.path.join(old, n) for n in ("quota_slots", "quota_buckets")}
            try:
                infos = {n: pinned_map_info(p) for n, p in paths.items()}
                if any((i.type, i.key_size, i.value_size) != (want[n][0].type, want[n][0].key_size,
                                                               want[n][0].value_size) for n, i in infos.items()):
                    log.warning("%s: its buckets have another layout; tenants start with a full burst", old)
                    continue
                slots = Map.pinned(paths["quota_slots"], ctypes.c_uint32, ctypes.c_uint32)
                buckets = Map.pinned(paths["quota_buckets"], ctypes.c_uint32, layout.QuotaBucket)
            except OSError as e:
                log.warning("%s: cannot read its buckets (%s); tenants start with a full burst", old, e)
                continue
            with slots, buckets:
                for tid, old_slot in slots.items():
                    slot = self.slots.get(tid.value)
                    got = buckets.lookup(old_slot.value)
                    if slot is None or got is None:
                        continue
                    cur = ours.lookup(slot)
                    cur.req_tat, cur.conn_tat = max(cur.req_tat, got.req_tat), max(cur.conn_tat, got.conn_tat)
                    ours.update(slot, cur)

    def _assign_slots(self, tids: list[int]) -> None:
        """Keep the slot of every tenant that stays (adopted pins included); a freed slot is zeroed before reuse.
        A tenant that leaves changes the rules, which empties the flow cache, so no flow keeps a stale slot (its
        ports were released before this)."""
        t = self.maps["quota_slots"]
        cur = {k.tenant: v.slot for k, v in t.items()}
        keep = {tid: s for tid, s in cur.items() if tid in tids and 0 < s < layout.SLOTS}
        free = iter(sorted(set(range(1, layout.SLOTS)) - set(keep.values())))
        for tid in tids:
            if tid not in keep:
                keep[tid] = next(free)
        for tid, s in cur.items():
            if keep.get(tid) != s:
                t.delete(tid)
                if 0 < s < layout.SLOTS:
                    for name in ("quota_limits", "quota_buckets", "quota_counters"):
                        self.maps[name].zero(s)
                    self._limits.pop(s, None)
        for tid, s in keep.items():
            if cur.get(tid) != s:
                t.update(tid, s)
        self.slots = keep
        self._by_slot = {s: tid for tid, s in keep.items()} | {0: UNMATCHED_ID}
        self._gens.resize(max(keep.values(), default=0) + 1)  # the generations each tick reads: the slots in use

    def set_overrides(self, overrides: Mapping[int, Bucket]) -> None:
        """Admission in enforce mode writes its overrides every tick: the same ones again change no entry, so no
        slot's limit is worked out again (write_config and set_fleet write them all after any other change). Only
        after a whole walk: one that a map update ended partway left slots unwritten, and the same overrides on the
        next tick walk again."""
        if overrides == self.overrides and self._limits_whole:
            return
        self.overrides = dict(overrides)
        self._write_limits()

    def set_fleet(self, shares: Mapping[int, tuple[Bucket, int]]) -> None:
        """This node's fleet shares: tenant id -> (bucket, end of its lease in CLOCK_MONOTONIC ns; FLEET_NO_END for a
        safe share). Tenants not named have none."""
        self.fleet = dict(shares)
        self._write_limits()

    def _write_limits(self) -> None:
        self._limits_whole = False
        t = self.maps["quota_limits"]
        written = {}
        for tid, slot in self.slots.items():
            req, conn = self.baseline.get(tid, (None, None))
            lim = QuotaLimit()
            lim.tenant = tid
            if req is not None:
                lim.req.interval_ns, lim.req.tau_ns = req.interval_ns, req.tau_ns
                lim.flags |= layout.QOS_LIMIT_REQ
            if conn is not None:
                lim.conn.interval_ns, lim.conn.tau_ns = conn.interval_ns, conn.tau_ns
                lim.flags |= layout.QOS_LIMIT_CONN
            ovr = self.overrides.get(tid)
            if ovr is not None:
                lim.override.interval_ns, lim.override.tau_ns = ovr.interval_ns, ovr.tau_ns
                lim.flags |= layout.QOS_LIMIT_OVERRIDE
            share = self.fleet.get(tid)
            if share is not None:
                fl, until = share
                lim.fleet.interval_ns, lim.fleet.tau_ns = fl.interval_ns, fl.tau_ns
                lim.fleet_until_ns = min(until, FLEET_NO_END)
                lim.flags |= layout.QOS_LIMIT_FLEET
            cur = self._limits.get(slot)
            if cur is None:  # not written since start: as the pins hold it
                cur = bytes(t.lookup(slot))
            if cur != bytes(lim):
                t.update(slot, bytes(lim))
            self._limits[slot] = bytes(lim)
            written[tid] = lim
        self._written = written
        self._limits_whole = True

    def _bump_rules_gen(self) -> None:
        t = self.maps["quota_config"]
        conf = QuotaConf.from_buffer_copy(bytes(t.lookup(0)))
        conf.rules_gen = (conf.rules_gen + 1) & 0xFFFFFFFF  # continues from an adopted pin's value
        t.update(0, bytes(conf))

    @staticmethod
    def _flags(cfg: Config, header_rules: bool) -> int:
        netns_rules = any(t.match.per_namespace for t in cfg.tenants)
        return (layout.QOS_CONF_HEADER_RULES if header_rules else 0) | \
            (layout.QOS_CONF_NETNS_RULES if netns_rules else 0)

    def set_netns(self, entries: Mapping[tuple[int, int], int]) -> bool:
        """quota_netns from (host-side veth ifindex, port or 0) -> tenant id. A change empties the flow cache and
        bumps the rules generation, as a rule change does: flows into a namespace found late were cached
        unmatched, and a gone one's ifindex may come back for another namespace."""
        if entries == self._netns:
            return False
        m = self.maps["quota_netns"]
        changed = sync(m, ((bytes(layout.NetnsKey(i, p, 0)), t) for (i, p), t in entries.items()))
        self._netns = dict(entries)
        if changed:
            self.maps["tenant_flows"].clear()
            self._bump_rules_gen()
        return changed

    def heartbeat(self, cfg: Config | None = None, flags: int | None = None) -> None:
        """Tell the kernel the agent is alive: overrides hold for heartbeat_timeout from now."""
        cfg = cfg or self.cfg
        t = self.maps["quota_config"]
        cur = QuotaConf.from_buffer_copy(bytes(t.lookup(0)))
        conf = QuotaConf()
        conf.rules_gen = cur.rules_gen  # only a rule change moves it (write_config)
        conf.heartbeat_ns = self.heartbeat_ns = time.monotonic_ns()  # CLOCK_MONOTONIC, bpf_ktime_get_ns's clock
        conf.heartbeat_timeout_ns = int(cfg.quota.heartbeat_timeout * 1e9)
        conf.flags = cur.flags if flags is None else flags
        t.update(0, bytes(conf))

    # ---- the hook ----------------------------------------------------------------------------------------
    def netlink(self) -> tc.Links:
        if self.links is None:
            self.links = tc.Links()
        return self.links

    def attach(self, ifnames: Iterable[str], egress: Iterable[str] = ()) -> list[str]:
        """Put the program on each interface's ingress, and on the egress of each of `egress` (host-side veths into
        serving namespaces), replacing only our own filter; drop it from interfaces recorded earlier and no longer
        named (a veth gone with its namespace took its filter along: only the record goes). Returns what
        changed. The same hooks again, while no link changed (Links.gen), change nothing and ask the kernel
        nothing."""
        links = self.netlink()
        hooks = [(n, tc.INGRESS) for n in ifnames] + [(n, tc.EGRESS) for n in egress]
        if self._attached_as == (hooks, links.gen) and not self.older and not self.inherited:
            return []
        q = self.cfg.quota
        rec = self.maps["quota_attach"]
        here = tc.netns_ino()
        done = []
        for (idx, ino), created in self.inherited.items():  # then replaced, or removed below like our own
            old = rec.lookup(bytes(AttachKey(idx, ino)))
            if old is None or (created and not old.created_clsact):
                rec.update(bytes(AttachKey(idx, ino)), bytes(AttachVal(created_clsact=int(created))))
        ipr = links.ipr
        keep = set()
        for name, parent in hooks:
            idx = tc.ifindex(ipr, name)
            if idx is None:
                if parent == tc.EGRESS:
                    continue  # the namespace went while we looked: nothing to attach to
                raise OSError(f"interface {name!r} not found")
            keep.add(idx)
            if (idx, parent) in self.hooked:
                continue  # this program is on the hook already: a netns sync or reload replaces nothing
            created = tc.ensure_clsact(ipr, idx)
            old = rec.lookup(bytes(AttachKey(idx, here)))
            if created or old is None:
                val = AttachVal(created_clsact=int(created or (old is not None and old.created_clsact)))
                rec.update(bytes(AttachKey(idx, here)), bytes(val))
            tc.attach(ipr, idx, self.prog, q.tc_prio, q.tc_handle, parent)
            self.hooked.add((idx, parent))
            done.append(f"{name}: attached{' on egress' if parent == tc.EGRESS else ''}"
                        f"{' (created clsact)' if created else ''}")
        for k, v in rec.items():
            if k.netns_ino == here and k.ifindex not in keep:
                still = ipr.get_links(k.ifindex) if ipr.link_lookup(index=k.ifindex) else []
                if still:
                    done += tc.remove(ipr, k.ifindex, still[0].get_attr("IFLA_IFNAME"), q.tc_prio, q.tc_handle,
                                      bool(v.created_clsact))
                rec.delete(k)
        self.hooked = {h for h in self.hooked if h[0] in keep}
        for old in self.older:
            done += remove_pins(old)
        self.older, self.inherited = [], {}
        self._attached_as = (hooks, links.gen)
        return done

    # ---- maps -> numbers ---------------------------------------------------------------------------------
    def read(self) -> Reading:
        """Every slot's counts and buckets, the limits as the kernel holds them, the stats."""
        limits = self.maps["quota_limits"]
        return self._read(set(self.slots.values()) | {0},
                          {tid: QuotaLimit.from_buffer_copy(bytes(limits.lookup(s))) for tid, s in self.slots.items()},
                          self.maps["quota_config"].lookup(0).heartbeat_ns, self.stats(fresh=True))

    def read_changed(self) -> Reading:
        """The tick's read: the counts and buckets of only the slots whose generation moved (quota_gen: qos_common.h;
        every slot at the first two reads), the limits and the heartbeat as last written (this agent is
        quota_config's only writer; a new dict each time they are written, never changed in place, so not copied
        here), the stats as of the last time a CPU counted one."""
        return self._read(self._gens.changed(), self._written, self.heartbeat_ns, self.stats())

    def _read(self, slots: set[int], limits: Mapping[int, QuotaLimit], heartbeat_ns: int,
              stats: Mapping[str, int]) -> Reading:
        counts, buckets = {}, {}
        by_slot = self._by_slot
        read = slots & by_slot.keys()
        words = self._count_words  # each of QuotaCount's 4 counts summed over the CPUs in C
        for first, n in runs(read):
            per_cpu = memoryview(self._counts_run.at(first, n)).cast("Q")
            tats = memoryview(self._buckets_run.at(first, n)).cast("Q")  # QuotaBucket: req_tat, conn_tat
            for i in range(n):
                tid = by_slot[first + i]
                c = per_cpu[i * words:(i + 1) * words]
                counts[tid] = (sum(c[0::4]), sum(c[1::4]), sum(c[2::4]), sum(c[3::4]))
                if tid:
                    buckets[tid] = (tats[2 * i], tats[2 * i + 1])
        return Reading(time.monotonic_ns(), counts, stats, limits, buckets, heartbeat_ns, len(read))

    def stats(self, fresh: bool = False) -> Mapping[str, int]:
        """quota_stats summed over the CPUs, by reason; the same dict as last time while no count moved. Read from
        the kernel only when fresh or when a CPU's stats generation moved since the last call (and at the call after
        that, once more: Generations)."""
        if not self._stat_gens.changed() and not fresh:
            return self._stats
        raw = self._stats_range.data()
        if raw != self._stats_raw:
            per = len(raw) // len(layout.STAT_REASONS)
            view = memoryview(raw)
            self._stats = {reason: sum(view[i * per:(i + 1) * per].cast("Q"))
                           for i, reason in enumerate(layout.STAT_REASONS)}
            self._stats_raw = raw
        return self._stats

    def flows(self) -> dict[tuple[str, int, str, int], tuple[int, str]]:
        """(client addr, client port, local addr, local port) -> (tenant id, how it was resolved); for tests/status."""
        out = {}
        for k, v in self.maps["tenant_flows"].items():
            ra = ipaddress.IPv6Address(bytes(k.raddr))
            la = ipaddress.IPv6Address(bytes(k.laddr))
            r = str(ra.ipv4_mapped or ra)
            loc = str(la.ipv4_mapped or la)
            out[(r, k.rport, loc, k.lport)] = (v.tenant, layout.VIA.get(v.via, "?"))
        return out

    def close(self) -> None:
        """Drop our references; what is pinned and attached stays (fail-static)."""
        self._gens.close()
        self._stat_gens.close()
        self.program.close()
        if self.links is not None:
            self.links.close()
            self.links = None

