#!/usr/bin/env bash
# On a host with a real NVIDIA GPU and no BPF toolchain: the agent's GPU paths end to end, read-only.
# The agent runs with dvfs, placement and admission in dry-run (nothing is clocked or pinned) next to a process that holds
# GPU memory; topology, status and a scrape are saved under $1. Nothing on the GPU is changed.
set -u
out=${1:?output dir}
cfg=$(mktemp --suffix=.yaml)
cat > "$cfg" <<YAML
interval: 100ms
metrics: {listen: "127.0.0.1:19464"}
status: {socket: /tmp/qa-gpu/status.sock}
state_dir: /tmp/qa-gpu/state
gpu: {backend: nvml}
latency: {enabled: false}
dvfs: {enabled: true, mode: dry-run}
placement:
  enabled: true
  mode: dry-run
  gpu_processes: true
  reconcile_interval: 1s
tenants:
  - {name: acme, tier: gold, match: {ports: [18001]}}
  - {name: hobby, tier: bronze, match: {ports: [18002]}}
# Thresholds far below the holder's real usage, so that real NVML readings drive a (dry-run) shed.
admission:
  enabled: true
  mode: dry-run
  gpu_pressure: {gpus: [0], enter: 0.01, exit: 0.005, pre_cleanup: {command: [/bin/true]}}
YAML
python3 -m qosagent check --config "$cfg" --json > "$out/check.json" 2>"$out/check.err"
python3 -m qosagent topology --config "$cfg" --json > "$out/topology.json" 2>"$out/topology.err"
python3 -c 'import sys,time,torch; x=torch.empty(1<<30,dtype=torch.uint8,device="cuda"); print("ready",flush=True); time.sleep(40)' > "$out/holder.out" &
holder=$!
sleep 8
python3 -m qosagent run --config "$cfg" > "$out/agent.log" 2>&1 &
agent=$!
sleep 8
python3 -m qosagent status --config "$cfg" > "$out/status.txt" 2>&1
python3 -m qosagent status --config "$cfg" --json --decisions > "$out/status.json" 2>&1
python3 -c 'import urllib.request;print(urllib.request.urlopen("http://127.0.0.1:19464/metrics").read().decode())' > "$out/metrics.txt" 2>&1
kill -TERM $agent; wait $agent; echo "agent exit $?" >> "$out/agent.log"
kill $holder 2>/dev/null; wait $holder 2>/dev/null
echo "holder pid $holder" >> "$out/holder.out"
nvidia-smi --query-gpu=clocks.sm,power.limit,clocks_event_reasons.active --format=csv >> "$out/holder.out" 2>&1
