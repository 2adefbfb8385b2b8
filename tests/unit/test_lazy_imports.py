"""A capability that is off loads none of its dependencies: an agent started, ticked and stopped with each one off
has none of their heavy modules in sys.modules (BCC and its LLVM, pyroute2, httpx and numpy, the servers' metrics
parser, NVML with `gpu.backend: none`, gRPC)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = {
    "latency": ("bcc",),
    "quota": ("bcc", "pyroute2"),
    "fleet": ("httpx", "numpy"),  # numpy: the allocator's, never an agent's
    "servers": ("prometheus_client.parser",),
    "placement": ("pynvml",),
}

SCRIPT = """
import json, sys
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.hostfs import HostFS
cfg = parse(json.loads(sys.argv[1]), "test")
agent = Agent(cfg, HostFS("/"))
agent.start()
agent.tick()
agent.stop()
print(json.dumps(sorted(sys.modules)))
"""


def loaded(cfg: dict) -> set[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_an_agent_loads_no_module_of_a_capability_that_is_off(tmp_path: Path) -> None:
    cfg: dict = {"state_dir": str(tmp_path), "status": {"socket": str(tmp_path / "s.sock")},
                 "metrics": {"enabled": False}, "gpu": {"backend": "none"}}
    cfg.update({cap: {"enabled": False} for cap in HEAVY if cap != "servers"})
    cfg["servers"] = []  # an empty list: no servers to read
    mods = loaded(cfg)
    for cap, modules in HEAVY.items():
        found = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in modules))
        assert not found, f"{cap} is off, and the agent loaded {found}"
    assert not [m for m in mods if m.split(".")[0] == "grpc"]  # the pods' CRI client: no pods tenant here
