"""The allocator and the reporter against a real etcd on loopback (no network namespaces, no BPF, no root): the
issue's bad input (malformed and foreign records under the prefix, two allocators that both think they lead,
absurd demand, a fleet quota below nodes x the minimum), tiers sharing fleet.capacity_rps, grants rewritten only
when they change, and `qosagent allocator`'s listener under the agent's metrics TLS and basic auth settings.

Rounds are driven one by one (Allocator.round), the new leader's wait of one lease moved back as the bench does;
each test uses a prefix of its own on the module's etcd. About 25 s in all."""

from __future__ import annotations

import math
import shutil
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from qosagent.config import parse
from qosagent.fleet import records
from qosagent.fleet.agent import Reporter
from qosagent.fleet.alloc import minimum
from qosagent.fleet.records import Want
from qosagent.fleet.allocator import Allocator
from qosagent.fleet.etcd import Etcd, EtcdError, Leadership
from testkit.agent import agent_argv, agent_env
from tests.conftest import require
from tests.integration.latency_helpers import free_port
from tests.integration.test_ship_web_config import get, pki, write_web_config  # noqa: F401 - pki: a fixture

LEASE = 2.0


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(shutil.which("etcd") is not None, "needs etcd (Debian's etcd-server: QOSAGENT_SETUP_TEST=1 make setup)")
    d = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    p = subprocess.Popen(["etcd", "--name", "t", "--data-dir", str(d / "data"), "--listen-client-urls", url,
                          "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
                          f"t=http://127.0.0.1:{peer}", "--log-level", "warn"],
                         stdout=open(d / "etcd.log", "ab"), stderr=subprocess.STDOUT)
    e = Etcd([url])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                e.get("/")
                break
            except EtcdError:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise AssertionError((d / "etcd.log").read_text()) from None
                time.sleep(0.1)
        yield url
    finally:
        e.close()
        p.kill()
        p.wait(10)


def fleet_config(url: str, prefix: str, tenants: dict[str, tuple[str, float]], **fleet: Any) -> dict[str, Any]:
    """tenants: name -> (tier, fleet_rps)."""
    return {"quota": {"enabled": True},
            "fleet": {"enabled": True, "endpoints": [url], "prefix": prefix, "report_interval": "500ms",
                      "lease": f"{LEASE}s", "expected_nodes": 3, **fleet},
            "tenants": [{"name": n, "tier": tier, "match": {"ports": [9000 + i]}, "quota": {"fleet_rps": q}}
                        for i, (n, (tier, q)) in enumerate(tenants.items())]}


def leader(url: str, prefix: str, tenants: dict[str, tuple[str, float]], me: str = "a", **fleet: Any) -> Allocator:
    a = Allocator(parse(fleet_config(url, prefix, tenants, **fleet), "test"), Etcd([url]), me=me)
    a.round()
    assert a.is_leader
    a.leading_since -= LEASE  # past the new leader's wait of one lease
    return a


def report(etcd: Etcd, prefix: str, node: str, wants: dict[str, Want], lease: int) -> None:
    etcd.put(records.nodes_prefix(prefix) + node, records.encode_report(node, wants), lease)


def grants(etcd: Etcd, prefix: str) -> dict[str, dict[str, float]]:
    gp = records.grants_prefix(prefix)
    return {kv.key[len(gp):]: dict(records.decode_grant(kv.value).tenants) for kv in etcd.get_prefix(gp)}


@pytest.fixture
def etcd(etcd_url: str) -> Iterator[Etcd]:
    e = Etcd([etcd_url])
    yield e
    e.close()


@pytest.fixture
def lease(etcd: Etcd) -> Iterator[int]:
    """The simulated nodes' etcd lease: their reports go with it at the end."""
    lease_id = etcd.grant(60)
    yield lease_id
    etcd.revoke(lease_id)


