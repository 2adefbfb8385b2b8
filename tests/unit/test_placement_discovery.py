"""Discovery on fake /proc trees, and the capability's decisions driven by fake GPU process lists (dry-run)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from qosagent import config as config_mod
from qosagent.capability import State
from qosagent.cgroups import read_cpuset
from qosagent.daemon import Agent
from qosagent.gpu.backend import GpuProcess
from qosagent.gpu.fake import FakeBackend
from qosagent.hostfs import HostFS
from qosagent.placement.capability import Placement
from qosagent.placement.config import Selector
from qosagent.placement.discovery import Matcher, discover, parse_numa_maps, proc_start
from qosagent.placement.model import Place
from qosagent.snapshot import Snapshot
from qosagent.status import render
from testkit.placement_trees import cpuset, proc_entry, two_socket_8gpu

ISSUE_EXAMPLE = """
placement:
  enabled: true
  mode: enforce
  reserved_cpus: "0"
  selectors:
    - cmdline: "vllm serve|text-generation-launcher|tritonserver"
"""


def test_issue_example_config_parses() -> None:
    cfg = config_mod.parse_text(ISSUE_EXAMPLE, "example")
    assert cfg.placement.enabled and cfg.placement.mode == "enforce" and cfg.placement.reserved_cpus == "0"
    assert cfg.placement.selectors[0].cmdline == "vllm serve|text-generation-launcher|tritonserver"


@pytest.mark.parametrize("text, path", [
    ("placement: {selectors: [{cmdline: '(unclosed'}]}", "placement.selectors[0].cmdline"),
    ("placement: {selectors: [{node: 1}]}", "placement.selectors[0]"),
    ("placement: {reserved_cpus: 'x-1'}", "placement.reserved_cpus"),
    ("placement: {selectors: [{cgroup: 'kubepods'}]}", "placement.selectors[0].cgroup"),
    ("placement: {exclusive_cpus: {platinum: 2}}", "placement.exclusive_cpus.platinum"),
    ("placement: {selectors: [{name: vllm, tenant: nobody}]}", "placement.selectors[0].tenant"),
])
def test_bad_placement_config_names_the_key(text: str, path: str) -> None:
    with pytest.raises(config_mod.ConfigError) as ei:
        config_mod.parse_text(text, "c.yaml")
    assert any(p == path for p, _ in ei.value.problems), ei.value.problems


def _host(tmp_path):
    two_socket_8gpu(tmp_path)
    proc_entry(tmp_path, 100, ["python3", "-m", "vllm.entrypoints.openai.api_server"], "python3",
               cgroup="/kubepods.slice/kubepods-pod1.slice/cri-a.scope", threads={100: "0-95", 101: "0-95"})
    proc_entry(tmp_path, 200, ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "meta/llama"], "vllm",
               cgroup="/system.slice/vllm.service")
    proc_entry(tmp_path, 300, ["/usr/bin/sshd", "-D"], "sshd", cgroup="/system.slice/ssh.service")
    proc_entry(tmp_path, 400, ["tritonserver", "--model-repository=/m"], "tritonserver",
               cgroup="/kubepods.slice/kubepods-pod2.slice/cri-b.scope")
    (tmp_path / "proc/2").mkdir()  # a kernel thread: empty cmdline
    (tmp_path / "proc/2/cmdline").write_text("")
    (tmp_path / "proc/2/comm").write_text("kthreadd\n")
    cpuset(tmp_path, "/", "0-95")
    cpuset(tmp_path, "/kubepods.slice/kubepods-pod2.slice", "60-63")
    return tmp_path


def _pids(fs, selectors, gpu_pids=()):
    return sorted(p.pid for p in discover(fs, Matcher([Selector(**s) for s in selectors]), gpu_pids))


def test_selectors(tmp_path) -> None:
    fs = HostFS(_host(tmp_path))
    assert _pids(fs, [{"cmdline": "vllm serve|text-generation-launcher|tritonserver"}]) == [200, 400]
    assert _pids(fs, [{"name": "^vllm$"}]) == [200]
    assert _pids(fs, [{"cgroup": "/kubepods.slice"}]) == [100, 400]
    assert _pids(fs, [{"cgroup": "/kubepods.slice/kubepods-pod2.slice"}]) == [400]
    assert _pids(fs, [{"cgroup": "/kubepods.slice/kubepods-pod"}]) == [], "a prefix is a whole path component"
    assert _pids(fs, [{"unit": "vllm.service"}]) == [200]
    # Several keys in one selector must all match; several selectors are alternatives.
    assert _pids(fs, [{"cgroup": "/kubepods.slice", "name": "tritonserver"}]) == [400]
    assert _pids(fs, [{"unit": "vllm.service"}, {"name": "triton"}]) == [200, 400]
    assert _pids(fs, []) == []
    assert _pids(fs, [], gpu_pids=[100]) == [100]


def test_discovered_process_details(tmp_path) -> None:
    fs = HostFS(_host(tmp_path))
    (p,) = discover(fs, Matcher([Selector(name="tritonserver", tenant="acme")]))
    assert (p.pid, p.start, p.selector, p.tenant) == (400, 1000, "selectors[0]", "acme")
    assert p.cpuset == frozenset(range(60, 64)), "the pod's cpuset, inherited by its container cgroup"
    (q,) = discover(fs, Matcher([Selector(name="python3")]))
    assert q.thread_cpus == {100: frozenset(range(96)), 101: frozenset(range(96))}
    assert q.cpuset == frozenset(range(96)), "no cpuset below the root: the root's"


def test_stat_with_parentheses_in_comm(tmp_path) -> None:
    proc_entry(tmp_path, 5, ["x"], "a) (b", start=4242)
    assert proc_start(HostFS(tmp_path), 5) == 4242
    assert proc_start(HostFS(tmp_path), 6) is None


def test_cgroup_v1_host(tmp_path) -> None:
    proc_entry(tmp_path, 7, ["vllm", "serve"], "vllm")
    (tmp_path / "proc/7/cgroup").write_text("9:name=systemd:/system.slice/vllm.service\n3:cpuset:/\n")
    (tmp_path / "sys/fs/cgroup/cpuset").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpuset/cpuset.effective_cpus").write_text("0-7\n")
    (p,) = discover(HostFS(tmp_path), Matcher([Selector(unit="vllm.service")]))
    assert p.cgroup == "/system.slice/vllm.service" and p.cpuset == frozenset(range(8))


def test_cgroup_v1_cpuset(tmp_path) -> None:
    (tmp_path / "sys/fs/cgroup/cpuset/docker").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpuset/docker/cpuset.effective_cpus").write_text("2-3\n")
    assert read_cpuset(HostFS(tmp_path), "/", "/docker") == {2, 3}
    assert read_cpuset(HostFS(tmp_path), "/", "") is None


def test_numa_maps() -> None:
    text = ("00400000 default file=/usr/bin/python3 mapped=10 N0=8 N1=2 kernelpagesize_kB=4\n"
            "7f00 bind:1 anon=5 dirty=5 N1=5 kernelpagesize_kB=4\n"
            "7f10 default\n")
    assert parse_numa_maps(text) == {0: 8, 1: 7}


# ---- the capability, dry-run, on the fake host with fake GPUs ------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _agent(tmp_path, extra: str, fake: FakeBackend) -> tuple[Agent, Clock]:
    text = f"""
