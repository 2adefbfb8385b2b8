/* Per-tenant request latency from socket events, and run-queue latency of the processes serving those sockets.
 *
 * A server-side socket on a watched port is learned when it is established (its tenant resolved once, then), and
 * forgotten at its close. Each tracked socket runs a request/response state machine: the first request bytes
 * start a request, the first bytes written back give the time to first byte, the last bytes written before the
 * next request (or the close) end the response. See docs/latency.md for what this can and cannot see.
 *
 * Two ways to get the events, chosen by the agent (qosagent/latency/capability.py):
 *  - QOS_SOCKOPS (>= 6.15): per-socket hooks. A sock_ops program on the cgroup2 root picks the server sockets at
 *    PASSIVE_ESTABLISHED and asks the kernel for their sendmsg callback (TX timestamping, SENDMSG only) and their
 *    state changes; a cgroup_skb ingress program on the serving cgroups sees request bytes arrive. Every other
 *    socket on the host (clients, other services) costs nothing per request. State is socket local storage.
 *  - otherwise, tracepoints that fire for every socket: inet_sock_set_state, the sock_recv_length /
 *    sock_send_length raw tracepoints (>= 6.4) or, built with QOS_KPROBE, kprobes on tcp_cleanup_rbuf /
 *    tcp_sendmsg, and sk_data_ready (QOS_ARRIVAL, >= 6.6; with QOS_KPROBE a kprobe on sock_def_readable) for
 *    arrival. State is a table keyed by socket address.
 * Only tracepoint arguments and UAPI types are used: in tracepoint mode `sk` is an opaque key, never dereferenced. */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/in.h>
#include <uapi/linux/bpf.h>
#include "qos_common.h"
#include "qos_hist.h"
#include "qos_flow.h"

/* Filled from config by the agent (qosagent/latency/capability.py), with the same layouts the quota classifier uses
 * (tenant_ports' slots stay 0 here: latency has no quota arrays). */
BPF_TABLE("array", __u32, struct qos_port_tenant, tenant_ports, QOS_PORTS);
BPF_F_TABLE("lpm_trie", struct qos_cidr_key, struct qos_tenant_val, tenant_cidrs, 4096, BPF_F_NO_PREALLOC);
BPF_HASH(watched_ports, struct qos_port_key, struct qos_watch_val, 1024);
#include "qos_tenant.h"

#ifdef QOS_FLOWS_PIN
/* The quota classifier's flow -> tenant map: the only place a header-matched tenant is known (TC sees payload,
 * these probes do not). Built in only when quota runs with header tenants, so latency never creates quota's pins. */
BPF_TABLE_PINNED("lru_hash", struct qos_flow_key, struct qos_flow_val, tenant_flows, QOS_FLOWS, QOS_FLOWS_PIN);
#endif

static __always_inline int qos_port_watched(__u16 lport)
{
    struct qos_port_key pk = {.port = lport};
    return watched_ports.lookup(&pk) != 0;
}

#define LAT_IDLE 0       /* no request in progress */
#define LAT_WAITING 1    /* request bytes in, nothing written back yet */
#define LAT_RESPONDING 2 /* response bytes written */
#define LAT_PUSHING 3    /* bytes written with no request first (server-first protocols) */
#define LAT_MUX 4        /* on a multiplexed port: requests overlap, the connection is counted and never timed */

/* Histogram kinds (mirrored in qosagent/latency/bpfmaps.py). */
#define LAT_KIND_TTFB 0
#define LAT_KIND_RESPONSE 1
#define LAT_KIND_RUNQ 2

/* Counters (mirrored in qosagent/latency/bpfmaps.py). Answered and completed requests are the TTFB and response
 * histogram counts: no counter of their own, one map update less per request. */
#define LAT_C_STARTED 1        /* requests started (first bytes in) */
#define LAT_C_UNPAIRED_SEND 3  /* write bursts with no request before them */
#define LAT_C_UNPAIRED_CLOSE 4 /* requests closed without any response byte */
#define LAT_C_EXTRA_READS 5    /* more request bytes after the first (reads; segments in sockops mode) before any
                                * response byte */
#define LAT_C_CONNS 6          /* server-side connections tracked */
#define LAT_C_MUX_CONNS 7      /* of those, on multiplexed ports (HTTP/2, gRPC): requests overlap, not timed */
#define LAT_C_OVERLAPPED 8     /* requests whose bytes arrived while the previous response was still being written */
#define LAT_C_LOST 9           /* observations dropped: their tenant had no slot (see lat_slot_of) */
#define LAT_C_UNTRACKED 10     /* connections not tracked: no room for their state */

