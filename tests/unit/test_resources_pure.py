"""The pure parts of resources: the config's checks, the files a group gets, the loop's steps, the node's verdict,
the shared-cgroup rule and the rendering."""

from __future__ import annotations

import collections
import math

import pytest

from qosagent import config as config_mod
from qosagent.capability import AgentContext, CapabilityError
from qosagent.cgroups import HostCgroups
from qosagent.config import ConfigError
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.resources import export, planner, policy
from qosagent.resources.applier import Applier, Moved, Store, Thread
from qosagent.resources.capability import Resources
from qosagent.resources.reading import node_problems
from qosagent.resources.config import SuppressConfig
from qosagent.resources.sched import Attr
from qosagent.resources.discovery import Layout, groups, is_shared
from qosagent.resources.model import Files, Group, GroupReport, Memory, ResourcesPart, Serving, TierReport
from qosagent.slo import tier, tier_slos
from qosagent.statefile import StateFileError
from qosagent.units import parse_size


def parse(text: str) -> config_mod.Config:
    return config_mod.parse_text(text, "test")


TIERS = """
tiers:
  gold: {slo_p99: 120ms, weight: 10, resources: {cpus: 4, memory: 8GiB}}
  silver: {slo_p99: 350ms, weight: 5, resources: {cpus: 2, memory: 4GiB, memory_high: 6GiB, cpu_weight: 300}}
  bronze: {slo_p99: 1200ms, weight: 1, resources: {cpus: 1, sched: idle}}
  free: {slo_p99: 5s, weight: 1}
"""


def test_sizes_and_tier_defaults() -> None:
    assert parse_size("8GiB") == 8 << 30 and parse_size("2GB") == 2_000_000_000 and parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("8 gigs")
    cfg = parse(TIERS)
    gold, silver, bronze = (cfg.tiers[n] for n in ("gold", "silver", "bronze"))
    assert gold.cpu_weight() == 1000 and silver.cpu_weight() == 300 and bronze.cpu_weight() == 100
    assert gold.latency_sensitive() and silver.latency_sensitive() and not bronze.latency_sensitive()
    assert not cfg.tiers["free"].latency_sensitive()
    assert cfg.resources.mode == "dry-run" and not cfg.resources.enabled and not cfg.resources.move


