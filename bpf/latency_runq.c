/* Run-queue latency of the processes serving tracked sockets: how long each of their threads waits for a CPU after
 * a wake-up or a preemption, into lat_hist's last row (LAT_RUNQ_ROW). The socket programs mark the serving processes
 * in runq_tgids; the agent expands them to their threads in runq_pids (qosagent/latency/runq.py), whose value is the
 * thread's wake-up time while it waits for a CPU (0 when it does not): stamping and clearing in place spares an
 * update and a delete per wait on the scheduler's hottest path. Compiled beside the mode's entry file when
 * latency.runqueue is on and the sched tracepoints exist. */
#include "lat_state.h"

BPF_HASH(runq_pids, struct lat_pid_key, struct lat_pid_val, 65536);

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
    lat_observe_row(LAT_RUNQ_ROW, delta);
    return 0;
}