#define MSG_PEEK_FLAG 2

struct lat_sock {
    __u64 start_ns;     /* the current request's first bytes: arrived at the socket, else read */
    __u64 last_send_ns; /* last bytes of the current response written */
    __u64 arrived_ns;   /* unread bytes of a next request arrived (QOS_ARRIVAL), 0 when none */
    __u32 tenant;
    __u16 slot;   /* the tenant's row in lat_hist and lat_counters */
    __u16 state;
    __u8 noted;   /* the serving process (and cgroup) is known (checked once per connection, not per request) */
    __u8 flags;
    __u8 pad[2];
    __u32 rcv_end; /* sockops mode: the sequence number just past the last request byte seen arrive */
#ifdef QOS_FLOWS_PIN
    struct qos_flow_key flow; /* set while the tenant is unresolved: a header rule may still claim the connection */
#endif
};

/* lat_sock.flags */
#define LAT_F_OVERLAP 1 /* the server wrote after a next request's bytes arrived: the client did not wait */
#define LAT_F_UNTIMED 2 /* the current request overlapped its predecessor: counted, not timed */

/* Histograms and counters live in arrays indexed by the tenant's slot (the agent numbers tenants densely in
 * lat_slots, 0 being unmatched traffic): an array lookup is inlined, a hash lookup is a call chain that costs
 * ~100-200 ns on machines with retpolines and return thunks, and each request made three of them.
 * The histograms are shared by all CPUs and updated with atomic adds, so neither their size nor the agent's read of
 * them (4.8 KB a row, every tick) grows with the number of CPUs. The counters, 88 bytes a slot and one of them bumped
 * by every request, are per CPU: no cache line moves between CPUs for them. Their adds stay atomic, because a softirq
 * (the ingress program) can interrupt a program in process context (the sendmsg callback) on the same CPU. */
#ifndef LAT_SLOTS /* from the number of tenants, with room for reloads (qosagent/latency/capability.py) */
#define LAT_SLOTS 64
#endif
#define LAT_NCOUNTERS 11
#define LAT_RUNQ_ROW (LAT_SLOTS * 2) /* rows 2*slot + kind hold TTFB and response; one more row, run-queue waits */

struct lat_row {
    __u64 sum_ns;
    __u64 count[QOS_HIST_NBUCKETS];
};

struct lat_counts {
    __u64 n[LAT_NCOUNTERS];
};

struct lat_tenant_key {
    __u32 tenant;
};

struct lat_slot_val {
    __u32 slot;
};

struct lat_pid_key {
    __u32 pid;
};

struct lat_pid_val {
    __u64 v;
};

BPF_ARRAY(lat_hist, struct lat_row, LAT_SLOTS * 2 + 1);
BPF_PERCPU_ARRAY(lat_counters, struct lat_counts, LAT_SLOTS);
BPF_HASH(lat_slots, struct lat_tenant_key, struct lat_slot_val, LAT_SLOTS);
/* Ports whose protocol runs requests concurrently on one connection (latency.multiplexed_ports). Without the
 * payload, overlapping requests cannot be told from one another, so these connections are counted, not timed. */
BPF_HASH(lat_mux_ports, struct qos_port_key, struct qos_watch_val, 1024);
/* Processes seen serving tracked sockets (by tgid); the agent expands them to their threads in runq_pids, whose
 * value is the thread's wake-up time while it waits for a CPU (0 when it does not): stamping and clearing in place
 * spares an update and a delete per wait on the scheduler's hottest path. */
BPF_HASH(runq_tgids, struct lat_pid_key, struct lat_pid_val, 1024);
BPF_HASH(runq_pids, struct lat_pid_key, struct lat_pid_val, 65536);

/* A tenant's slot, looked up once per connection (and when a header rule claims it), never per request. Every
 * configured tenant has one; LAT_NO_SLOT would mean the agent's slots and the kernel's maps disagree. */
#define LAT_NO_SLOT 0xffff
static __always_inline __u16 lat_slot_of(__u32 tenant)
{
    struct lat_tenant_key k = {.tenant = tenant};
    struct lat_slot_val *v = lat_slots.lookup(&k);
    return v && v->slot < LAT_SLOTS ? (__u16)v->slot : LAT_NO_SLOT;
}

static __always_inline void lat_count(__u16 slot, __u32 what)
{
    __u32 i = slot == LAT_NO_SLOT ? 0 : slot;
    struct lat_counts *c = lat_counters.lookup(&i);
    if (c && what < LAT_NCOUNTERS)
        __sync_fetch_and_add(&c->n[what], 1);
}