@pytest.mark.parametrize("bad, where, says", [
    ("{cpus: 0}", "tiers.gold.resources.cpus", "greater than 0"),
    ("{memory: 8 gigs}", "tiers.gold.resources.memory", "expected a size"),
    ("{memory: 8GiB, memory_high: 4GiB}", "tiers.gold.resources", "memory_high is below memory"),
    ("{memory: 8GiB, memory_max: 4GiB}", "tiers.gold.resources", "memory_max is below memory"),
    ("{memory_high: 8GiB, memory_max: 6GiB}", "tiers.gold.resources", "memory_max is below memory_high"),
    ("{memory_high: none}", "tiers.gold.resources.memory_high", "or max (no limit)"),
    ("{memory_max: max}", "tiers.gold.resources.memory_max", "expected a size"),
    ("{sched: idle, latency_sensitive: true}", "tiers.gold.resources", "contradicts latency_sensitive"),
    ("{cpu_weight: 20000}", "tiers.gold.resources.cpu_weight", "less than or equal to 10000"),
    ("{shares: 3}", "tiers.gold.resources.shares", "unknown key"),
])
def test_bad_tier_resources_name_the_key(bad: str, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(f"tiers:\n  gold: {{slo_p99: 120ms, weight: 10, resources: {bad}}}\n")
    assert any(path == where and says in msg for path, msg in e.value.problems), e.value.problems


def test_bad_resources_section() -> None:
    with pytest.raises(ConfigError) as e:
        parse("resources: {latency_slice: 10ms5, suppress: {factor: 1.5, floor_cpus: 0}, mode: on}")
    paths = {p for p, _ in e.value.problems}
    assert {"resources.latency_slice", "resources.suppress.factor", "resources.suppress.floor_cpus",
            "resources.mode"} <= paths


def test_node_too_small_is_a_verdict() -> None:
    cfg = parse(TIERS)
    problems = node_problems(cfg, cpus=2, memory=6 << 30)
    assert "tiers.gold.resources.cpus 4 is more than the node's 2 online CPUs" in problems
    assert "tiers.gold.resources.memory 8GiB is more than the node's memory (6.0GiB)" in problems
    assert "tiers.silver.resources.memory_high 6GiB is more than the node's memory (5.0GiB)" in node_problems(
        cfg, cpus=64, memory=5 << 30)
    assert not any("bronze" in p for p in problems)
    assert node_problems(cfg, cpus=64, memory=64 << 30) == []
    # Each within the node, together beyond it (tiers without tenants hold no cgroup, so promise nothing).
    served = parse(TIERS + "tenants: [{name: a, tier: gold, match: {ports: [8000]}}, "
                           "{name: b, tier: silver, match: {ports: [8001]}}]")
    assert node_problems(served, cpus=64, memory=10 << 30) == [
        "the memory guarantees of tiers gold, silver add up to 12GiB (one serving cgroup each), more than the "
        "node's memory (10.0GiB)"]
    assert node_problems(cfg, cpus=64, memory=10 << 30) == []


def test_files_per_version() -> None:
    cfg = parse(TIERS)
    gold, silver, bronze = (cfg.tiers[n] for n in ("gold", "silver", "bronze"))
    assert planner.values("cpu", "v2", gold, None, True) == (("cpu.max", "400000 100000"), ("cpu.weight", "1000"))
    assert planner.values("cpu", "v1", gold, None, True) == (
        ("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "400000"), ("cpu.shares", "10240"))
    assert planner.values("memory", "v2", silver, None, True) == (
        ("memory.min", str(4 << 30)), ("memory.high", str(6 << 30)))
    assert planner.values("memory", "v1", silver, None, True) == (("memory.soft_limit_in_bytes", str(4 << 30)),)
    # The loop's quota replaces the configured one; idle where the kernel has cpu.idle; never under 1 ms a period.
    assert planner.values("cpu", "v2", bronze, 0.25, True) == (
        ("cpu.max", "25000 100000"), ("cpu.weight", "100"), ("cpu.idle", "1"))
    assert planner.values("cpu", "v2", bronze, 0.001, False)[0] == ("cpu.max", "1000 100000")
    assert planner.values("memory", "v1", bronze, None, True) == ()
    assert planner.values("cpu", "v2", cfg.tiers["free"], None, True) == ()


MEMORY = """
tiers:
  gold: {slo_p99: 120ms, weight: 10, resources: {memory: 8GiB}}
  silver: {slo_p99: 350ms, weight: 5, resources: {memory: 4GiB, memory_high: max, memory_max: 6GiB}}
  bronze: {slo_p99: 1200ms, weight: 1, resources: {memory_high: 1GiB}}
"""


def test_memory_high_follows_memory_unless_told_and_v1_gets_a_hard_limit_only_by_name() -> None:
    cfg = parse(MEMORY)
    gold, silver, bronze = (cfg.tiers[n] for n in ("gold", "silver", "bronze"))
    # v2: the guarantee is the throttle too (reclaimed and slowed above it, never killed for it) ...
    assert planner.values("memory", "v2", gold, None, True) == (
        ("memory.min", str(8 << 30)), ("memory.high", str(8 << 30)))
    # ... unless memory_high says otherwise (max: none); the hard limit only from memory_max.
    assert planner.values("memory", "v2", silver, None, True) == (
        ("memory.min", str(4 << 30)), ("memory.high", "max"), ("memory.max", str(6 << 30)))
    assert planner.values("memory", "v2", bronze, None, True) == (("memory.high", str(1 << 30)),)
    # v1 has no throttle: the guarantee is the soft limit, and an OOM limit is never derived from it.
    assert planner.values("memory", "v1", gold, None, True) == (("memory.soft_limit_in_bytes", str(8 << 30)),)
    assert planner.values("memory", "v1", silver, None, True) == (
        ("memory.soft_limit_in_bytes", str(4 << 30)), ("memory.limit_in_bytes", str(6 << 30)))
    assert planner.values("memory", "v1", bronze, None, True) == ()
    # An explicit memory_high a v1 host cannot honour is said, naming the tier; max asks for nothing.
    assert planner.left_out(cfg, "v1") == [
        "tiers.bronze.resources.memory_high is left: cgroup v1's memory controller has no limit that throttles "
        "without killing (memory_max sets the hard one)"]
    assert planner.left_out(cfg, "v2") == [] and planner.left_out(cfg, None) == []
    assert [p.split()[0] for p in node_problems(cfg, cpus=64, memory=5 << 30)] == [
        "tiers.gold.resources.memory", "tiers.silver.resources.memory_max"]


@pytest.mark.parametrize("path, shared", [("/", True), ("", True), ("/user.slice/user-1000.slice", True),
                                          ("/user.slice/user-1000.slice/session-3.scope", True),
                                          ("/system.slice/vllm.service", False), ("/qosagent-gold", False),
                                          ("/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope", False)])
def test_shared_cgroups(path: str, shared: bool) -> None:
    assert is_shared(path) is shared


def tin(name: str, weight: int, observed: float | None, slo: float, cpus: float | None = None,
        usage: float | None = None, settable: bool = True) -> policy.TierIn:
    return policy.TierIn(name, weight, tier(observed, slo, 0.8, 0.9), cpus, settable, usage)


def run(steps: list[dict[str, policy.TierIn]], cfg: SuppressConfig, dt: float = 1.0,
        node: float = 2.0) -> list[policy.Outcome]:
    state, out, now = policy.LoopState(), [], 0.0
    for tiers in steps:
        o = policy.decide(tiers, cfg, node, now, state)
        state = o.state
        out.append(o)
        now += dt
    return out


def test_loop_cuts_lowest_first_to_the_floor_then_the_next_and_gives_back_paced() -> None:
    cfg = SuppressConfig(floor_cpus=0.1, factor=0.5, every="1s", release_step=1.0, release_every="1s",
                         healthy_ticks=2)
    pressed = {"gold": tin("gold", 10, 0.110, 0.120), "silver": tin("silver", 5, 0.1, 0.35, cpus=1.0),
               "bronze": tin("bronze", 1, 0.1, 1.2, usage=0.8)}
    calm = {"gold": tin("gold", 10, 0.05, 0.120), "silver": tin("silver", 5, 0.1, 0.35, cpus=1.0),
            "bronze": tin("bronze", 1, 0.1, 1.2)}
    outs = run([pressed] * 6 + [calm] * 8, cfg)
    cuts = [(s.tier, s.new) for o in outs[:6] for s in o.steps]
    # bronze from what it used (0.8, not the node's 2), halving to the floor; then silver from its configured 1.
    assert cuts == [("bronze", 0.4), ("bronze", 0.2), ("bronze", 0.1), ("silver", 0.5), ("silver", 0.25),
                    ("silver", 0.125)]
    assert outs[0].pressed == "gold" and outs[0].held == {"bronze", "silver"}
    assert outs[3].held == {"silver"}, "bronze at its floor is no longer held back from admission"
    assert all(s.reason == policy.NEAR_SLO and "gold 0.110s near its SLO" in s.why for o in outs[:6] for s in o.steps)
    back = [[(s.tier, s.action, s.new) for s in o.steps] for o in outs[6:]]
    # healthy_ticks healthy ticks first, then one step per release_every, the most important tier first.
    assert back[0] == []
    assert back[1] == [("silver", "raise", 0.25), ("bronze", "raise", 0.2)]
    assert back[2] == [("silver", "raise", 0.5), ("bronze", "raise", 0.4)]
    assert back[3] == [("silver", "restore", None), ("bronze", "raise", 0.8)]
    assert back[4] == [("bronze", "raise", 1.6)] and back[5] == [("bronze", "restore", None)]
    assert outs[-1].state.quota == {} and outs[-1].held == frozenset()


def test_loop_paces_cuts_never_goes_below_the_floor_and_holds_between_near_and_healthy() -> None:
    cfg = SuppressConfig(floor_cpus=0.3, factor=0.5, every="2s", healthy_ticks=1)
    pressed = {"gold": tin("gold", 10, 0.2, 0.120), "bronze": tin("bronze", 1, 0.1, 1.2, cpus=1.0)}
    outs = run([pressed] * 6, cfg)
    assert [[s.new for s in o.steps] for o in outs] == [[0.5], [], [0.3], [], [], []]
    # Gold calm but bronze itself near its SLO: nothing below bronze to cut, and not calm enough to give back.
    between = {"gold": tin("gold", 10, 0.05, 0.120), "bronze": tin("bronze", 1, 1.15, 1.2, cpus=1.0)}
    state = outs[-1].state
    o = policy.decide(between, cfg, 2.0, 100.0, state)
    assert o.steps == () and o.state.quota == {"bronze": 0.3}


def test_loop_leaves_tiers_it_may_not_set_and_the_pressed_tier_itself() -> None:
    cfg = SuppressConfig()
    tiers = {"gold": tin("gold", 10, 0.2, 0.120), "silver": tin("silver", 5, 0.5, 0.35),
             "bronze": tin("bronze", 1, 0.1, 1.2, settable=False)}
    (o,) = run([tiers], cfg)
    # silver is over its SLO too, but gold is the most important pressed tier: silver is below it and is cut.
    assert [(s.tier, s.action) for s in o.steps] == [("silver", "cut")]
    assert o.pressed == "gold" and o.held == {"silver"}
    off = SuppressConfig(enabled=False)
    (o,) = run([tiers], off)
    assert o.steps == () and o.held == frozenset() and math.isinf(-o.state.last_step)


def test_the_loop_judges_by_the_slos_of_the_config_in_force_kept_per_config_not_per_tick(tmp_path) -> None:
    tenants = "tenants: [{name: acme, tier: gold, match: {ports: [8000]}}]\nresources: {enabled: true}\n"
    cfg = parse(TIERS + tenants)
    cap = Resources(AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=NoGpu()))
    assert cap._rules().tier_slo == {"gold": 0.12}
    assert cap._rules().tier_slo is cap._rules().tier_slo
    slower = parse(TIERS.replace("gold: {slo_p99: 120ms", "gold: {slo_p99: 200ms") + tenants)
    change = cap.prepare(slower)
    change.commit()
    assert cap._rules().tier_slo == {"gold": 0.2}
    change.undo()
    assert cap._rules().tier_slo == {"gold": 0.12}


def test_memory_high_left_on_v1_is_logged_at_start_and_when_a_reload_asks_it(tmp_path, caplog) -> None:
    """Not only the probe's verdict: the log says it once at start, and a reload that adds it says it then."""
    (tmp_path / "sys/fs/cgroup/memory").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory/cgroup.procs").write_text("1\n")
    base = f"state_dir: {tmp_path / 'state'}\nresources: {{enabled: true}}\ntiers:\n"
    cfg = parse(base + "  gold: {slo_p99: 120ms, weight: 10, resources: {memory: 1GiB, memory_high: 2GiB}}\n")
    cap = Resources(AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=NoGpu()))
    cap.start(None)

    def said() -> list[str]:
        out = [r.getMessage() for r in caplog.records if "memory_high is left" in r.getMessage()]
        caplog.clear()
        return out

    assert said() == [planner.left_out(cfg, "v1")[0]]
    cap.prepare(cfg).commit()
    assert said() == [], "a reload that keeps it says nothing new"
    more = parse(base + "  gold: {slo_p99: 120ms, weight: 10, resources: {memory: 1GiB, memory_high: 2GiB}}\n"
                 "  silver: {slo_p99: 1s, weight: 1, resources: {memory_high: 1GiB}}\n")
    cap.prepare(more).commit()
    assert [line.split()[0] for line in said()] == ["tiers.silver.resources.memory_high"]


def test_a_damaged_originals_file_is_kept_and_stops_resources(tmp_path) -> None:
    path = tmp_path / "state" / Store.FILE
    path.parent.mkdir()
    path.write_text('{"threads": {"5": {"pid": 5}}}')
    store = Store(str(tmp_path / "state"))
    with pytest.raises(StateFileError, match="not a resources originals file"):
        store.load()
    store.save()
    assert path.read_text() == '{"threads": {"5": {"pid": 5}}}'
    cfg = parse(f"state_dir: {tmp_path / 'state'}\nresources: {{enabled: true}}")
    ctx = AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=NoGpu())
    with pytest.raises(CapabilityError, match="move it away"):
        Resources(ctx).start(None)
    assert Resources.detach(ctx)[0].startswith("resources: ") and path.exists()


