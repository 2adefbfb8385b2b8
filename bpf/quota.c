/* Per-tenant quotas at TC ingress (and on the egress of host-side veths toward serving network namespaces): a
 * cls_bpf direct-action classifier.
 *
 * A new connection (SYN) and a new HTTP/1.x request (a segment whose payload starts with a method token) each take
 * a token from their tenant's bucket; over quota that segment is dropped and TCP retransmits it (back-pressure).
 * Every other segment, and all traffic that matches no tenant, passes untouched (TC_ACT_UNSPEC: later filters
 * still run). Buckets refill here from bpf_ktime_get_ns, so enforcement goes on with the last limits written when
 * the agent is gone; adaptive overrides and fleet shares stop counting once the agent's heartbeat is older than its
 * timeout (a fleet share also at the end of its lease).
 *
 * Defines from the loader: QOS_PIN_DIR (string), QOS_FLOWS (LRU entries), QOS_HDR_SCAN (bytes, power of two),
 * QOS_GEN_CPUS (the possible CPUs: one stats generation each). */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>

#include "qos_common.h"
#include "qos_flow.h"
#include "qos_quota.h"

BPF_TABLE_PINNED("array", __u32, struct qos_port_tenant, tenant_ports, QOS_PORTS, QOS_PIN_DIR "/tenant_ports");
BPF_TABLE_PINNED7("lpm_trie", struct qos_cidr_key, struct qos_tenant_val, tenant_cidrs, 4096,
                  QOS_PIN_DIR "/tenant_cidrs", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct qos_port_key, struct qos_watch_val, watched_ports, 1024, QOS_PIN_DIR "/watched_ports");
BPF_TABLE_PINNED("lru_hash", struct qos_flow_key, struct qos_flow_val, tenant_flows, QOS_FLOWS,
                 QOS_PIN_DIR "/tenant_flows");
BPF_TABLE_PINNED("hash", struct qos_header_key, struct qos_tenant_val, quota_headers, 1024, QOS_PIN_DIR "/quota_headers");
BPF_TABLE_PINNED("hash", struct qos_tenant_val, struct qos_slot_val, quota_slots, QOS_SLOTS, QOS_PIN_DIR "/quota_slots");
BPF_TABLE_PINNED("array", __u32, struct qos_quota_limit, quota_limits, QOS_SLOTS, QOS_PIN_DIR "/quota_limits");
BPF_TABLE_PINNED("array", __u32, struct qos_quota_bucket, quota_buckets, QOS_SLOTS, QOS_PIN_DIR "/quota_buckets");
BPF_TABLE_PINNED("percpu_array", __u32, struct qos_quota_count, quota_counters, QOS_SLOTS,
                 QOS_PIN_DIR "/quota_counters");
/* The slots' generations (qos_common.h), then each CPU's stats generation (qos_quota.h): not in QOS_PIN_DIR but kept
 * with the build (the compile child pins every map beside its programs), as an agent reads only its own build's; it
 * reads every slot and the stats once at its start, since counts an adopted program made are in the pinned counters,
 * not here. */
#ifndef QOS_GEN_CPUS
#define QOS_GEN_CPUS 1
#endif
BPF_F_TABLE("array", int, struct qos_gen, quota_gen, QOS_SLOTS + QOS_GEN_LINE * QOS_GEN_CPUS,
            BPF_F_MMAPABLE); /* read by the agent in place */
BPF_TABLE_PINNED("percpu_array", __u32, struct qos_stat_val, quota_stats, QOS_STAT_MAX, QOS_PIN_DIR "/quota_stats");
BPF_TABLE_PINNED("array", __u32, struct qos_quota_conf, quota_config, 1, QOS_PIN_DIR "/quota_config");
BPF_TABLE_PINNED("hash", struct qos_attach_key, struct qos_attach_val, quota_attach, 256, QOS_PIN_DIR "/quota_attach");
BPF_TABLE_PINNED("hash", struct qos_netns_key, struct qos_tenant_val, quota_netns, 1024, QOS_PIN_DIR "/quota_netns");