static __always_inline void lat_observe_row(__u32 row, __u64 delta_ns)
{
    struct lat_row *r = lat_hist.lookup(&row);
    if (!r)
        return;
    __u32 b = qos_hist_index(delta_ns);
    /* clang knows b < QOS_HIST_NBUCKETS and would drop the check; the verifier needs to see it. */
    asm volatile("" : "+r"(b));
    if (b >= QOS_HIST_NBUCKETS)
        return;
    __sync_fetch_and_add(&r->count[b], 1);
    __sync_fetch_and_add(&r->sum_ns, delta_ns);
}

/* An observation of a tenant without a slot is counted as lost (on the unmatched slot), never misattributed. */
static __always_inline void lat_observe(__u16 slot, __u16 kind, __u64 delta_ns)
{
    if (slot == LAT_NO_SLOT) {
        lat_count(slot, LAT_C_LOST);
        return;
    }
    lat_observe_row((__u32)slot * 2 + kind, delta_ns);
}

/* The tenant a request is counted under: the one resolved when the connection was established, or one a header
 * rule claimed the connection for (learned per flow by quota's classifier) by the time the request starts. */
static __always_inline void lat_request_tenant(struct lat_sock *s)
{
#ifdef QOS_FLOWS_PIN
    /* TC has classified the request's first segment before it reaches the socket, so its verdict is in place. */
    if (s->tenant == QOS_UNMATCHED) {
        struct qos_flow_val *v = tenant_flows.lookup(&s->flow);
        if (v && v->via == QOS_VIA_HEADER) {
            s->tenant = v->tenant;
            s->slot = lat_slot_of(v->tenant);
        }
    }
#endif
}

static __always_inline void lat_note_process(void)
{
    struct lat_pid_key k = {.pid = bpf_get_current_pid_tgid() >> 32};
    if (runq_tgids.lookup(&k))
        return;
    struct lat_pid_val one = {.v = 1};
    runq_tgids.update(&k, &one);
}

/* A fresh socket's state: its tenant (port, then client address), and whether its port is multiplexed.
 * client and local are 16-byte addresses, IPv4 ones mapped; ports in host byte order. */
static __always_inline void lat_init_sock(struct lat_sock *s, __u16 lport, __u16 rport, const __u8 *client,
                                          const __u8 *local)
{
    __u8 via;
    s->tenant = qos_resolve_tenant(lport, client, &via);
    s->slot = lat_slot_of(s->tenant);
#ifdef QOS_FLOWS_PIN
    if (s->tenant == QOS_UNMATCHED) {
        __builtin_memcpy(s->flow.raddr, client, 16);
        __builtin_memcpy(s->flow.laddr, local, 16);
        s->flow.rport = rport;
        s->flow.lport = lport;
    }
#endif
    struct qos_port_key pk = {.port = lport};
    s->state = lat_mux_ports.lookup(&pk) ? LAT_MUX : LAT_IDLE;
}

static __always_inline void lat_finish_response(struct lat_sock *s)
{
    if (s->flags & LAT_F_UNTIMED)
        return;
    lat_observe(s->slot, LAT_KIND_RESPONSE, s->last_send_ns - s->start_ns);
}

/* Request bytes came in (read, or arrived in sockops mode) on a timed socket. */
static __always_inline void lat_request_bytes(struct lat_sock *s, __u64 start_ns, int overlapped)
{
    if (s->state == LAT_WAITING) {
        lat_count(s->slot, LAT_C_EXTRA_READS);
        return;
    }
    if (s->state == LAT_RESPONDING)
        lat_finish_response(s);
    lat_request_tenant(s);
    s->start_ns = start_ns;
    s->state = LAT_WAITING;
    if (overlapped) {
        s->flags = LAT_F_UNTIMED;
        lat_count(s->slot, LAT_C_OVERLAPPED);
    } else {
        s->flags = 0;
        lat_count(s->slot, LAT_C_STARTED);
    }
}

/* ret response bytes written on a timed socket, at now. */
static __always_inline void lat_response_bytes(struct lat_sock *s, __u64 now)
{
    if (s->state == LAT_WAITING) {
        if (!(s->flags & LAT_F_UNTIMED))
            lat_observe(s->slot, LAT_KIND_TTFB, now - s->start_ns);
        s->state = LAT_RESPONDING;
    } else if (s->state == LAT_RESPONDING && s->arrived_ns) {
        s->flags |= LAT_F_OVERLAP;
    } else if (s->state == LAT_IDLE) {
        lat_count(s->slot, LAT_C_UNPAIRED_SEND);
        s->state = LAT_PUSHING;
    }
    s->last_send_ns = now;
}

