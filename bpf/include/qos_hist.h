/* Log-linear histogram index, identical to qosagent/hist.py bucket_index(): 16 sub-buckets per power of two,
 * computed on v-1 so that each bucket is (lower, upper] and Prometheus' inclusive `le` is exact. */
#ifndef QOS_HIST_H
#define QOS_HIST_H

#define QOS_HIST_SUB_BITS 4
#define QOS_HIST_SUB (1 << QOS_HIST_SUB_BITS)
#define QOS_HIST_MAX_LOG2 40
#define QOS_HIST_NBUCKETS ((QOS_HIST_MAX_LOG2 - QOS_HIST_SUB_BITS + 1) * QOS_HIST_SUB + QOS_HIST_SUB)

/* floor(log2(x)) for x > 0 without loops or clz (no BPF instruction for it). */
static __always_inline __u32 qos_log2(__u64 x)
{
    __u32 r = 0, s;
    s = (x > 0xFFFFFFFFULL) << 5; x >>= s; r |= s;
    s = (x > 0xFFFF) << 4; x >>= s; r |= s;
    s = (x > 0xFF) << 3; x >>= s; r |= s;
    s = (x > 0xF) << 2; x >>= s; r |= s;
    s = (x > 0x3) << 1; x >>= s; r |= s;
    r |= (x >> 1);
    return r;
}

static __always_inline __u32 qos_hist_index(__u64 v)
{
    __u64 x = v ? v - 1 : 0;
    if (x < QOS_HIST_SUB)
        return (__u32)x;
    __u32 msb = qos_log2(x);
    if (msb > QOS_HIST_MAX_LOG2)
        return QOS_HIST_NBUCKETS - 1;
    __u32 shift = msb - QOS_HIST_SUB_BITS;
    return (shift + 1) * QOS_HIST_SUB + (__u32)((x >> shift) - QOS_HIST_SUB);
}

#endif
