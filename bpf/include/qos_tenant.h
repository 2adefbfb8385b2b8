/* Tenant resolution shared by the latency probes and the quota classifier, so that a tenant's latency and its
 * quota describe the same traffic. Rules, in order:
 *   1. the local port, when one tenant claims it alone (tenant_ports);
 *   (between 1 and 2, each program's own rule for process and pods tenants, by serving network namespace: quota by the
 *    host-side veth a request leaves through (quota_netns), latency by the socket's local address (lat_netns))
 *   2. the client address, longest prefix first, among the CIDRs bound to that local port, then among the CIDRs
 *      bound to any watched port (tenant_cidrs, port 0);
 *   3. (TC only) an HTTP/1.x header value in the first segment of a request; see qos_quota.h.
 * BCC rewrites map calls only in the main file, so qosagent/ebpf/loader.py pastes our quoted includes into it.
 * Include this after declaring tenant_ports (an array of QOS_PORTS qos_port_tenant, __u32 key) and tenant_cidrs
 * (qos_cidr_key -> qos_tenant_val, an LPM trie). Ports are in host byte order here; addresses IPv4-mapped. */
#ifndef QOS_TENANT_H
#define QOS_TENANT_H

#include "qos_common.h"

#define QOS_VIA_NONE 0
#define QOS_VIA_PORT 1
#define QOS_VIA_CIDR 2
#define QOS_VIA_HEADER 3

/* The bits of qos_cidr_key.prefixlen taken by the port before the address starts. */
#define QOS_CIDR_PORT_BITS 16

/* The tenant claiming a local port alone, or 0 when none does. */
static __always_inline struct qos_port_tenant *qos_port_claim(__u16 lport)
{
    __u32 k = lport;
    struct qos_port_tenant *c = tenant_ports.lookup(&k);
    return c && c->tenant != QOS_UNMATCHED ? c : 0;
}

static __always_inline __u32 qos_tenant_by_port(__u16 lport)
{
    struct qos_port_tenant *c = qos_port_claim(lport);
    return c ? c->tenant : QOS_UNMATCHED;
}

/* via, where given, says the tenant came from a CIDR: the quota classifier keeps it in its flow table for
 * `qosagent status`; the latency probes have no use for it and pass 0. */
static __always_inline __u32 qos_tenant_by_addr(__u16 lport, const __u8 *raddr, __u8 *via)
{
    struct qos_cidr_key ck = {};
    ck.prefixlen = QOS_CIDR_PORT_BITS + 128;
    ck.port = __builtin_bswap16(lport);
    __builtin_memcpy(ck.addr, raddr, 16);
    struct qos_tenant_val *t = tenant_cidrs.lookup(&ck);
    if (!t) {
        ck.port = 0;
        t = tenant_cidrs.lookup(&ck);
    }
    if (!t)
        return QOS_UNMATCHED;
    if (via)
        *via = QOS_VIA_CIDR;
    return t->tenant;
}

#endif