/* The socket is closing: a response in progress ends, a request never answered is counted. */
static __always_inline void lat_closed(struct lat_sock *s)
{
    if (s->state == LAT_RESPONDING)
        lat_finish_response(s);
    else if (s->state == LAT_WAITING && !(s->flags & LAT_F_UNTIMED))
        lat_count(s->slot, LAT_C_UNPAIRED_CLOSE);
}

/* A new connection's counts, or its loss when there was no room to track it. */
static __always_inline void lat_count_conn(const struct lat_sock *s, int tracked)
{
    if (!tracked) {
        lat_count(s->slot, LAT_C_UNTRACKED);
        return;
    }
    lat_count(s->slot, LAT_C_CONNS);
    if (s->state == LAT_MUX)
        lat_count(s->slot, LAT_C_MUX_CONNS);
}

#ifdef QOS_SOCKOPS
/* ---- sockops mode: per-socket hooks ------------------------------------------------------------------------- */
/* Kernel ABI values newer than the UAPI headers BCC compiles against (include/uapi/linux/bpf.h, 6.15). */
#define LAT_SOL_SOCKET 1
#define LAT_SK_BPF_CB_FLAGS 1009
#define LAT_SK_BPF_CB_TX_TIMESTAMPING 1
#define LAT_OPS_TSTAMP_SENDMSG_CB 20
#define LAT_ETH_P_IP 0x0800
#define LAT_ETH_P_IPV6 0x86DD
#define LAT_AF_INET 2
#define LAT_AF_INET6 10

BPF_SK_STORAGE(lat_sk, struct lat_sock);

struct lat_cgroup_key {
    __u64 id;
};

struct lat_cgroup_event {
    __u64 id;   /* cgroup v2 id: the inode number of its directory */
    __u32 tgid; /* a process seen serving there, for the agent's log */
    __u32 pad;
};

/* cgroup v2 ids where watched ports are served: of a process calling listen() on one, of a process answering on a
 * tracked socket, or (lat_ingress_learn) of a tracked socket a request arrives on. Each is reported once on
 * lat_cgroup_events; the agent then links lat_ingress to that cgroup, so that request bytes arriving for its sockets
 * are seen. The agent deletes the ids of cgroups that are gone. */
BPF_HASH(lat_cgroups, struct lat_cgroup_key, __u8, 1024);
BPF_RINGBUF_OUTPUT(lat_cgroup_events, 1);

static __always_inline void lat_note_cgroup_id(__u64 id, __u32 tgid)
{
    struct lat_cgroup_key k = {.id = id};
    if (lat_cgroups.lookup(&k))
        return;
    __u8 one = 1;
    /* Reported even when the set is full: the agent's attach is idempotent, a missed cgroup is not. */
    lat_cgroups.update(&k, &one);
    struct lat_cgroup_event ev = {.id = id, .tgid = tgid};
    lat_cgroup_events.ringbuf_output(&ev, sizeof(ev), 0);
}

/* In the serving process (listen, sendmsg): its cgroup is where its sockets' bytes arrive. */
static __always_inline void lat_note_cgroup(void)
{
    lat_note_cgroup_id(bpf_get_current_cgroup_id(), bpf_get_current_pid_tgid() >> 32);
}

/* A 16-byte address from sock_ops' words (network byte order), IPv4 mapped the way the tracepoints report it. */
static __always_inline void lat_ops_addr(__u8 *out, __u32 family, __u32 ip4, __u32 a, __u32 b, __u32 c, __u32 d)
{
    __u32 w[4] = {a, b, c, d};
    if (family == LAT_AF_INET) {
        w[0] = 0;
        w[1] = 0;
        w[2] = bpf_htonl(0xffff);
        w[3] = ip4;
    }
    __builtin_memcpy(out, w, 16);
}

