/* Per-tenant request latency from socket events, and run-queue latency of the processes serving those sockets.
 *
 * A server-side socket on a watched port is learned when it reaches ESTABLISHED (its tenant resolved once, then),
 * and forgotten at CLOSE. Each tracked socket runs a request/response state machine driven by the sizes the
 * application reads and writes: the first bytes read start a request, the first bytes written back give the time
 * to first byte, the last bytes written before the next read (or the close) end the response. See docs/latency.md
 * for what this can and cannot see.
 *
 * The socket read/write hooks are the sock_recv_length / sock_send_length raw tracepoints (>= 6.4) or, built with
 * QOS_KPROBE, kretprobes on tcp_recvmsg / tcp_sendmsg; both feed lat_recv() / lat_send(). Only tracepoint arguments
 * and UAPI types are used: `sk` is an opaque key, never dereferenced. */
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
#define LAT_WAITING 1    /* request bytes read, nothing written back yet */
#define LAT_RESPONDING 2 /* response bytes written */
#define LAT_PUSHING 3    /* bytes written with no request read first (server-first protocols) */
#define LAT_MUX 4        /* on a multiplexed port: requests overlap, the connection is counted and never timed */

/* Histogram kinds (mirrored in qosagent/latency/bpfmaps.py). */
#define LAT_KIND_TTFB 0
#define LAT_KIND_RESPONSE 1
#define LAT_KIND_RUNQ 2

/* Counters (mirrored in qosagent/latency/bpfmaps.py). Answered and completed requests are the TTFB and response
 * histogram counts: no counter of their own, one map update less per request. */
#define LAT_C_STARTED 1        /* requests started (first bytes read) */
#define LAT_C_UNPAIRED_SEND 3  /* write bursts with no request before them */
#define LAT_C_UNPAIRED_CLOSE 4 /* requests closed without any response byte */
#define LAT_C_EXTRA_READS 5    /* reads of more request bytes after the first, before any response byte */
#define LAT_C_CONNS 6          /* server-side connections tracked */
#define LAT_C_MUX_CONNS 7      /* of those, on multiplexed ports (HTTP/2, gRPC): requests overlap, not timed */
#define LAT_C_OVERLAPPED 8     /* requests whose bytes arrived while the previous response was still being written */
#define LAT_C_LOST 9           /* observations dropped because lat_hist was full */
#define LAT_C_UNTRACKED 10     /* connections not tracked: the socket table had no free slot for them */

#define MSG_PEEK_FLAG 2

struct lat_sock {
    __u64 start_ns;     /* the current request's first bytes: arrived at the socket, else read */
    __u64 last_send_ns; /* last bytes of the current response written */
    __u64 arrived_ns;   /* unread bytes of a next request arrived (QOS_ARRIVAL), 0 when none */
    __u32 tenant;
    __u16 state;
    __u8 noted;   /* the serving process is known to runq_tgids (checked once per connection, not per request) */
    __u8 flags;
#ifdef QOS_FLOWS_PIN
    struct qos_flow_key flow; /* set while the tenant is unresolved: a header rule may still claim the connection */
#endif
};

/* lat_sock.flags */
#define LAT_F_OVERLAP 1 /* the server wrote after a next request's bytes arrived: the client did not wait */
#define LAT_F_UNTIMED 2 /* the current request overlapped its predecessor: counted, not timed */

struct lat_hist_key {
    __u32 tenant;
    __u16 kind;
    __u16 bucket;
};

struct lat_hist_val {
    __u64 count;
    __u64 sum_ns;
};

struct lat_counter_key {
    __u32 tenant;
    __u32 what;
};

struct lat_counter_val {
    __u64 n;
};

struct lat_pid_key {
    __u32 pid;
};

struct lat_pid_val {
    __u64 v;
};

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

BPF_F_TABLE("percpu_hash", struct lat_hist_key, struct lat_hist_val, lat_hist, 16384, BPF_F_NO_PREALLOC);
BPF_F_TABLE("percpu_hash", struct lat_counter_key, struct lat_counter_val, lat_counters, 4096, BPF_F_NO_PREALLOC);
/* Ports whose protocol runs requests concurrently on one connection (latency.multiplexed_ports). Without the
 * payload, overlapping requests cannot be told from one another, so these connections are counted, not timed. */
