"""Leaves what a killed agent of pin layout 1 left behind, for the layout-upgrade tests: its filter on lo's ingress
(our prio, handle and name) over a clsact it created, and under <pin_root>/quota-v1 its program and the maps that
matter to a successor (quota_attach recording the clsact; tenant_ports in the old hash layout).

Run in the test's network namespace: python tests/quota_v1.py PIN_ROOT PRIO HANDLE; prints the program id."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qosagent.ebpf import libbpf  # noqa: E402
from qosagent.quota import tc  # noqa: E402

SOURCE = """
#include <uapi/linux/pkt_cls.h>
struct attach_key { u32 ifindex; u32 netns_ino; };
struct attach_val { u8 created_clsact; u8 pad[7]; };
struct port_key { u16 port; u16 pad; };
struct tenant_val { u32 tenant; };
BPF_TABLE_PINNED("hash", struct attach_key, struct attach_val, quota_attach, 256, "DIR/quota_attach");
BPF_TABLE_PINNED("hash", struct port_key, struct tenant_val, tenant_ports, 4096, "DIR/tenant_ports");
int quota_classify(struct __sk_buff *skb) { return TC_ACT_UNSPEC; }
"""


def main() -> None:
    from bcc import BPF

    pin_root, prio, handle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3], 0)
    d = os.path.join(pin_root, "quota-v1")
    os.makedirs(d)
    b = BPF(text=SOURCE.replace("DIR", d).encode())
    fn = b.load_func(b"quota_classify", BPF.SCHED_CLS)
    libbpf.obj_pin(fn.fd, os.path.join(d, "quota_classify"))
    with tc.IPRoute() as ipr:
        idx = tc.ifindex(ipr, "lo")
        created = tc.ensure_clsact(ipr, idx)
        tc.attach(ipr, idx, fn.fd, prio, handle)
    rec = b[b"quota_attach"]
    rec[rec.Key(idx, tc.netns_ino())] = rec.Leaf(created_clsact=int(created))
    print(libbpf.prog_id(fn.fd))


if __name__ == "__main__":
    main()