def test_originals_round_trip_and_an_empty_store_leaves_no_file(tmp_path) -> None:
    store = Store(str(tmp_path / "state"))
    store.files["/sys/fs/cgroup/cpu/x/cpu.shares"] = "1024"
    store.moved[42] = Moved(7, {"cpu": "/sys/fs/cgroup/cpu"}, {"cpu": "/sys/fs/cgroup/cpu/qosagent-gold"})
    store.created.append("/sys/fs/cgroup/cpu/qosagent-gold")
    store.threads[43] = Thread(42, 7, Attr(0, 0, 1400000))
    store.default_slice = 1400000
    store.save()
    again = Store(str(tmp_path / "state"))
    again.load()
    assert (again.files, again.moved, again.created, again.threads, again.default_slice) == \
        (store.files, store.moved, store.created, store.threads, 1400000)
    again.files, again.moved, again.created, again.threads = {}, {}, [], {}
    again.save()
    assert not (tmp_path / "state" / Store.FILE).exists()


def test_groups_and_their_states_on_a_hybrid_tree(tmp_path) -> None:
    """cpu and memory as v1 hierarchies: each serving process's cgroup per controller, and what may be set."""
    cgroups = {1: "/", 10: "/system.slice/vllm.service", 11: "/kubepods.slice/pod-a/cri-1.scope",
               12: "/mixed", 13: "/mixed", 14: "/user.slice/user-1000.slice/session-2.scope"}
    for pid, path in cgroups.items():
        (tmp_path / f"proc/{pid}").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/cgroup").write_text(f"5:memory:{path}\n4:cpu,cpuacct:{path}\n0::/\n")
        for c in ("cpu", "memory"):
            d = tmp_path / f"sys/fs/cgroup/{c}{path}"
            d.mkdir(parents=True, exist_ok=True)
            procs = d / "cgroup.procs"
            procs.write_text((procs.read_text() if procs.exists() else "") + f"{pid}\n")
    fs = HostFS(tmp_path)
    layout = Layout.probe(fs)
    assert layout.versions == {"cpu": "v1", "memory": "v1"}
    serving = [Serving(10, 1, "vllm", "acme", "gold"), Serving(11, 1, "tgi", "pod", "silver"),
               Serving(12, 1, "a", "acme", "gold"), Serving(13, 1, "b", "hobby", "bronze"),
               Serving(14, 1, "dev", "hobby", "bronze")]
    found = {(g.controller, g.path): g for g in groups(fs, HostCgroups(fs, pid=1), layout, serving, True, own_pid=1)}
    assert len(found) == 8
    states = {path: g.state for (c, path), g in found.items() if c == "cpu"}
    assert states == {"/system.slice/vllm.service": "ok", "/kubepods.slice/pod-a/cri-1.scope": "kubelet",
                      "/mixed": "conflict", "/user.slice/user-1000.slice/session-2.scope": "shared"}
    assert found[("cpu", "/mixed")].tiers == ("bronze", "gold") and found[("cpu", "/mixed")].tier == ""
    assert found[("memory", "/system.slice/vllm.service")].directory == \
        "/sys/fs/cgroup/memory/system.slice/vllm.service"
    again = groups(fs, HostCgroups(fs, pid=1), layout, serving, False, own_pid=1)
    assert {g.path: g.state for g in again if g.controller == "cpu"}["/kubepods.slice/pod-a/cri-1.scope"] == "ok"