BPF_HASH(lat_mux_ports, struct qos_port_key, struct qos_watch_val, 1024);
/* Processes seen serving tracked sockets (by tgid); the agent expands them to their threads in runq_pids, whose
 * value is the thread's wake-up time while it waits for a CPU (0 when it does not): stamping and clearing in place
 * spares an update and a delete per wait on the scheduler's hottest path. */
BPF_HASH(runq_tgids, struct lat_pid_key, struct lat_pid_val, 1024);
BPF_HASH(runq_pids, struct lat_pid_key, struct lat_pid_val, 65536);

static __always_inline void lat_count(__u32 tenant, __u32 what)
{
    struct lat_counter_key k = {.tenant = tenant, .what = what};
    struct lat_counter_val zero = {};
    struct lat_counter_val *v = lat_counters.lookup_or_try_init(&k, &zero);
    if (v)
        v->n += 1;
}

static __always_inline void lat_observe(__u32 tenant, __u16 kind, __u64 delta_ns)
{
    struct lat_hist_key k = {.tenant = tenant, .kind = kind, .bucket = (__u16)qos_hist_index(delta_ns)};
    struct lat_hist_val zero = {};
    struct lat_hist_val *v = lat_hist.lookup_or_try_init(&k, &zero);
    if (!v) {
        lat_count(tenant, LAT_C_LOST);
        return;
    }
    v->count += 1;
    v->sum_ns += delta_ns;
}

/* The tenant a request is counted under. Today the one resolved when the connection was established; a tenant
 * matched on request headers (learned per flow by quota's classifier) is to be looked up here, at request start. */
static __always_inline __u32 lat_request_tenant(struct lat_sock *s)
{
#ifdef QOS_FLOWS_PIN
    /* TC has classified the request's first segment before the server reads it, so its verdict is in place. */
    if (s->tenant == QOS_UNMATCHED) {
        struct qos_flow_val *v = tenant_flows.lookup(&s->flow);
        if (v && v->via == QOS_VIA_HEADER)
            return v->tenant;
    }
#endif
    return s->tenant;
}

static __always_inline void lat_note_process(void)
{
    struct lat_pid_key k = {.pid = bpf_get_current_pid_tgid() >> 32};
    if (runq_tgids.lookup(&k))
        return;
    struct lat_pid_val one = {.v = 1};
    runq_tgids.update(&k, &one);
}

static __always_inline void lat_finish_response(struct lat_sock *s)
{
    if (s->flags & LAT_F_UNTIMED)
        return;
    lat_observe(s->tenant, LAT_KIND_RESPONSE, s->last_send_ns - s->start_ns);
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
    if (s->state == LAT_WAITING) {
        lat_count(s->tenant, LAT_C_EXTRA_READS);
        return;
    }
    if (s->state == LAT_RESPONDING)
        lat_finish_response(s);
    s->tenant = lat_request_tenant(s);
    /* With the arrival clock the request's start is already stamped: no clock read (a helper call) here. */
    s->start_ns = s->arrived_ns ? s->arrived_ns : bpf_ktime_get_ns();
    s->arrived_ns = 0;
    s->state = LAT_WAITING;
    if (s->flags & LAT_F_OVERLAP) {
        s->flags = LAT_F_UNTIMED;
        lat_count(s->tenant, LAT_C_OVERLAPPED);
    } else {
        s->flags = 0;
        lat_count(s->tenant, LAT_C_STARTED);
    }
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
    __u64 now = bpf_ktime_get_ns();
    if (s->state == LAT_WAITING) {
        if (!(s->flags & LAT_F_UNTIMED))
            lat_observe(s->tenant, LAT_KIND_TTFB, now - s->start_ns);
        s->state = LAT_RESPONDING;
    } else if (s->state == LAT_RESPONDING && s->arrived_ns) {
        s->flags |= LAT_F_OVERLAP;
    } else if (s->state == LAT_IDLE) {
        lat_count(s->tenant, LAT_C_UNPAIRED_SEND);
        s->state = LAT_PUSHING;
    }
    s->last_send_ns = now;
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
        struct lat_sock s = {};
        /* the kernel stores IPv4 peers IPv4-mapped in daddr_v6 */
        /* Copied to the stack byte by byte: the verifier refuses loads through a ctx pointer moved by an offset. */
        __u8 client[16], via;
#pragma unroll
        for (int i = 0; i < 16; i++)
            client[i] = args->daddr_v6[i];
        s.tenant = qos_resolve_tenant(args->sport, client, &via);
#ifdef QOS_FLOWS_PIN
        if (s.tenant == QOS_UNMATCHED) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                s.flow.raddr[i] = client[i];
                s.flow.laddr[i] = args->saddr_v6[i];
            }
            s.flow.rport = args->dport;
            s.flow.lport = args->sport;
        }
