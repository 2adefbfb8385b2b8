/* Sockops mode (>= 6.15; chosen by qosagent/latency/planning.py): per-socket hooks, state in socket local storage.
 * A sock_ops program on the cgroup2 root picks the server sockets at PASSIVE_ESTABLISHED and asks the kernel for their
 * sendmsg callback and their state changes; cgroup_skb ingress and egress programs on the serving cgroups see request
 * bytes arrive and response bytes leave. Every other socket on the host costs nothing per request. */
#include "lat_state.h"
#include "lat_packet.h"
#include "lat_http.h"

/* Kernel ABI values newer than the UAPI headers BCC compiles against (include/uapi/linux/bpf.h, 6.15). */
#define LAT_SOL_SOCKET 1
#define LAT_SK_BPF_CB_FLAGS 1009
#define LAT_SK_BPF_CB_TX_TIMESTAMPING 1
#define LAT_OPS_TSTAMP_SENDMSG_CB 20
#define LAT_AF_INET 2
#define LAT_AF_INET6 10

/* A socket's state with the agent run it was made in. The agent's next run may reuse this program and its maps
 * (qosagent/ebpf/pinned.py keeps the build), but socket storage cannot be listed to be emptied, and the state an
 * earlier run left on a socket missed whatever happened while no agent ran: it is never read as this run's. */
struct lat_sk_state {
    struct lat_sock s;
    __u32 run;
    __u32 pad;
};

struct lat_run_cfg {
    __u32 run; /* moved on by the agent at each start */
    __u32 pad;
};

BPF_SK_STORAGE(lat_sk, struct lat_sk_state);
BPF_ARRAY(lat_run, struct lat_run_cfg, 1);

/* The socket's state of this run, or 0; with `create`, made (or taken over from an earlier run) for the caller to
 * initialise. */
static __always_inline struct lat_sock *lat_sk_get(struct bpf_sock *sk, int create)
{
    __u32 zero = 0;
    struct lat_run_cfg *run = lat_run.lookup(&zero);
    if (!run)
        return 0;
    struct lat_sk_state *st = lat_sk.sk_storage_get(sk, 0, create ? BPF_SK_STORAGE_GET_F_CREATE : 0);
    if (!st)
        return 0;
    if (st->run != run->run) {
        if (!create)
            return 0;
        st->run = run->run;
    }
    return &st->s;
}

struct lat_cgroup_key {
    __u64 id;
};

struct lat_cgroup_event {
    __u64 id;   /* cgroup v2 id: the inode number of its directory */
    __u32 tgid; /* a process seen serving there, for the agent's log */
    __u32 pad;
};

/* cgroup v2 ids where tracked ports are served: of a process calling listen() on one, of a process answering on a
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
    if ((family != LAT_AF_INET && family != LAT_AF_INET6) || !sk || !lat_port_tracked(lport))
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
    struct lat_sock *s = lat_sk_get(sk, 1);
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
    struct lat_sock *s = lat_sk_get(sk, 0);
    if (!s)
        return;
    /* A request's response is timed by the egress program, linked wherever the ingress program is; writes with no
     * request before them are counted here. */
    if (s->state == LAT_IDLE || s->state == LAT_PUSHING)
        lat_response_bytes(s, bpf_ktime_get_ns());
    if (!s->noted) {
        /* sendmsg runs in the serving process: its tgid for the run-queue probes, its cgroup for lat_ingress. */
        lat_note_process(s->slot);
        lat_note_cgroup();
        s->noted = 1;
    }
}

static __always_inline void lat_ops_state(struct bpf_sock_ops *skops)
{
    struct bpf_sock *sk = skops->sk;
    if (skops->args[1] != BPF_TCP_CLOSE || !sk)
        return;
    struct lat_sock *s = lat_sk_get(sk, 0);
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
        if (lat_port_tracked((__u16)skops->local_port))
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
    return lat_sk_get(*sk, 0);
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
    struct lat_sock *s = lat_sk_get(sk, 1);
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
 * own, so that its runs (every packet on the host leaves through it) are told from the steady state's; what it does
 * is lat_egress's, tail-called (the kernel counts the runs of the program the hook ran). A copy of lat_departure
 * here was as much C for LLVM and as many paths for the verifier as lat_egress itself: ~0.3 s of a cold start's
 * compile child. A tail call that returns failed (the slot empty or holding another program: never, once the agent
 * linked it): the packet goes on unread, and a response's TTFT may be lost with it, so it is counted (unmatched
 * traffic's slot: no socket was looked at), for the self-test, status and metrics to show. */
int lat_egress_learn(struct __sk_buff *skb)
{
    lat_tail.call(skb, LAT_TAIL_EGRESS);
    lat_count(0, LAT_C_EGRESS_UNREAD);
    return 1;
}

/* Tail-called by lat_egress when a response's header block ends (see lat_response_segment). */
int lat_egress_framing(struct __sk_buff *skb)
{
    __u32 zero = 0;
    struct lat_scan *buf = lat_scan_buf.lookup(&zero);
    struct bpf_sock *sk = skb->sk;
    struct lat_sock *s = sk ? lat_sk_get(sk, 0) : 0;
    if (buf && s)
        lat_framing_and_body(skb, buf, s);
    return 1;
}
