/* Per-tenant request latency from socket events, and run-queue latency of the processes serving those sockets.
 *
 * A server-side socket on a watched port is learned when it is established (its tenant resolved once, then), and
 * forgotten at its close. Each tracked socket runs a request/response state machine: the first request bytes
 * start a request, the first bytes written back give the time to headers, the last bytes written before the
 * next request (or the close) end the response. An egress program reads the response as it leaves: where its
 * header block ends (the first body byte is the time to first token), the gaps between its body writes (inter-token
 * latency), and its framing (Content-Length, the chunked end), which ends it at its last byte even when the
 * connection then stays idle. See docs/latency.md for what this can and cannot see.
 *
 * Two ways to get the events, chosen by the agent (qosagent/latency/capability.py):
 *  - QOS_SOCKOPS (>= 6.15): per-socket hooks. A sock_ops program on the cgroup2 root picks the server sockets at
 *    PASSIVE_ESTABLISHED and asks the kernel for their sendmsg callback (TX timestamping, SENDMSG only) and their
 *    state changes; cgroup_skb ingress and egress programs on the serving cgroups see request bytes arrive and
 *    response bytes leave. Every other socket on the host (clients, other services) costs nothing per request.
 *    State is socket local storage.
 *  - otherwise, tracepoints that fire for every socket: inet_sock_set_state, the sock_recv_length /
 *    sock_send_length raw tracepoints (>= 6.4) or, built with QOS_KPROBE, kprobes on tcp_cleanup_rbuf /
 *    tcp_sendmsg, and sk_data_ready (QOS_ARRIVAL, >= 6.6; with QOS_KPROBE a kprobe on sock_def_readable) for
 *    arrival. State is a table keyed by socket address; with QOS_EGRESS, a cgroup_skb egress program on the
 *    cgroup2 root finds a response's socket by its addresses.
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

/* Process and pods tenants (match.process, match.pods): connections to a serving network namespace (a pod), by the
 * local address and port of the server's socket. The key is the address because it is what every mode sees where a
 * connection is established: the inet_sock_set_state tracepoint (tracepoint and kprobe modes) carries the socket's
 * addresses and ports, never its namespace, and bpf_get_netns_cookie is refused to tracing programs; sock_ops and the
 * adopting ingress programs see the same addresses. Pods hold addresses of their own; loopback and link-local ones are
 * never entered (every namespace has them), so a pod's requests to itself over lo stay unmatched, as quota, which sees
 * a pod's traffic on its host-side veth, never sees them either. Written by the agent (qosagent/latency/pods.py) from
 * the addresses of the namespaces where watched ports listen, a tenant of any watched port under each of them: one
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
#define MSG_PEEK_FLAG 2

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
#ifndef LAT_SLOTS /* from the number of tenants, with room for reloads (qosagent/latency/capability.py) */
#define LAT_SLOTS 64
#endif
#define LAT_NCOUNTERS 18
#define LAT_RUNQ_ROW (LAT_SLOTS * LAT_KINDS) /* the rows of the slots' kinds; one more row, run-queue waits */

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

BPF_ARRAY(lat_hist, struct lat_row, LAT_SLOTS * LAT_KINDS + 1);
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

static __always_inline void lat_note_process(void)
{
    struct lat_pid_key k = {.pid = bpf_get_current_pid_tgid() >> 32};
    if (runq_tgids.lookup(&k))
        return;
    struct lat_pid_val one = {.v = 1};
    runq_tgids.update(&k, &one);
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

#if defined(QOS_SOCKOPS) || defined(QOS_EGRESS)
/* ---- responses read as they leave (cgroup_skb egress, both modes) ------------------------------------------- */
/* Server sockets write a response's status line and headers, then its body. For HTTP/1.x the first body byte is
 * what a streaming client calls its first token, and each later body write a next token (group). The send hooks
 * carry no payload, so the egress program reads it: the status line and header block of each response (their
 * bytes only, at most LAT_HDR_MAX of them), then nothing of the body but its framing's end. Everything here reads
 * packets through bpf_skb_load_bytes (payload sits in page fragments, out of direct reach) into a per-CPU buffer. */
#define LAT_ETH_P_IP 0x0800
#define LAT_ETH_P_IPV6 0x86DD
#define LAT_TCP_PSH 0x08
#ifndef LAT_SCAN
#define LAT_SCAN 512      /* header bytes scanned per segment */
#endif
#define LAT_HDR_MAX 4096  /* header bytes scanned per response, over its segments */

/* Eight bytes as one little-endian word, for comparing header text a word at a time. */
#define LAT_U64(a, b, c, d, e, f, g, h)                                                                            \
    ((__u64)(a) | (__u64)(b) << 8 | (__u64)(c) << 16 | (__u64)(d) << 24 | (__u64)(e) << 32 | (__u64)(f) << 40 |   \
     (__u64)(g) << 48 | (__u64)(h) << 56)
#define LAT_LOWER 0x2020202020202020ULL /* ORed in: ASCII letters to lower case (header names have any case) */
#define LAT_7BYTES 0x00ffffffffffffffULL
#define LAT_LOWER 0x2020202020202020ULL /* ORed in: ASCII letters to lower case (header names have any case) */
#define LAT_CANDS 8 /* words of a header block whose lines may name its framing, read by lat_framing */
#define LAT_CRLFCRLF 0x0a0d0a0dU

struct lat_tcp_head {
    __u16 sport;
    __u16 dport;
    __u32 seq;
    __u32 ack_seq;
    __u8 doff_res; /* data offset in the upper four bits */
    __u8 flags;
};

/* The TCP header of a cgroup_skb packet, read in place (TCP has pulled it into the linear area before socket
 * filters run, and on the way out it was built there), and where its payload is; *len is 0 when it carries none:
 * an ACK or a window update, most of what a busy connection's other direction sends. */
static __always_inline struct lat_tcp_head *lat_tcp(struct __sk_buff *skb, __u32 *off, __u32 *len)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    __u32 iphl;
    if (skb->protocol == bpf_htons(LAT_ETH_P_IP)) {
        __u8 *vihl = data;
        if ((void *)(vihl + 1) > data_end)
            return 0;
        iphl = (*vihl & 0xf) * 4;
    } else if (skb->protocol == bpf_htons(LAT_ETH_P_IPV6)) {
        iphl = 40; /* TCP right after the fixed header: extension headers on a TCP stream would be unusual */
    } else {
        return 0;
    }
    struct lat_tcp_head *th = data + iphl;
    if ((void *)(th + 1) > data_end)
        return 0;
    __u32 hl = iphl + (th->doff_res >> 4) * 4;
    *off = hl;
    *len = skb->len > hl ? skb->len - hl : 0;
    return th;
}