static __always_inline void lat_ops_established(struct bpf_sock_ops *skops)
{
    __u32 family = skops->family;
    __u16 lport = (__u16)skops->local_port;
    struct bpf_sock *sk = skops->sk;
    if ((family != LAT_AF_INET && family != LAT_AF_INET6) || !sk || !qos_port_watched(lport))
        return;
    /* Volatile loads, each straight from ctx: left to itself clang turns loads of two fields into one load through
     * a selected pointer, and the verifier refuses loads through a moved ctx pointer. */
#define LAT_CTX(field) (*(volatile __u32 *)&skops->field)
    __u32 rip4 = LAT_CTX(remote_ip4), lip4 = LAT_CTX(local_ip4), rport = LAT_CTX(remote_port);
    __u32 r0 = LAT_CTX(remote_ip6[0]), r1 = LAT_CTX(remote_ip6[1]), r2 = LAT_CTX(remote_ip6[2]),
          r3 = LAT_CTX(remote_ip6[3]);
    __u32 l0 = LAT_CTX(local_ip6[0]), l1 = LAT_CTX(local_ip6[1]), l2 = LAT_CTX(local_ip6[2]),
          l3 = LAT_CTX(local_ip6[3]);
#undef LAT_CTX
    __u8 client[16], local[16];
    lat_ops_addr(client, family, rip4, r0, r1, r2, r3);
    lat_ops_addr(local, family, lip4, l0, l1, l2, l3);
    struct lat_sock init = {};
    /* remote_port reads as the network-order port shifted into the upper half (a long-standing quirk). */
    lat_init_sock(&init, lport, (__u16)bpf_ntohl(rport), client, local);
    if (init.state == LAT_MUX) {
        lat_count_conn(&init, 1); /* counted, never timed: no per-socket hooks, no state */
        return;
    }
    struct lat_sock *s = lat_sk.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
    if (!s) {
        lat_count_conn(&init, 0);
        return;
    }
    *s = init;
    s->rcv_end = skops->rcv_nxt;
    int on = LAT_SK_BPF_CB_TX_TIMESTAMPING;
    /* The sendmsg callback (no timestamps are taken: bpf_sock_ops_enable_tx_tstamp is never called) and the state
     * callback, for this socket only. */
    if (bpf_setsockopt(skops, LAT_SOL_SOCKET, LAT_SK_BPF_CB_FLAGS, &on, sizeof(on)) ||
        bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG)) {
        lat_sk.sk_storage_delete(sk);
        lat_count_conn(&init, 0);
        return;
    }
    lat_count_conn(&init, 1);
}

static __always_inline void lat_ops_sendmsg(struct bpf_sock_ops *skops)
{
    struct bpf_sock *sk = skops->sk;
    if (!sk)
        return;
    struct lat_sock *s = lat_sk.sk_storage_get(sk, 0, 0);
    if (!s)
        return;
    lat_response_bytes(s, bpf_ktime_get_ns());
    if (!s->noted) {
        /* sendmsg runs in the serving process: its tgid for the run-queue probes, its cgroup for lat_ingress. */
        lat_note_process();
        lat_note_cgroup();
        s->noted = 1;
    }
}

static __always_inline void lat_ops_state(struct bpf_sock_ops *skops)
{
    struct bpf_sock *sk = skops->sk;
    if (skops->args[1] != BPF_TCP_CLOSE || !sk)
        return;
    struct lat_sock *s = lat_sk.sk_storage_get(sk, 0, 0);
    if (!s)
        return;
    lat_closed(s);
    lat_sk.sk_storage_delete(sk);
}

int lat_sockops(struct bpf_sock_ops *skops)
{
    switch (skops->op) {
    case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
        lat_ops_established(skops);
        break;
    case LAT_OPS_TSTAMP_SENDMSG_CB:
        lat_ops_sendmsg(skops);
        break;
    case BPF_SOCK_OPS_STATE_CB:
        lat_ops_state(skops);
        break;
    case BPF_SOCK_OPS_TCP_LISTEN_CB:
        /* listen() runs in the server's process: its cgroup is where its connections' bytes will arrive. */
        if (qos_port_watched((__u16)skops->local_port))
            lat_note_cgroup();
        break;
    }
    return 1; /* sock_ops' verdict only matters for ops we never answer */
}

struct lat_tcp_head {
    __u16 sport;
    __u16 dport;
    __u32 seq;
    __u32 ack_seq;
    __u8 doff_res; /* data offset in the upper four bits */
};

/* Request bytes reaching a tracked socket, on the serving cgroups: the request's clock starts at arrival, as it
 * does with the sk_data_ready hook in tracepoint mode. Always lets the packet through. The headers are read in
 * place (TCP has pulled them into the linear area before socket filters run): no helper calls for them. This runs
 * before TCP has checked the sequence numbers: rcv_end keeps a retransmitted or reordered old segment from starting
 * a request. */
