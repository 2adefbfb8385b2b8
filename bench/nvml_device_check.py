"""A read-only check of the NVML backend on a host with a real GPU (run by hand on such a host).

It opens the backend, describes the devices, samples them while a child process holds GPU memory (so the
compute-process list has a known PID), and compares NVML's bus ids and affinities with sysfs. It never sets
clocks or power limits: the GPU is left exactly as found. Prints one JSON document.
Run from the repository root: `python3 -m bench.nvml_device_check` (the package need not be installed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from qosagent.gpu.backend import normalize_bus_id
from qosagent.gpu.nvml import NvmlBackend
from qosagent.hostfs import HostFS

HOLDER = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def main() -> int:
    out: dict = {}
    b = NvmlBackend()
    t0 = time.perf_counter()
    b.open()
    out["open_s"] = time.perf_counter() - t0
    devs = b.devices()
    out["devices"] = [d.__dict__ for d in devs]
    fs = HostFS("/")
    out["sysfs"] = {}
    for d in devs:
        base = f"/sys/bus/pci/devices/{d.pci_bus_id}"
        out["sysfs"][d.pci_bus_id] = {
            "exists": fs.exists(base),
            "numa_node": fs.try_read(f"{base}/numa_node"),
            "local_cpulist": fs.try_read(f"{base}/local_cpulist"),
            "vendor": fs.try_read(f"{base}/vendor"),
            "class": fs.try_read(f"{base}/class"),
        }
    out["normalize_examples"] = {s: normalize_bus_id(s) for s in ["00000000:3B:00.0", "0000:3b:00.0", "3b:00.0"]}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "1024", "20"], stdout=subprocess.PIPE, text=True)
    ready = holder.stdout.readline().strip() if holder.stdout else ""
    out["holder"] = {"pid": holder.pid, "ready": ready}
    samples = []
    t_total = 0.0
    for _ in range(20):
        t = time.perf_counter()
        st = b.sample()
        t_total += time.perf_counter() - t
        samples.append(st)
        time.sleep(0.05)
    out["sample_ms_mean"] = 1000 * t_total / len(samples)
    last = samples[-1]
    out["state"] = {
        "available": last.available,
        "reason": last.reason,
        "errors_total": last.errors_total,
        "gpus": [
            {k: (v if not isinstance(v, tuple) else [getattr(p, "__dict__", p) for p in v])
             for k, v in g.__dict__.items()}
            for g in last.gpus
        ],
    }
    pids = {p.pid for g in last.gpus for p in g.processes}
    out["holder_pid_listed"] = holder.pid in pids
    for i in range(len(devs)):
        try:
            out.setdefault("power", {})[i] = {"constraints_w": b.power_limit_constraints(i),
                                              "limit_w": b.power_limit(i)}
        except Exception as e:  # noqa: BLE001 - report whatever NVML says
            out.setdefault("power", {})[i] = {"error": f"{type(e).__name__}: {e}", "kind": getattr(e, "kind", None)}
    holder.kill()
    holder.wait()
    b.close()
    print(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