/* quota_flow_l1: a per-CPU direct-mapped front for tenant_flows. A hashed map lookup is a kernel call (tens of ns
 * with retpolines and safe-RET); a per-CPU array lookup is inlined by the verifier. A flow's segments mostly arrive
 * on one CPU (RSS, RPS), so a request start of a CIDR or header tenant usually finds its flow here and skips the
 * LRU. tenant_flows stays the cache of record (the latency probes read it); an entry here is a copy of a resolved
 * tenant, valid while its gen equals quota_config.rules_gen, which the agent bumps after it emptied tenant_flows on
 * a rule change. "Unmatched" is never held, so a header claiming a flow later is never hidden. Not pinned by name:
 * it lives in the build (qosagent/ebpf/pinned.py), and an agent that reuses the build finds its entries valid
 * exactly as long as the adopted tenant_flows' (the same rules_gen). Written only from TC (softirq, which does not nest
 * on one CPU), so an entry is never torn. A hit does not touch the LRU entry's reference bit: under LRU pressure a
 * flow hot here can be evicted there, and is then resolved again on its next miss here. */
#define QOS_FLOW_WORDS 9
_Static_assert(sizeof(struct qos_flow_key) == QOS_FLOW_WORDS * 4, "the flow front reads a flow key as words");
#ifndef QOS_FLOW_L1_BITS /* from the loader: entries per CPU, sized from quota.flow_entries and the CPU count */
#define QOS_FLOW_L1_BITS 12
#endif
struct flow_l1 {
    __u32 flow_w[QOS_FLOW_WORDS]; /* a struct qos_flow_key */
    __u32 tenant; /* QOS_UNMATCHED: empty */
    __u32 gen;
    __u16 slot;
    __u16 pad;
};
BPF_PERCPU_ARRAY(quota_flow_l1, struct flow_l1, 1 << QOS_FLOW_L1_BITS);

/* What quota_classify hands quota_header through a tail call: the header scan is its own program so that the
 * verifier walks the scan loop once, not once per path through the parser. */
struct scan_buf {
    struct qos_flow_key flow; /* first: word-aligned, read as words by the flow front */
    __u32 gen; /* the rules generation quota_classify read before it looked at any flow state */
    __u32 payload_off;
    __u32 payload_len;
    __u64 hash;
    __u32 state;
    __u32 found;
    __u32 end;
    __u8 b[QOS_HDR_SCAN];
};
BPF_PERCPU_ARRAY(quota_scan, struct scan_buf, 1);
/* Pinned: a prog array empties when its last user-space reference goes, which would end header matching when the
 * agent dies. */
BPF_TABLE_PINNED("prog", __u32, __u32, quota_progs, 1, QOS_PIN_DIR "/quota_progs");
#define QOS_PROG_HEADER 0

#include "qos_tenant.h"

#define FNV64_OFFSET 0xcbf29ce484222325ULL
#define FNV64_PRIME 0x100000001b3ULL
/* Clamp of every interval and tau (the agent writes no more): base + interval cannot overflow for centuries. */
#define QOS_MAX_NS (1ULL << 60)

struct pkt {
    union { /* words: the flow front's hash and compare go 32 bits at a time */
        struct qos_flow_key flow;
        __u32 flow_w[QOS_FLOW_WORDS];
    };
    __u32 payload_off;
    __u32 payload_len;
    __u8 syn; /* SYN without ACK: a new connection */
};

/* A count by reason, then this CPU's stats generation: a line only this CPU writes, so a plain increment (TC programs
 * do not nest on one CPU; one that did would still move the value, which is all the agent looks for). */
static __always_inline void stat_inc(__u32 reason)
{
    struct qos_stat_val *v = quota_stats.lookup(&reason);
    if (v)
        v->packets++;
    __u32 g = QOS_SLOTS + QOS_GEN_LINE * (bpf_get_smp_processor_id() % QOS_GEN_CPUS);
    struct qos_gen *sg = quota_gen.lookup(&g);
    if (sg)
        sg->n++;
}

/* Copy n bytes (a multiple of 4) at off: straight from the linear area when it holds them (the usual case for
 * headers at TC ingress), else through the helper (payload on loopback and veth is often not linear). The copy
 * goes in 32-bit words: a memcpy from a packet offset of unknown alignment compiles to one load, shift and or per
 * byte, which made the parse most of an established flow's cost. Unaligned packet loads are allowed wherever the
 * kernel has efficient unaligned access (x86, arm64), where BPF does not check packet alignment. */