static __always_inline int lat_arrival(struct __sk_buff *skb, int learn)
{
    /* Headers first: most segments of a long response's connection are the client's pure ACKs, and telling them
     * apart is cheaper than the socket storage lookup. */
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    __u32 iphl;
    if (skb->protocol == bpf_htons(LAT_ETH_P_IP)) {
        __u8 *vihl = data;
        if ((void *)(vihl + 1) > data_end)
            return 1;
        iphl = (*vihl & 0xf) * 4;
    } else if (skb->protocol == bpf_htons(LAT_ETH_P_IPV6)) {
        iphl = 40; /* TCP right after the fixed header: extension headers on a TCP stream would be unusual */
    } else {
        return 1;
    }
    struct lat_tcp_head *th = data + iphl;
    if ((void *)(th + 1) > data_end)
        return 1;
    __u32 hl = iphl + (th->doff_res >> 4) * 4;
    if (skb->len <= hl)
        return 1; /* no payload: an ACK, a window update */
    struct bpf_sock *sk = skb->sk;
    if (!sk)
        return 1;
    /* No bpf_sk_fullsock() first: the storage lookup takes a sock_common and answers NULL for request and
     * time-wait sockets itself, and a helper call costs ~15 ns here. */
    struct lat_sock *s = lat_sk.sk_storage_get(sk, 0, 0);
    if (!s)
        return 1;
    if (learn)
        lat_note_cgroup_id(bpf_sk_cgroup_id(sk), 0);
    __u32 end = bpf_ntohl(th->seq) + (skb->len - hl);
    if ((__s32)(end - s->rcv_end) <= 0)
        return 1; /* nothing new: a retransmission, a keepalive probe, or a segment both ingress programs see */
    s->rcv_end = end;
    lat_request_bytes(s, bpf_ktime_get_ns(), 0);
    return 1;
}

int lat_ingress(struct __sk_buff *skb)
{
    return lat_arrival(skb, 0);
}

/* Linked on the cgroup2 root for a while after the agent starts: servers that were already running are found
 * through their first request's arrival, which is then timed, instead of at their first response. */
int lat_ingress_learn(struct __sk_buff *skb)
{
    return lat_arrival(skb, 1);
}

#else
/* ---- tracepoint mode: hooks on every socket, state keyed by socket address ---------------------------------- */
/* Tracked sockets. A hash map would cost a call chain per lookup (~50-100 ns on machines with retpolines and return
 * thunks, and three lookups per request on the busiest path); instead a table of buckets of LAT_SOCK_WAYS slots,
 * chosen by a hash of the socket pointer, in BPF arrays, whose lookups the verifier inlines. lat_sock_tags holds
 * each slot's socket (0: free), lat_socks its state. A socket whose bucket is full is not tracked, and counted
 * (LAT_C_UNTRACKED): with 65 536 slots, about 3 in 1000 connections at 10 000 tracked at once. Sized by
 * latency.socket_slots. */
#ifndef LAT_SOCK_BUCKETS_LOG2 /* from latency.socket_slots */
#define LAT_SOCK_BUCKETS_LOG2 14
#endif
#define LAT_SOCK_WAYS 4
#define LAT_MAX_SOCKS (LAT_SOCK_WAYS << LAT_SOCK_BUCKETS_LOG2)
#define LAT_SOCK_RESERVED 1ULL  /* a slot being filled: never a socket pointer, so no lookup matches it */

struct lat_sock_bucket {
    __u64 sk[LAT_SOCK_WAYS];
};

BPF_ARRAY(lat_sock_tags, struct lat_sock_bucket, LAT_MAX_SOCKS / LAT_SOCK_WAYS);
BPF_ARRAY(lat_socks, struct lat_sock, LAT_MAX_SOCKS);

static __always_inline __u32 lat_sock_bucket_of(__u64 sk)
{
#if LAT_SOCK_BUCKETS_LOG2 == 0
    return 0;
#else
    /* Fibonacci hashing: the top bits of the product mix every bit of the (cache-line aligned) pointer. */
    return (__u32)((sk * 0x9E3779B97F4A7C15ULL) >> (64 - LAT_SOCK_BUCKETS_LOG2));
#endif
}

static __always_inline struct lat_sock *lat_sock_at(__u32 bucket, __u32 way)
{
    __u32 i = bucket * LAT_SOCK_WAYS + way;
    return lat_socks.lookup(&i);
}

/* sk's bucket of tags (its index in *b), or 0. */
static __always_inline struct lat_sock_bucket *lat_bucket(__u64 sk, __u32 *b)
{
    *b = lat_sock_bucket_of(sk);
    return lat_sock_tags.lookup(b);
}