def test_malformed_and_foreign_records_are_counted_and_skipped_and_their_node_gets_no_grant(etcd_url, etcd, lease):
    p = "/bad"
    report(etcd, p, "n1", {"acme": Want(50, 20)}, lease)
    report(etcd, p, "n2", {"acme": Want(10, 20), "stranger": Want(5, 5)}, lease)  # a tenant not configured here
    etcd.put(records.nodes_prefix(p) + "n3", b"\xff not ours", lease)
    etcd.put(records.nodes_prefix(p) + "n4", b'{"v": 1, "node": "n4", "tenants": {}}', lease)  # JSON, version 1
    etcd.put(records.nodes_prefix(p) + "n5", records.encode_report("n1", {"acme": Want(1, 1)}), lease)  # not n5's
    etcd.put(records.nodes_prefix(p) + "a/b", records.encode_report("a/b", {}), lease)  # not a node key
    etcd.put(records.nodes_prefix(p) + "n6", records.encode_report("n6", {"acme": Want(math.nan, 0)}), lease)
    etcd.put(f"{p}/something-else", b"another program's key", lease)  # under the prefix, outside fleet/
    a = leader(etcd_url, p, {"acme": ("gold", 60.0)})
    a.round()
    assert a.stats.errors == {"malformed": 5, "foreign": 1}, a.stats.errors
    g = grants(etcd, p)
    assert set(g) == {"n1", "n2"} and sum(x["acme"] for x in g.values()) <= 60 + 0.01
    a.round()  # an unchanged record is not decoded (nor counted) again
    assert a.stats.errors == {"malformed": 5, "foreign": 1}
    etcd.put(records.nodes_prefix(p) + "n3", records.encode_report("n3", {"acme": Want(0, 20)}), lease)
    a.round()  # mended: n3 is allocated from the next round
    assert set(grants(etcd, p)) == {"n1", "n2", "n3"}
    a.resign()


def test_two_allocators_that_both_think_they_lead_the_deposed_ones_writes_are_fenced(etcd_url, etcd, lease):
    p = "/fence"
    report(etcd, p, "n1", {"acme": Want(50, 20)}, lease)
    t = {"acme": ("gold", 60.0)}
    a = leader(etcd_url, p, t, me="a")
    a.round()
    stale = a.leading
    assert stale is not None
    etcd.revoke(a.lease_id)  # a's lease ran out (a pause, a partition) and b won the election meanwhile
    b = leader(etcd_url, p, t, me="b")
    report(etcd, p, "n1", {"acme": Want(5, 20)}, lease)  # demand moved: a would write a new grant
    b.round()
    assert grants(etcd, p)["n1"]["acme"] == pytest.approx(60)  # b's: the only node takes all
    # a has not noticed: its campaign (as if from a stale read) still says it leads, so it writes its round.
    a.lease_id = etcd.grant(60)
    a.etcd.campaign = lambda *_args: Leadership("a", stale.revision, True)  # type: ignore[method-assign]
    before = a.stats.deposed
    report(etcd, p, "n2", {"acme": Want(50, 0)}, lease)
    a.round()
    assert a.stats.deposed == before + 1 and not a.is_leader
    g = grants(etcd, p)
    assert "n2" not in g and records.decode_grant(etcd.get(records.grants_prefix(p) + "n1").value).leader == "b"
    leader_of_round, _ = records.decode_round(etcd.get(records.round_key(p)).value)
    assert leader_of_round == "b"
    b.resign()


def test_absurd_demand_is_held_to_the_quota_and_no_other_node_is_starved(etcd_url, etcd, lease):
    p = "/absurd"
    report(etcd, p, "n1", {"acme": Want(1e15, 20)}, lease)
    report(etcd, p, "n2", {"acme": Want(3, 20)}, lease)
    report(etcd, p, "n3", {"acme": Want(0, 20)}, lease)
    a = leader(etcd_url, p, {"acme": ("gold", 60.0)})
    for _ in range(3):
        a.round()
        g = grants(etcd, p)
        held = {n: g[n]["acme"] for n in g}
        report(etcd, p, "n1", {"acme": Want(1e15, held["n1"])}, lease)
        report(etcd, p, "n2", {"acme": Want(3, held["n2"])}, lease)
        report(etcd, p, "n3", {"acme": Want(0, held["n3"])}, lease)
    assert sum(held.values()) <= 60 + 0.01
    assert held["n2"] >= 3 and held["n3"] >= minimum(60, 3) - 0.01, held
    assert a.last.tenants["acme"].demand <= 60 + 3
    a.resign()


def test_a_fleet_quota_below_nodes_times_the_minimum_is_split_evenly_and_counted(etcd_url, etcd, lease):
    p = "/short"
    for n in ("n1", "n2", "n3"):
        report(etcd, p, n, {"tiny": Want(10, 0)}, lease)
    a = leader(etcd_url, p, {"tiny": ("gold", 2.0)})
    a.round()
    g = grants(etcd, p)
    assert [g[n]["tiny"] for n in ("n1", "n2", "n3")] == pytest.approx([2 / 3] * 3, abs=0.001)
    assert a.stats.short["tiny"] == 1
    a.resign()


