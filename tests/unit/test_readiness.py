"""/readyz's answer: every enabled capability active or optional; a capability degraded by a tick error is unready
until a whole tick of it succeeds again."""

from __future__ import annotations

from typing import Any

import pytest

from qosagent import config
from qosagent.capability import State, Verdict
from qosagent.readiness import readiness
from tests.unit.test_daemon import agent, make_cap, scripted  # noqa: F401 - scripted is a fixture


def flaky(name: str) -> tuple[type, dict[str, bool]]:
    state = {"fail": False}
    base = make_cap(name)

    class Flaky(base):  # type: ignore[misc, valid-type]
        def collect(self) -> Any:
            if state["fail"]:
                raise OSError("map read failed")
            return {"n": 1}

    Flaky.name = name
    return Flaky, state


def test_ready_with_optional_unavailable_and_again_after_a_transient_error(scripted, tmp_path) -> None:  # noqa: F811
    quota, state = flaky("quota")
    scripted(make_cap("latency"), quota, make_cap("dvfs", fail_start=True))
    a = agent(tmp_path, "readiness: {optional: [dvfs]}\n")
    assert readiness(a) == (False, "starting")
    a.start()
    a.tick()
    a.ready.set()
    assert readiness(a) == (True, "ready")
    state["fail"] = True
    a.tick()
    ok, why = readiness(a)
    assert not ok and why.startswith("quota degraded: collect failed: map read failed"), why
    state["fail"] = False
    a.tick()
    assert a.verdicts["quota"] == Verdict(State.ACTIVE)
    assert readiness(a) == (True, "ready")


def test_an_enabled_capability_that_cannot_run_keeps_the_agent_unready(scripted, tmp_path) -> None:  # noqa: F811
    scripted(make_cap("latency"), make_cap("dvfs", fail_start=True))
    a = agent(tmp_path)
    a.start()
    a.tick()
    a.ready.set()
    assert readiness(a) == (False, "dvfs unavailable: no luck")


def test_optional_names_a_capability() -> None:
    with pytest.raises(config.ConfigError, match="readiness.optional"):
        config.parse({"readiness": {"optional": ["nosuch"]}}, "test")


def test_an_idle_capability_is_ready(scripted, tmp_path) -> None:  # noqa: F811
    base = make_cap("servers")

    class Idle(base):  # type: ignore[misc, valid-type]
        def probe(self, features: Any) -> Verdict:
            return Verdict(State.IDLE, "nothing to read here", plan=("planned", "servers"))

    Idle.name = "servers"
    scripted(make_cap("latency"), Idle)
    a = agent(tmp_path)
    a.start()
    a.tick()
    a.ready.set()
    assert a.verdicts["servers"].state is State.IDLE
    assert readiness(a) == (True, "ready")


def test_a_host_snapshot_with_only_dvfs_is_ready(copied_sysfs, tmp_path) -> None:
    """`qosagent run --host-root SNAPSHOT` with only dvfs on: the servers capability (on by default) has no
    /proc/net/tcp to find servers in, which is the snapshot's circumstance, so it idles and /readyz answers 200."""
    from qosagent.daemon import Agent
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS

    path = tmp_path / "cfg.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\nlatency: {{enabled: false}}\ndvfs: {{enabled: true}}\n")
    a = Agent(config.load(str(path)), HostFS(copied_sysfs), str(path), gpu=NoGpu())
    a.start()
    try:
        a.tick()
        a.ready.set()
        assert a.verdicts["servers"].state is State.IDLE and "no /proc/net/tcp" in a.verdicts["servers"].reason
        assert a.verdicts["dvfs"].state is State.ACTIVE, a.verdicts["dvfs"]
        assert readiness(a) == (True, "ready")
    finally:
        a.stop()
