/* Per-tenant request latency from socket events, and run-queue latency of the processes serving those sockets.
 *
 * A server-side socket on a tracked port is learned when it is established (its tenant resolved once, then), and
 * forgotten at its close. Each tracked socket runs a request/response state machine: the first request bytes
 * start a request, the first bytes written back give the time to headers, the last bytes written before the
 * next request (or the close) end the response. An egress program reads the response as it leaves: where its
 * header block ends (the first body byte is the time to first token), the gaps between its body writes (inter-token
 * latency), and its framing (Content-Length, the chunked end), which ends it at its last byte even when the
 * connection then stays idle. See docs/latency.md for what this can and cannot see.
 *
 * Two ways to get the events, chosen by the agent (qosagent/latency/planning.py), each an entry file of its own:
 *  - bpf/latency_sockops.c (>= 6.15): per-socket hooks (sock_ops, and cgroup_skb on the serving cgroups); state is
 *    socket local storage. Every other socket on the host costs nothing per request.
 *  - bpf/latency_trace.c: tracepoints that fire for every socket (kprobes on kernels < 6.4), state in a table keyed
 *    by socket address (lat_socktable.h); with QOS_EGRESS, bpf/latency_trace_skb.c's cgroup_skb programs on the
 *    cgroup2 root read the responses.
 * bpf/latency_runq.c (the sched tracepoints) is compiled beside either when run-queue latency is on. The agent
 * compiles the entry files its plan names as one program (qosagent/latency/datapath.py), so that they share these
 * maps. Only tracepoint arguments and UAPI types are used.
 *
 * This header is what every one of them shares, whatever its hook: the tenant maps, the histograms and counters, and
 * the per-socket request/response state machine (struct lat_sock and the lat_request_bytes / lat_response_bytes /
 * lat_closed steps each hook drives). */
#ifndef LAT_STATE_H
#define LAT_STATE_H

#include <uapi/linux/ptrace.h>
#include <uapi/linux/in.h>
#include <uapi/linux/bpf.h>
#include "qos_common.h"
#include "qos_hist.h"
#include "qos_flow.h"

/* Filled from config by the agent (qosagent/latency/datapath.py), with the same layouts the quota classifier uses
 * (tenant_ports' slots stay 0 here: latency has no quota arrays). */
BPF_TABLE("array", __u32, struct qos_port_tenant, tenant_ports, QOS_PORTS);
BPF_F_TABLE("lpm_trie", struct qos_cidr_key, struct qos_tenant_val, tenant_cidrs, 4096, BPF_F_NO_PREALLOC);
/* The tracked ports (Config.tracked_ports): connections on them are tracked, those on lat_mux_ports counted only. */
BPF_HASH(tracked_ports, struct qos_port_key, struct qos_watch_val, 1024);
#include "qos_tenant.h"

/* Process and pods tenants (match.process, match.pods): connections to a serving network namespace (a pod), by the
 * local address and port of the server's socket. The key is the address because it is what every mode sees where a
 * connection is established: the inet_sock_set_state tracepoint (tracepoint and kprobe modes) carries the socket's
 * addresses and ports, never its namespace, and bpf_get_netns_cookie is refused to tracing programs; sock_ops and the
 * adopting ingress programs see the same addresses. Pods hold addresses of their own; loopback and link-local ones are
 * never entered (every namespace has them), so a pod's requests to itself over lo stay unmatched, as quota, which sees
 * a pod's traffic on its host-side veth, never sees them either. Written by the agent (qosagent/latency/pods.py) from
 * the addresses of the namespaces where tracked ports listen, a tenant of any tracked port under each of them: one
 * lookup per connection, and none while lat_netns_conf says the map is empty. */
struct lat_netns_key {
    __u8 addr[16]; /* IPv4 mapped, as the tracepoints report it */
    __u16 port;    /* host byte order */
    __u16 pad;
};

struct lat_netns_cfg {
    __u32 entries; /* in lat_netns */
};

#define LAT_NETNS_MAX 4096 /* mirrored in qosagent/latency/pods.py */
BPF_HASH(lat_netns, struct lat_netns_key, struct qos_tenant_val, LAT_NETNS_MAX);
BPF_ARRAY(lat_netns_conf, struct lat_netns_cfg, 1);