def test_on_cgroup_v2_a_controller_not_enabled_for_the_cgroup_is_said_and_left(tmp_path) -> None:
    """The parent's cgroup.subtree_control is the host's: a serving cgroup without the cpu controller is
    `unavailable` for cpu (named in its reason), and its memory group is set as usual."""
    for pid, path in {1: "/", 10: "/app"}.items():
        (tmp_path / f"proc/{pid}").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/cgroup").write_text(f"0::{path}\n")
    root = tmp_path / "sys/fs/cgroup"
    (root / "app").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.procs").write_text("1\n")
    (root / "app/cgroup.controllers").write_text("memory pids\n")
    (root / "app/cgroup.procs").write_text("10\n")
    fs = HostFS(tmp_path)
    layout = Layout.probe(fs)
    assert layout.versions == {"cpu": "v2", "memory": "v2"}
    found = {g.controller: g for g in groups(fs, HostCgroups(fs, pid=1), layout,
                                             [Serving(10, 1, "vllm", "acme", "gold")], True, own_pid=1)}
    assert found["memory"].state == "ok"
    assert found["cpu"].state == "unavailable" and "cgroup.subtree_control" in found["cpu"].why
    cfg = parse(TIERS + "tenants: [{name: acme, tier: gold, match: {ports: [8000]}}]")
    rules = policy.Rules(cfg, True, False, lambda d: False, tier_slos(cfg))
    part = ResourcesPart("enforce", True, True, found=tuple(found.values()))
    decided = {d.target: d.action for d in policy.reconcile(rules, Memory(), {}, part)}
    assert decided == {"cpu:/app": "report", "memory:/app": "set"}


