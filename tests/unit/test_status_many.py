"""`qosagent status` for many tenants (issue 26): the tenants most in need first (SLO breach, throttled, busiest),
--top N of them (20 by default) with a line saying how many were left out, --tenant NAME alone, every tenant in
--json."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from qosagent import cli
from qosagent.daemon import Agent
from qosagent.status import StatusServer, ranked, render
from testkit import scale


def _latency(tenant: str, slo: str, rps: float) -> dict[str, Any]:
    q = {"count": 1, "p50": 0.01, "p95": 0.02, "p99": 0.03}
    return {"tenant": tenant, "tier": "gold", "requests": 10, "rate_rps": rps, "slo": slo, "ttft": q,
            "inter_token": q, "response": q, "slo_p99": None}


def _quota(tenant: str, admitted: float, dropped: float) -> dict[str, Any]:
    return {"tenant": tenant, "tier": "gold", "limit": None, "baseline": None, "admitted": 1, "dropped": 0,
            "conn_admitted": 0, "conn_dropped": 0, "admitted_rps": admitted, "dropped_rps": dropped,
            "bucket_tokens": None}


def _admission(tenant: str, signal: str) -> dict[str, Any]:
    return {"tenant": tenant, "tier": "gold", "baseline": "unlimited", "limit": "unlimited", "shed": False,
            "adaptive": True, "signal": signal, "rule": "baseline", "why": ""}


STATUS: dict[str, Any] = {
    "version": "t", "seq": 1, "time": 0.0, "config": "t", "interval_s": 0.1, "capabilities": {},
    "latency": {"window_s": 10.0, "tenants": [_latency("busy", "ok", 50.0), _latency("late", "breach", 1.0),
                                              _latency("dropped", "ok", 2.0), _latency("held", "ok", 0.0),
                                              _latency("idle", "no data", 0.0)]},
    "quota": {"interfaces": ["lo"], "tenants": [_quota("busy", 50.0, 0.0), _quota("dropped", 3.0, 2.0),
                                                _quota("idle", 0.0, 0.0)]},
    "admission": {"mode": "dry-run", "enforcing": False, "quantile": 0.95, "signal": "ttft", "gpu": "ok",
                  "shed_tiers": 0, "server_pressure": [], "tiers": {},
                  "tenants": [_admission("held", "slo"), _admission("busy", "config")]},
}


def rows(text: str, table: str) -> list[str]:
    """The tenant column of one table of the human view (LATENCY, QUOTA or ADMISSION), in order."""
    block = text.split(f"\n{table}", 1)[1].split("\n\n", 1)[0]
    header = next(i for i, line in enumerate(block.splitlines()) if line.startswith("TENANT"))
    return [line.split()[0] for line in block.splitlines()[header + 1:] if line.strip()]


def test_tenants_in_breach_then_throttled_then_the_busiest_first() -> None:
    # late breaches; dropped (quota drops, 5 rps) and held (admission holds it) are throttled; then by rps.
    assert ranked(STATUS) == ["late", "dropped", "held", "busy", "idle"]
    text = render(STATUS)  # every tenant unless told
    assert rows(text, "LATENCY") == ["late", "dropped", "held", "busy", "idle"]
    assert rows(text, "QUOTA") == ["dropped", "busy", "idle"] and rows(text, "ADMISSION") == ["held", "busy"]
    assert "left out" not in text


def test_top_cuts_every_table_to_the_same_tenants_and_says_how_many_were_left_out() -> None:
    text = render(STATUS, top=2)
    assert rows(text, "LATENCY") == ["late", "dropped"] and rows(text, "QUOTA") == ["dropped"]
    assert rows(text, "ADMISSION") == []
    assert "TENANTS: 2 of 5 shown" in text and "3 left out" in text
    assert rows(render(STATUS, top=0), "LATENCY") == ranked(STATUS)  # 0: all
    only = render(STATUS, tenant="held")
    assert rows(only, "LATENCY") == ["held"] and rows(only, "ADMISSION") == ["held"] and rows(only, "QUOTA") == []
    assert "4 left out" in only


# ---- a thousand tenants, through the status socket and the CLI -------------------------------------------------------
@pytest.fixture
def node(tmp_path: pathlib.Path) -> Iterator[tuple[Agent, str]]:
    a = scale.agent(tmp_path)
    scale.publish(a, 0.0, 1000, {i: 100 * (i + 1) for i in range(10)})  # t0009 the busiest
    path = str(tmp_path / "status.sock")
    srv = StatusServer(a, path)
    srv.start()
    try:
        yield a, path
    finally:
        srv.close()


def status(path: str, *args: str) -> Any:
    return CliRunner().invoke(cli.main, ["status", "--socket", path, *args])


def test_a_thousand_tenants_print_twenty_by_default(node: tuple[Agent, str]) -> None:
    _, path = node
    r = status(path)
    assert r.exit_code == 0, r.output
    busiest = [scale.name(i) for i in range(9, -1, -1)]
    assert rows(r.output, "LATENCY")[:10] == busiest and len(rows(r.output, "LATENCY")) == 20
    assert rows(r.output, "QUOTA")[:10] == busiest and len(rows(r.output, "ADMISSION")) == 20
    assert re.search(r"^TENANTS: 20 of 1000 shown.*980 left out", r.output, re.M)
    assert len(r.output.splitlines()) < 100
    r = status(path, "--top", "3")
    assert rows(r.output, "LATENCY") == busiest[:3] and "997 left out" in r.output


def test_tenant_shows_one_and_json_lists_every_tenant(node: tuple[Agent, str]) -> None:
    _, path = node
    r = status(path, "--tenant", "t0500")
    assert r.exit_code == 0 and rows(r.output, "LATENCY") == ["t0500"] == rows(r.output, "QUOTA")
    r = status(path, "--tenant", "nobody")
    assert r.exit_code == 2 and "no tenant 'nobody'" in r.output
    full = json.loads(status(path, "--json").output)
    assert len(full["latency"]["tenants"]) == len(full["quota"]["tenants"]) == 1000
    one = json.loads(status(path, "--json", "--tenant", "t0007").output)
    assert [t["tenant"] for t in one["latency"]["tenants"]] == ["t0007"] == [t["tenant"] for t in
                                                                            one["admission"]["tenants"]]
    r = status(path, "--top", "-1")
    assert r.exit_code == 2
