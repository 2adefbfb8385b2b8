# The shipped unit under a real systemd (PID 1 in the kernel matrix's VM; tests/vm/test_systemd_unit.py boots it and
# reads the `check NAME: ok|FAILED ...` lines this prints). Installed as the README says (`make install`, offline
# from the wheelhouse `make setup-kernels` built), with a config enabling every capability: latency, quota on lo,
# servers (on by default), admission in enforce, placement in enforce across the VM's two NUMA nodes, resources in
# enforce on a serving process of its own (a transient service: its cgroup's cpu.max, cpu.weight, memory.min and its
# threads' nice written through the unit's drop-in, and put back on stop), and dvfs in dry-run, which the VM gives
# nothing to act on (no cpufreq policy, no temperature sensor): it is unavailable, saying so, and listed in
# readiness.optional so that the agent is still ready. Then: started, ready, reloaded, killed (Restart=on-failure,
# quota's handover holding), hung (the watchdog), stopped (only the handover and the kept builds stay, resources'
# writes undone), uninstalled (nothing stays: programs, maps, links, perf attachments, pins, the qdisc). Runs as the
# systemd-run-generator's service, with /etc, /opt, /usr/share, /var, /tmp and the checkout writable through
# overlays (tests/vm/runner.py).
set -u
# The agent's modules compiled once, by the first command that imports them, into the installed tree (an overlay
# here): under emulation each process compiling them again costs seconds. The agent itself cannot write there
# (ProtectSystem=strict); `make install`'s `qosagent check --systemd` and the status calls below can.
unset PYTHONDONTWRITEBYTECODE
UNIT=qosagent
AGENT=/opt/qosagent/bin/qosagent
CONF=/etc/qosagent/config.yaml
PORT=9464