latency: {{enabled: false}}
state_dir: {tmp_path}/state
placement:
  enabled: true
  mode: dry-run
{extra}
"""
    cfg = config_mod.parse_text(text, "test")
    agent = Agent(cfg, HostFS(_host(tmp_path / "host")), gpu=fake)
    clock = Clock()
    agent.ctx.clock = clock
    agent.start()
    return agent, clock


def test_fake_gpu_process_list_drives_discovery(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[5].processes = [GpuProcess(100, 1 << 30)]
    fake.gpus[1].processes = [GpuProcess(200, 1 << 30)]
    agent, clock = _agent(tmp_path, "  gpu_processes: true\n  selectors: [{unit: vllm.service}]", fake)
    assert agent.verdicts["placement"].state is State.ACTIVE, agent.verdicts
    agent.tick()  # maintain sees the tick's GPU list before collect: a process only on a GPU is found at once
    pins = {d.inputs["pid"]: d for d in agent.decisions if d.action == "pin"}
    assert sorted(pins) == [100, 200]
    assert pins[100].new == "48-95" and pins[100].inputs["gpus"] == [5] and not pins[100].applied
    assert pins[200].new == "0-47" and "GPU 1 on node 0" in pins[200].reason
    # apply acts on each decision's typed command, never on its audit fields.
    assert pins[100].command == Place("pin", pins[100].command.proc, pins[100].command.target, pins[100].reason)
    assert pins[100].command.proc.pid == 100 and pins[100].command.target.cpus == frozenset(range(48, 96))
    snap = agent.tick()  # status and metrics show the state a tick's collect saw: the one after these decisions
    rows = {r["pid"]: r for r in agent.status()["placement"]["processes"]}
    assert rows[100]["node"] == 1 and rows[100]["last_action"] == "pin" and rows[100]["applied"] is False
    text = render(agent.status())
    assert "PLACEMENT (dry-run" in text and "48-95" in text and "dry-run: computed, not written" in text
    fams = {m.name: m for m in Placement(agent.ctx).metrics(snap)}
    assert "qosagent_placement_process_info" in fams
    # Nothing was written: dry-run leaves no originals behind.
    assert not (tmp_path / "state" / "placement-originals.json").exists()
    agent.stop()


def test_gpu_list_does_not_select_without_opt_in(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[5].processes = [GpuProcess(100, None)]
    fake.gpus[6].processes = [GpuProcess(400, None)]
    agent, clock = _agent(tmp_path, "  selectors: [{name: tritonserver}]", fake)
    agent.tick()
    clock.t += 10
    agent.tick()
    pins = [d for d in agent.decisions if d.action == "pin"]
    # tritonserver is selected; its GPU 6 is on node 1 but its pod's cpuset is 60-63: the target stays inside it.
    assert [(d.inputs["pid"], d.new) for d in pins] == [(400, "60-63")]
    agent.stop()


def test_gpu_moves_repin_and_exit_is_forgotten(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[0].processes = [GpuProcess(200, None)]
    agent, clock = _agent(tmp_path, "  selectors: [{unit: vllm.service}]", fake)
    agent.tick()
    agent.tick()  # between reconciles: no new decision
    assert [d.action for d in agent.decisions] == ["pin"]
    fake.gpus[0].processes, fake.gpus[7].processes = [], [GpuProcess(200, None)]
    clock.t += 10
    agent.tick()
    assert [(d.action, d.new) for d in agent.decisions] == [("pin", "0-47"), ("pin", "48-95")]
    for f in (tmp_path / "host/proc/200").rglob("*"):
        if f.is_file():
            f.unlink()
    clock.t += 10
    agent.tick()
    assert agent.decisions[-1].action == "forget" and agent.decisions[-1].reason == "exited"
    agent.tick()
    assert agent.status()["placement"]["processes"] == []
    agent.stop()


def test_unknown_gpu_node_is_left_with_a_warning_decision(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[2].processes = [GpuProcess(200, None)]
    host = tmp_path / "host"
    _host(host)
    (host / "sys/devices/pci0000:00/0000:3a:00.0/numa_node").write_text("-1\n")
    from qosagent.gpu.fake import with_device

    fake.gpus[2] = with_device(fake.gpus[2], numa_node=None, cpu_affinity=None)
    fake.gpus[2].processes = [GpuProcess(200, None)]
    cfg = config_mod.parse_text(f"latency: {{enabled: false}}\nstate_dir: {tmp_path}/s\nplacement: "
                                "{enabled: true, selectors: [{unit: vllm.service}]}", "t")
    agent = Agent(cfg, HostFS(host), gpu=fake)
    agent.start()
    assert agent.verdicts["placement"].state is State.DEGRADED
    assert "NUMA node unknown" in agent.verdicts["placement"].reason
    agent.tick()
    (d,) = agent.decisions
    assert d.action == "leave" and "GPU 2 unknown" in d.reason
    agent.tick()
    assert len(agent.decisions) == 1, "an unchanged reason is not repeated"
    agent.stop()


def test_tier_guarantee_reaches_the_plan_through_config(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[6].processes = [GpuProcess(400, None)]
    fake.gpus[2].processes = [GpuProcess(200, None)]
    extra = """  exclusive_cpus: {gold: 2}
  selectors:
    - {name: tritonserver, tenant: acme}
    - {unit: vllm.service}