def test_the_heavier_tier_is_served_first_when_the_capacity_is_short(etcd_url, etcd, lease):
    p = "/tiers"
    t = {"g": ("gold", 100.0), "b": ("bronze", 100.0)}
    for n in ("n1", "n2"):
        report(etcd, p, n, {"g": Want(45, 0), "b": Want(45, 0)}, lease)
    a = leader(etcd_url, p, t, capacity_rps=110)
    for _ in range(3):  # the nodes apply what they are granted
        a.round()
        for n, g in grants(etcd, p).items():
            report(etcd, p, n, {"g": Want(45, g["g"]), "b": Want(45, g["b"])}, lease)
    got = {x: sum(v[x] for v in grants(etcd, p).values()) for x in ("g", "b")}
    assert got["g"] == pytest.approx(90, abs=0.01)  # gold's whole demand
    assert got["b"] == pytest.approx(20, abs=0.01)  # bronze: what is left (more than its floor of 2 x 2.5)
    a.resign()


def reporter_and_leader(etcd_url: str, p: str) -> tuple[Reporter, Allocator]:
    """A real reporter for node n1 (demand 30, holding 20 of a fleet quota of 60), and a leader that has run a
    round on its report."""
    cfg = parse(fleet_config(etcd_url, p, {"acme": ("gold", 60.0)}, node="n1"), "test")
    r = Reporter(cfg.fleet, Etcd([etcd_url]))
    r.offer({"acme": Want(30, 20)})
    r.cycle()
    a = leader(etcd_url, p, {"acme": ("gold", 60.0)})
    a.round()
    return r, a


def test_grants_are_written_when_they_change_and_the_round_record_renews_them(etcd_url, etcd):
    p = "/renew"
    r, a = reporter_and_leader(etcd_url, p)
    r.cycle()
    first = r.seen()
    assert first.grant == {"acme": 60.0} and first.renewed_at is not None
    rev = etcd.get(records.grants_prefix(p) + "n1").mod_revision
    a.round()  # nothing moved: the grant stays as written, the round record moves
    assert etcd.get(records.grants_prefix(p) + "n1").mod_revision == rev
    r.cycle()
    assert r.seen().renewed_at > first.renewed_at  # renewed by the round record alone
    # The report after a read says the grant as held (what the tick enforces from its next run on), and for
    # DEMAND_WINDOW after a raise, the raised rate as demand (what was measured under 20 understates it).
    doc = records.Reports({"acme": 60.0}).decode("n1", etcd.get(records.nodes_prefix(p) + "n1").value)[0]
    assert (doc.demand.tolist(), doc.held.tolist()) == ([60], [60])
    a.stop()
    a.resign()  # the round record goes with the leader's lease: no renewal until a new leader writes one
    renewed = r.seen().renewed_at
    r.cycle()
    assert r.seen().renewed_at == renewed
    r.stop()


def test_a_report_refused_for_an_expired_lease_keeps_the_renewal_and_takes_a_new_lease(etcd_url, etcd):
    p = "/expired"
    r, a = reporter_and_leader(etcd_url, p)
    etcd.revoke(r.lease_id)  # the node's lease ran out while it could not reach etcd (a partition, now healed)
    r.cycle(full=False)  # a poll: the grant is read, the report after it refused (no such lease)
    seen = r.seen()
    assert seen.grant == {"acme": 60.0} and seen.renewed_at is not None and seen.report_errors == 1
    r.cycle(full=False)  # a new lease, and the report is back
    assert r.seen().etcd_up and etcd.get(records.nodes_prefix(p) + "n1") is not None
    a.resign()
    r.stop()