#define LAT_TCP_FIN 0x01
#define LAT_TCP_RST 0x04

/* ---- connections open before their port was watched ------------------------------------------------------------ */
/* At start, and after a reload that adds watched ports, the agent lists the established connections on watched
 * ports (sock_diag) and writes them here, by their addresses from the server's side. No hook saw them established,
 * and no per-socket hook can be turned on for them from outside, so each is taken under observation when its next
 * request's first segment arrives: by the ingress program in sockops mode (which then creates the socket's local
 * storage), by lat_adopt_ingress on the cgroup2 root otherwise (which enters it in the socket table before the
 * data-ready and read hooks run for that segment). */
#ifndef LAT_ADOPT_MAX
#define LAT_ADOPT_MAX 65536
#endif

struct lat_adopt_val {
    __u8 on;
};

BPF_F_TABLE("hash", struct qos_flow_key, struct lat_adopt_val, lat_adopt, LAT_ADOPT_MAX, BPF_F_NO_PREALLOC);
/* Connections established while the agent listed (lat_adopt_conf.listing): hooked already, so not to be adopted. */
BPF_F_TABLE("hash", struct qos_flow_key, struct lat_adopt_val, lat_fresh, 8192, BPF_F_NO_PREALLOC);

struct lat_adopt_cfg {
    __u32 adopting; /* lat_adopt has entries: only then is a segment of an untracked socket looked up there */
    __u32 listing;  /* the agent is listing open connections: note new ones in lat_fresh */
};

BPF_ARRAY(lat_adopt_conf, struct lat_adopt_cfg, 1);

static __always_inline struct lat_adopt_cfg *lat_adopt_config(void)
{
    __u32 zero = 0;
    return lat_adopt_conf.lookup(&zero);
}

static __always_inline int lat_adopting(void)
{
    struct lat_adopt_cfg *c = lat_adopt_config();
    return c && c->adopting;
}

static __always_inline void lat_flow_key(struct qos_flow_key *k, const __u8 *client, const __u8 *local, __u16 rport,
                                         __u16 lport)
{
    __builtin_memcpy(k->raddr, client, 16);
    __builtin_memcpy(k->laddr, local, 16);
    k->rport = rport;
    k->lport = lport;
}

/* A connection established now: while the agent lists the open ones, it must learn that this one is hooked. */
static __always_inline void lat_note_fresh(const __u8 *client, const __u8 *local, __u16 rport, __u16 lport)
{
    struct lat_adopt_cfg *c = lat_adopt_config();
    if (!c || !c->listing)
        return;
    struct qos_flow_key k = {};
    lat_flow_key(&k, client, local, rport, lport);
    struct lat_adopt_val on = {.on = 1};
    lat_fresh.update(&k, &on);
}

/* A TCP packet's connection from the server's side (remote: the client; IPv4 addresses mapped, ports in host order),
 * the key of lat_adopt, lat_fresh and lat_flows: leaving, the server is the source; arriving, the destination.
 * 0 when it is not TCP. */
static __always_inline int lat_packet_flow(struct __sk_buff *skb, const struct lat_tcp_head *th, int arriving,
                                           struct qos_flow_key *k)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    if (skb->protocol == bpf_htons(LAT_ETH_P_IP)) {
        __u8 *ip = data;
        if ((void *)(ip + 20) > data_end || ip[9] != IPPROTO_TCP)
            return 0;
        k->raddr[10] = k->raddr[11] = k->laddr[10] = k->laddr[11] = 0xff; /* IPv4-mapped, as the tracepoint has them */
        __builtin_memcpy(&k->laddr[12], ip + (arriving ? 16 : 12), 4);
        __builtin_memcpy(&k->raddr[12], ip + (arriving ? 12 : 16), 4);
    } else {
        __u8 *ip6 = data;
        if ((void *)(ip6 + 40) > data_end || ip6[6] != IPPROTO_TCP)
            return 0;
        __builtin_memcpy(k->laddr, ip6 + (arriving ? 24 : 8), 16);
        __builtin_memcpy(k->raddr, ip6 + (arriving ? 8 : 24), 16);
    }
    k->lport = bpf_ntohs(arriving ? th->dport : th->sport);
    k->rport = bpf_ntohs(arriving ? th->sport : th->dport);
    return 1;
}