failed=0
check() {  # check NAME CMD...: the command's success, said, with the end of its output when it fails
  local name=$1 out; shift
  if out=$("$@" 2>&1); then echo "check $name: ok"; return 0; fi
  failed=1; echo "check $name: FAILED $(tail -c 600 <<<"$out" | tr '\n' ' ')"; return 1
}
wait_for() {  # wait_for SECONDS CMD...: until the command succeeds
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do [ $SECONDS -ge $end ] && return 1; sleep 1; done
}
http() { python3 -c 'import sys, urllib.request as u
try: r = u.urlopen(sys.argv[1], timeout=20); print(r.status); sys.stdout.write(r.read().decode()[:200000])
except u.HTTPError as e: print(e.code); sys.exit(1)' "$1"; }
main_pid() { systemctl show -p MainPID --value $UNIT; }
restarts() { systemctl show -p NRestarts --value $UNIT; }
active() { [ "$(systemctl is-active $UNIT)" = active ]; }
our_filter() { tc filter show dev lo ingress | grep -q quota_classify; }
metrics_ok() { http http://127.0.0.1:$PORT/metrics | grep -q '^qosagent_capability_state'; }
# Under the unit's set every process's /proc/PID/ns/net and fd read (the VM's daemons of other users, the root
# server): nothing refused, both counters shown at 0.
proc_readable() { http http://127.0.0.1:$PORT/metrics | python3 -c 'import re, sys
n = re.findall(r"^qosagent_proc_unreadable_total\{what=\"(\w+)\"\} (\S+)$", sys.stdin.read(), re.M)
print(n); sys.exit(0 if len(n) == 2 and all(float(v) == 0 for _, v in n) else 1)'; }
# Each enabled capability active, or idle (nothing to act on here), in the agent's own status; dvfs unavailable for
# the one reason this VM gives it.
all_active() {
  $AGENT status --json --config $CONF | python3 -c 'import json, sys
caps = json.load(sys.stdin)["capabilities"]
dvfs = caps.pop("dvfs", {})
bad = {n: c for n, c in caps.items() if c["state"] not in ("active", "idle", "disabled")}
if dvfs.get("state") != "unavailable" or "no cpufreq policy with a frequency knob and no temperature sensor" \
        not in dvfs.get("reason", ""):
    bad["dvfs"] = dvfs
print(json.dumps(bad or caps)); sys.exit(1 if bad else 0)'
}
ids() {  # ids prog|map|link: the ids of what the kernel holds now, one a line; not systemd's own (sd_*: its
  # firewall and device programs, loaded again at each daemon-reload)
  bpftool -j "$1" show | python3 -c 'import json, sys
print("\n".join(str(o["id"]) for o in json.load(sys.stdin) if not o.get("name", "").startswith("sd_")))' | sort
}
none_new() {  # none_new prog|map|link: nothing the kernel holds now that it did not before the install
  local new; new=$(comm -13 "$BEFORE/$1" <(ids "$1"))
  [ -z "$new" ] || { echo "new $1 ids: $new"; for i in $new; do bpftool "$1" show id "$i"; done; return 1; }
}
same_as_before() {  # same_as_before NAME CMD...: the command's output as it was before the install
  local name=$1; shift
  diff "$BEFORE/$name" <("$@")
}
gone_soon() {  # gone_soon prog|map: none_new within 30 s (a program or map goes with its last reference, which the
  wait_for 30 none_new "$1" || none_new "$1"  # kernel may finish a moment later), else what is left
}
detached() { same_as_before perf bpftool perf && none_new link; }  # no perf attachment, no link
# The serving process resources acts on: a service of its own (its cgroup is neither a slice nor a session, so it is
# set, not reported as shared). systemd enables the cpu controller for a unit only when one of its settings needs it
# (it counts CPU time from cpu.stat without it), hence CPUWeight= at its default; memory's likewise.
SERVER=qosagent-vm-server
SERVER_CG=/sys/fs/cgroup/system.slice/$SERVER.service
server_nice() { ps -L -o ni= -p "$(systemctl show -p MainPID --value $SERVER)" | tr -d ' ' | sort -u; }
resources_now() {
  for f in cpu.max cpu.weight memory.min memory.high; do echo "$f $(cat $SERVER_CG/$f)"; done
  echo "nice $(server_nice)"
}
# gold's resources {cpus: 1, memory: 64MiB} (memory.high follows memory) and weight 10 (cpu.weight 1000); a
# latency-sensitive tier (slo_p99 under 500 ms) on a kernel without custom scheduler slices: nice -5 on every serving
# thread.
resources_set() {
  local now; now=$(resources_now)
  grep -qx 'cpu.max 100000 100000' <<<"$now" && grep -qx 'memory.min 67108864' <<<"$now" \
    && grep -qx 'memory.high 67108864' <<<"$now" && grep -qx 'cpu.weight 1000' <<<"$now" \
    && grep -qx 'nice -5' <<<"$now" || { echo "$now"; return 1; }
}
resources_soon() { wait_for 60 resources_set || resources_set; }  # the first reconcile writes them
restarted_from() {  # the unit active again under a new main process, its restart counted
  active && [ "$(main_pid)" != "$1" ] && [ "$(main_pid)" != 0 ] && [ "$(restarts)" -gt "$2" ] && all_active
}

mkdir -p /etc/qosagent
cat >$CONF <<EOF
interval: 100ms
metrics: {listen: 127.0.0.1:$PORT}
tiers:
  gold:   {slo_p99: 120ms, weight: 10, resources: {cpus: 1, memory: 64MiB}}
  silver: {slo_p99: 350ms, weight: 5}
  bronze: {slo_p99: 1200ms, weight: 1}
tenants:
  - {name: chat, tier: gold, match: {ports: [18040]}, quota: {rps: 50, burst: 20}}
latency: {enabled: true, ports: [18040]}
quota: {enabled: true, interfaces: [lo]}
admission: {enabled: true, mode: enforce}
placement: {enabled: true, mode: enforce, selectors: [{name: qosagent-vm-server}]}
resources: {enabled: true, mode: enforce}
dvfs: {enabled: true, mode: dry-run}
readiness: {optional: [dvfs]}
EOF

# What the kernel held before: after the uninstall nothing of ours may remain (programs, maps, links, perf
# attachments, the qdisc quota added), and after a stop only quota's handover (filter and pins) and the builds the
# agent keeps for its next start (attached nowhere: docs/ARCHITECTURE.md).
BEFORE=$(mktemp -d)
for kind in prog map link; do ids $kind >"$BEFORE/$kind"; done
bpftool perf >"$BEFORE/perf"
tc qdisc show dev lo >"$BEFORE/qdisc"

echo "qosagent-vm: make install"
t0=$SECONDS
# Offline, from the wheelhouse; no bytecode compiled at install (a minute of emulation for every module of every
# package): the first command to import a module compiles it.
check install env PIP_NO_INDEX=1 PIP_FIND_LINKS=/var/lib/qosagent-vm/wheels PIP_NO_COMPILE=1 make install
echo "qosagent-vm: make install took $((SECONDS - t0)) s"
check dropin_written test -s /etc/systemd/system/$UNIT.service.d/capabilities.conf
# Emulation compiles BPF ten times slower than a host: the start may take longer than the unit's 120 s. Only this.
mkdir -p /etc/systemd/system/$UNIT.service.d
printf '[Service]\nTimeoutStartSec=600s\n' >/etc/systemd/system/$UNIT.service.d/zz-emulated.conf
systemctl daemon-reload

systemd-run --unit=$SERVER -p CPUWeight=100 -p MemoryAccounting=yes \
  python3 -m http.server --bind 127.0.0.1 18040 >/dev/null
wait_for 60 sh -c "ss -Htln 'sport = :18040' | grep -q ."
resources_now >"$BEFORE/resources"
echo "qosagent-vm: $SERVER before the agent: $(tr '\n' ';' <"$BEFORE/resources")"

t0=$SECONDS
check start systemctl start $UNIT
echo "qosagent-vm: systemctl start took $((SECONDS - t0)) s"
check active active
check readyz http http://127.0.0.1:$PORT/readyz
check capabilities all_active || journalctl -u $UNIT --no-pager | tail -n 60
check metrics metrics_ok
check resources_written resources_soon
# After resources found the server (its discovery reads every process's fds): nothing refused.
check proc_readable proc_readable

# systemctl reload: a tenant added to the config shows in the agent's status.
sed -i 's/^tenants:$/tenants:\n  - {name: batch, tier: bronze, match: {ports: [18041]}, quota: {rps: 5, burst: 2}}/' $CONF
check reload systemctl reload $UNIT
check reloaded_tenant sh -c "$AGENT status --json --config $CONF | grep -q '\"batch\"'"

# kill -9: restarted (Restart=on-failure); quota's filter never left lo, and the new agent took it over.
pid=$(main_pid); n=$(restarts)
kill -9 "$pid"
check handover_while_down our_filter
t0=$SECONDS
check restarted_after_kill wait_for 400 restarted_from "$pid" "$n"
echo "qosagent-vm: restart after kill -9 took $((SECONDS - t0)) s"
check one_filter_after_restart sh -c "[ \$(tc filter show dev lo ingress | grep -c quota_classify) -eq 1 ]"

# A hung loop (SIGSTOP): no WATCHDOG=1 for WatchdogSec, systemd kills it (SIGABRT) and restarts it.
pid=$(main_pid); n=$(restarts)
kill -STOP "$pid"
t0=$SECONDS
check restarted_after_hang wait_for 500 restarted_from "$pid" "$n"
echo "qosagent-vm: restart after SIGSTOP took $((SECONDS - t0)) s"
check watchdog_named sh -c "journalctl -u $UNIT --no-pager | grep -qi 'watchdog timeout'"

# systemctl stop: latency's attachments (perf events, links) and the status socket go; quota's filter and pins stay
# for the next agent.
check stop systemctl stop $UNIT
check stopped_handover our_filter
check stopped_pins sh -c "ls /sys/fs/bpf/qosagent/quota-v* >/dev/null"
check stopped_no_latency detached
check stopped_no_socket test ! -e /run/qosagent/status.sock
check stopped_resources_restored same_as_before resources resources_now

# make uninstall: nothing of ours stays but the operator's config.
check uninstall make uninstall
check uninstalled_filter sh -c "! tc filter show dev lo ingress | grep -q quota_"
check uninstalled_pins test ! -e /sys/fs/bpf/qosagent
check uninstalled_qdisc same_as_before qdisc tc qdisc show dev lo
check uninstalled_programs gone_soon prog
check uninstalled_maps gone_soon map
check uninstalled_attachments detached
check uninstalled_files sh -c "! ls -d /opt/qosagent /etc/systemd/system/$UNIT.service /usr/share/qosagent \
  /etc/systemd/system/$UNIT.service.d/capabilities.conf /run/qosagent 2>/dev/null | grep -q ."
check config_kept test -s $CONF
systemctl stop $SERVER
journalctl -u $UNIT --no-pager | tail -n 40
exit $failed