tenants:
  - {name: acme, tier: gold, match: {ports: [8000]}}
"""
    agent, _ = _agent(tmp_path, extra, fake)
    agent.tick()
    pins = {d.inputs["pid"]: d for d in agent.decisions}
    assert pins[400].new == "60-61" and "tier gold: 2 exclusive CPUs" in pins[400].reason
    assert pins[200].new == "0-47", "exclusive CPUs are taken only on the gold process's node"
    agent.stop()


def test_unknown_gpu_process_list_postpones_the_reconcile(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[5].processes = [GpuProcess(200, None)]
    fake.fail("processes", "gpu_lost", 3)
    agent, clock = _agent(tmp_path, "  selectors: [{unit: vllm.service}]", fake)
    agent.tick()
    # vllm.service on GPU 5 would look GPU-less with GPU 3's list missing, and be moved to the wrong node.
    assert list(agent.decisions) == []
    assert placement_counters(agent)["errors"] == {"gpu_data_unknown": 1}
    fake.clear("processes", 3)
    clock.t += 10
    agent.tick()
    ((d),) = agent.decisions
    assert d.inputs["pid"] == 200 and d.new == "48-95"
    agent.stop()


def test_decide_is_pure_the_same_snapshot_gives_the_same_decisions_and_changes_nothing(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[5].processes = [GpuProcess(100, 1 << 30)]
    agent, clock = _agent(tmp_path, "  gpu_processes: true\n  selectors: [{unit: vllm.service}]", fake)
    cap = next(c for c in agent.capabilities if isinstance(c, Placement))
    agent.tick()
    fake.gpus[1].processes = [GpuProcess(200, 1 << 30)]  # a new GPU process: a reconcile is wanted
    fake.fail("processes", "gpu_lost", 3)  # and one GPU's list unknown: a reconcile to skip
    clock.t += cap.cfg.reconcile_interval
    cap.ctx.gpu_state = gpu = fake.sample()
    cap.maintain()
    part = cap.collect()
    for reconcile in (False, True):  # the skip as maintain decided it, and a reconcile forced on this part
        snap = Snapshot.build(2, clock.t, 0.0, {"gpu": gpu, "placement": replace(part, reconcile=reconcile)})

        def state() -> tuple:
            return (copy.deepcopy(cap.records), copy.deepcopy(cap.counters), dict(cap.store.entries),
                    set(cap._gpu_pids), vars(cap._reconcile).copy(), cap._reconciling)

        before = state()
        first, second = cap.decide(snap), cap.decide(snap)
        assert [replace(d, wall_time=0) for d in first] == [replace(d, wall_time=0) for d in second]
        assert state() == before
    agent.stop()


def placement_counters(agent: Agent) -> dict:
    (cap,) = [c for c in agent.capabilities if c.name == "placement"]
    assert isinstance(cap, Placement)
    return {k: dict(v) for k, v in cap.counters.items()}


def test_reused_pid_is_a_new_process(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    agent, clock = _agent(tmp_path, "  selectors: [{unit: vllm.service}]", fake)
    agent.tick()
    assert [(d.action, d.inputs["pid"]) for d in agent.decisions] == [("pin", 200)]
    # pid 200 exits and the kernel hands the number to a new vllm.service process.
    proc_entry(tmp_path / "host", 200, ["vllm", "serve", "other"], "vllm", cgroup="/system.slice/vllm.service",
               start=5000)
    clock.t += 10
    agent.tick()
    assert [d.action for d in agent.decisions][1:] == ["forget", "pin"]
    agent.tick()
    (row,) = [r for r in agent.status()["placement"]["processes"] if r["pid"] == 200]
    assert row["last_action"] == "pin" and row["time"] == agent.decisions[-1].wall_time
    agent.stop()


def test_collect_only_reads_and_maintain_refreshes_page_locality(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    fake.open()
    fake.gpus[1].processes = [GpuProcess(200, None)]
    agent, clock = _agent(tmp_path, "  selectors: [{unit: vllm.service}]", fake)
    cap = next(c for c in agent.capabilities if c.name == "placement")
    agent.tick()
    rec = cap.records[200]
    numa_maps = tmp_path / "host" / "proc" / "200" / "numa_maps"
    numa_maps.write_text("7f00 default anon=9 N0=6 N1=3\n")
    clock.t += cap.cfg.reconcile_interval + cap.cfg.locality_interval
    before = (rec.pages, rec.locality_at)
    for _ in range(2):  # a reconcile's collect, however often called, changes no record
        cap._reconciling = True
        cap.collect()
        assert (rec.pages, rec.locality_at) == before
    cap.maintain()  # the reconcile is due: the locality is read again, once
    assert (rec.pages, rec.locality_at) == ({0: 6, 1: 3}, clock.t)
    numa_maps.write_text("7f00 default anon=9 N0=9\n")
    cap.maintain()  # not due again yet
    assert rec.pages == {0: 6, 1: 3}
    agent.stop()