static __always_inline int load(struct __sk_buff *skb, __u32 off, void *to, __u32 n)
{
    void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
    if (n % 4 == 0 && off <= 1024 && data + off + n <= end) { /* n is a constant: the test folds away */
#pragma unroll
        for (__u32 i = 0; i < n / 4; i++)
            ((__u32 *)to)[i] = ((const __u32 *)(data + off))[i];
        return 0;
    }
    return bpf_skb_load_bytes(skb, off, to, n);
}

/* 0 parsed; 1 not TCP (pass silently); -1 malformed or fragment (pass, counted by the caller's reason). */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p, __u32 *reason)
{
    __u32 l4, l3_payload;
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (load(skb, ETH_HLEN, &ip, sizeof(ip)) < 0 || ip.version != 4 || ip.ihl < 5) {
            *reason = QOS_STAT_MALFORMED;
            return -1;
        }
        if (ip.protocol != IPPROTO_TCP)
            return 1;
        if (ip.frag_off & bpf_htons(0x3fff)) { /* MF or an offset */
            *reason = QOS_STAT_FRAGMENT;
            return -1;
        }
        __u32 hl = ip.ihl * 4, tot = bpf_ntohs(ip.tot_len);
        if (tot < hl) {
            *reason = QOS_STAT_MALFORMED;
            return -1;
        }
        l4 = ETH_HLEN + hl;
        l3_payload = tot - hl;
        p->flow.raddr[10] = 0xff;
        p->flow.raddr[11] = 0xff;
        __builtin_memcpy(&p->flow.raddr[12], &ip.saddr, 4);
        p->flow.laddr[10] = 0xff;
        p->flow.laddr[11] = 0xff;
        __builtin_memcpy(&p->flow.laddr[12], &ip.daddr, 4);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (load(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0 || ip6.version != 6) {
            *reason = QOS_STAT_MALFORMED;
            return -1;
        }
        __u8 nh = ip6.nexthdr;
        l4 = ETH_HLEN + sizeof(ip6);
        l3_payload = bpf_ntohs(ip6.payload_len);
        /* Extension headers: hop-by-hop, routing, destination options, fragment, AH; a few are plenty. */
        for (int i = 0; i < 6; i++) {
            if (nh == IPPROTO_TCP)
                break;
            __u8 ext[8];
            __u32 len;
            if (nh != IPPROTO_HOPOPTS && nh != IPPROTO_ROUTING && nh != IPPROTO_DSTOPTS &&
                nh != IPPROTO_FRAGMENT && nh != IPPROTO_AH)
                return 1;
            if (bpf_skb_load_bytes(skb, l4, ext, sizeof(ext)) < 0) {
                *reason = QOS_STAT_MALFORMED;
                return -1;
            }
            if (nh == IPPROTO_FRAGMENT) {
                /* offset (13 bits) and M flag: anything but an atomic fragment */
                if (((__u16)ext[2] << 8 | ext[3]) & 0xfff9) {
                    *reason = QOS_STAT_FRAGMENT;
                    return -1;
                }
                len = 8;
            } else if (nh == IPPROTO_AH) {
                len = ((__u32)ext[1] + 2) * 4;
            } else {
                len = ((__u32)ext[1] + 1) * 8;
            }
            if (l3_payload < len) {
                *reason = QOS_STAT_MALFORMED;
                return -1;
            }
            nh = ext[0];
            l4 += len;
            l3_payload -= len;
        }
        if (nh != IPPROTO_TCP)
            return 1;
        __builtin_memcpy(p->flow.raddr, &ip6.saddr, 16);
        __builtin_memcpy(p->flow.laddr, &ip6.daddr, 16);
    } else {
        return 1;
    }
    struct tcphdr tcp;
    if (load(skb, l4, &tcp, sizeof(tcp)) < 0 || tcp.doff < 5 || l3_payload < tcp.doff * 4u) {
        *reason = QOS_STAT_MALFORMED;
        return -1;
    }
    p->flow.rport = bpf_ntohs(tcp.source);
    p->flow.lport = bpf_ntohs(tcp.dest);
    p->payload_off = l4 + tcp.doff * 4;
    p->payload_len = l3_payload - tcp.doff * 4;
    p->syn = tcp.syn && !tcp.ack;
    /* The IP length says there is more than the packet holds: a truncated capture, never a real segment. */
    if (p->payload_off + p->payload_len > skb->len) {
        *reason = QOS_STAT_MALFORMED;
        return -1;
    }
    return 0;
}

