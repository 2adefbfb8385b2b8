/* tenant_flows: a connection's tenant as the TC classifier resolved it (LRU, pinned), so that later packets cost
 * one lookup and the latency probes can attribute a socket the header rule claimed, which only TC can see.
 * Only connections to a port no tenant claims alone are here: a claimed port's tenant and slot come from
 * tenant_ports directly (cheaper than this lookup), and the latency probes resolve port tenants themselves.
 * Key it from the server's side: remote = the client. Ports in host byte order, addresses IPv4-mapped. */
#ifndef QOS_FLOW_H
#define QOS_FLOW_H

#include <linux/types.h>

struct qos_flow_key {
    __u8 raddr[16];
    __u8 laddr[16];
    __u16 rport;
    __u16 lport;
};

struct qos_flow_val {
    __u32 tenant; /* QOS_UNMATCHED: no rule matched yet (a header may still claim the connection) */
    __u8 via;     /* QOS_VIA_* of qos_tenant.h */
    __u8 pad;
    __u16 slot;   /* the tenant's index in the quota arrays (qos_quota.h); 0: none */
};

#endif
