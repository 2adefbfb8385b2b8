/* Structs shared by qosagent's BPF programs and mirrored in Python (qosagent/ebpf/tenant_ports.py, qosagent/tenants.py;
 * tests/unit/test_bpf_layouts.py compares them).
 * Only UAPI types: these programs must stay correct when the headers they compile against are not the
 * running kernel's exact ones. */
#ifndef QOS_COMMON_H
#define QOS_COMMON_H

#include <uapi/linux/bpf.h>
#include <linux/types.h>

#define QOS_UNMATCHED 0

/* watched_ports, tracked_ports, lat_mux_ports: a local port (host byte order). */
struct qos_port_key {
    __u16 port;
    __u16 pad;
};

/* tenant_ports: an array indexed by the local port (host byte order, a __u32 key), so that a port tenant costs one
 * load the verifier inlines instead of a hashed lookup (a kernel call: tens of ns with retpolines). */
#define QOS_PORTS 65536

struct qos_port_tenant {
    __u32 tenant; /* QOS_UNMATCHED: no single tenant claims the port */
    __u16 slot;   /* the tenant's index in quota's arrays (qos_quota.h); always 0 in latency's copy, which has no
                   * slots */
    __u16 pad;
};

struct qos_tenant_val {
    __u32 tenant;
};

/* tenant_cidrs: LPM trie over (local port, client address); port 0 means any watched port.
 * IPv4 addresses are stored IPv4-mapped (::ffff:a.b.c.d) so one trie serves both families. */
struct qos_cidr_key {
    __u32 prefixlen; /* bits, counted from `port` */
    __u16 port;      /* network byte order, so the trie matches it as the first 16 bits */
    __u8 addr[16];
} __attribute__((packed));

/* A port set's value: quota's watched_ports (the watched ports, Config.watched_ports), latency's tracked_ports
 * (Config.tracked_ports) and lat_mux_ports. */
struct qos_watch_val {
    __u8 on;
};

/* lat_gen, quota_gen: a slot's generation, bumped after every change the programs make to its rows or counters, so that
 * the agent's tick reads this small array and then only the rows of slots whose generation moved: an idle tenant
 * costs no per-tick read. Both arrays are BPF_F_MMAPABLE: the agent maps them and compares them in its own memory,
 * no system call, where a batch read cost ~0.13 us per slot (half of what 1,000 idle tenants cost a tick). The bump follows the change it marks; where a CPU may let another see the two out of order
 * (arm64's relaxed atomics), the agent reads a slot once more on the tick after its generation last moved. */
struct qos_gen {
    __u64 n;
};

static __always_inline void qos_gen_bump(struct qos_gen *g)
{
    if (g)
        __sync_fetch_and_add(&g->n, 1);
}

#endif