static __always_inline __u32 lat_tenant_by_netns(__u16 lport, const __u8 *local)
{
    __u32 zero = 0;
    struct lat_netns_cfg *c = lat_netns_conf.lookup(&zero);
    if (!c || !c->entries)
        return QOS_UNMATCHED;
    struct lat_netns_key k = {.port = lport};
    __builtin_memcpy(k.addr, local, 16);
    struct qos_tenant_val *t = lat_netns.lookup(&k);
    return t ? t->tenant : QOS_UNMATCHED;
}

#ifdef QOS_FLOWS_PIN
/* The quota classifier's flow -> tenant map: the only place a header-matched tenant is known (TC sees payload,
 * these probes do not). Built in only when quota runs with header tenants, so latency never creates quota's pins. */
BPF_TABLE_PINNED("lru_hash", struct qos_flow_key, struct qos_flow_val, tenant_flows, QOS_FLOWS, QOS_FLOWS_PIN);
#endif

static __always_inline int lat_port_tracked(__u16 lport)
{
    struct qos_port_key pk = {.port = lport};
    return tracked_ports.lookup(&pk) != 0;
}

#define LAT_IDLE 0       /* no request in progress */
#define LAT_WAITING 1    /* request bytes in, nothing written back yet */
#define LAT_RESPONDING 2 /* response bytes written */
#define LAT_PUSHING 3    /* bytes written with no request first (server-first protocols) */
#define LAT_MUX 4        /* on a multiplexed port: requests overlap, the connection is counted and never timed */
#define LAT_DONE 5       /* the response ended at its last byte, by its framing: counted; the next request is awaited */

/* Histogram kinds (mirrored in qosagent/latency/bpfmaps.py): rows LAT_KINDS * slot + kind. */
#define LAT_KIND_HEADERS 0  /* request's first bytes -> first response bytes written (time to headers) */
#define LAT_KIND_RESPONSE 1 /* -> last response byte */
#define LAT_KIND_TTFT 2     /* -> first response body byte (time to first token) */
#define LAT_KIND_ITL 3      /* gaps between a response's successive body writes (inter-token latency) */
#define LAT_KINDS 4

/* Counters (mirrored in qosagent/latency/bpfmaps.py). Answered and completed requests are the headers and response
 * histogram counts: no counter of their own, one map update less per request. */
#define LAT_C_STARTED 1        /* requests started (first bytes in) */
#define LAT_C_EGRESS_UNREAD 2  /* sockops mode, slot 0 only: packets lat_egress_learn could not tail-call lat_egress for */
#define LAT_C_UNPAIRED_SEND 3  /* write bursts with no request before them */
#define LAT_C_UNPAIRED_CLOSE 4 /* requests closed without any response byte */
#define LAT_C_PIPELINED 5      /* sockops mode: a next request's first line arrived while one was still waiting */
#define LAT_C_CONNS 6          /* server-side connections tracked */
#define LAT_C_MUX_CONNS 7      /* of those, on multiplexed ports (HTTP/2, gRPC): requests overlap, not timed */
#define LAT_C_OVERLAPPED 8     /* requests whose bytes arrived while the previous response was still being written */
#define LAT_C_LOST 9           /* observations dropped: their tenant had no slot (see lat_slot_of) */
#define LAT_C_UNTRACKED 10     /* connections not tracked: no room for their state */
/* Responses without a time to first token, by reason; their headers and response times are still observed. */
#define LAT_C_NOTTFT_NOT_HTTP 11 /* the first bytes are no HTTP/1.x status line (TLS, another protocol, an upgrade) */
#define LAT_C_NOTTFT_LONG 12     /* a header block longer than LAT_HDR_MAX, or than LAT_SCAN within one segment */
#define LAT_C_NOTTFT_NO_BODY 13  /* ended before any body byte: the client left first, or the body is empty */
#define LAT_C_NOTTFT_UNSEEN 14   /* the response's bytes were not seen leaving (no egress program on its way) */
#define LAT_C_INTERIM 15         /* interim responses (1xx) passed over: not the response */
#define LAT_C_FRAMED 16          /* responses ended at their last byte by their framing (not by what came next) */
#define LAT_C_ADOPTED 17         /* of LAT_C_CONNS, connections open before their port was watched (lat_adopt) */

#define MSG_PEEK_FLAG 2

/* Where the egress parser is in the current response (lat_sock.resp). */
#define LAT_R_START 0 /* none of it seen leave yet: its first bytes are a status line */
#define LAT_R_HEAD 1  /* inside its header block */
#define LAT_R_BODY 2  /* past its header block */
#define LAT_R_DONE 3  /* ended by its framing */
#define LAT_R_OFF 4   /* not parsed (a reason was counted): no TTFT; it ends at the next request or the close */