#define M4(a, b, c, d) ((__u64)(a) | (__u64)(b) << 8 | (__u64)(c) << 16 | (__u64)(d) << 24)

/* An HTTP/1.x request line starts with a method token and a space (RFC 9112 3). One switch on the first four bytes
 * (a jump through a few compares) instead of testing every method against the whole word. */
static __always_inline int is_request_start(struct __sk_buff *skb, struct pkt *p)
{
    __u64 w;
    /* "GET / HTTP/1.1\r\n" is the shortest request line a client sends. */
    if (p->payload_len < 16 || load(skb, p->payload_off, &w, 8) < 0)
        return 0;
    __u32 hi = w >> 32;
    switch ((__u32)w) {
    case M4('G', 'E', 'T', ' '):
    case M4('P', 'U', 'T', ' '):
        return 1;
    case M4('P', 'O', 'S', 'T'):
    case M4('H', 'E', 'A', 'D'):
        return (hi & 0xff) == ' ';
    case M4('P', 'A', 'T', 'C'):
        return (hi & 0xffff) == M4('H', ' ', 0, 0);
    case M4('T', 'R', 'A', 'C'):
        return (hi & 0xffff) == M4('E', ' ', 0, 0);
    case M4('D', 'E', 'L', 'E'):
        return (hi & 0xffffff) == M4('T', 'E', ' ', 0);
    case M4('O', 'P', 'T', 'I'):
        return hi == M4('O', 'N', 'S', ' ');
    case M4('C', 'O', 'N', 'N'):
        return hi == M4('E', 'C', 'T', ' ');
    }
    return 0;
}

/* A header line "Name: value" of this first segment whose hash names a tenant; QOS_UNMATCHED if none. The name is
 * compared case-insensitively, the value exactly after leading blanks. Headers that continue in a later segment
 * are not seen (counted as QOS_STAT_HEADER_INCOMPLETE). */
#define SCAN_REQUEST_LINE 0
#define SCAN_LINE_START 1
#define SCAN_NAME 2
#define SCAN_BLANKS 3
#define SCAN_VALUE 4
static __always_inline __u32 tenant_by_header(struct __sk_buff *skb, struct scan_buf *s)
{
    __u32 n = s->payload_len;
    if (n > QOS_HDR_SCAN)
        n = QOS_HDR_SCAN;
    if (n < 16 || bpf_skb_load_bytes(skb, s->payload_off, s->b, n) < 0)
        return QOS_UNMATCHED;
    /* The scan state lives in map memory (volatile): the verifier then sees unknown values at every step and the
     * paths of one iteration collapse into one state, instead of multiplying by every byte-dependent branch. */
    volatile __u64 *hash = &s->hash;
    volatile __u32 *state = &s->state;
    volatile __u32 *found = &s->found;
    /* The scan's end, compared from memory at each byte: with n in a register clang turns the loop into a countdown
     * of min(n, QOS_HDR_SCAN) bytes, and 6.1's verifier learns no bound from that counter's "!= 0" (newer ones
     * do), walks past the buffer and refuses the program (EACCES). */
    volatile __u32 *end = &s->end;
    *end = n;
    *hash = FNV64_OFFSET;
    *state = SCAN_REQUEST_LINE;
    *found = QOS_UNMATCHED;
    for (__u32 i = 0; i < QOS_HDR_SCAN; i++) {
        if (i >= *end)
            break;
        __u8 c = s->b[i];
        __u32 st = *state;
        if (c == '\n') {
            if (st == SCAN_LINE_START)
                return QOS_UNMATCHED; /* the blank line: headers ended without a match */
            if (st == SCAN_VALUE) {
                struct qos_header_key hk = {.hash = *hash};
                struct qos_tenant_val *t = quota_headers.lookup(&hk);
                if (t) {
                    *found = t->tenant;
                    break;
                }
            }
            *state = SCAN_LINE_START;
            *hash = FNV64_OFFSET;
            continue;
        }
        if (c == '\r' || st == SCAN_REQUEST_LINE)
            continue;
        if (st == SCAN_LINE_START || st == SCAN_NAME) {
            if (c == ':')
                *state = SCAN_BLANKS;
            else
                *state = SCAN_NAME;
            if (c >= 'A' && c <= 'Z')
                c += 'a' - 'A';
        } else if (st == SCAN_BLANKS) {
            if (c == ' ' || c == '\t')
                continue;
            *state = SCAN_VALUE;
        }
        *hash = (*hash ^ c) * FNV64_PRIME;
    }
    if (*found == QOS_UNMATCHED)
        stat_inc(QOS_STAT_HEADER_INCOMPLETE);
    return *found;
}

