"""`qosagent run --host-root DIR` with only dvfs, as a subprocess against a copied sysfs tree: files written while
it runs, restored after SIGTERM, after an exception, and after a crash (by detach or by the next agent)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from testkit.agent import AgentProcess, agent_argv, agent_env

CPUFREQ = "sys/devices/system/cpu/cpu{}/cpufreq/scaling_max_freq"
ORIGINAL = ["3700000", "3700000", "4200000", "4200000"]
DEADLINE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rehearsal(copied_sysfs: Path, tmp_path: Path) -> dict:
    (copied_sysfs / "proc").mkdir(exist_ok=True)
    (copied_sysfs / "proc/stat").write_text("cpu0 10 0 10 80 0 0 0 0 0 0\ncpu1 10 0 10 80 0 0 0 0 0 0\n")
    # A short path: unix socket paths are limited to 108 bytes, pytest's tmp_path can be longer.
    sock = Path("/tmp") / f"qa-dvfs-{uuid.uuid4().hex[:8]}.sock"
    port = free_port()
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "status": {"socket": str(sock)},
        "gpu": {"backend": "none"},
        "latency": {"enabled": False},
        "dvfs": {"enabled": True, "mode": "enforce", "points": [
            {"name": "capped", "temp_below_c": 70, "freq": "1600MHz"}, {"name": "full", "freq": "100%"}]},
    }
    path = tmp_path / "qosagent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    yield {"root": copied_sysfs, "config": str(path), "state": tmp_path / "state", "socket": str(sock),
           "port": port}
    sock.unlink(missing_ok=True)


def maxfreqs(root: Path) -> list[str]:
    return [(root / CPUFREQ.format(i)).read_text().strip() for i in range(4)]


def start(r: dict, log: str = "agent.log") -> AgentProcess:
    """The agent on the fixture host, ready (its first tick done, so its signal handlers are in place)."""
    agent = AgentProcess(r["config"], r["socket"], Path(r["config"]).with_name(log),
                         args=["--host-root", str(r["root"])])
    agent.start(timeout=DEADLINE_S)
    return agent


def stop(agent: AgentProcess, sig: int = signal.SIGTERM) -> str:
    """Its output, once the signal ended it."""
    agent.signal(sig)
    agent.wait(DEADLINE_S)
    return agent.output()


def test_rehearsal_writes_shows_and_restores_on_sigterm(rehearsal) -> None:
    r = rehearsal
    proc = start(r)
    try:
        assert maxfreqs(r["root"]) == ["1600000"] * 4
        assert (r["state"] / "dvfs-originals.json").exists()
        status = subprocess.run(agent_argv("status", "--socket", r["socket"]), env=agent_env(),
                                capture_output=True, text=True, timeout=DEADLINE_S)
        assert status.returncode == 0, status.stderr
        assert "DVFS (enforce)" in status.stdout and "policy3" in status.stdout and "capped" in status.stdout
        js = json.loads(subprocess.run(agent_argv("status", "--json", "--socket", r["socket"]), env=agent_env(),
                                       capture_output=True, text=True, timeout=DEADLINE_S).stdout)
        assert [p["target_mhz"] for p in js["dvfs"]["policies"]] == [1600] * 4
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{r['port']}/metrics", timeout=5).read().decode()
        assert 'qosagent_dvfs_target_frequency_hertz{policy="policy0"} 1.6e+09' in scrape
        assert 'qosagent_dvfs_operating_point{point="capped",policy="policy2"} 1.0' in scrape
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=scrape, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
    finally:
        out = stop(proc)
    assert proc.proc is not None and proc.proc.returncode == 0, out
    assert maxfreqs(r["root"]) == ORIGINAL
    assert not (r["state"] / "dvfs-originals.json").exists()
    assert "restored 4200000" in out


def test_crash_then_detach_restores(rehearsal) -> None:
    r = rehearsal
    proc = start(r)
    assert maxfreqs(r["root"]) == ["1600000"] * 4
    stop(proc, signal.SIGKILL)
    assert maxfreqs(r["root"]) == ["1600000"] * 4  # nothing could run at a SIGKILL
    out = subprocess.run(agent_argv("detach", "--config", r["config"], "--host-root", str(r["root"])),
                         env=agent_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("restored") == 4
    assert maxfreqs(r["root"]) == ORIGINAL
    again = subprocess.run(agent_argv("detach", "--config", r["config"], "--host-root", str(r["root"])),
                           env=agent_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert "nothing of qosagent's was found" in again.stdout


def test_crash_then_restart_recovers_first(rehearsal) -> None:
    r = rehearsal
    proc = start(r)
    assert maxfreqs(r["root"]) == ["1600000"] * 4
    stop(proc, signal.SIGKILL)
    # An operator raises one policy while no agent runs; the next agent must not take it back.
    (r["root"] / CPUFREQ.format(1)).write_text("3000000\n")
    proc = start(r, "agent-2.log")
    out = stop(proc)
    assert proc.proc is not None and proc.proc.returncode == 0, out
    assert "recovering after an unclean stop" in out and "changed by someone else" in out
    assert maxfreqs(r["root"]) == ["3700000", "3000000", "4200000", "4200000"]


def test_restore_when_the_loop_raises(rehearsal, monkeypatch) -> None:
    from click.testing import CliRunner

    from qosagent import cli
    from qosagent.daemon import Agent

    r = rehearsal

    def run_then_fail(self, notify=None):
        self.tick()
        assert maxfreqs(r["root"]) == ["1600000"] * 4
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(Agent, "run", run_then_fail)
    cfg = yaml.safe_load(Path(r["config"]).read_text())
    cfg["metrics"] = {"enabled": False}
    Path(r["config"]).write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(cli.main, ["run", "--config", r["config"], "--host-root", str(r["root"])])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert isinstance(result.exception, RuntimeError)
    assert maxfreqs(r["root"]) == ORIGINAL
    assert not (r["state"] / "dvfs-originals.json").exists()
