/* ---- responses read as they leave (cgroup_skb egress, both modes) ------------------------------------------- */
/* Server sockets write a response's status line and headers, then its body. For HTTP/1.x the first body byte is
 * what a streaming client calls its first token, and each later body write a next token (group). The send hooks
 * carry no payload, so the egress program reads it: the status line and header block of each response (their
 * bytes only, at most LAT_HDR_MAX of them), then nothing of the body but its framing's end. Everything here reads
 * packets through bpf_skb_load_bytes (payload sits in page fragments, out of direct reach) into a per-CPU buffer. */
#ifndef LAT_HTTP_H
#define LAT_HTTP_H

#include "lat_packet.h"

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
#define LAT_CANDS 8 /* words of a header block whose lines may name its framing, read by lat_framing */
#define LAT_CRLFCRLF 0x0a0d0a0dU

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

/* The tail-call slots, filled by the agent (qosagent/latency/links.py): lat_egress_framing, and (sockops mode) lat_egress
 * for the egress learner. */
#define LAT_TAIL_FRAMING 0
#define LAT_TAIL_EGRESS 1
BPF_PROG_ARRAY(lat_tail, 2);

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
        lat_tail.call(skb, LAT_TAIL_FRAMING);
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

#endif /* LAT_HTTP_H */
