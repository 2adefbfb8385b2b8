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