/* The way of t that holds sk, LAT_SOCK_WAYS when none does. */
static __always_inline __u32 lat_way(const struct lat_sock_bucket *t, __u64 sk)
{
#pragma unroll
    for (__u32 w = 0; w < LAT_SOCK_WAYS; w++)
        if (t->sk[w] == sk)
            return w;
    return LAT_SOCK_WAYS;
}

static __always_inline struct lat_sock *lat_tracked(__u64 sk)
{
    __u32 b;
    struct lat_sock_bucket *t = lat_bucket(sk, &b);
    if (!t)
        return 0;
    __u32 w = lat_way(t, sk);
    return w < LAT_SOCK_WAYS ? lat_sock_at(b, w) : 0;
}

/* Track sk with state *init; 0 when its bucket is full. The slot is reserved, filled, then published, so that an
 * event on another CPU never sees a half-written state under this socket's tag. A slot still holding this pointer
 * (a socket freed without its CLOSE seen, whose memory now holds a new socket) is taken over like the hash map's
 * update would have: two slots with one tag would leave the stale one answering lookups. */
static __always_inline int lat_track(__u64 sk, const struct lat_sock *init)
{
    __u32 b;
    struct lat_sock_bucket *t = lat_bucket(sk, &b);
    if (!t)
        return 0;
    __u64 want = lat_way(t, sk) < LAT_SOCK_WAYS ? sk : 0;
#pragma unroll
    for (__u32 w = 0; w < LAT_SOCK_WAYS; w++) {
        if (t->sk[w] != want || __sync_val_compare_and_swap(&t->sk[w], want, LAT_SOCK_RESERVED) != want)
            continue;
        struct lat_sock *s = lat_sock_at(b, w);
        if (s)
            *s = *init;
        __sync_lock_test_and_set(&t->sk[w], sk);
        return 1;
    }
    return 0;
}

/* The state of a tracked, timed socket for a read or write of ret bytes; 0 when there is nothing to time. */
static __always_inline struct lat_sock *lat_timed(__u64 sk, int ret)
{
    if (ret <= 0)
        return 0;
    struct lat_sock *s = lat_tracked(sk);
    if (!s || s->state == LAT_MUX)
        return 0;
    return s;
}

static __always_inline void lat_recv(__u64 sk, int ret, int flags)
{
    if (flags & MSG_PEEK_FLAG)
        return;
    struct lat_sock *s = lat_timed(sk, ret);
    if (!s)
        return;
    /* With the arrival clock the request's start is already stamped: no clock read (a helper call) here. */
    int overlapped = s->state != LAT_WAITING && (s->flags & LAT_F_OVERLAP);
    lat_request_bytes(s, s->arrived_ns ? s->arrived_ns : bpf_ktime_get_ns(), overlapped);
    s->arrived_ns = 0;
    if (!s->noted) {
        lat_note_process();
        s->noted = 1;
    }
}

static __always_inline void lat_send(__u64 sk, int ret)
{
    struct lat_sock *s = lat_timed(sk, ret);
    if (s)
        lat_response_bytes(s, bpf_ktime_get_ns());
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    __u64 sk = (__u64)args->skaddr;
    if (args->newstate == BPF_TCP_ESTABLISHED) {
        /* Server side only: a child socket goes SYN_RECV -> ESTABLISHED; `sport` is then the listening port. */
        if (args->oldstate != BPF_TCP_SYN_RECV || !qos_port_watched(args->sport))
            return 0;
        /* the kernel stores IPv4 peers IPv4-mapped in daddr_v6 */
        /* Copied to the stack byte by byte: the verifier refuses loads through a ctx pointer moved by an offset. */
        __u8 client[16], local[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            client[i] = args->daddr_v6[i];
            local[i] = args->saddr_v6[i];
        }
        struct lat_sock s = {};
        lat_init_sock(&s, args->sport, args->dport, client, local);
        lat_count_conn(&s, lat_track(sk, &s));
        return 0;
    }
    if (args->newstate != BPF_TCP_CLOSE)
        return 0;
    __u32 b;
    struct lat_sock_bucket *t = lat_bucket(sk, &b);
    __u32 w = t ? lat_way(t, sk) : LAT_SOCK_WAYS;
    struct lat_sock *s = w < LAT_SOCK_WAYS ? lat_sock_at(b, w) : 0;
    if (!t || !s)
        return 0;
    lat_closed(s);
    __sync_val_compare_and_swap(&t->sk[w], sk, 0); /* the slot is free again */
    return 0;
}

