"""`qosagent check`'s per-tenant report: what each tenant will match, who sees it, and what it can never match."""

from __future__ import annotations

import json
import textwrap

import yaml
from click.testing import CliRunner

from qosagent.cli import main
from qosagent.config import parse_text
from qosagent.matchreport import render, tenant_reports

HEAD = textwrap.dedent("""
    tiers:
      gold:   {slo_p99: 120ms, weight: 10}
      bronze: {slo_p99: 1200ms, weight: 1}
    latency: {ports: [8000, 8001], multiplexed_ports: [8001]}
""")


def reports(tenants: list[dict], **sections: dict) -> dict:
    text = HEAD + yaml.safe_dump({"tenants": tenants, **sections})
    return {r.tenant: r for r in tenant_reports(parse_text(text, "t.yaml"))}


def test_ports_networks_and_headers_are_reported_with_who_sees_them() -> None:
    r = reports([{"name": "acme", "tier": "gold", "match": {"ports": [18001]}},
                 {"name": "lab", "tier": "bronze", "match": {"cidrs": ["10.0.0.0/8"]}},
                 {"name": "web", "tier": "bronze", "match": {"ports": [8000], "header": {"name": "X-Tenant",
                                                                                          "value": "web"}}}],
                quota={"enabled": True})
    assert (r["acme"].ports, r["acme"].ports_from, r["acme"].clients) == ([18001], "match.ports", ["any"])
    assert r["acme"].seen_by == ["latency", "quota"] and r["acme"].warnings == []
    # Networks without ports apply on every watched port: the latency ports and every tenant's.
    assert (r["lab"].ports, r["lab"].ports_from, r["lab"].clients) == ([8000, 8001, 18001], "watched",
                                                                       ["10.0.0.0/8"])
    assert r["web"].header == "X-Tenant: web"
    assert r["web"].seen_by == ["quota", "latency"]


def test_a_claimed_port_shadows_every_other_rule_on_it() -> None:
    r = reports([{"name": "acme", "tier": "gold", "match": {"ports": [18001]}},
                 {"name": "lab", "tier": "bronze", "match": {"ports": [18001], "cidrs": ["10.1.0.0/16"]}}])
    assert r["lab"].shadowed == {18001: "tenant acme claims it by port alone"}
    assert r["lab"].matches_nothing() and r["lab"].warnings[0] == "matches nothing"
    assert not r["acme"].matches_nothing()


def test_a_header_tenant_needs_quota_and_http1() -> None:
    header = {"name": "X-Tenant", "value": "a"}
    off = reports([{"name": "a", "tier": "gold", "match": {"header": header}}])
    assert off["a"].seen_by == [] and off["a"].matches_nothing()
    assert "quota is off" in " ".join(off["a"].warnings)
    on = reports([{"name": "a", "tier": "gold", "match": {"ports": [8001], "header": header}}],
                 quota={"enabled": True})
    assert on["a"].shadowed == {8001: "a multiplexed port (HTTP/2): its headers are not read"}
    assert on["a"].matches_nothing()


def test_networks_that_nest_or_repeat_are_overlaps() -> None:
    r = reports([{"name": "wide", "tier": "bronze", "match": {"ports": [8000], "cidrs": ["10.0.0.0/8"]}},
                 {"name": "narrow", "tier": "gold", "match": {"ports": [8000], "cidrs": ["10.1.0.0/16"]}},
                 {"name": "same", "tier": "gold", "match": {"ports": [8000], "cidrs": ["10.0.0.0/8"]}},
                 {"name": "v6", "tier": "gold", "match": {"ports": [8000], "cidrs": ["fd00::/8"]}}])
    assert any("overlaps narrow" in w for w in r["wide"].warnings)
    assert any("are same's (listed later, same network)" in w for w in r["wide"].warnings)
    assert any("overlaps wide: same clients" in w for w in r["same"].warnings)
    assert r["v6"].warnings == []
    assert not any(x.matches_nothing() for x in r.values())


def test_a_network_tenant_takes_clients_before_a_header_is_read() -> None:
    r = reports([{"name": "lab", "tier": "bronze", "match": {"cidrs": ["10.0.0.0/8"]}},
                 {"name": "web", "tier": "gold", "match": {"ports": [8000],
                                                           "header": {"name": "X-Tenant", "value": "web"}}}],
                quota={"enabled": True})
    assert r["web"].warnings == ["requests from 10.0.0.0/8 on port 8000 are lab's before any header is read"]


def test_nothing_watched_and_nothing_enabled_say_so() -> None:
    r = reports([{"name": "lab", "tier": "bronze", "match": {"cidrs": ["10.0.0.0/8"]}}],
                latency={"enabled": False, "ports": []})
    assert r["lab"].ports == [] and r["lab"].matches_nothing()
    assert "latency and quota are both off" in r["lab"].warnings
    assert any("no port is watched" in w for w in r["lab"].warnings)


def test_check_prints_the_report_and_puts_it_in_json(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(HEAD + yaml.safe_dump({"tenants": [
        {"name": "acme", "tier": "gold", "match": {"ports": [18001]}},
        {"name": "lab", "tier": "bronze", "match": {"ports": [18001], "cidrs": ["10.1.0.0/16"]}}]}))
    text = CliRunner().invoke(main, ["check", "--config", str(cfg), "--host-root", str(tmp_path)])
    assert "TENANT" in text.output and "warning: tenant lab: matches nothing" in text.output, text.output
    out = CliRunner().invoke(main, ["check", "--json", "--config", str(cfg), "--host-root", str(tmp_path)])
    tenants = {t["tenant"]: t for t in json.loads(out.output)["tenants"]}
    assert tenants["lab"]["matches_nothing"] is True and tenants["acme"]["matches_nothing"] is False
    assert tenants["lab"]["shadowed"] == {"18001": "tenant acme claims it by port alone"}


def test_render_lines_up_and_lists_warnings() -> None:
    r = reports([{"name": "acme", "tier": "gold", "match": {"ports": [18001]}}])
    lines = render(list(r.values())).splitlines()
    assert lines[0].split() == ["TENANT", "TIER", "PORTS", "CLIENTS", "ALSO", "SEEN", "BY"]
    assert lines[1].split() == ["acme", "gold", "18001", "any", "-", "latency"]