#endif
        struct qos_port_key pk = {.port = args->sport};
        s.state = lat_mux_ports.lookup(&pk) ? LAT_MUX : LAT_IDLE;
        if (!lat_track(sk, &s)) {
            lat_count(s.tenant, LAT_C_UNTRACKED);
            return 0;
        }
        lat_count(s.tenant, LAT_C_CONNS);
        if (s.state == LAT_MUX)
            lat_count(s.tenant, LAT_C_MUX_CONNS);
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
    if (s->state == LAT_RESPONDING)
        lat_finish_response(s);
    else if (s->state == LAT_WAITING && !(s->flags & LAT_F_UNTIMED))
        lat_count(s->tenant, LAT_C_UNPAIRED_CLOSE);
    __sync_val_compare_and_swap(&t->sk[w], sk, 0); /* the slot is free again */
    return 0;
}

#ifdef QOS_ARRIVAL
/* Bytes queued on a tracked socket (>= 6.6). A request's clock starts when its first bytes arrive, not when the
 * application gets round to reading them: time in the socket's queue is part of what the client waits. */
RAW_TRACEPOINT_PROBE(sk_data_ready)
{
    struct lat_sock *s = lat_tracked(ctx->args[0]); /* TP_PROTO(const struct sock *sk) */
    if (!s || s->state == LAT_WAITING || s->state == LAT_MUX || s->arrived_ns)
        return 0;
    s->arrived_ns = bpf_ktime_get_ns();
    return 0;
}
#endif

#ifdef QOS_KPROBE
/* Kernels without the sock_*_length tracepoints: the same hooks from tcp_recvmsg / tcp_sendmsg, whose first
 * argument is the socket and whose return value is the byte count. The flags of tcp_recvmsg moved between kernel
 * versions, so MSG_PEEK reads are not filtered here (rare on servers; documented). */
/* The socket of each thread's tcp_recvmsg/tcp_sendmsg call in progress, for its return probe. */
struct kp_sock {
    __u64 sk;
};

BPF_F_TABLE("lru_hash", struct lat_pid_key, struct kp_sock, kp_sk, 16384, 0);

/* Entry of both tcp_recvmsg and tcp_sendmsg: remember the socket for the return probe. */
int kp_tcp_enter(struct pt_regs *ctx)
{
    struct lat_pid_key t = {.pid = (__u32)bpf_get_current_pid_tgid()};
    struct kp_sock k = {.sk = PT_REGS_PARM1(ctx)};
    if (lat_tracked(k.sk))
        kp_sk.update(&t, &k);
    return 0;
}

/* The tracked socket of this thread's call that returns now, or 0. */
static __always_inline __u64 kp_exit(void)
{
    struct lat_pid_key t = {.pid = (__u32)bpf_get_current_pid_tgid()};
    struct kp_sock *k = kp_sk.lookup(&t);
    if (!k)
        return 0;
    __u64 sk = k->sk;
    kp_sk.delete(&t);
    return sk;
}

int kp_tcp_recvmsg_ret(struct pt_regs *ctx)
{
    __u64 sk = kp_exit();
    if (sk)
        lat_recv(sk, (int)PT_REGS_RC(ctx), 0);
    return 0;
}

int kp_tcp_sendmsg_ret(struct pt_regs *ctx)
{
    __u64 sk = kp_exit();
    if (sk)
        lat_send(sk, (int)PT_REGS_RC(ctx));
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
    lat_observe(QOS_UNMATCHED, LAT_KIND_RUNQ, delta);
    return 0;
}
#endif