def wait_for(what: str, ok: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(0.05)


def started_reporter(etcd_url: str, p: str, interval: float) -> Reporter:
    """A running reporter for n1 whose grant polls (interval / 4 apart while its watch is down) and full reports
    (interval) are far apart from what the test waits for."""
    cfg = parse(fleet_config(etcd_url, p, {"acme": ("gold", 60.0)}, node="n1", report_interval=f"{interval}s",
                             lease=f"{2 * interval}s"), "test")
    r = Reporter(cfg.fleet, Etcd([etcd_url]))
    r.offer({"acme": Want(30, 20)})
    r.start()
    wait_for("the first report", lambda: r.seen().etcd_up, 5)
    return r


def test_a_node_reads_its_grant_when_the_round_writes_it_through_the_watch(etcd_url, etcd):
    p = "/watch"
    r = started_reporter(etcd_url, p, 40.0)  # a poll every 10 s, were the watch down
    wait_for("the watch", lambda: r._watching, 5)
    a = leader(etcd_url, p, {"acme": ("gold", 60.0)})
    a.round()  # the first grant
    wait_for("the grant, woken by the watch", lambda: r.seen().grant.get("acme") is not None, 5)
    first = r.seen()
    assert first.watching and first.watch_breaks == 0 and first.renewed_at is not None
    a.round()  # nothing moved: the round record alone, and the watch wakes the node to renew
    wait_for("the renewal", lambda: r.seen().renewed_at > first.renewed_at, 5)
    a.resign()
    r.stop()


def test_a_node_whose_watch_breaks_polls_its_grant(etcd_url, etcd, monkeypatch):
    p = "/nowatch"

    def refused(self: Etcd, key: str, idle: float) -> Any:
        raise EtcdError("watch refused (a proxy that does not stream)")

    monkeypatch.setattr(Etcd, "watch", refused)
    r = started_reporter(etcd_url, p, 8.0)  # a poll every 2 s while the watch is down, a full report every 8
    wait_for("the break counted", lambda: r._watch_breaks >= 1, 5)
    a = leader(etcd_url, p, {"acme": ("gold", 60.0)})
    a.round()
    wait_for("the grant, polled", lambda: r.seen().grant.get("acme") is not None, 5)
    assert not r.seen().watching and r.seen().watch_breaks >= 1
    a.resign()
    r.stop()


def write_allocator_config(tmp: Path, url: str, metrics: dict[str, Any]) -> Path:
    path = tmp / "allocator.yaml"
    path.write_text(yaml.safe_dump({**fleet_config(url, "/cli", {"acme": ("gold", 60.0)}), "metrics": metrics}))
    return path


@pytest.mark.parametrize("how", ["--web-config-file", "metrics.tls and metrics.basic_auth"])
def test_qosagent_allocator_serves_metrics_under_the_agents_tls_and_auth_settings(
        etcd_url, pki, tmp_path, how):  # noqa: F811 - pki is the fixture imported above
    require(shutil.which("openssl") is not None, "openssl not installed")
    port, health = free_port(), free_port()
    argv = ["--metrics", f"127.0.0.1:{port}", "--health-listen", f"127.0.0.1:{health}"]
    if how == "--web-config-file":
        cfg = write_allocator_config(tmp_path, etcd_url, {})
        argv += ["--web-config-file", str(write_web_config(pki))]
    else:
        (tmp_path / "password").write_text("scrape-me\n")
        cfg = write_allocator_config(tmp_path, etcd_url, {
            "tls": {"cert_file": str(pki["server"]), "key_file": str(pki["server_key"]), "client_auth": "require",
                    "client_ca_file": str(pki["ca"])},
            "basic_auth": {"username": "prometheus", "password_file": str(tmp_path / "password")}})
    log = tmp_path / "allocator.log"
    p = subprocess.Popen(agent_argv("allocator", "--config", str(cfg), *argv), env=agent_env(),
                         stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, body = get(port, "/metrics", pki, auth=("prometheus", "scrape-me"))
                break
            except OSError:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise AssertionError(log.read_text()) from None
                time.sleep(0.2)
        assert status == 200 and b"qosagent_allocator_leader" in body
        assert get(port, "/metrics", pki)[0] == 401
        with pytest.raises((ssl.SSLError, OSError)):
            get(port, "/metrics", pki, cert=False, auth=("prometheus", "scrape-me"))
        with pytest.raises(OSError):
            get(port, "/metrics", None)  # plain HTTP to the TLS listener
        assert get(health, "/healthz", None) == (200, b"ok\n")
        assert get(health, "/readyz", None)[0] == 200
        assert get(health, "/metrics", None)[0] == 404
    finally:
        p.terminate()
        p.wait(10)
    assert p.returncode == 0, log.read_text()


def test_qosagent_allocator_refuses_an_unusable_web_config_with_a_message(etcd_url, tmp_path):
    cfg = write_allocator_config(tmp_path, etcd_url, {})
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config: {cert_file: nope.crt, key_file: nope.key}\n")
    r = subprocess.run(agent_argv("allocator", "--config", str(cfg), "--metrics", f"127.0.0.1:{free_port()}",
                                  "--web-config-file", str(bad)), env=agent_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "nope.crt" in r.stderr, r.stderr
