"""Tier resources for real on this host's cgroups (hybrid here: cpu and memory as v1 controllers; the unified
layout in the kernel matrix's VM): servers listening on tenant ports, in cgroups the test creates, get the
configured files and scheduler hints; everything goes back on stop, after kill -9 (by detach, or by the next
agent), and a value someone else rewrites is left to them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from qosagent import config as config_mod
from qosagent.capability import State
from qosagent.cgroups import V2
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.resources import sched
from qosagent.resources.capability import Resources
from tests.conftest import require
from tests.integration.admission_harness import wait_for
from tests.integration.resources_lab import HOST, Lab, cgroup_lab, free_port
from testkit.agent import AgentProcess, agent_argv, agent_env, status_socket


@pytest.fixture
def lab(root: None) -> Iterator[Lab]:
    with cgroup_lab() as lab:
        yield lab


def expected(lab: Lab, cpus: float, weight: int, memory: int | None = None, hard: int | None = None) -> dict:
    """The files of a tier with these cpus, cpu_weight, memory and memory_max, and no memory_high: on v2 the
    guarantee is its memory.high as well; v1 has no throttle, and its hard limit is memory_max's alone."""
    cpu_v2 = lab.layout.versions["cpu"] == V2
    out = {"cpu.max": f"{round(cpus * 100000)} 100000", "cpu.weight": str(weight)} if cpu_v2 else {
        "cpu.cfs_quota_us": str(round(cpus * 100000)), "cpu.cfs_period_us": "100000",
        "cpu.shares": str(weight * 1024 // 100)}
    mem_v2 = lab.layout.versions["memory"] == V2
    if memory is not None:
        if mem_v2:
            out["memory.min"] = out["memory.high"] = str(memory)
        else:
            out["memory.soft_limit_in_bytes"] = str(memory)
    if hard is not None:
        out["memory.max" if mem_v2 else "memory.limit_in_bytes"] = str(hard)
    return out


GOLD_MEMORY = "memory: 64MiB, memory_max: 256MiB"


def config(tmp_path: Path, gold: int, bronze: int, extra: str = "", mode: str = "enforce") -> str:
    return f"""
latency: {{enabled: false}}
servers: []
state_dir: {tmp_path}/state
tiers:
  gold: {{slo_p99: 120ms, weight: 10, resources: {{cpus: 1.5, {GOLD_MEMORY}}}}}
  bronze: {{slo_p99: 1200ms, weight: 1, resources: {{cpus: 0.5, sched: batch}}}}
tenants:
  - {{name: acme, tier: gold, match: {{ports: [{gold}]}}}}
  - {{name: hobby, tier: bronze, match: {{ports: [{bronze}]}}}}
resources:
  enabled: true
  mode: {mode}
  reconcile_interval: 1s
{extra}"""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_agent(text: str) -> tuple[Agent, Clock]:
    agent = Agent(config_mod.parse_text(text, "test"), HOST, gpu=NoGpu())
    clock = Clock()
    agent.ctx.clock = clock
    agent.start()
    return agent, clock


def resources(agent: Agent) -> Resources:
    (cap,) = [c for c in agent.capabilities if isinstance(c, Resources)]
    return cap


def threads(pid: int) -> dict[int, sched.Attr]:
    return {int(t): sched.get(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def slices(pid: int) -> dict[int, int]:
    """se.slice of every thread, as /proc/PID/task/TID/sched shows it."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        for line in open(f"/proc/{pid}/task/{t}/sched"):
            if line.startswith("se.slice"):
                out[int(t)] = int(line.split(":")[1])
    return out


def chrt(pid: int) -> str:
    return subprocess.run(["chrt", "-p", str(pid)], capture_output=True, text=True, check=True).stdout


def test_enforce_sets_files_and_hints_every_thread_then_stop_restores(tmp_path, lab) -> None:
    gp, bp = free_port(), free_port()
    gold, bronze = lab.cgroup("gold"), lab.cgroup("bronze")
    g, b = lab.serve(gp, gold), lab.serve(bp, bronze)
    before = {gold: lab.files(gold), bronze: lab.files(bronze)}
    g_threads, b_threads = threads(g.pid), threads(b.pid)
    agent, clock = make_agent(config(tmp_path, gp, bp))
    cap = resources(agent)
    try:
        snap = agent.tick()
        assert lab.files(gold) == {**before[gold], **expected(lab, 1.5, 1000, 64 << 20, 256 << 20)}
        assert lab.files(bronze) == {**before[bronze], **expected(lab, 0.5, 100)}
        slice_ns = 500_000 if cap.plan.slices.supported else None
        if slice_ns:
            assert set(slices(g.pid).values()) == {slice_ns}, slices(g.pid)
        else:
            assert {a.nice for a in threads(g.pid).values()} == {-5}
        assert all(a.policy == sched.POLICIES["batch"] for a in threads(b.pid).values())
        assert "SCHED_BATCH" in chrt(b.pid)
        # A thread the gold server spawns after start gets the hint within one reconcile interval.
        assert g.stdin is not None and g.stdout is not None
        g.stdin.write("spawn\n")
        g.stdin.flush()
        assert g.stdout.readline().strip() == "spawned"
        assert len(threads(g.pid)) == 5
        clock.t += 1
        agent.tick()
        if slice_ns:
            assert set(slices(g.pid).values()) == {slice_ns}, slices(g.pid)
        part = snap.part("resources")
        states = {(r.group.controller, r.group.path): (r.group.state, r.applied) for r in part.groups}
        assert states[("cpu", gold)] == ("ok", True) and states[("memory", gold)] == ("ok", True)
        text = Resources.render(cap.status(agent.latest))
        assert "RESOURCES (enforce" in text and gold in text
        fams = {m.name: m for m in cap.metrics(agent.latest)}
        quota = "cpu.max" if lab.layout.versions["cpu"] == V2 else "cpu.cfs_quota_us"
        assert [s.value for s in fams["qosagent_resources_setting"].samples
                if s.labels["cgroup"] == bronze and s.labels["file"] == quota] == [50000.0]
        assert any(s.labels["cgroup"] == gold for s in fams["qosagent_resources_throttled_periods"].samples)
        assert [s.value for s in fams["qosagent_resources_hinted_threads"].samples if s.labels["tier"] == "gold"] \
            == [5.0]
    finally:
        agent.stop()
    assert {gold: lab.files(gold), bronze: lab.files(bronze)} == before
    after = threads(g.pid)
    assert all(after[t] == g_threads.get(t, g_threads[g.pid]) for t in after), (after, g_threads)
    assert threads(b.pid) == b_threads and "SCHED_OTHER" in chrt(b.pid)
    assert not (tmp_path / "state" / "resources-originals.json").exists()


def test_dry_run_writes_nothing_and_says_would(tmp_path, lab) -> None:
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    g = lab.serve(gp, gold)
    before, attrs = lab.files(gold), threads(g.pid)
    agent, _ = make_agent(config(tmp_path, gp, bp, mode="dry-run"))
    try:
        agent.tick()
        sets = [d for d in agent.decisions if d.action == "set"]
        assert sets and not any(d.applied for d in sets)
        assert lab.files(gold) == before and threads(g.pid) == attrs
        assert "* dry-run" in Resources.render(resources(agent).status(agent.latest))
    finally:
        agent.stop()


def test_a_reload_to_dry_run_restores_what_enforce_wrote(tmp_path, lab) -> None:
    """enforce -> dry-run by reload: the files and hints written go back at once (a dry run must not leave them as
    if still decided) and the dry run says "would"; back to enforce, they are written again."""
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    g = lab.serve(gp, gold)
    before, attrs = lab.files(gold), threads(g.pid)
    path = tmp_path / "qosagent.yaml"
    path.write_text(config(tmp_path, gp, bp))
    agent = Agent(config_mod.load(str(path)), HOST, config_path=str(path), gpu=NoGpu())
    clock = Clock()
    agent.ctx.clock = clock
    agent.start()
    want = {**before, **expected(lab, 1.5, 1000, 64 << 20, 256 << 20)}
    originals = tmp_path / "state" / "resources-originals.json"
    try:
        agent.tick()
        assert lab.files(gold) == want and threads(g.pid) != attrs and originals.exists()
        path.write_text(config(tmp_path, gp, bp, mode="dry-run"))
        assert agent.reload() == (True, "reloaded")
        assert lab.files(gold) == before and threads(g.pid) == attrs and not originals.exists()
        clock.t += 1
        seen = len(agent.decisions)  # the audit ring: this tick's come after
        agent.tick()
        sets = [d for d in list(agent.decisions)[seen:] if d.capability == "resources" and d.action == "set"]
        assert sets and not any(d.applied for d in sets)
        assert lab.files(gold) == before and threads(g.pid) == attrs
        path.write_text(config(tmp_path, gp, bp))
        assert agent.reload() == (True, "reloaded")
        clock.t += 1
        agent.tick()
        assert lab.files(gold) == want
    finally:
        agent.stop()
    assert lab.files(gold) == before and threads(g.pid) == attrs and not originals.exists()


def test_kill9_then_detach_or_the_next_agent_restores(tmp_path, lab) -> None:
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    g = lab.serve(gp, gold)
    before, attrs = lab.files(gold), threads(g.pid)
    want = {**before, **expected(lab, 1.5, 1000, 64 << 20, 256 << 20)}
    sock = status_socket()
    cfg = tmp_path / "qosagent.yaml"
    cfg.write_text(config(tmp_path, gp, bp) + f"metrics: {{enabled: false}}\nstatus: {{socket: {sock}}}\n")
    for then in ("detach", "restart"):
        agent = AgentProcess(cfg, sock, tmp_path / "agent.log")
        agent.start()
        wait_for("the files set", lambda: lab.files(gold) == want, 30)
        agent.kill()  # SIGKILL: no stop, nothing restored
        assert lab.files(gold) == want and threads(g.pid) != attrs
        if then == "detach":
            out = subprocess.run(agent_argv("detach", "--config", str(cfg)), env=agent_env(), capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert "resources:" in out.stdout and "restored" in out.stdout, out.stdout
        else:
            with AgentProcess(cfg, sock, tmp_path / "agent2.log"):
                wait_for("the files set", lambda: lab.files(gold) == want, 30)
        assert lab.files(gold) == before and threads(g.pid) == attrs
        assert not (tmp_path / "state" / "resources-originals.json").exists()


def test_an_explicit_memory_high_is_kept_to_and_v1_derives_no_hard_limit_from_it(tmp_path, lab) -> None:
    """memory_high as configured, not the guarantee: on v2 `max` lifts a throttle the host had set (and stop puts
    it back); v1 has no throttle-only limit, so an explicit one is said (degraded, the key named) and no hard limit
    is made of it (before, it became memory.limit_in_bytes)."""
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    lab.serve(gp, gold)
    mem_v2 = lab.layout.versions["memory"] == V2
    if mem_v2:
        with open(f"{lab.dir('memory', gold)}/memory.high", "w") as f:
            f.write(str(512 << 20))  # a throttle of the host's own, as a unit's MemoryHigh= sets it
    before = lab.files(gold)
    text = config(tmp_path, gp, bp).replace(GOLD_MEMORY, "memory: 64MiB, memory_high: " + ("max" if mem_v2 else
                                                                                           "128MiB"))
    agent, _ = make_agent(text)
    try:
        agent.tick()
        if mem_v2:
            assert lab.files(gold) == {**before, **expected(lab, 1.5, 1000), "memory.min": str(64 << 20),
                                       "memory.high": "max"}
        else:
            assert lab.files(gold) == {**before, **expected(lab, 1.5, 1000, 64 << 20)}
            verdict = agent.verdicts["resources"]
            assert verdict.state is State.DEGRADED, verdict
            assert "tiers.gold.resources.memory_high is left" in verdict.reason, verdict
    finally:
        agent.stop()
    assert lab.files(gold) == before


def test_shared_cgroup_is_reported_or_moved_and_two_tiers_in_one_are_reported(tmp_path, lab) -> None:
    gp, bp = free_port(), free_port()
    both = lab.cgroup("both")
    g, b = lab.serve(gp, both), lab.serve(bp, both)
    before = lab.files(both)
    # No memory for gold here: a shared cgroup's memory settings would be the harness's own.
    text = config(tmp_path, gp, bp).replace(f", {GOLD_MEMORY}", "")
    agent, clock = make_agent(text)
    try:
        agent.tick()
        reports = [d for d in agent.decisions if d.action == "report"]
        assert reports and all("conflict: serving processes of tiers bronze, gold" in d.reason for d in reports)
        assert lab.files(both) == before
    finally:
        agent.stop()
    moved_text = text.replace("  reconcile_interval: 1s\n", "  reconcile_interval: 1s\n  move: true\n")
    agent, clock = make_agent(moved_text)
    try:
        agent.tick()
        assert {d.action for d in agent.decisions} >= {"move"}
        clock.t += 1
        agent.tick()
        own = "/qosagent-gold"
        for c in ("cpu", "memory"):
            with open(f"{lab.dir(c, own)}/cgroup.procs") as f:
                assert str(g.pid) in f.read().split()
        assert lab.files(own)[("cpu.max" if lab.layout.versions["cpu"] == V2 else "cpu.cfs_quota_us")] in (
            "150000 100000", "150000")
        assert str(b.pid) in open(f"{lab.dir('cpu', '/qosagent-bronze')}/cgroup.procs").read().split()
    finally:
        agent.stop()
    for p in (g, b):
        for c in ("cpu", "memory"):
            assert str(p.pid) in open(f"{lab.dir(c, both)}/cgroup.procs").read().split()
    assert not os.path.exists(lab.dir("cpu", "/qosagent-gold"))
    assert lab.files(both) == before


def test_refused_write_leaves_nothing_half_applied(tmp_path, lab) -> None:
    # The kernel refuses a v1 hard limit below what the group holds (EBUSY); v2's memory.max below it reclaims and
    # then kills instead, and every other file takes any value, so there is no refusal to provoke (the kernel
    # matrix's v2 run leaves this test out).
    require(lab.layout.versions["memory"] != V2, "cgroup v2's memory files take any value: no write to refuse")
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    g = lab.serve(gp, gold, mib=48)
    before = lab.files(gold)
    # A hard limit below what the server holds (no swap): the kernel refuses it.
    small = config(tmp_path, gp, bp).replace(GOLD_MEMORY, "memory: 4MiB, memory_max: 8MiB")
    agent, _ = make_agent(small)
    cap = resources(agent)
    try:
        agent.tick()
        mem = [r for r in agent.latest.part("resources").groups if r.group.controller == "memory"]
        assert mem and mem[0].error and not mem[0].applied, mem
        assert cap.counters["errors"]["EBUSY"] >= 1
        now = lab.files(gold)
        assert now["memory.soft_limit_in_bytes"] == before["memory.soft_limit_in_bytes"]
        assert now["memory.limit_in_bytes"] == before["memory.limit_in_bytes"]
        assert now["cpu.cfs_quota_us"] == "150000"  # the cpu group is one of its own
    finally:
        agent.stop()
    assert g.poll() is None
    assert lab.files(gold) == before


def test_a_value_rewritten_by_another_owner_is_left_to_it(tmp_path, lab) -> None:
    gp, bp = free_port(), free_port()
    gold = lab.cgroup("gold")
    lab.serve(gp, gold)
    before = lab.files(gold)
    agent, clock = make_agent(config(tmp_path, gp, bp))
    cap = resources(agent)
    shares = "cpu.weight" if lab.layout.versions["cpu"] == V2 else "cpu.shares"
    try:
        agent.tick()
        with open(f"{lab.dir('cpu', gold)}/{shares}", "w") as f:
            f.write("77")  # as the kubelet or systemd would
        clock.t += 1
        agent.tick()
        assert [d.action for d in agent.decisions].count("back_off") == 1
        assert cap.counters["rewritten"]["cpu"] == 1
        clock.t += 1
        agent.tick()
        assert lab.read("cpu", gold, shares) == "77"
        assert [d.action for d in agent.decisions].count("back_off") == 1
    finally:
        agent.stop()
    now = lab.files(gold)
    assert now[shares] == "77"
    assert {k: v for k, v in now.items() if k.startswith("memory")} == \
        {k: v for k, v in before.items() if k.startswith("memory")}


def test_check_names_a_serving_cgroup_already_above_what_it_would_get_and_writes_nothing(tmp_path, lab) -> None:
    """`qosagent check` finds the serving processes as a reconcile does (the tenant's port → the process listening
    on it → its cgroup) and names the one whose memory use (v1 memory.usage_in_bytes, v2 memory.current) is above
    what `memory` would set (v1 memory.soft_limit_in_bytes, v2 memory.high), with the use it read; the one below
    its limit is not named, nothing is written, and the exit status is the verdicts' (0 here)."""
    gp, bp = free_port(), free_port()
    big, small = lab.cgroup("big"), lab.cgroup("small")
    lab.serve(gp, big, mib=64)
    lab.serve(bp, small, mib=1)
    before = {path: lab.files(path) for path in (big, small)}
    cfg = tmp_path / "qosagent.yaml"
    cfg.write_text(config(tmp_path, gp, bp).replace(GOLD_MEMORY, "memory: 16MiB").replace(
        "sched: batch}", "sched: batch, memory: 512MiB}"))
    usage = "memory.current" if lab.layout.versions["memory"] == V2 else "memory.usage_in_bytes"
    limit = "memory.high" if lab.layout.versions["memory"] == V2 else "memory.soft_limit_in_bytes"
    used = int(lab.read("memory", big, usage))
    assert used > 64 << 20, f"the server holds its 64MiB: {usage} {used}"
    r = subprocess.run(agent_argv("check", "--json", "--config", str(cfg)), env=agent_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["capabilities"]["resources"]["state"] in ("active", "degraded"), report["capabilities"]
    (found,) = report["findings"]["resources"]
    assert (found["tier"], found["cgroup"], found["directory"], found["usage_file"]) == (
        "gold", big, lab.dir("memory", big), usage), found
    assert abs(found["usage_bytes"] - used) < 16 << 20, (found, used)  # the same cgroup's, read a moment apart
    assert [(a["file"], a["limit_bytes"]) for a in found["above"]] == [(limit, 16 << 20)], found
    # The line the text output prints under FOUND (one check run: each costs ~25 s in the emulated matrix VM).
    line = found["text"]
    assert f"tier gold: {lab.dir('memory', big)} (memory {lab.layout.versions['memory']}): {usage} " in line, line
    assert f"above the {limit} 16MiB it would get" in line, line
    assert {path: lab.files(path) for path in (big, small)} == before, "check writes nothing"