#ifdef QOS_ARRIVAL
/* Bytes queued on a tracked socket. A request's clock starts when its first bytes arrive, not when the
 * application gets round to reading them: time in the socket's queue is part of what the client waits. */
static __always_inline void lat_arrived(__u64 sk)
{
    struct lat_sock *s = lat_tracked(sk);
    if (!s || s->state == LAT_WAITING || s->state == LAT_MUX || s->arrived_ns)
        return;
    s->arrived_ns = bpf_ktime_get_ns();
}

#ifdef QOS_KPROBE
/* Before 6.6 there is no sk_data_ready tracepoint: a kprobe on sock_def_readable, the TCP socket's data-ready
 * callback that the tracepoint was later put in. Its first argument is the socket, used only as the key. Not
 * tcp_rcv_established: it runs for every segment, the client's pure ACKs too, and telling those apart would mean
 * reading the skb. */
int kp_data_ready(struct pt_regs *ctx)
{
    lat_arrived(PT_REGS_PARM1(ctx));
    return 0;
}
#else
RAW_TRACEPOINT_PROBE(sk_data_ready)
{
    lat_arrived(ctx->args[0]); /* TP_PROTO(const struct sock *sk), >= 6.6 */
    return 0;
}
#endif
#endif

#ifdef QOS_KPROBE
/* Kernels without the sock_*_length tracepoints: kprobes at function entry only, on functions whose arguments
 * carry the socket (a key, never dereferenced) and the byte count. No kretprobes: a kretprobe takes one of a small
 * pool of instances (maxactive, about 2 per CPU) for as long as the call runs, and every thread on the host blocked
 * in tcp_recvmsg (an idle keep-alive connection's reader) holds one, so once a handful are blocked every later
 * call's return is missed and nothing is counted.
 *  - reads: tcp_cleanup_rbuf(sk, copied), called by tcp_recvmsg (and splice's tcp_read_sock) with the bytes it
 *    copied to the application; 0 when it read nothing. MSG_PEEK reads are not told apart (documented); a read
 *    that waits for more (MSG_WAITALL, SO_RCVLOWAT) shows as an extra read.
 *  - writes: tcp_sendmsg(sk, msg, size), the bytes the application hands over, timed at the call. */
int kp_tcp_read(struct pt_regs *ctx)
{
    lat_recv(PT_REGS_PARM1(ctx), (int)PT_REGS_PARM2(ctx), 0);
    return 0;
}

int kp_tcp_sendmsg(struct pt_regs *ctx)
{
    lat_send(PT_REGS_PARM1(ctx), (int)PT_REGS_PARM3(ctx));
    return 0;
}
#else
/* Raw tracepoints for the per-read/write hooks: no perf record is built per event, which is most of a classic
 * tracepoint's cost. Their arguments are TP_PROTO(struct sock *sk, int ret, int flags): the pointer is only a key,
 * the rest are ints, so no kernel struct layout is assumed. Only TCP sockets are in lat_socks. */
RAW_TRACEPOINT_PROBE(sock_recv_length)
{
    lat_recv(ctx->args[0], (int)ctx->args[1], (int)ctx->args[2]);
    return 0;
}

RAW_TRACEPOINT_PROBE(sock_send_length)
{
    lat_send(ctx->args[0], (int)ctx->args[1]);
    return 0;
}
#endif
#endif /* QOS_SOCKOPS */

#ifdef QOS_RUNQ
static __always_inline void runq_enqueued(__u32 pid)
{
    struct lat_pid_key k = {.pid = pid};
    struct lat_pid_val *w = runq_pids.lookup(&k);
    if (w)
        w->v = bpf_ktime_get_ns();
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    runq_enqueued(args->pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    runq_enqueued(args->pid);
    return 0;
}

/* A task switched out while still runnable (preempted) waits in the run queue again. */
#define RUNQ_TASK_REPORT_MASK 0xff

TRACEPOINT_PROBE(sched, sched_switch)
{
    if ((args->prev_state & RUNQ_TASK_REPORT_MASK) == 0)
        runq_enqueued(args->prev_pid);
    struct lat_pid_key k = {.pid = args->next_pid};
    struct lat_pid_val *w = runq_pids.lookup(&k);
    if (!w || !w->v)
        return 0;
    __u64 delta = bpf_ktime_get_ns() - w->v;
    w->v = 0;
    lat_observe_row(LAT_RUNQ_ROW, delta);
    return 0;
}
#endif