/* Whether the connection of an arriving segment awaits adoption; it is then taken off the list (by one CPU only). */
static __always_inline int lat_adopt_take(struct __sk_buff *skb, const struct lat_tcp_head *th, struct qos_flow_key *k)
{
    return lat_packet_flow(skb, th, 1, k) && lat_adopt.lookup(k) && lat_adopt.delete(k) == 0;
}

/* An adopted connection's counts: tracked (and adopted), or not for want of room. */
static __always_inline void lat_count_adopted(const struct lat_sock *s, int tracked)
{
    lat_count_conn(s, tracked);
    if (tracked)
        lat_count(s->slot, LAT_C_ADOPTED);
}

/* b[0..2] hold the last bytes of the header block's previous segment, b[3..] this segment's scanned bytes; the
 * slack after them lets every word compare read whole words without a bounds check of its own. */
/* A read of the scan's end that clang may not keep in a register (see struct lat_scan). */
#define LAT_SCAN_END(buf) (*(volatile __u32 *)&(buf)->end)


struct lat_scan {
    __u8 b[2 * LAT_SCAN + 16];
    /* b's first index past the scanned bytes. Compared from memory each time: a register compared with every byte
     * index would split the verifier's states at each one. */
    __u32 end;
    __u32 found; /* the '\n' that ends the header block, 0: not in these bytes */
    __u32 ncands;                /* words with lines that may name the framing */
    __u32 cand_at[LAT_CANDS];    /* where each such word starts in b */
    __u64 cand_mask[LAT_CANDS];  /* its '\n' bytes (0x80) followed by such a line */
    __u32 length_at;             /* where a Content-Length value starts in b, 0: none */
    /* What lat_egress_framing goes on with: the segment's body bytes after the header block. */
    __u32 rest_off;
    __u32 rest_len;
    __u64 now;
    __u64 sk; /* tracepoint mode: the socket's key in the table (lat_egress sets it) */
    __u8 psh;
};

BPF_PROG_ARRAY(lat_tail, 1); /* lat_egress_framing, put there by the agent */

BPF_PERCPU_ARRAY(lat_scan_buf, struct lat_scan, 1);

/* The response's status line, at b[3..]: HTTP/1.x and a three-digit code; 0 when it is not one. Interim (1xx)
 * and bodiless (204, 304) responses are marked in framing: a header block's own framing lines cannot change
 * that. 101 hands the connection to another protocol: not a response to parse. */
static __always_inline int lat_status_line(struct lat_scan *buf, __u32 n, struct lat_sock *s)
{
    if (n < 12)
        return 0;
    if ((*(__u64 *)&buf->b[3] & LAT_7BYTES) != LAT_U64('H', 'T', 'T', 'P', '/', '1', '.', 0) || buf->b[11] != ' ')
        return 0;
    __u8 c0 = buf->b[12], c1 = buf->b[13], c2 = buf->b[14];
    if (c0 < '1' || c0 > '5' || c1 < '0' || c1 > '9' || c2 < '0' || c2 > '9')
        return 0;
    if (c0 == '1') {
        if (c1 == '0' && c2 == '1')
            return 0;
        s->framing = LAT_FR_INTERIM;
    } else if ((c0 == '2' || c0 == '3') && c1 == '0' && c2 == '4') {
        s->framing = LAT_FR_EMPTY;
    } else {
        s->framing = LAT_FR_NONE;
    }
    return 1;
}

