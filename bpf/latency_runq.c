/* Run-queue latency of the processes serving tracked sockets: how long each of their threads waits for a CPU after
 * a wake-up or a preemption, into the run-queue row of the tier they serve (LAT_RUNQ_ROW + row, lat_state.h). The
 * socket programs mark the serving processes in runq_tgids with the slot they served; the agent expands them to their
 * threads in runq_pids (qosagent/latency/runq.py), with the row of that slot's tier (the shared row for a process
 * serving several tiers). The value's `since` is the thread's wake-up time while it waits for a CPU (0 when it does
 * not): stamping and clearing in place spares an update and a delete per wait on the scheduler's hottest path, and
 * the row is read from the same entry, so that a tier costs no lookup more. Compiled beside the mode's entry file
 * when latency.runqueue is on and the sched tracepoints exist. */
#include "lat_state.h"

BPF_HASH(runq_pids, struct lat_pid_key, struct lat_runq_val, 65536);

static __always_inline void runq_enqueued(__u32 pid)
{
    struct lat_pid_key k = {.pid = pid};
    struct lat_runq_val *w = runq_pids.lookup(&k);
    if (w)
        w->since = bpf_ktime_get_ns();
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
    struct lat_runq_val *w = runq_pids.lookup(&k);
    if (!w || !w->since)
        return 0;
    __u64 delta = bpf_ktime_get_ns() - w->since;
    w->since = 0;
    __u32 row = w->row < LAT_RUNQ_ROWS ? w->row : LAT_RUNQ_SHARED;
    if (lat_hist_add(LAT_RUNQ_ROW + row, delta))
        lat_touched(LAT_SLOTS);
    return 0;
}
