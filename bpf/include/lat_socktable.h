/* ---- tracepoint mode: hooks on every socket, state keyed by socket address ---------------------------------- */
/* Tracked sockets. A hash map would cost a call chain per lookup (~50-100 ns on machines with retpolines and return
 * thunks, and three lookups per request on the busiest path); instead a table of buckets of LAT_SOCK_WAYS slots,
 * chosen by a hash of the socket pointer, in BPF arrays, whose lookups the verifier inlines. lat_sock_tags holds
 * each slot's socket (0: free), lat_socks its state. A socket whose bucket is full is not tracked, and counted
 * (LAT_C_UNTRACKED): with 65 536 slots, about 3 in 1000 connections at 10 000 tracked at once. Sized by
 * latency.socket_slots. */
#ifndef LAT_SOCKTABLE_H
#define LAT_SOCKTABLE_H

#include "lat_state.h"

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
        lat_note_process(s->slot);
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
#endif /* QOS_EGRESS */

#endif /* LAT_SOCKTABLE_H */
