# A kernel the agent refuses (no BPF atomic operations: before 5.12; qosagent/ebpf/atomics.py), in the kernel matrix's
# VM (tests/vm/test_kernel_matrix.py boots it and reads the `check NAME: ok|FAILED ...` lines this prints): with
# latency and quota enabled, `qosagent run` exits 4 with one line naming what the kernel lacks and what to do, before
# anything is compiled or attached, so nothing of ours stays (no pin, program, map or qdisc), and `qosagent check`
# says the same. Nothing else is run here: on such a kernel that refusal is all the agent does.
set -u
AGENT=.venv/bin/qosagent
CONF=$(mktemp --suffix=.yaml)
cat >"$CONF" <<EOF
tenants:
  - {name: chat, tier: gold, match: {ports: [18040]}, quota: {rps: 50, burst: 20}}
latency: {enabled: true, ports: [18040]}
quota: {enabled: true, interfaces: [lo]}
EOF
WANT="kernel $(uname -r) has no BPF atomic operations (compare-and-exchange, exchange: Linux 5.12+), which quota \
and latency need: run a 5.12 or newer kernel, or disable quota and latency"

failed=0
check() {  # check NAME CMD...: the command's success, said, with the end of its output when it fails
  local name=$1 out; shift
  if out=$("$@" 2>&1); then echo "check $name: ok"; return 0; fi
  failed=1; echo "check $name: FAILED $(tail -c 600 <<<"$out" | tr '\n' ' ')"; return 1
}
refused() {  # refused SUBCOMMAND: exit 4, stderr the one line, stdout empty
  local out err rc
  out=$(mktemp); err=$(mktemp)
  timeout 300 $AGENT "$1" --config "$CONF" >"$out" 2>"$err"; rc=$?
  echo "qosagent $1: exit $rc, stderr: $(cat "$err")"
  [ $rc -eq 4 ] && [ "$(cat "$err")" = "$WANT" ] && [ ! -s "$out" ]
}
# What the kernel holds of the kinds the agent would add: the count of programs and maps, lo's qdiscs.
held() {
  bpftool -j prog show | python3 -c 'import json, sys; print("programs", len(json.load(sys.stdin)))'
  bpftool -j map show | python3 -c 'import json, sys; print("maps", len(json.load(sys.stdin)))'
  tc qdisc show dev lo
}
as_before() { [ "$before" = "$(held)" ] || { echo "before: $before; now: $(held)"; return 1; }; }

before=$(held)
t0=$SECONDS
check run_refused refused run
echo "qosagent-vm: qosagent run took $((SECONDS - t0)) s"
check check_refused refused check
check no_pins test ! -e /sys/fs/bpf/qosagent
check nothing_added as_before
exit $failed
