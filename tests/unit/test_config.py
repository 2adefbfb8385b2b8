from __future__ import annotations

import textwrap

import pytest

from qosagent import config
from qosagent.config import ConfigError, parse_text

EXAMPLE = textwrap.dedent("""
    interval: 100ms
    metrics:
      listen: 127.0.0.1:9464
    tiers:
      gold:   {slo_p99: 120ms, weight: 10}
      silver: {slo_p99: 350ms, weight: 5}
      bronze: {slo_p99: 1200ms, weight: 1}
    tenants:
      - name: acme
        tier: gold
        match: {ports: [18001]}
      - name: hobby
        tier: bronze
        match: {ports: [18002]}
""")


def problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as ei:
        parse_text(text, "cfg.yaml")
    assert str(ei.value).startswith("cfg.yaml: ")
    return ei.value.problems


def test_issue_example_loads_as_written() -> None:
    cfg = parse_text(EXAMPLE, "example.yaml")
    assert cfg.interval == pytest.approx(0.1)
    assert cfg.tiers["gold"].slo_p99 == pytest.approx(0.120)
    assert cfg.tiers["bronze"].weight == 1
    assert [t.name for t in cfg.tenants] == ["acme", "hobby"]
    assert cfg.watched_ports() == sorted({8000, 8001, 8080, 3000, 18001, 18002})


def test_embedded_default_observes_only() -> None:
    cfg = config.load(None)
    assert cfg.latency.enabled
    assert not (cfg.quota.enabled or cfg.admission.enabled or cfg.dvfs.enabled or cfg.placement.enabled)
    assert cfg.latency.ports == [8000, 8001, 8080, 3000]


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("interval: 100", "interval", "duration"),
        ("interval: 5ms", "interval", "between"),
        ("bogus: 1", "bogus", "unknown key"),
        ("metrics: {listen: nowhere}", "metrics.listen", "HOST:PORT"),
        ("metrics: {listn: 1.2.3.4:5}", "metrics.listn", "unknown key"),
        ("tiers: {gold: {weight: 1}}", "tiers.gold.slo_p99", "missing required key"),
        ("tiers: {gold: {slo_p99: fast, weight: 1}}", "tiers.gold.slo_p99", "duration"),
        ("tenants: [{name: a, tier: platinum, match: {ports: [1]}}]", "tenants[0].tier", "unknown tier"),
        ("tenants: [{name: a, tier: gold, match: {ports: [70000]}}]", "tenants[0].match.ports[0]", "65535"),
        ("tenants: [{name: a, tier: gold, match: {cidrs: [10.0.0.300/8]}}]", "tenants[0].match.cidrs", "network"),
        ("tenants: [{name: a, tier: gold, match: {}}]", "tenants[0].match", "at least one"),
        ("tenants: [{name: Bad Name, tier: gold, match: {ports: [1]}}]", "tenants[0].name", "pattern"),
        ("tenants: [{name: unmatched, tier: gold, match: {ports: [1]}}]", "tenants[0].name", "reserved"),
        ("tiers: {none: {slo_p99: 1s, weight: 1}}", "tiers.none", "reserved"),
        ("rest_interval: 2s", "rest_interval", "between 0 and 1s"),
        ("tenants: [{name: a, tier: gold, match: {ports: [1]}}, {name: a, tier: gold, match: {ports: [2]}}]",
         "tenants[1].name", "duplicate"),
        ("tenants: [{name: a, tier: gold, match: {ports: [1]}}, {name: b, tier: gold, match: {ports: [1]}}]",
         "tenants[1].match.ports", "already claimed"),
        ("tenants: [{name: a, tier: gold, match: {ports: [1]}, quota: {rps: -1}}]", "tenants[0].quota.rps", "0"),
        ("latency: {enabled: maybe}", "latency.enabled", "bool"),
        ("- just\n- a list", "", "mapping"),
        ("interval: [", "line", "invalid YAML"),
    ],
)
def test_errors_name_the_key_path(text: str, path: str, fragment: str) -> None:
    found = problems(text)
    assert any(p.startswith(path) and fragment.lower() in m.lower() for p, m in found), found


def test_missing_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(str(tmp_path / "nope.yaml"))


def test_cidrs_are_normalized() -> None:
    cfg = parse_text("tenants: [{name: a, tier: gold, match: {cidrs: [10.1.2.3/8, '2001:db8::1/32']}}]", "x")
    assert cfg.tenants[0].match.cidrs == ["10.0.0.0/8", "2001:db8::/32"]


def test_pods_tenants_need_quota_namespaces_only_while_quota_is_on() -> None:
    def text(quota: str) -> str:
        return (f"quota: {quota}\nlatency: {{ports: [8000]}}\n"
                "tenants:\n- {name: a, tier: gold, match: {pods: {namespace: ml}}}\n")

    assert ("tenants[0].match.pods", "needs quota.namespaces while quota is enabled (quota classifies a pod's "
            "requests at the host-side veths of the serving network namespaces it follows)") in \
        problems(text("{enabled: true, interfaces: [lo], namespaces: false}"))
    # Latency learns the pods itself (the agent's one listing): a pods tenant with quota off is valid.
    assert parse_text(text("{enabled: false}"), "x").tenants[0].match.pods is not None


def test_command_line_metrics_keys_merge_into_a_file_with_durations() -> None:
    # `qosagent run --metrics-listen` (the DaemonSet's) and `qosagent allocator --web-config-file` re-validate the
    # file's metrics section with the keys given; its durations come back as seconds and must stay accepted.
    cfg = parse_text("metrics: {retention: 15m}\n", "test")
    merged = config.with_metrics(cfg, {"listen": "127.0.0.1:9999", "health_listen": None})
    assert merged.metrics.listen == "127.0.0.1:9999"
    assert merged.metrics.retention == 900.0
    assert merged.metrics.model_dump(exclude={"listen"}) == cfg.metrics.model_dump(exclude={"listen"})


def test_a_bare_number_is_still_no_duration_in_a_file() -> None:
    with pytest.raises(ConfigError, match="expected a duration"):
        parse_text("metrics: {retention: 600}\n", "test")
