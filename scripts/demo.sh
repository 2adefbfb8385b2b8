#!/usr/bin/env bash
# qosagent on this host alone: llama.cpp's llama-server on CPU with a tiny generated model where make setup-test
# built it (else a streaming inference-like stand-in) in a private network namespace, two tenants with load, the
# latency the agent measures in the kernel beside what the clients saw, a quota at work, and `qosagent status`.
# Everything lives in the namespace (its own lo, its own mounts) and is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "demo: run as root (sudo make demo): it loads BPF programs and makes a netns" >&2; exit 1; }
PY=${PY:-.venv/bin/python}
SECONDS_OF_LOAD=${DEMO_SECONDS:-10}
ns="qosagent-demo-$$"
work=$(mktemp -d /tmp/qosagent-demo.XXXXXX)
agent_pid="" server_pid=""

cleanup() {
  set +e
  if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
    kill -TERM "$agent_pid"                      # run with --detach-on-exit: SIGTERM removes filters and pins
    for _ in $(seq 1 40); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$agent_pid" 2>/dev/null
  fi
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  wait 2>/dev/null
  ip netns del "$ns" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# Foreground only: a function run with & is a subshell, and its $! is that subshell, not the process; killing it
# would orphan the agent (still attached) instead of stopping it. Background jobs call `ip netns exec` directly,
# which execs the command in place, so $! is the process itself.
in_ns() { ip netns exec "$ns" "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

get() { in_ns "$PY" -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }
ip netns add "$ns"
in_ns ip link set lo up
# The real engine where make setup-test has built it (scripts/llama-server.sh): llama.cpp's llama-server with the
# tiny generated model (testkit/tiny_llama.py), both tenants on it, told apart by their address; else the stand-in.
engine=$(scripts/llama-server.sh path 2>/dev/null || true)
if [ -n "$engine" ]; then
  step "a network namespace ($ns) with llama.cpp's llama-server (a tiny generated Llama, 2 slots) on :18001: acme from 127.0.0.2, hobby from 127.0.0.3"
  "$PY" -m testkit.tiny_llama "$work/tiny-llama.gguf" --gguf-py "$engine/src/gguf-py" >/dev/null
  ip netns exec "$ns" "$engine/bin/llama-server" -m "$work/tiny-llama.gguf" --host 127.0.0.1 --port 18001 -np 2 \
    -c 4096 -t 1 --metrics --no-webui > "$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 120); do
    get http://127.0.0.1:18001/health >/dev/null 2>&1 && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
    sleep 0.5
  done
  acme=(--port 18001 --source 127.0.0.2 --chat) hobby=(--port 18001 --source 127.0.0.3 --chat)
  # Matched by address too, not by the port alone: the agent reads the engine's /metrics on that port.
  match_acme="{cidrs: [127.0.0.2/32], ports: [18001]}" match_hobby="{cidrs: [127.0.0.3/32], ports: [18001]}"
else
  step "a network namespace ($ns) with a streaming stand-in server (llama-server is not built): acme on :18001, hobby on :18002"
  ip netns exec "$ns" "$PY" scripts/demo_traffic.py serve 18001 18002 > "$work/server.log" 2>&1 &
  server_pid=$!
  acme=(--port 18001) hobby=(--port 18002)
  match_acme="{ports: [18001]}" match_hobby="{ports: [18002]}"
fi

cat > "$work/config.yaml" <<YAML
interval: 100ms
metrics: {listen: 127.0.0.1:9464}
status: {socket: $work/status.sock}
bpf: {pin_root: /sys/fs/bpf/qosagent-demo}
tiers:
  gold:   {slo_p99: 150ms, weight: 10}
  bronze: {slo_p99: 1200ms, weight: 1}
tenants:
  - {name: acme,  tier: gold,   match: $match_acme}
  - {name: hobby, tier: bronze, match: $match_hobby, quota: {rps: 10, burst: 5}}
latency: {enabled: true, window: 10s}
quota: {enabled: true, interfaces: [lo]}
YAML
step "the agent, with this config:"
sed 's/^/    /' "$work/config.yaml"
# Inside the namespace the agent mounts its own tracefs and bpffs (ip netns exec gives it a private /sys).
ip netns exec "$ns" "$PY" -m qosagent run --detach-on-exit --config "$work/config.yaml" > "$work/agent.log" 2>&1 &
agent_pid=$!
metrics() { get "http://127.0.0.1:9464$1"; }
for _ in $(seq 1 120); do
  metrics /readyz >/dev/null 2>&1 && break
  kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log" >&2; exit 1; }
  sleep 0.5
done
metrics /readyz >/dev/null || { echo "demo: the agent did not become ready" >&2; cat "$work/agent.log" >&2; exit 1; }
"$PY" -m qosagent status --socket "$work/status.sock" | sed -n '1,12p'

step "load for ${SECONDS_OF_LOAD}s: acme 15 req/s (within its SLO), hobby 30 req/s against a quota of 10/s"
ip netns exec "$ns" "$PY" scripts/demo_traffic.py load --name acme "${acme[@]}" --rps 15 --duration "$SECONDS_OF_LOAD" &
acme_pid=$!
in_ns "$PY" scripts/demo_traffic.py load --name hobby "${hobby[@]}" --rps 30 --duration "$SECONDS_OF_LOAD"
wait "$acme_pid"

step "qosagent status: what the agent measured in the kernel and what it enforced"
"$PY" -m qosagent status --socket "$work/status.sock"

step "the same in Prometheus' terms (curl http://127.0.0.1:9464/metrics inside the namespace)"
metrics /metrics | grep -E '^qosagent_(latency_requests_total|latency_slo_seconds|latency_ttft_window_seconds|quota_requests)' \
  | grep -E 'tenant="(acme|hobby)"' | grep -vE '_created|quantile="0\.(5|9)"' | head -30

step "done: stopping the agent removes its TC filter and programs; the namespace goes with it"