/* The serving namespace's tenant for this port, else for any watched port; skb->ifindex is the host-side veth
 * whose egress leads into the namespace. */
static __always_inline __u32 tenant_by_netns(__u32 ifindex, __u16 lport, __u8 *via)
{
    struct qos_netns_key k = {.ifindex = ifindex, .port = lport};
    struct qos_tenant_val *t = quota_netns.lookup(&k);
    if (!t) {
        k.port = 0;
        t = quota_netns.lookup(&k);
    }
    if (!t)
        return QOS_UNMATCHED;
    *via = QOS_VIA_NETNS;
    return t->tenant;
}

/* GCRA: admit when the bucket (capacity tau/interval tokens) holds a token; lock-free with a bounded retry. */
static __always_inline int take(__u64 *tat, __u64 now, const struct qos_bucket_limit *l)
{
    __u64 interval = l->interval_ns, tau = l->tau_ns;
    if (interval > QOS_MAX_NS)
        interval = QOS_MAX_NS;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __u64 old = *(volatile __u64 *)tat;
        __u64 base = old > now ? old : now;
        /* An old tat far in the future (clock or layout change) must not lock a tenant out forever. */
        if (base - now > QOS_MAX_NS)
            base = now;
        __u64 next = base + interval;
        if (next - now > tau)
            return 0;
        if (__sync_val_compare_and_swap(tat, old, next) == old)
            return 1;
    }
    return 0; /* lost the race four times: others took the tokens; the segment is retransmitted */
}

/* The fleet share is one more limit beside the baseline and admission's override: the lowest rate holds (on a
 * tie, the smaller burst). It holds only before its lease ends and while the agent's heartbeat is fresh, so neither
 * a lost lease nor a dead agent leaves a stale grant; then the others decide alone. The limit in force is copied to
 * the stack: choosing between map-value pointers compiles to a branchless select the verifier refuses. */
static __always_inline void fleet_limit(const struct qos_quota_limit *lim, struct qos_bucket_limit *use, int *have,
                                        int fresh, __u64 now)
{
    if (!(lim->flags & QOS_LIMIT_FLEET))
        return;
    if (!fresh || now >= lim->fleet_until_ns) {
        stat_inc(QOS_STAT_FLEET_EXPIRED);
        return;
    }
    if (!*have || lim->fleet.interval_ns > use->interval_ns ||
        (lim->fleet.interval_ns == use->interval_ns && lim->fleet.tau_ns < use->tau_ns)) {
        *use = lim->fleet;
        *have = 1;
    }
}

static __always_inline void count(__u32 slot, int conn, int admitted)
{
    struct qos_quota_count *c = quota_counters.lookup(&slot);
    if (!c)
        return;
    if (conn) {
        if (admitted)
            c->conn_admitted++;
        else
            c->conn_dropped++;
    } else {
        if (admitted)
            c->req_admitted++;
        else
            c->req_dropped++;
    }
    qos_gen_bump(quota_gen.lookup(&slot));
}

static __always_inline __u16 slot_of(__u32 tenant)
{
    struct qos_tenant_val k = {.tenant = tenant};
    struct qos_slot_val *s = tenant == QOS_UNMATCHED ? 0 : quota_slots.lookup(&k);
    return s && s->slot < QOS_SLOTS ? s->slot : 0;
}