/* 0x80 in each byte of x that equals c (in every byte of cs), 0 in the others; exact (no carries across bytes). */
static __always_inline __u64 lat_bytes_eq(__u64 x, __u64 cs)
{
    __u64 y = x ^ cs;
    return ~(((y & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | y | 0x7f7f7f7f7f7f7f7fULL);
}

/* 1 when x is 0, else 0, without a branch (BPF has no set-on-condition: a comparison's value is a jump). */
#define LAT_IS0(x) ((((x) | -(x)) >> 63) ^ 1)
#define LAT_CRS 0x0d0d0d0d0d0d0d0dULL
#define LAT_LFS 0x0a0a0a0a0a0a0a0aULL
#define LAT_CS 0x6363636363636363ULL /* 'c' */
#define LAT_TS 0x7474747474747474ULL /* 't' */

/* Scans b[3..3 + n) for the end of the header block ("\r\n\r\n", which may begin in b[0..2], the previous
 * segment's last bytes): returns the index in b of its '\n', 0 when it does not end in these bytes. Eight positions
 * at a time and without a branch on the bytes but one that rejoins at once: the verifier walks every path through a
 * loop's rounds, and a branch per byte or per line makes their number grow with the bytes scanned. */
static __always_inline __u32 lat_scan_head(struct lat_scan *buf, __u32 n)
{
    buf->end = 3 + n;
    buf->found = buf->ncands = 0;
    for (__u32 j = 3; j < 3 + LAT_SCAN; j += 8) {
        if (j >= LAT_SCAN_END(buf) || *(volatile __u32 *)&buf->found)
            break;
        /* Most words hold no '\n', and all that is looked for ends or follows one: skipped after one compare. Both
         * ways lead to the next round in the same state, so this branch does not multiply the verifier's paths. */
        __u64 lf = lat_bytes_eq(*(__u64 *)&buf->b[j], LAT_LFS);
        if (!lf)
            continue;
        /* Bit 8t+7 of e: b[j+t-3..j+t] is "\r\n\r\n", for t = 0..7 (four unaligned loads, no carry between rounds). */
        __u64 e = lf & lat_bytes_eq(*(__u64 *)&buf->b[j - 1], LAT_CRS) & lat_bytes_eq(*(__u64 *)&buf->b[j - 2], LAT_LFS) &
                  lat_bytes_eq(*(__u64 *)&buf->b[j - 3], LAT_CRS);
        /* The first such t, also without branches: the lowest set bit, 1 << (8t + 7), shifted down to 1 << 8t and
         * multiplied by bytes 0..7 puts byte 7 - t of them on top. */
        __u64 t = 7 - ((((e & -e) >> 7) * 0x0706050403020100ULL) >> 56);
        __u64 hit = (e | -e) >> 63;                        /* a match in this word */
        __u64 first = ((__u64)buf->found - 1) >> 63;       /* none before (found is 0) */
        __u64 in = ((__u64)j + t - LAT_SCAN_END(buf)) >> 63; /* inside the bytes scanned */
        __u64 take = hit & first & in;
        /* clang must not learn that take is 0 or 1: it would turn the product back into a branch. */
        asm volatile("" : "+r"(take));
        buf->found += take * (j + t);
        /* Lines of this word that may name the framing: after a '\n', a 'c' (Content-Length) or a 't'
         * (Transfer-Encoding), any case. Their word is noted (at most LAT_CANDS words) for lat_framing. */
        __u64 after = *(__u64 *)&buf->b[j + 1] | LAT_LOWER;
        __u64 m = lf & (lat_bytes_eq(after, LAT_CS) | lat_bytes_eq(after, LAT_TS));
        __u32 c = buf->ncands;
        buf->cand_mask[c & (LAT_CANDS - 1)] = m;
        buf->cand_at[c & (LAT_CANDS - 1)] = j;
        __u64 some = (m | -m) >> 63;
        asm volatile("" : "+r"(some));
        buf->ncands = c + some;
    }
    return *(volatile __u32 *)&buf->found;
}

/* The framing of a header block that ended in this segment, from its Content-Length or Transfer-Encoding line
 * (when it lies wholly in these bytes, within the first LAT_CANDS candidate words), unless its status decided
 * already. Chunked wins over a length (RFC 9112 6.3). */
static __always_inline void lat_framing(struct lat_scan *buf, struct lat_sock *s)
{
    if (s->framing != LAT_FR_NONE)
        return;
    /* Without branches, as the scan: a branch per candidate made the verifier's paths multiply past its limit. */
    __u64 length_at = 0, chunked = 0, found = *(volatile __u32 *)&buf->found, ncands = buf->ncands;
#pragma nounroll
    for (__u32 c = 0; c < LAT_CANDS; c++) {
        if (c >= ncands)
            break;
        __u64 m = buf->cand_mask[c];
        /* The first candidate line of the word: two framing lines are at least 16 bytes apart. */
        __u32 q = buf->cand_at[c] + 8 - ((((m & -m) >> 7) * 0x0706050403020100ULL) >> 56); /* as in the scan */
        /* The mask says to the verifier what the scan ensures: a line starts inside b. */
        asm volatile("" : "+r"(q));
        q &= 2 * LAT_SCAN - 1;
        __u64 ok = ((__u64)q + 17 - found) >> 63; /* q + 18 <= found: the line lies in the header block */
        __u64 w0 = *(__u64 *)&buf->b[q] | LAT_LOWER;
        __u64 w1 = *(__u64 *)&buf->b[q + 8] | LAT_LOWER;
        __u64 w2 = *(__u64 *)&buf->b[q + 16] | LAT_LOWER;
        __u64 w3 = *(__u32 *)&buf->b[q + 24] | 0x20202020;
        __u64 is_len = ok & LAT_IS0((w0 ^ LAT_U64('c', 'o', 'n', 't', 'e', 'n', 't', '-')) |
                                    ((w1 & LAT_7BYTES) ^ LAT_U64('l', 'e', 'n', 'g', 't', 'h', ':', 0)));
        /* "Transfer-Encoding: chunked" and its CRLF ('\r' | 0x20 is '-', '\n' | 0x20 is '*'). */
        __u64 is_chunked = ok & LAT_IS0((w0 ^ LAT_U64('t', 'r', 'a', 'n', 's', 'f', 'e', 'r')) |
                                        (w1 ^ LAT_U64('-', 'e', 'n', 'c', 'o', 'd', 'i', 'n')) |
                                        (w2 ^ LAT_U64('g', ':', ' ', 'c', 'h', 'u', 'n', 'k')) |
                                        (w3 ^ ('e' | 'd' << 8 | '-' << 16 | '*' << 24)));
        /* clang must not learn that these are 0 or 1: it would turn the products back into branches. */
        asm volatile("" : "+r"(is_len));
        chunked |= is_chunked;
        length_at += is_len * (q + 15 - length_at);
    }
    if (chunked) {
        s->framing = LAT_FR_CHUNKED;
        return;
    }
    buf->length_at = length_at;
    __u32 q = buf->length_at;
    asm volatile("" : "+r"(q));
    q &= 2 * LAT_SCAN - 1;
    if (!q)
        return;
    if (buf->b[q] == ' ')
        q++;
    /* Up to nine digits (999 999 999 bytes; a longer body's end is left to what comes next), read without
     * branches: each way out of this loop would be one more path through all that follows, for the verifier. */
    __u64 v = 0, digits = 0, run = 1;
#pragma unroll
    for (int i = 0; i < 9; i++) {
        __u64 d = (__u64)(buf->b[q + i] - '0') & 0xff;
        run &= ((d - 10) >> 63) & ((q + i - (__u64)*(volatile __u32 *)&buf->found) >> 63);
        v = v * (1 + 9 * run) + run * d;
        digits += run;
    }
    asm volatile("" : "+r"(digits));
    digits &= 15;
    if (!digits || buf->b[q + digits] != '\r')
        return;
    s->framing = v ? LAT_FR_LENGTH : LAT_FR_EMPTY;
    s->body_left = v;
}

/* The response ends at its last byte, now, as its framing says: it is counted, and the connection awaits the
 * next request. */
static __always_inline void lat_complete(struct lat_sock *s, __u64 now)
{
    lat_observe(s->slot, LAT_KIND_RESPONSE, now - s->start_ns);
    lat_count(s->slot, LAT_C_FRAMED);
    s->resp = LAT_R_DONE;
    s->state = LAT_DONE;
}

/* Whether the body bytes [off, off + len) end with the zero-size chunk that ends a chunked body (no trailers). */
static __always_inline int lat_chunked_end(struct __sk_buff *skb, __u32 off, __u32 len)
{
    __u64 t = 0;
    if (len >= 7) {
        if (bpf_skb_load_bytes(skb, off + len - 7, &t, 7))
            return 0;
        return t == LAT_U64('\r', '\n', '0', '\r', '\n', '\r', '\n', 0);
    }
    if (len == 5) {
        if (bpf_skb_load_bytes(skb, off, &t, 5))
            return 0;
        return t == LAT_U64('0', '\r', '\n', '\r', '\n', 0, 0, 0);
    }
    return 0;
}

/* Body bytes [off, off + len) of the current response leave at now. The first is its time to first token; each
 * later segment that ends a write (TCP sets PSH where a write ends) is a next token (group). */
static __always_inline void lat_body(struct __sk_buff *skb, struct lat_sock *s, __u32 off, __u32 len, __u8 psh,
                                     __u64 now)
{
    if (!s->body_ns) {
        lat_observe(s->slot, LAT_KIND_TTFT, now - s->start_ns);
        s->body_ns = now;
    } else if (psh) {
        lat_observe(s->slot, LAT_KIND_ITL, now - s->body_ns);
        s->body_ns = now;
    }
    if (s->framing == LAT_FR_LENGTH) {
        if (len < s->body_left) {
            s->body_left -= len;
            return;
        }
    } else if (s->framing != LAT_FR_CHUNKED || !psh || !lat_chunked_end(skb, off, len)) {
        return;
    }
    lat_complete(s, now);
}

/* Response bytes [off, off + len) of skb, new on the wire, leave a tracked socket. */
static __always_inline void lat_response_segment(struct __sk_buff *skb, struct lat_sock *s, __u32 off, __u32 len,
                                                 __u8 psh)
{
    if (s->state != LAT_WAITING && s->state != LAT_RESPONDING)
        return; /* idle, pushing, done: nothing of a request's to time (the send hooks count unpaired writes) */
    __u64 now = bpf_ktime_get_ns();
    if (s->resp == LAT_R_BODY) {
        lat_response_bytes(s, now);
        lat_body(skb, s, off, len, psh, now);
        return;
    }
    __u32 zero = 0;
    struct lat_scan *buf = lat_scan_buf.lookup(&zero);
    /* 1 to LAT_SCAN - 1 bytes, and the size passed is bounded by arithmetic on itself: clang knows the bounds and
     * would drop a mask, or merge "0 < n <= max" into one compare of n - 1, and older verifiers (6.1) see no range
     * through that, nor from a compare of a copy of n reloaded from the stack. */
    __u32 n = len < LAT_SCAN ? len : LAT_SCAN - 1;
    asm volatile("" : "+r"(n));
    n &= LAT_SCAN - 1;
    __u32 size = n;
    asm volatile("" : "+r"(size));
    size = ((size - 1) & (LAT_SCAN - 1)) + 1;
    if ((s->resp != LAT_R_START && s->resp != LAT_R_HEAD) || !buf || n == 0 ||
        bpf_skb_load_bytes(skb, off, &buf->b[3], size)) {
        lat_response_bytes(s, now);
        return;
    }
    if (s->resp == LAT_R_START) {
        if (!lat_status_line(buf, n, s)) {
            s->resp = LAT_R_OFF;
            lat_count(s->slot, LAT_C_NOTTFT_NOT_HTTP);
            lat_response_bytes(s, now);
            return;
        }
        buf->b[0] = buf->b[1] = buf->b[2] = 0;
        s->resp = LAT_R_HEAD;
        s->scanned = 0;
    } else {
        buf->b[0] = s->tail[0];
        buf->b[1] = s->tail[1];
        buf->b[2] = s->tail[2];
    }
    /* An interim response is not the response: the request still waits (and its body may still arrive). */
    if (s->framing != LAT_FR_INTERIM)
        lat_response_bytes(s, now);
    __u32 p = lat_scan_head(buf, n);
    if (!p) {
        s->scanned += n;
        if (n < len || s->scanned > LAT_HDR_MAX) {
            s->resp = LAT_R_OFF;
            lat_count(s->slot, LAT_C_NOTTFT_LONG);
            return;
        }
        s->tail[0] = buf->b[n];
        s->tail[1] = buf->b[n + 1];
        s->tail[2] = buf->b[n + 2];
        return;
    }
    __u32 used = p - 2; /* b[3..p]: this segment's bytes up to the header block's end */
    if (s->framing == LAT_FR_INTERIM) {
        lat_count(s->slot, LAT_C_INTERIM);
        s->framing = LAT_FR_NONE;
        s->resp = LAT_R_START;
        if (used < len) { /* the final response in the same segment: its status line is not where we look */
            s->resp = LAT_R_OFF;
            lat_count(s->slot, LAT_C_NOTTFT_NOT_HTTP);
            lat_response_bytes(s, now);
        }
        return;
    }
    if (s->framing == LAT_FR_EMPTY) {
        lat_count(s->slot, LAT_C_NOTTFT_NO_BODY);
        lat_complete(s, now);
        return;
    }
    s->resp = LAT_R_BODY;
    buf->rest_off = off + used;
    buf->rest_len = used < len ? len - used : 0;
    buf->psh = psh;
    buf->now = now;
    /* The framing is read by a program of its own (lat_egress_framing), which then goes on with this segment's
     * body bytes: verified apart, its paths do not multiply with this one's. When the header block ended in a later
     * segment than it began (its lines were not all scanned here), or the call fails, the end comes from what follows. */
    if (!s->scanned)
        lat_tail.call(skb, 0);
    if (used < len)
        lat_body(skb, s, off + used, len - used, psh, now);
}

/* The rest of a segment whose header block ended in it (lat_response_segment): its framing, then its body bytes. */
static __always_inline void lat_framing_and_body(struct __sk_buff *skb, struct lat_scan *buf, struct lat_sock *s)
{
    lat_framing(buf, s);
    __u32 len = buf->rest_len;
    if (len)
        lat_body(skb, s, buf->rest_off, len, buf->psh, buf->now);
}

/* Payload of a tracked socket leaves: the part not seen before (a retransmission, or a packet the learner and a
 * serving cgroup's program both see, brings nothing new) is response bytes. */
static __always_inline void lat_leaving(struct __sk_buff *skb, struct lat_sock *s, __u32 seq, __u8 psh, __u32 off,
                                        __u32 len)
{
    __u32 end = seq + len;
    if (s->snd_seen) {
        if ((__s32)(end - s->snd_end) <= 0)
            return;
        __u32 seen = s->snd_end - seq;
        if ((__s32)seen > 0) {
            off += seen;
            len -= seen;
        }
    }
    s->snd_seen = 1;
    s->snd_end = end;
    lat_response_segment(skb, s, off, len, psh);
}
#endif

#ifdef QOS_SOCKOPS
/* ---- sockops mode: per-socket hooks ------------------------------------------------------------------------- */
/* Kernel ABI values newer than the UAPI headers BCC compiles against (include/uapi/linux/bpf.h, 6.15). */
#define LAT_SOL_SOCKET 1
#define LAT_SK_BPF_CB_FLAGS 1009
#define LAT_SK_BPF_CB_TX_TIMESTAMPING 1
#define LAT_OPS_TSTAMP_SENDMSG_CB 20
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
    __u16 rport16 = (__u16)bpf_ntohl(rport);
    lat_note_fresh(client, local, rport16, lport);
    lat_init_sock(&init, lport, rport16, client, local);
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
    s->snd_end = skops->snd_nxt;
    s->snd_seen = 1;
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
    /* A request's response is timed by the egress program, linked wherever the ingress program is; writes with no
     * request before them are counted here. */
    if (s->state == LAT_IDLE || s->state == LAT_PUSHING)
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

/* The state of the tracked socket a TCP segment with payload (or with one of the `ends` flags: an adopted socket's
 * close) belongs to, with its header and where its payload is; 0 for anything else. Headers first: most segments of
 * a busy connection's other direction are pure ACKs, and telling them apart is cheaper than the storage lookup. No
 * bpf_sk_fullsock() before that: the lookup takes a sock_common and answers NULL for request and time-wait sockets
 * itself, and a helper call costs ~15 ns here. */
static __always_inline struct lat_sock *lat_segment(struct __sk_buff *skb, struct lat_tcp_head **th,
                                                    struct bpf_sock **sk, __u32 *off, __u32 *len, __u8 ends)
{
    *th = lat_tcp(skb, off, len);
    *sk = skb->sk;
    if (!*th || !*sk || (!*len && !((*th)->flags & ends)))
        return 0;
    return lat_sk.sk_storage_get(*sk, 0, 0);
}

/* The first request segment of a connection the agent found open (lat_adopt): its state, created here, as the
 * sock_ops program would have at its establishment; 0 when it is none of those. The per-socket sendmsg and state
 * callbacks cannot be turned on from here (bpf_setsockopt is for sock_ops): the egress program times its responses,
 * and its close is seen as its FIN or RST go by (lat_adopted_closed). Its bytes from this segment on are new. */
static __always_inline struct lat_sock *lat_adopt_sock(struct __sk_buff *skb, const struct lat_tcp_head *th,
                                                       struct bpf_sock *sk)
{
    struct qos_flow_key k = {};
    if (!lat_adopting() || !lat_adopt_take(skb, th, &k))
        return 0;
    struct lat_sock init = {};
    lat_init_sock(&init, k.lport, k.rport, k.raddr, k.laddr);
    init.adopted = 1;
    if (init.state == LAT_MUX) {
        lat_count_adopted(&init, 1); /* counted, never timed: no state, as at establishment */
        return 0;
    }
    struct lat_sock *s = lat_sk.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
    lat_count_adopted(&init, s != 0);
    if (!s)
        return 0;
    *s = init;
    s->rcv_end = bpf_ntohl(th->seq);
    return s;
}

/* An adopted socket's FIN or RST went by: it closes as the state callback would have closed it. */
static __always_inline void lat_adopted_closed(struct bpf_sock *sk, struct lat_sock *s)
{
    if (!s->adopted)
        return;
    lat_closed(s);
    lat_sk.sk_storage_delete(sk);
}

/* Whether payload at off starts with an HTTP/1.x request line: evidence of a pipelined request when it comes while
 * one is still waiting for its response (rather than the rest of that request: its body, more of its headers). */
static __always_inline int lat_request_line(struct __sk_buff *skb, __u32 off)
{
    __u32 m = 0;
    if (bpf_skb_load_bytes(skb, off, &m, 4))
        return 0;
    return m == ('G' | 'E' << 8 | 'T' << 16 | ' ' << 24) || m == ('P' | 'O' << 8 | 'S' << 16 | 'T' << 24) ||
           m == ('P' | 'U' << 8 | 'T' << 16 | ' ' << 24) || m == ('H' | 'E' << 8 | 'A' << 16 | 'D' << 24) ||
           m == ('D' | 'E' << 8 | 'L' << 16 | 'E' << 24) || m == ('P' | 'A' << 8 | 'T' << 16 | 'C' << 24) ||
           m == ('O' | 'P' << 8 | 'T' << 16 | 'I' << 24);
}

/* Request bytes reaching a tracked socket, on the serving cgroups: the request's clock starts at arrival, as it
 * does with the sk_data_ready hook in tracepoint mode. Always lets the packet through. This runs before TCP has
 * checked the sequence numbers: rcv_end keeps a retransmitted or reordered old segment from starting a request. */
static __always_inline int lat_arrival(struct __sk_buff *skb, int learn)
{
    __u32 off, len;
    struct lat_tcp_head *th;
    struct bpf_sock *sk;
    /* A client's FIN is no close: the server may still answer a half-closed connection. Its RST is. */
    struct lat_sock *s = lat_segment(skb, &th, &sk, &off, &len, LAT_TCP_RST);
    if (!s && (!th || !sk || !len || !(s = lat_adopt_sock(skb, th, sk))))
        return 1;
    if (learn)
        lat_note_cgroup_id(bpf_sk_cgroup_id(sk), 0);
    if (!len) {
        lat_adopted_closed(sk, s);
        return 1;
    }
    __u32 seq = bpf_ntohl(th->seq), end = seq + len;
    if ((__s32)(end - s->rcv_end) <= 0)
        return 1; /* nothing new: a retransmission, a keepalive probe, or a segment both ingress programs see */
    if (s->state == LAT_WAITING && seq == s->rcv_end && lat_request_line(skb, off))
        lat_count(s->slot, LAT_C_PIPELINED);
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

/* Response bytes leaving a tracked socket. */
static __always_inline int lat_departure(struct __sk_buff *skb)
{
    __u32 off, len;
    struct lat_tcp_head *th;
    struct bpf_sock *sk;
    struct lat_sock *s = lat_segment(skb, &th, &sk, &off, &len, LAT_TCP_FIN | LAT_TCP_RST);
    if (!s)
        return 1;
    if (!len) {
        lat_adopted_closed(sk, s); /* the server's FIN or RST: it writes no more */
        return 1;
    }
    lat_leaving(skb, s, bpf_ntohl(th->seq), th->flags & LAT_TCP_PSH, off, len);
    return 1;
}

/* On the serving cgroups, beside lat_ingress. */
int lat_egress(struct __sk_buff *skb)
{
    return lat_departure(skb);
}

/* On the cgroup2 root while lat_ingress_learn is: the responses of servers found by the learner. A program of its
 * own, so that its runs (every packet on the host leaves through it) are told from the steady state's. */
int lat_egress_learn(struct __sk_buff *skb)
{
    return lat_departure(skb);
}

/* Tail-called by lat_egress when a response's header block ends (see lat_response_segment). */
int lat_egress_framing(struct __sk_buff *skb)
{
    __u32 zero = 0;
    struct lat_scan *buf = lat_scan_buf.lookup(&zero);
    struct bpf_sock *sk = skb->sk;
    struct lat_sock *s = sk ? lat_sk.sk_storage_get(sk, 0, 0) : 0;
    if (buf && s)
        lat_framing_and_body(skb, buf, s);
    return 1;
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
    if (!s)
        return;
#ifdef QOS_EGRESS
    /* Once the egress program has seen this connection's bytes leave it times its responses: it runs inside the
     * write, before this hook, and it can tell an interim response from the response. */
    if (s->snd_seen && s->state != LAT_IDLE && s->state != LAT_PUSHING)
        return;
#endif
    lat_response_bytes(s, bpf_ktime_get_ns());
}

#ifdef QOS_EGRESS
/* Tracked connections by their addresses, for the egress program: a packet names its socket only as a pointer the
 * program may not turn into the table's key. Written at ESTABLISHED and removed at CLOSE. */
struct lat_flow_sk {
    __u64 sk;
};

BPF_F_TABLE("hash", struct qos_flow_key, struct lat_flow_sk, lat_flows, LAT_MAX_SOCKS, BPF_F_NO_PREALLOC);

/* Response bytes leaving any socket, on the cgroup2 root: those of tracked connections go to the parser. */
int lat_egress(struct __sk_buff *skb)
{
    __u32 off, len;
    struct lat_tcp_head *th = lat_tcp(skb, &off, &len);
    struct qos_flow_key k = {};
    if (!th || !len || !lat_packet_flow(skb, th, 0, &k))
        return 1;
    __u32 seq = bpf_ntohl(th->seq);
    __u8 psh = th->flags & LAT_TCP_PSH;
    struct lat_flow_sk *f = lat_flows.lookup(&k);
    struct lat_sock *s = f ? lat_tracked(f->sk) : 0;
    __u32 zero = 0;
    struct lat_scan *buf = lat_scan_buf.lookup(&zero);
    if (!s || s->state == LAT_MUX || !buf)
        return 1;
    buf->sk = f->sk;
    lat_leaving(skb, s, seq, psh, off, len);
    return 1;
}

/* Tail-called by lat_egress when a response's header block ends (see lat_response_segment). */
int lat_egress_framing(struct __sk_buff *skb)
{
    __u32 zero = 0;
    struct lat_scan *buf = lat_scan_buf.lookup(&zero);
    struct lat_sock *s = buf ? lat_tracked(buf->sk) : 0;
    if (buf && s)
        lat_framing_and_body(skb, buf, s);
    return 1;
}

struct lat_sk_word {
    __u64 sk;
};

BPF_PERCPU_ARRAY(lat_sk_words, struct lat_sk_word, 1);

/* The socket table's key for a packet's socket: the address of the kernel's struct sock, as the tracepoints pass it.
 * The verifier keeps a socket pointer a pointer (no arithmetic, no hashing) until it has been through memory; a
 * privileged loader (the agent is root) may store it in a map and read it back as a number. Never dereferenced. */
static __always_inline __u64 lat_sock_key(struct bpf_sock *sk)
{
    __u32 zero = 0;
    struct lat_sk_word *w = lat_sk_words.lookup(&zero);
    if (!w)
        return 0;
    w->sk = (__u64)sk;
    return *(volatile __u64 *)&w->sk;
}

/* Linked on the cgroup2 root while connections the agent found open await their first request (lat_adopt): the
 * first segment of that request enters the socket in the table, before the data-ready and read hooks run for it, so
 * the request is timed from its arrival as on any tracked connection. */
int lat_adopt_ingress(struct __sk_buff *skb)
{
    __u32 off, len;
    struct lat_tcp_head *th = lat_tcp(skb, &off, &len);
    struct bpf_sock *bsk = skb->sk;
    struct qos_flow_key k = {};
    if (!th || !len || !bsk || !lat_adopting() || !lat_adopt_take(skb, th, &k))
        return 1;
    __u64 sk = lat_sock_key(bsk);
    if (!sk || lat_tracked(sk))
        return 1; /* established while the agent listed: tracked since */
    struct lat_sock init = {};
    lat_init_sock(&init, k.lport, k.rport, k.raddr, k.laddr);
    init.adopted = 1;
    int tracked = lat_track(sk, &init);
    lat_count_adopted(&init, tracked);
    if (tracked && init.state != LAT_MUX) {
        struct lat_flow_sk f = {.sk = sk};
        lat_flows.update(&k, &f);
    }
    return 1;
}
#endif

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
#ifdef QOS_EGRESS
        lat_note_fresh(client, local, args->dport, args->sport);
#endif
        lat_init_sock(&s, args->sport, args->dport, client, local);
        int tracked = lat_track(sk, &s);
        lat_count_conn(&s, tracked);
#ifdef QOS_EGRESS
        if (tracked && s.state != LAT_MUX) {
            struct qos_flow_key k = {};
            struct lat_flow_sk f = {.sk = sk};
            lat_flow_key(&k, client, local, args->dport, args->sport);
            lat_flows.update(&k, &f);
        }
#endif
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
#ifdef QOS_EGRESS
    {
        __u8 client[16], local[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            client[i] = args->daddr_v6[i];
            local[i] = args->saddr_v6[i];
        }
        struct qos_flow_key k = {};
        lat_flow_key(&k, client, local, args->dport, args->sport);
        lat_flows.delete(&k);
    }
#endif
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