def test_on_cgroup_v2_the_cpu_and_memory_groups_of_one_directory_keep_to_their_own_files(tmp_path) -> None:
    """One v2 directory holds both controllers' files: setting, releasing or checking one group leaves the other's
    (found on a pure-v2 guest, where memory's set put cpu.max and cpu.weight back the moment after they were set)."""
    d = tmp_path / "sys/fs/cgroup/app"
    d.mkdir(parents=True)
    original = {"cpu.max": "max 100000", "cpu.weight": "100", "memory.min": "0", "memory.high": "max"}
    for f, v in original.items():
        (d / f).write_text(v + "\n")
    fs = HostFS(tmp_path)
    a = Applier(fs, Store(str(tmp_path / "state")), {k: collections.Counter() for k in ("writes", "errors")})
    cpu, mem = (Group(c, "v2", "/app", "/sys/fs/cgroup/app", ("gold",), (10,), "ok") for c in ("cpu", "memory"))
    a.files(Files(cpu, (("cpu.max", "150000 100000"), ("cpu.weight", "1000"))))
    a.files(Files(mem, (("memory.min", "4096"),)))
    now = {f: (d / f).read_text().strip() for f in original}
    assert now == {"cpu.max": "150000 100000", "cpu.weight": "1000", "memory.min": "4096", "memory.high": "max"}
    (d / "memory.min").write_text("8192\n")
    assert a.rewritten(cpu.directory, "cpu") == []
    assert a.rewritten(mem.directory, "memory") == ["/sys/fs/cgroup/app/memory.min"]
    a.release(cpu.directory, "cpu")
    assert {f: (d / f).read_text().strip() for f in original} == {**original, "memory.min": "8192"}