/* How the current response's end is known (lat_sock.framing). */
#define LAT_FR_NONE 0    /* it is not: the next request or the close ends it */
#define LAT_FR_LENGTH 1  /* Content-Length: body_left bytes to come */
#define LAT_FR_CHUNKED 2 /* Transfer-Encoding: chunked: the zero-size chunk ends it */
#define LAT_FR_EMPTY 3   /* 204, 304, Content-Length: 0: no body */
#define LAT_FR_INTERIM 4 /* 1xx: the real response follows its header block */

struct lat_sock {
    __u64 start_ns;     /* the current request's first bytes: arrived at the socket, else read */
    __u64 last_send_ns; /* last bytes of the current response written */
    __u64 arrived_ns;   /* unread bytes of a next request arrived (QOS_ARRIVAL), 0 when none */
    __u64 body_ns;      /* the current response's last body write left (its first body byte, first), 0 before */
    __u32 tenant;
    __u16 slot;   /* the tenant's row in lat_hist and lat_counters */
    __u16 state;
    __u8 noted;   /* the serving process (and cgroup) is known (checked once per connection, not per request) */
    __u8 flags;
    __u8 resp;    /* LAT_R_*: the egress parser's place in the current response */
    __u8 framing; /* LAT_FR_* */
    __u32 rcv_end; /* sockops mode: the sequence number just past the last request byte seen arrive */
    __u32 snd_end; /* the sequence number just past the last response byte seen leave (valid once snd_seen) */
    __u32 body_left; /* LAT_FR_LENGTH: body bytes still to leave */
    __u16 scanned;   /* header block bytes scanned so far */
    __u8 snd_seen;
    __u8 tail[3];    /* the last 3 header bytes scanned: a "\r\n\r\n" may straddle two segments */
    __u8 adopted;    /* open before its port was watched (lat_adopt): sockops mode has no state callback for it */
    __u8 pad[2];
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
 * them (4.8 KB a row, every tick) grows with the number of CPUs. The counters, 144 bytes a slot and one of them bumped
 * by every request, are per CPU: no cache line moves between CPUs for them. Their adds stay atomic, because a softirq
 * (the ingress program) can interrupt a program in process context (the sendmsg callback) on the same CPU. */
#ifndef LAT_SLOTS /* from the number of tenants, with room for reloads (qosagent/latency/bpfmaps.py) */
#define LAT_SLOTS 64
#endif
#define LAT_NCOUNTERS 18
/* Run-queue waits have rows of their own past the slots' kinds: LAT_RUNQ_ROW + LAT_RUNQ_SHARED for the processes
 * serving several tiers, then one per tier, numbered by the agent (qosagent/latency/slots.py); every serving process
 * counts in exactly one of them. */
#ifndef LAT_RUNQ_ROWS /* from the number of tiers, with room for reloads (qosagent/latency/bpfmaps.py) */
#define LAT_RUNQ_ROWS 8
#endif
#define LAT_RUNQ_ROW (LAT_SLOTS * LAT_KINDS)
#define LAT_RUNQ_SHARED 0

struct lat_row {
    __u64 sum_ns;
    __u64 count[QOS_HIST_NBUCKETS];
};

struct lat_counts {
    __u64 n[LAT_NCOUNTERS];
};

/* lat_gen[slot]: the slot's generation (qos_common.h); lat_gen[LAT_SLOTS] that of the run-queue rows, all of them. */
struct lat_tenant_key {
    __u32 tenant;
};

struct lat_slot_val {
    __u32 slot;
};

struct lat_pid_key {
    __u32 pid;
};

/* runq_tgids' value: the slot of the first socket the process was seen serving (of the first tenant's socket once
 * one comes, unmatched traffic being no tier's, lat_note_process), and whether it has served a tenant of
 * another tier since (lat_slot_tier said so then): the agent puts its threads in that slot's tier's run-queue row, or,
 * once it served several tiers, in the shared row, never in one tier's. */
struct lat_served {
    __u32 slot;
    __u32 several;
};

/* runq_pids' value (latency_runq.c): when the thread began waiting for a CPU (0 while it does not) and its run-queue
 * row (of LAT_RUNQ_ROWS), both written by the agent, the first stamped and cleared in place by the sched probes. */
struct lat_runq_val {
    __u64 since;
    __u32 row;
    __u32 pad;
};

/* lat_slot_tier[slot]: the run-queue row of the tier of the slot's tenant (LAT_RUNQ_SHARED where none), written by
 * the agent beside lat_slots. */
struct lat_tier_row {
    __u32 row;
};

BPF_ARRAY(lat_hist, struct lat_row, LAT_SLOTS * LAT_KINDS + LAT_RUNQ_ROWS);
BPF_PERCPU_ARRAY(lat_counters, struct lat_counts, LAT_SLOTS);
BPF_F_TABLE("array", int, struct qos_gen, lat_gen, LAT_SLOTS + 1, BPF_F_MMAPABLE); /* read by the agent in place */
BPF_HASH(lat_slots, struct lat_tenant_key, struct lat_slot_val, LAT_SLOTS);
/* Ports whose protocol runs requests concurrently on one connection (latency.multiplexed_ports). Without the
 * payload, overlapping requests cannot be told from one another, so these connections are counted, not timed. */
BPF_HASH(lat_mux_ports, struct qos_port_key, struct qos_watch_val, 1024);
/* Processes seen serving tracked sockets (by tgid), for the run-queue programs (latency_runq.c), which time their
 * threads, each in the row of the tiers it served. */
BPF_HASH(runq_tgids, struct lat_pid_key, struct lat_served, 1024);
BPF_ARRAY(lat_slot_tier, struct lat_tier_row, LAT_SLOTS);

/* A tenant's slot, looked up once per connection (and when a header rule claims it), never per request. Every
 * configured tenant has one; LAT_NO_SLOT would mean the agent's slots and the kernel's maps disagree. */
#define LAT_NO_SLOT 0xffff
static __always_inline __u16 lat_slot_of(__u32 tenant)
{
    struct lat_tenant_key k = {.tenant = tenant};
    struct lat_slot_val *v = lat_slots.lookup(&k);
    return v && v->slot < LAT_SLOTS ? (__u16)v->slot : LAT_NO_SLOT;
}

/* The slot's (or the run-queue row's, at LAT_SLOTS) rows changed: after the change, never before it. */
static __always_inline void lat_touched(__u32 i)
{
    qos_gen_bump(lat_gen.lookup(&i));
}

static __always_inline void lat_count(__u16 slot, __u32 what)
{
    __u32 i = slot == LAT_NO_SLOT ? 0 : slot;
    struct lat_counts *c = lat_counters.lookup(&i);
    if (c && what < LAT_NCOUNTERS) {
        __sync_fetch_and_add(&c->n[what], 1);
        lat_touched(i);
    }
}

/* One observation into lat_hist's row; 0 when there is no such row. */
static __always_inline int lat_hist_add(__u32 row, __u64 delta_ns)
{
    struct lat_row *r = lat_hist.lookup(&row);
    if (!r)
        return 0;
    __u32 b = qos_hist_index(delta_ns);
    /* clang knows b < QOS_HIST_NBUCKETS and would drop the check; the verifier needs to see it. */
    asm volatile("" : "+r"(b));
    if (b >= QOS_HIST_NBUCKETS)
        return 0;
    __sync_fetch_and_add(&r->count[b], 1);
    __sync_fetch_and_add(&r->sum_ns, delta_ns);
    return 1;
}

static __always_inline void lat_observe_row(__u32 row, __u64 delta_ns)
{
    if (lat_hist_add(row, delta_ns))
        lat_touched(row / LAT_KINDS);
}

/* An observation of a tenant without a slot is counted as lost (on the unmatched slot), never misattributed. */
static __always_inline void lat_observe(__u16 slot, __u16 kind, __u64 delta_ns)
{
    if (slot == LAT_NO_SLOT) {
        lat_count(slot, LAT_C_LOST);
        return;
    }
    lat_observe_row((__u32)slot * LAT_KINDS + kind, delta_ns);
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

static __always_inline __u32 lat_tier_row_of(__u32 slot)
{
    struct lat_tier_row *t = lat_slot_tier.lookup(&slot);
    return t ? t->row : LAT_RUNQ_SHARED;
}

/* Unmatched traffic (slot 0) and a tenant without a slot are no tier's: a probe, a scrape or a client outside every
 * tenant's network reaching a tier's server must not move it out of that tier's row. */
static __always_inline int lat_slot_tierless(__u32 slot)
{
    return slot == 0 || slot == LAT_NO_SLOT;
}

/* The current process serves a socket of slot's tenant (once per connection): noted with that slot when it is new,
 * or when it was noted with a tierless slot and now serves a tenant's; marked as serving several tiers when slot's
 * tier is not that of the tenant's slot it was noted with. A tierless slot never marks it: a process that only ever
 * served unmatched traffic stays in the unmatched row. Two first tenants of different tiers noted at once on two
 * CPUs may both overwrite a tierless slot, the later one kept and the process not marked: a lost update in a window
 * of instructions, for one process, until its next connection of the other tier marks it. */
static __always_inline void lat_note_process(__u16 slot)
{
    struct lat_pid_key k = {.pid = bpf_get_current_pid_tgid() >> 32};
    struct lat_served *p = runq_tgids.lookup(&k);
    if (!p) {
        struct lat_served first = {.slot = slot};
        if (runq_tgids.insert(&k, &first) == 0)
            return;
        p = runq_tgids.lookup(&k); /* noted meanwhile on another CPU, or the map is full */
        if (!p)
            return;
    }
    if (p->slot == slot || p->several || lat_slot_tierless(slot))
        return;
    if (lat_slot_tierless(p->slot))
        p->slot = slot;
    else if (lat_tier_row_of(p->slot) != lat_tier_row_of(slot))
        p->several = 1;
}

/* A fresh socket's state: its tenant, and whether its port is multiplexed. The tenant is resolved in the quota
 * classifier's order: the port claimed alone, the serving namespace (process and pods tenants), the client's address.
 * client and local are 16-byte addresses, IPv4 ones mapped; ports in host byte order. */
static __always_inline void lat_init_sock(struct lat_sock *s, __u16 lport, __u16 rport, const __u8 *client,
                                          const __u8 *local)
{
    s->tenant = qos_tenant_by_port(lport);
    if (s->tenant == QOS_UNMATCHED)
        s->tenant = lat_tenant_by_netns(lport, local);
    if (s->tenant == QOS_UNMATCHED)
        s->tenant = qos_tenant_by_addr(lport, client, 0);
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

/* Why the response that ends now has no time to first token, when it has none. */
static __always_inline void lat_count_no_ttft(struct lat_sock *s)
{
    if (s->resp == LAT_R_START)
        lat_count(s->slot, LAT_C_NOTTFT_UNSEEN);
    else if ((s->resp == LAT_R_HEAD || s->resp == LAT_R_BODY) && !s->body_ns)
        lat_count(s->slot, LAT_C_NOTTFT_NO_BODY);
}

/* The response in progress ends at its last write: the next request's bytes came, or the connection closes. */
static __always_inline void lat_finish_response(struct lat_sock *s)
{
    if (s->flags & LAT_F_UNTIMED)
        return;
    lat_count_no_ttft(s);
    lat_observe(s->slot, LAT_KIND_RESPONSE, s->last_send_ns - s->start_ns);
}

/* Request bytes came in (read, or arrived in sockops mode) on a timed socket. Bytes while a request is waiting
 * belong to it (a request in several segments or reads); sockops mode counts a next request line among them. */
static __always_inline void lat_request_bytes(struct lat_sock *s, __u64 start_ns, int overlapped)
{
    if (s->state == LAT_WAITING)
        return;
    if (s->state == LAT_RESPONDING)
        lat_finish_response(s);
    lat_request_tenant(s);
    s->start_ns = start_ns;
    s->state = LAT_WAITING;
    s->body_ns = 0;
    s->framing = LAT_FR_NONE;
    s->scanned = 0;
    if (overlapped) {
        s->flags = LAT_F_UNTIMED;
        s->resp = LAT_R_OFF;
        lat_count(s->slot, LAT_C_OVERLAPPED);
    } else {
        s->flags = 0;
        s->resp = LAT_R_START;
        lat_count(s->slot, LAT_C_STARTED);
    }
}

/* Response bytes written (send hooks) or seen leave (egress) on a timed socket, at now: the first of a response
 * gives its time to headers, whichever hook sees it first. */
static __always_inline void lat_response_bytes(struct lat_sock *s, __u64 now)
{
    if (s->state == LAT_WAITING) {
        if (!(s->flags & LAT_F_UNTIMED))
            lat_observe(s->slot, LAT_KIND_HEADERS, now - s->start_ns);
        s->state = LAT_RESPONDING;
    } else if (s->state == LAT_RESPONDING && s->arrived_ns) {
        s->flags |= LAT_F_OVERLAP;
    } else if (s->state == LAT_IDLE) {
        lat_count(s->slot, LAT_C_UNPAIRED_SEND);
        s->state = LAT_PUSHING;
    } else if (s->state == LAT_DONE) {
        return; /* a write whose bytes the egress program saw end the response before this hook ran */
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

#endif /* LAT_STATE_H */
