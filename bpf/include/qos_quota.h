/* The quota classifier's maps, mirrored in qosagent/quota/layout.py (tests/unit/test_bpf_layouts.py compares the
 * two). Change a struct here and there together, and bump QOS_QUOTA_LAYOUT: pins of another layout are then
 * replaced, never adopted. */
#ifndef QOS_QUOTA_H
#define QOS_QUOTA_H

#include <linux/types.h>

#define QOS_QUOTA_LAYOUT 3

/* Per-tenant state lives in arrays indexed by a slot the agent assigns (quota_slots: tenant -> slot) and
 * tenant_ports or the flow cache carries, so that a request of a port tenant costs inlined array lookups only, and
 * one of a CIDR or header tenant too when quota.c's per-CPU flow front holds the flow (else one hashed lookup, the
 * flow in tenant_flows, more). Slot 0 is the traffic of no tenant. */
#define QOS_SLOTS 4096

struct qos_slot_val {
    __u32 slot;
};

/* A token bucket as GCRA: interval = 1e9/rate ns, tau = capacity * interval. tau 0 sheds every request. */
struct qos_bucket_limit {
    __u64 interval_ns;
    __u64 tau_ns;
};

#define QOS_LIMIT_REQ 1      /* request starts are limited by req */
#define QOS_LIMIT_CONN 2     /* new connections are limited by conn */
#define QOS_LIMIT_OVERRIDE 4 /* override replaces req while the heartbeat is fresh */
#define QOS_LIMIT_FLEET 8    /* fleet (this node's share of a fleet quota) holds where it is lower than the rest,
                              * while the heartbeat is fresh and before fleet_until_ns */

/* quota_limits[slot]. */
struct qos_quota_limit {
    struct qos_bucket_limit req;
    struct qos_bucket_limit conn;
    struct qos_bucket_limit override;
    struct qos_bucket_limit fleet;
    __u64 fleet_until_ns; /* the grant's lease, on the bpf_ktime_get_ns clock (a safe share: no end) */
    __u32 flags;
    __u32 tenant; /* the slot's owner, for anyone reading the map */
};

/* quota_buckets[slot]: theoretical arrival times (ns, bpf_ktime_get_ns clock). */
struct qos_quota_bucket {
    __u64 req_tat;
    __u64 conn_tat;
};

/* quota_counters[slot] (per CPU). Slot 0 counts what matched no tenant (always admitted). */
struct qos_quota_count {
    __u64 req_admitted;
    __u64 req_dropped;
    __u64 conn_admitted;
    __u64 conn_dropped;
};

/* quota_stats: per-CPU packet counts by reason, indexed by QOS_STAT_*. */
#define QOS_STAT_UNMATCHED 0       /* a new connection or request on a watched port, no tenant: passed */
#define QOS_STAT_MALFORMED 1       /* truncated or inconsistent headers: passed */
#define QOS_STAT_FRAGMENT 2        /* IP fragments: passed (TCP does not fragment; no port to classify by) */
#define QOS_STAT_HEADER_INCOMPLETE 3 /* request start whose headers did not end inside the scanned bytes */
#define QOS_STAT_OVERRIDE_EXPIRED 4  /* request checked against baseline because the heartbeat was stale */
#define QOS_STAT_FLEET_EXPIRED 5     /* request not checked against a fleet share: its lease or the heartbeat ran out */
#define QOS_STAT_MAX 6

struct qos_stat_val {
    __u64 packets;
};

/* quota_gen (quota.c, struct qos_gen): slot s's generation at [s], s < QOS_SLOTS, bumped after each count of the slot;
 * past them the stats' generation of each CPU at [QOS_SLOTS + QOS_GEN_LINE * cpu], bumped after each count in
 * quota_stats on that CPU. One cache line per CPU (QOS_GEN_LINE generations of 8 bytes): a CPU writes only its own,
 * so these bumps contend for no line. Only a flood of malformed or fragment packets contends for none at all: an
 * unmatched packet (header_incomplete included, which ends unmatched) is also counted in slot 0 (count(0, ...)),
 * whose generation at [0] every CPU bumps atomically on one shared line, and an expired-lease request is counted in
 * its tenant's slot as every checked request is. The agent's tick at rest compares them in place and skips its read
 * of quota_stats. */
#define QOS_GEN_LINE 8

/* quota_config[0]: written by the agent; heartbeat_ns every tick. */
#define QOS_CONF_HEADER_RULES 1 /* some tenant is matched by a header: scan unmatched request starts */
#define QOS_CONF_NETNS_RULES 2  /* some tenant is matched by a serving network namespace: look up quota_netns */
struct qos_quota_conf {
    __u64 heartbeat_ns;
    __u64 heartbeat_timeout_ns;
    __u32 flags;
    __u32 rules_gen; /* bumped after each rule change emptied tenant_flows: entries of the per-CPU flow front
                      * (quota.c) filled under another generation are stale */
};

/* quota_headers: FNV-1a 64 of lowercase(name) ":" value -> tenant. */
struct qos_header_key {
    __u64 hash;
};

/* quota_netns: requests to a serving network namespace, seen on the egress of the host-side veth toward it:
 * (that veth's ifindex, local port; port 0 = any watched port) -> tenant. Resolved like a CIDR tenant, once per
 * flow, and cached in tenant_flows with via QOS_VIA_NETNS. */
#define QOS_VIA_NETNS 4
struct qos_netns_key {
    __u32 ifindex;
    __u16 port;
    __u16 pad;
};

/* quota_attach: what the agent attached, so that `qosagent detach` can remove it without a running agent. */
struct qos_attach_key {
    __u32 ifindex;
    __u32 netns_ino; /* the network namespace the ifindex belongs to */
};

struct qos_attach_val {
    __u8 created_clsact; /* the clsact qdisc was ours: delete it on detach */
    __u8 pad[7];
};

#endif
