"""What one placement reconcile costs on this host, as ratios against plain reads done in the same run.

    python bench/placement_bench.py [--rounds N]

1. discovery: one pass over /proc with the issue's selector, against the floor of reading every cmdline once;
2. numa_maps: reading the locality of a process with 256 MiB touched, against reading its status file;
3. planning 64 processes on the 8-GPU two-socket tree, against one discovery pass.
Prints a Markdown table for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qosagent.gpu.fake import FakeBackend  # noqa: E402
from qosagent.hostfs import HostFS  # noqa: E402
from qosagent.placement.config import Selector  # noqa: E402
from qosagent.placement.discovery import Matcher, ProcInfo, discover, numa_pages  # noqa: E402
from qosagent.placement.planner import Policy, plan  # noqa: E402
from qosagent.placement.topology import read_topology  # noqa: E402
from testkit.placement_trees import two_socket_8gpu  # noqa: E402


def paired(fn, base, rounds: int) -> tuple[float, float, float]:
    """(median seconds of fn, of base, median of the per-round ratios): the two alternate in each round, so a noisy
    neighbour on this shared machine slows both sides of a ratio alike."""
    fn(), base()
    a, b, r = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        base()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
        r.append((t1 - t0) / (t2 - t1))
    return statistics.median(a), statistics.median(b), statistics.median(r)


def cmdline_floor(fs: HostFS) -> None:
    for e in fs.listdir("/proc"):
        if e.isdigit():
            fs.try_read(f"/proc/{e}/cmdline")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    fs = HostFS("/")
    nproc = sum(1 for e in os.listdir("/proc") if e.isdigit())
    matcher = Matcher([Selector(cmdline="vllm serve|text-generation-launcher|tritonserver")])
    t_disc, t_floor, r_disc = paired(lambda: discover(fs, matcher, own_pid=os.getpid()), lambda: cmdline_floor(fs),
                                     args.rounds)

    child = subprocess.Popen([sys.executable, "-c", "import sys\nb = bytearray(256 << 20)\n"
                              "for i in range(0, len(b), 4096): b[i] = 1\nprint('r', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline()
        t_maps, t_status, r_maps = paired(lambda: numa_pages(fs, child.pid),
                                          lambda: fs.try_read(f"/proc/{child.pid}/status"), args.rounds)
    finally:
        child.kill()
        child.wait()

    with tempfile.TemporaryDirectory() as d:
        topo = read_topology(HostFS(two_socket_8gpu(Path(d))), FakeBackend.preset("h200x8").devices())
    procs = [ProcInfo(1000 + i, 1, "vllm", "vllm serve", "/", None, "selectors[0]") for i in range(64)]
    gpus = {1000 + i: (i % 8,) for i in range(64)}
    policy = Policy(reserved=frozenset({0, 48}))
    t_plan, t_disc2, r_plan = paired(lambda: plan(procs, gpus, topo, policy),
                                     lambda: discover(fs, matcher, own_pid=os.getpid()), args.rounds)

    print(f"host: {os.cpu_count()} CPUs, {nproc} processes; median of {args.rounds} rounds\n")
    print("| measurement | time | baseline | ratio |")
    print("|---|---|---|---|")
    print(f"| discovery pass over /proc ({nproc} processes) | {t_disc * 1e3:.2f} ms | cmdline of each: "
          f"{t_floor * 1e3:.2f} ms | {r_disc:.2f} |")
    print(f"| numa_maps of a process with 256 MiB touched | {t_maps * 1e3:.2f} ms | its status file: "
          f"{t_status * 1e3:.3f} ms | {r_maps:.0f} |")
    print(f"| plan 64 processes on 8 GPUs / 2 nodes | {t_plan * 1e3:.2f} ms | one discovery pass: "
          f"{t_disc2 * 1e3:.2f} ms | {r_plan:.2f} |")
    print(f"\nreconcile every 5 s: discovery + planning ~{(t_disc + t_plan) / 5 * 100:.3f} % of one CPU")


if __name__ == "__main__":
    main()
