"""DVFS per-tick cost on the real sysfs snapshot, as a ratio to one sysfs read through HostFS in the same run.

    python -m bench.dvfs_collect [--ticks N]

What a tick of dvfs costs is dominated by file reads (sensors, /proc/stat, scaling_cur_freq per policy every
freq_read_interval); the ratio says how many single-file reads a tick is worth, independent of machine speed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=2000)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from qosagent import config as config_mod
    from qosagent.capability import AgentContext
    from qosagent.dvfs.capability import Dvfs
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.snapshot import Snapshot
    from testkit.fixtures import sysfs_snapshot

    tmp = Path(tempfile.mkdtemp(prefix="qa-bench-dvfs-"))
    try:
        root = sysfs_snapshot(tmp / "host")
        (root / "proc").mkdir()
        shutil.copy("/proc/stat", root / "proc" / "stat")
        fs = HostFS(root)
        cfg = config_mod.parse({"state_dir": str(tmp / "state"),
                                "dvfs": {"enabled": True, "mode": "dry-run", "freq_read_interval": "1s"}}, "bench")
        clock = [0.0]
        cap = Dvfs(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu(), clock=lambda: clock[0]))
        cap.start()

        def one_read() -> None:
            fs.read_text("/sys/class/thermal/thermal_zone0/temp")

        def one_tick() -> None:
            clock[0] += 0.1  # 100 ms ticks: scaling_cur_freq is read on every tenth
            snap = Snapshot.build(1, clock[0], 0.0, {"dvfs": cap.collect()})
            cap.decide(snap)

        def per_call(fn, n: int) -> float:
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples.append((time.perf_counter() - t0) / n)
            return statistics.median(samples)

        base = per_call(one_read, args.ticks)
        tick = per_call(one_tick, args.ticks // 5)
        print(f"sensors {len(cap.reader.sensors)}, policies {len(cap.policies)}")
        print(f"one HostFS read: {base * 1e6:.1f} us")
        print(f"dvfs tick (collect+decide): {tick * 1e6:.1f} us = {tick / base:.1f} reads")
        print(f"share of a 100 ms tick: {tick / 0.1:.3%}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
