/* Tenant resolution shared by every program that attributes traffic to a tenant (latency's socket probes, quota's
 * TC classifier), so both see one tenant for one connection. Declares the three tenant maps the agent fills from
 * config; include it once per BPF object, after qos_common.h.
 *
 * Rules, in order: a local port claimed by one tenant (tenant_ports); else the longest (local port, client address)
 * prefix in tenant_cidrs; else the longest (any port, client address) prefix; else QOS_UNMATCHED. */
#ifndef QOS_TENANT_H
#define QOS_TENANT_H

#include "qos_common.h"

#ifndef QOS_TENANT_MAX
#define QOS_TENANT_MAX 4096
#endif

BPF_HASH(tenant_ports, struct qos_port_key, struct qos_tenant_val, QOS_TENANT_MAX);
BPF_F_TABLE("lpm_trie", struct qos_cidr_key, struct qos_tenant_val, tenant_cidrs, QOS_TENANT_MAX, BPF_F_NO_PREALLOC);
BPF_HASH(watched_ports, struct qos_port_key, struct qos_watch_val, 1024);

/* Bits of a qos_cidr_key that precede the address: the port. */
#define QOS_CIDR_PORT_BITS 16

/* lport in host byte order; client is the peer address, IPv4 as ::ffff:a.b.c.d. */
static __always_inline int qos_port_watched(__u16 lport)
{
    struct qos_port_key pk = {.port = lport};
    return watched_ports.lookup(&pk) != 0;
}

static __always_inline __u32 qos_tenant_resolve(__u16 lport, const __u8 client[16])
{
    struct qos_port_key pk = {.port = lport};
    struct qos_tenant_val *t = tenant_ports.lookup(&pk);
    if (t)
        return t->tenant;
    struct qos_cidr_key ck = {};
    ck.prefixlen = QOS_CIDR_PORT_BITS + 128;
    ck.port = htons(lport);
#pragma unroll
    for (int i = 0; i < 16; i++)
        ck.addr[i] = client[i];
    t = tenant_cidrs.lookup(&ck);
    if (t)
        return t->tenant;
    ck.port = 0;
    t = tenant_cidrs.lookup(&ck);
    if (t)
        return t->tenant;
    return QOS_UNMATCHED;
}

#endif
