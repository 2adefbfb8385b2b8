/* Tracepoint mode's cgroup_skb programs, on the cgroup2 root (built with QOS_EGRESS, beside latency_trace.c): the
 * responses of the socket table's connections read as they leave (lat_egress, with lat_egress_framing in its tail-call
 * slot), and connections open before their port was watched taken into the table at their next request
 * (lat_adopt_ingress). A packet names its socket only as a pointer, so lat_flows finds the table's key by the
 * connection's addresses. */
#ifndef QOS_EGRESS
#error "latency_trace_skb.c is built with QOS_EGRESS (its programs read lat_flows, which the tracepoints keep)"
#endif
#include "lat_state.h"
#include "lat_packet.h"
#include "lat_http.h"
#include "lat_socktable.h"

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
