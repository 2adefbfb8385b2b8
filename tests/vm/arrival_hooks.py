"""Which kernel function to time a request's arrival from where there is no sk_data_ready tracepoint (< 6.6).

    python -m tests.vm.arrival_hooks [--requests N]

Counts, over N HTTP requests on loopback (half on fresh connections, half on one keep-alive connection), how often
each candidate runs for any socket and for the server's sockets: a candidate that runs for segments without
request bytes (the client's ACKs) would start requests that are not there. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys

from tests.vm.agent_ready import PORT, Handler
from tests.integration.latency_helpers import serving

CANDIDATES = ("sock_def_readable", "tcp_rcv_established", "tcp_data_ready")

PROG = r"""
#include <uapi/linux/ptrace.h>
BPF_ARRAY(calls, u64, 8);
BPF_HASH(servers, u64, u8, 1024);
static __always_inline void hit(u32 i, u64 sk)
{
    u32 all = i * 2, srv = i * 2 + 1;
    calls.atomic_increment(all);
    if (servers.lookup(&sk))
        calls.atomic_increment(srv);
}
"""


def main(argv: list[str] | None = None) -> int:
    from bcc import BPF

    p = argparse.ArgumentParser(prog="python -m tests.vm.arrival_hooks")
    p.add_argument("--requests", type=int, default=40)
    a = p.parse_args(argv)
    syms = {line.split()[2] for line in open("/proc/kallsyms") if len(line.split()) >= 3}
    found = [c for c in CANDIDATES if c in syms]
    text = PROG + "".join(f"int on_{c}(struct pt_regs *ctx) {{ hit({i}, PT_REGS_PARM1(ctx)); return 0; }}\n"
                          for i, c in enumerate(found))
    # The server's sockets, learned from the accept's return (inet_csk_accept returns the new socket).
    text += "int on_accept(struct pt_regs *ctx) { u64 sk = PT_REGS_RC(ctx); u8 one = 1; " \
            "if (sk) servers.update(&sk, &one); return 0; }\n"
    b = BPF(text=text)
    for c in found:
        b.attach_kprobe(event=c, fn_name=f"on_{c}")
    b.attach_kretprobe(event="inet_csk_accept", fn_name="on_accept")
    with serving((PORT,), Handler):
        keep = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
        for i in range(a.requests):
            conn = keep if i % 2 else http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
            conn.request("GET", "/")
            conn.getresponse().read()
            if conn is not keep:
                conn.close()
        keep.close()
    calls = b[b"calls"]
    out = {c: {"calls": calls[calls.Key(i * 2)].value, "server_socket_calls": calls[calls.Key(i * 2 + 1)].value}
           for i, c in enumerate(found)}
    print("arrival_hooks " + json.dumps({"requests": a.requests, "candidates": out}), flush=True)
    b.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