/* The verdict for one new connection (conn=1) or request (conn=0) of a tenant's slot. */
static __always_inline int admit(__u32 slot, int conn)
{
    struct qos_quota_limit *lim = quota_limits.lookup(&slot);
    if (!lim || !(lim->flags & (conn ? QOS_LIMIT_CONN : QOS_LIMIT_REQ | QOS_LIMIT_OVERRIDE | QOS_LIMIT_FLEET)))
        return 1;
    struct qos_quota_bucket *b = quota_buckets.lookup(&slot);
    if (!b)
        return 1; /* cannot happen with an array; never black-hole */
    __u64 now = bpf_ktime_get_ns();
    if (conn)
        return take(&b->conn_tat, now, &lim->conn);
    struct qos_bucket_limit use = {};
    int have = 0;
    if (lim->flags & QOS_LIMIT_REQ) {
        use = lim->req;
        have = 1;
    }
    if (lim->flags & (QOS_LIMIT_OVERRIDE | QOS_LIMIT_FLEET)) {
        __u32 zero = 0;
        struct qos_quota_conf *cf = quota_config.lookup(&zero);
        int fresh = cf && cf->heartbeat_ns <= now && now - cf->heartbeat_ns <= cf->heartbeat_timeout_ns;
        if (lim->flags & QOS_LIMIT_OVERRIDE) {
            if (fresh) {
                use = lim->override;
                have = 1;
            } else {
                stat_inc(QOS_STAT_OVERRIDE_EXPIRED);
            }
        }
        fleet_limit(lim, &use, &have, fresh, now);
    }
    if (!have)
        return 1;
    return take(&b->req_tat, now, &use);
}

/* The flow's entry in this CPU's flow front: its 9 words folded (rotate, xor), spread by a multiply (Fibonacci
 * hashing), top bits taken. */
static __always_inline struct flow_l1 *l1_entry(const __u32 *w)
{
    __u32 h = 0;
#pragma unroll
    for (int i = 0; i < QOS_FLOW_WORDS; i++)
        h = (h << 5 | h >> 27) ^ w[i];
    __u32 i = (h * 0x9e3779b1u) >> (32 - QOS_FLOW_L1_BITS);
    return quota_flow_l1.lookup(&i);
}

/* Word by word, without a branch per word. */
static __always_inline int l1_holds(const struct flow_l1 *e, const __u32 *w)
{
    __u32 d = 0;
#pragma unroll
    for (int i = 0; i < QOS_FLOW_WORDS; i++)
        d |= e->flow_w[i] ^ w[i];
    return d == 0;
}

/* Remember a resolved tenant; for an unmatched one only forget what the entry held for this flow (a SYN reusing
 * the 4-tuple of a header-claimed connection starts unmatched again, as in tenant_flows). */
static __always_inline void l1_fill(struct flow_l1 *e, const __u32 *w, __u32 tenant, __u16 slot, __u32 gen)
{
    if (!e)
        return;
    if (tenant == QOS_UNMATCHED) {
        if (l1_holds(e, w))
            e->tenant = QOS_UNMATCHED;
        return;
    }
#pragma unroll
    for (int i = 0; i < QOS_FLOW_WORDS; i++)
        e->flow_w[i] = w[i];
    e->tenant = tenant;
    e->slot = slot;
    e->gen = gen;
}

