/* ---- TCP segments seen by cgroup_skb programs (both modes) ---------------------------------------------------- */
/* The TCP header of a packet and its connection's key from the server's side, and the connections open before
 * their port was watched, which the first segment of their next request takes under observation. */
#ifndef LAT_PACKET_H
#define LAT_PACKET_H

#include "lat_state.h"

#define LAT_ETH_P_IP 0x0800
#define LAT_ETH_P_IPV6 0x86DD
#define LAT_TCP_PSH 0x08

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

#endif /* LAT_PACKET_H */
