/* Tracepoint mode (and its kprobe fallback, QOS_KPROBE, for kernels < 6.4): hooks that fire for every socket, state
 * in the socket table (lat_socktable.h) keyed by socket address. Connections are learned at ESTABLISHED and forgotten
 * at CLOSE (inet_sock_set_state); requests are seen read (sock_recv_length, or a kprobe on tcp_cleanup_rbuf) and, with
 * QOS_ARRIVAL, arrive (sk_data_ready, or a kprobe on sock_def_readable); responses are seen written (sock_send_length,
 * or a kprobe on tcp_sendmsg). With QOS_EGRESS the response's own bytes are read as they leave by the cgroup_skb
 * programs of latency_trace_skb.c, compiled with this file. Only tracepoint arguments are used: `sk` is an opaque key,
 * never dereferenced. */
#include "lat_state.h"
#include "lat_socktable.h"
#ifdef QOS_EGRESS
#include "lat_packet.h"
#endif

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    __u64 sk = (__u64)args->skaddr;
    if (args->newstate == BPF_TCP_ESTABLISHED) {
        /* Server side only: a child socket goes SYN_RECV -> ESTABLISHED; `sport` is then the listening port. */
        if (args->oldstate != BPF_TCP_SYN_RECV || !lat_port_tracked(args->sport))
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