def test_a_group_already_above_the_memory_high_it_gets_is_said_once(tmp_path, caplog) -> None:
    d = tmp_path / "sys/fs/cgroup/app"
    d.mkdir(parents=True)
    for f, v in {"memory.min": "0", "memory.high": "max", "memory.current": str(6 << 30)}.items():
        (d / f).write_text(v + "\n")
    counters = {k: collections.Counter() for k in ("writes", "errors")}
    a = Applier(HostFS(tmp_path), Store(str(tmp_path / "state")), counters)
    mem = Group("memory", "v2", "/app", "/sys/fs/cgroup/app", ("gold",), (10,), "ok")
    a.files(Files(mem, (("memory.min", str(4 << 30)), ("memory.high", str(4 << 30)))))
    said = [r.getMessage() for r in caplog.records if "above the memory.high" in r.getMessage()]
    assert len(said) == 1 and "memory.current 6GiB, above the memory.high 4GiB it gets by 2GiB (now max)" in said[0]
    assert "tiers.gold.resources.memory_high" in said[0]
    caplog.clear()
    a.files(Files(mem, (("memory.min", str(4 << 30)), ("memory.high", str(5 << 30)))))
    a.files(Files(mem, (("memory.min", str(4 << 30)), ("memory.high", str(8 << 30)))))
    assert not [r for r in caplog.records if "above the memory.high" in r.getMessage()], "once, at the first write"


def test_status_shows_per_group_what_was_set_and_what_the_kernel_reports_back() -> None:
    cpu = Group("cpu", "v2", "/bronze.slice/b.service", "/sys/fs/cgroup/bronze.slice/b.service", ("bronze",), (7,),
                "ok")
    mem = Group("memory", "v1", "/gold", "/sys/fs/cgroup/memory/gold", ("gold",), (8,), "ok")
    part = ResourcesPart("enforce", True, True, groups=(
        GroupReport(cpu, {"cpu.max": "30000 100000"}, True, "", {"nr_periods": 90, "nr_throttled": 12,
                                                                  "throttled_usec": 3_400_000}),
        GroupReport(mem, {"memory.soft_limit_in_bytes": "4096"}, True, "", {}, {"failcnt": 0, "oom_kill": 1}),
        GroupReport(Group("memory", "v2", "/g", "/sys/fs/cgroup/g", ("gold",), (9,), "ok"), {}, True, "", {},
                    {"low": 0, "high": 5, "max": 2, "oom": 1, "oom_kill": 0})),
        tiers=(TierReport("bronze", 1, 0.3, 1.0, 2, "", 0),))
    text = export.render(export.status(part))
    rows = {line.split()[0]: line for line in text.splitlines()}
    assert "thr 12 3.4s" in rows["/bronze.slice/b.service"] and "cpu.max=30000 100000" in rows[
        "/bronze.slice/b.service"]
    assert "oom_kill 1" in rows["/gold"] and "failcnt 0" in rows["/gold"]
    assert "high 5 max 2 oom 1 oom_kill 0" in rows["/g"]
    assert rows["bronze"].split()[1:5] == ["1", "1", "0.3", "2"]  # groups, configured, in force, the step