int quota_classify(struct __sk_buff *skb)
{
    struct pkt p = {};
    __u32 reason = QOS_STAT_MALFORMED;
    int r = parse(skb, &p, &reason);
    if (r) {
        if (r < 0)
            stat_inc(reason);
        return TC_ACT_UNSPEC;
    }
    /* Only new connections and new requests meet a bucket: every other segment passes here without a map
     * lookup, which keeps an established flow's cost near the bare parse. */
    int request = !p.syn && is_request_start(skb, &p);
    if (!p.syn && !request)
        return TC_ACT_UNSPEC;
    /* Rule 1 of qos_tenant.h first: a port one tenant claims gives tenant and slot from one inlined array load,
     * with no flow to look up or cache (a claimed port is always watched). */
    struct qos_port_tenant *claim = qos_port_claim(p.flow.lport);
    struct qos_quota_conf *cf = 0;
    __u32 zero = 0, gen = 0, tenant, slot;
    if (claim) {
        tenant = claim->tenant;
        slot = claim->slot;
    } else {
        /* The generation is read before any flow state: one read after the agent's bump comes after its rule sync
         * and flow clear too, so an entry filled under that generation holds a tenant of the new rules. */
        cf = quota_config.lookup(&zero);
        gen = cf ? cf->rules_gen : 0;
        struct flow_l1 *e = l1_entry(p.flow_w);
        /* A SYN resolves afresh (a reused 4-tuple): it reads neither cache and refreshes both. */
        if (!p.syn && e && e->tenant != QOS_UNMATCHED && e->gen == gen && l1_holds(e, p.flow_w)) {
            tenant = e->tenant;
            slot = e->slot;
        } else {
            struct qos_flow_val *fv = p.syn ? 0 : tenant_flows.lookup(&p.flow);
            if (fv) {
                tenant = fv->tenant;
                slot = fv->slot;
            } else {
                struct qos_port_key wk = {.port = p.flow.lport};
                if (!watched_ports.lookup(&wk))
                    return TC_ACT_UNSPEC;
                struct qos_flow_val nv = {};
                nv.tenant = QOS_UNMATCHED;
                if (cf && (cf->flags & QOS_CONF_NETNS_RULES))
                    nv.tenant = tenant_by_netns(skb->ifindex, p.flow.lport, &nv.via);
                if (nv.tenant == QOS_UNMATCHED)
                    nv.tenant = qos_tenant_by_addr(p.flow.lport, p.flow.raddr, &nv.via);
                nv.slot = slot_of(nv.tenant);
                tenant_flows.update(&p.flow, &nv);
                tenant = nv.tenant;
                slot = nv.slot;
            }
            l1_fill(e, p.flow_w, tenant, slot, gen);
        }
    }
    if (p.syn) {
        int ok = tenant == QOS_UNMATCHED || admit(slot, 1);
        count(slot, 1, ok);
        if (tenant == QOS_UNMATCHED)
            stat_inc(QOS_STAT_UNMATCHED);
        return ok ? TC_ACT_UNSPEC : TC_ACT_SHOT;
    }
    if (tenant == QOS_UNMATCHED) {
        struct scan_buf *s = quota_scan.lookup(&zero);
        if (cf && (cf->flags & QOS_CONF_HEADER_RULES) && s) {
            s->flow = p.flow;
            s->gen = gen;
            s->payload_off = p.payload_off;
            s->payload_len = p.payload_len;
            quota_progs.call(skb, QOS_PROG_HEADER);
        }
        /* No header rules, or the tail call is not in place (agent starting): unmatched. */
        count(0, 0, 1);
        stat_inc(QOS_STAT_UNMATCHED);
        return TC_ACT_UNSPEC;
    }
    int ok = admit(slot, 0);
    count(slot, 0, ok);
    return ok ? TC_ACT_UNSPEC : TC_ACT_SHOT;
}

/* Tail call of quota_classify for a request start on a connection no port or CIDR claimed. */
int quota_header(struct __sk_buff *skb)
{
    __u32 zero = 0;
    struct scan_buf *s = quota_scan.lookup(&zero);
    if (!s)
        return TC_ACT_UNSPEC;
    __u32 tenant = tenant_by_header(skb, s);
    if (tenant == QOS_UNMATCHED) {
        count(0, 0, 1);
        stat_inc(QOS_STAT_UNMATCHED);
        return TC_ACT_UNSPEC;
    }
    struct qos_flow_val hv = {.tenant = tenant, .via = QOS_VIA_HEADER, .slot = slot_of(tenant)};
    tenant_flows.update(&s->flow, &hv);
    const __u32 *w = (const __u32 *)&s->flow;
    l1_fill(l1_entry(w), w, tenant, hv.slot, s->gen);
    int ok = admit(hv.slot, 0);
    count(hv.slot, 0, ok);
    return ok ? TC_ACT_UNSPEC : TC_ACT_SHOT;
}
