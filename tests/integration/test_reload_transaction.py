"""A reload is one transaction over every capability, checked on the real maps: quota (first in tick order) has
prepared but not written when latency (second) refuses, so the classifier's rules stay the old ones."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from qosagent.ebpf.pins import QUOTA_LAYOUT as LAYOUT
from qosagent.status import request
from tests.conftest import netns, require
from tests.integration.quota_agent import start_quota_agent

pytestmark = pytest.mark.privileged

# The classifier's rules and limits as the config writes them (not its counters, buckets or heartbeat).
RULE_MAPS = ("tenant_ports", "tenant_cidrs", "watched_ports", "quota_headers", "quota_slots", "quota_limits")


def config(tmp: Path, pin_root: str, tenants: int) -> dict[str, Any]:
    return {
        "interval": "100ms",
        "state_dir": str(tmp),
        "status": {"socket": str(tmp / "status.sock")},
        "metrics": {"enabled": False},
        # The reloads here are the test's own (`qosagent reload`): a watch polling between a write and the request
        # would try the same file first and count its refusal too.
        "config_watch": {"enabled": False},
        "bpf": {"pin_root": pin_root},
        "latency": {"ports": [8000], "runqueue": {"enabled": False}},
        "quota": {"enabled": True, "interfaces": ["lo"]},
        "tenants": [{"name": f"t{i}", "tier": "gold", "match": {"ports": [8100 + i]}, "quota": {"rps": 10 + i}}
                    for i in range(tenants)],
    }


def claimed(ports: list[dict[str, Any]]) -> int:
    """Ports a tenant claims in a dump of tenant_ports (an array: unclaimed ports are all zero)."""
    return sum(1 for e in ports if any(int(b, 16) for b in e["value"]))


def dump(pins: Path) -> dict[str, Any]:
    return {m: json.loads(subprocess.run(["bpftool", "-j", "map", "dump", "pinned", str(pins / m)], check=True,
                                         capture_output=True, text=True).stdout) for m in RULE_MAPS}


@pytest.fixture
def running(root: None, bpf: None, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    require(all(shutil.which(t) for t in ("tc", "nsenter", "bpftool")), "tc, nsenter or bpftool missing")
    pin_root = f"/sys/fs/bpf/qosagent-test-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "qosagent.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path, pin_root, 2)))
    with netns("reload") as ns:
        agent = start_quota_agent(ns, path, str(tmp_path / "status.sock"), tmp_path / "agent.log")
        try:
            yield path, pin_root
        finally:
            try:
                agent.stop()
            finally:
                shutil.rmtree(pin_root, ignore_errors=True)


def test_a_reload_latency_refuses_leaves_the_classifier_rules_as_they_were(running) -> None:
    path, pin_root = running
    socket = str(path.parent / "status.sock")
    assert request(socket, {"cmd": "status"})["capabilities"]["latency"]["state"] in ("active", "degraded")
    pins = Path(pin_root) / f"quota-v{LAYOUT}"
    before = dump(pins)
    assert claimed(before["tenant_ports"]) == 2
    # More tenants than latency's arrays have slots (64 for a config of 2): latency refuses at prepare.
    path.write_text(yaml.safe_dump(config(path.parent, pin_root, 70)))
    resp = request(socket, {"cmd": "reload"}, timeout=30)
    assert not resp["ok"] and resp["message"].startswith("latency: the latency arrays have 64 tenant slots"), resp
    assert dump(pins) == before
    st = request(socket, {"cmd": "status"})
    assert [t["tenant"] for t in st["quota"]["tenants"]] == ["t0", "t1"]
    assert st["self"]["reloads_failed"] == 1
    # The same change within latency's slots goes through, and reaches the kernel.
    path.write_text(yaml.safe_dump(config(path.parent, pin_root, 5)))
    resp = request(socket, {"cmd": "reload"}, timeout=30)
    assert resp["ok"], resp
    assert claimed(dump(pins)["tenant_ports"]) == 5
