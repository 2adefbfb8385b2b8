"""The servers capability's pure parts: parsing each kind's exposition, bad answers, kinds, discovery on a fixture
/proc tree, restarts by pid, and which GPUs' memory is no load signal."""

from __future__ import annotations

from typing import Any, Iterator

import collections
import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from qosagent.admission.inputs import gpu_input
from qosagent.gpu.backend import GpuProcess, GpuSample, GpuState
from qosagent.hostfs import HostFS
from qosagent.servers import discovery, kinds
from qosagent.servers.config import ServerConfig
from qosagent.servers.model import ServerReading, ServersPart, gpu_holders
from qosagent.servers.parse import ExpositionError, parse
from qosagent.servers.scraper import (
    DOWN,
    GARBAGE,
    HTTP_ERROR,
    OK,
    REFUSED,
    ROUND_S,
    TIMEOUT,
    Scraper,
    resolution,
    tokens_rate,
)
from tests.integration.inference_metrics import LLAMACPP_SLOTS, TGI_KV_TOKENS, exposition

LOAD = {"kv": 0.42, "waiting": 7, "running": 12, "preemptions": 3, "generated": 5000}
CAPACITY = {"tgi": TGI_KV_TOKENS, "llamacpp": LLAMACPP_SLOTS}


@pytest.mark.parametrize(("kind", "want"), [
    ("vllm", {"kv_cache_usage": 0.42, "requests_waiting": 7, "requests_running": 12, "preemptions": 3,
              "generated_tokens": 5000}),
    ("sglang", {"kv_cache_usage": 0.42, "requests_waiting": 7, "requests_running": 12, "preemptions": 3,
                "generated_tokens": 5000}),
    ("tgi", {"kv_cache_usage": 0.42, "requests_waiting": 7, "requests_running": 12}),
    ("triton", {"kv_cache_usage": 0.42, "requests_waiting": 7, "requests_running": 12}),
    # 2 of its 4 slots busy (0.42 of 4, rounded): the slots are both its KV reading and its running requests.
    ("llamacpp", {"kv_cache_usage": 0.5, "requests_waiting": 7, "requests_running": 2, "generated_tokens": 5000}),
])
def test_each_kinds_exposition_gives_its_fields(kind: str, want: dict[str, float]) -> None:
    p = parse(exposition(kind, LOAD), kind, CAPACITY.get(kind))
    assert p.kind == kind and p.values == pytest.approx(want)
    assert set(p.missing) == set(kinds.FIELDS) - set(want)
    assert all("not exported" in why for why in p.missing.values())
    # A server whose kind is not known is read by its metric names.
    assert parse(exposition(kind, LOAD), "generic").kind == kind


def test_tgi_kv_usage_needs_its_capacity_from_info() -> None:
    p = parse(exposition("tgi", LOAD), "tgi")
    assert p.missing["kv_cache_usage"] == "max_batch_total_tokens unknown (read from /info)"
    assert p.values["requests_waiting"] == 7


def test_llamacpp_slot_usage_needs_its_slot_count_and_more_busy_than_slots_is_no_reading() -> None:
    p = parse(exposition("llamacpp", LOAD), "llamacpp")
    assert p.missing["kv_cache_usage"] == "total_slots unknown (read from /props)"
    assert p.values["requests_waiting"] == 7 and p.values["requests_running"] == 2
    p = parse(exposition("llamacpp", {**LOAD, "kv": 1.0}), "llamacpp", 3)  # 4 busy of 3: the capacity is wrong
    assert "kv_cache_usage" not in p.values and "above 1" in p.missing["kv_cache_usage"]


def test_older_vllm_names_and_several_engines() -> None:
    text = exposition("vllm", LOAD).replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    text += ('vllm:num_requests_waiting{engine="1",model_name="m"} 5\n'
             'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.97\n')
    p = parse(text, "vllm")
    assert p.values["kv_cache_usage"] == 0.97  # the fullest cache decides
    assert p.values["requests_waiting"] == 12  # queues add up


@pytest.mark.parametrize(("body", "why"), [
    ("<!DOCTYPE html><html><body>Login</body></html>", "not a metrics exposition"),
    ("<html>\n<head>", "not a metrics exposition"),
    ('{"error": "not found"}', "not a metrics exposition"),
    ("\x00\x01 this is { not metrics\n", "not a metrics exposition"),
    ("", "empty exposition"),
    ("# just a comment\n", "empty exposition"),
])
def test_answers_that_are_no_exposition_are_errors_not_zeros(body: str, why: str) -> None:
    with pytest.raises(ExpositionError, match=why):
        parse(body, "vllm")


def test_nan_infinite_negative_and_out_of_range_values_leave_the_field_unknown() -> None:
    for bad, why in (("NaN", "NaN"), ("+Inf", "infinite"), ("-1", "negative"), ("1.7", "above 1")):
        p = parse(exposition("vllm", LOAD).replace(" 0.42\n", f" {bad}\n"), "vllm")
        assert "kv_cache_usage" not in p.values and why in p.missing["kv_cache_usage"]
        assert p.values["requests_waiting"] == 7  # the other fields stand
    p = parse("vllm:num_requests_running 3\n", "vllm")
    assert p.missing["kv_cache_usage"] == "vllm:kv_cache_usage_perc absent"


def test_kind_from_the_command_line() -> None:
    assert kinds.from_cmdline(["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm"
    assert kinds.from_cmdline(["vllm", "serve", "meta-llama/Llama-3.1-8B"]) == "vllm"
    assert kinds.from_cmdline(["python3", "-m", "sglang.launch_server", "--model-path", "x"]) == "sglang"
    assert kinds.from_cmdline(["text-generation-router", "--port", "80"]) == "tgi"
    assert kinds.from_cmdline(["tritonserver", "--model-repository=/models"]) == "triton"
    assert kinds.from_cmdline(["nginx: master process"]) is None
    assert kinds.from_cmdline(["/var/lib/qosagent-llama/0.3.36-x/bin/llama-server", "-m", "m.gguf"]) == "llamacpp"
    assert kinds.from_cmdline(["llama-server", "--metrics"]) == "llamacpp"
    # llama-cpp-python's own server is another server, without llamacpp: metrics; a model's name is no server.
    assert kinds.from_cmdline(["python3", "-m", "llama_cpp.server", "--model", "llama-server.gguf"]) is None
    assert kinds.from_cmdline(["vllm", "serve", "org/llama-server-ft"]) == "vllm"
    assert kinds.metrics_url(8000, "triton") == "http://127.0.0.1:8002/metrics"
    assert kinds.metrics_url(8000, "vllm") == "http://127.0.0.1:8000/metrics"


# ---- discovery on a fixture /proc tree ----

def proc(root: Path, pid: int, ppid: int, argv: list[str], sockets: tuple[int, ...] = ()) -> None:
    d = root / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text(f"{pid} (python3 (x)) S {ppid} {pid} {pid} 0 -1\n")
    (d / "cmdline").write_text("\x00".join(argv) + "\x00")
    (d / "fd" / "0").symlink_to("/dev/null")
    for i, inode in enumerate(sockets):
        os.symlink(f"socket:[{inode}]", d / "fd" / str(10 + i))


def tcp_table(root: Path, rows: list[tuple[int, str, int]], addr: str = "00000000") -> None:
    (root / "proc" / "net").mkdir(parents=True, exist_ok=True)
    lines = ["  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"]
    for i, (port, st, inode) in enumerate(rows):
        a = "0A000005" if port == 8080 else addr  # nginx bound to 5.0.0.10 only
        lines.append(f"   {i}: {a}:{port:04X} 00000000:0000 {st} 00000000:00000000 00:00000000 00000000"
                     f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0")
    (root / "proc" / "net" / "tcp").write_text("\n".join(lines) + "\n")


def host(tmp_path: Path) -> Path:
    # vLLM: the API server listens on 8000 and 8001 (one server), its engine process (spawned, no name) holds
    # the GPU. TGI: the router listens on 3000, the launcher's shard holds GPU 1. nginx listens on 8080.
    proc(tmp_path, 1, 0, ["/sbin/init"])
    proc(tmp_path, 100, 1, ["vllm", "serve", "m"], sockets=(5001, 5002))
    proc(tmp_path, 101, 100, ["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main"])
    proc(tmp_path, 200, 1, ["text-generation-launcher", "--model-id", "m"])
    proc(tmp_path, 201, 200, ["text-generation-router", "--port", "3000"], sockets=(5003,))
    proc(tmp_path, 202, 200, ["/usr/bin/python3", "/usr/bin/text-generation-server", "serve", "m"])
    proc(tmp_path, 300, 1, ["nginx: master process"], sockets=(5004,))
    tcp_table(tmp_path, [(8000, "0A", 5001), (8001, "0A", 5002), (3000, "0A", 5003), (8080, "0A", 5004),
                         (9999, "01", 5005)])
    return tmp_path


def test_discovery_finds_servers_by_socket_process_and_command_line(tmp_path: Path) -> None:
    s = Scraper(HostFS(host(tmp_path)), None, [3000, 8000, 8001, 8080])
    s.rediscover()
    part = s.part()
    by_port = {r.port: r for r in part.servers}
    assert set(by_port) == {3000, 8000, 8080}  # 8001 is the vLLM process again: one server
    assert (by_port[8000].kind, by_port[8000].pid, by_port[8000].pids) == ("vllm", 100, frozenset({100, 101}))
    assert by_port[8000].url == "http://127.0.0.1:8000/metrics" and not by_port[8000].configured
    assert (by_port[3000].kind, by_port[3000].pid) == ("tgi", 201)
    assert by_port[3000].pids == frozenset({200, 201, 202})  # up to the launcher: its shards hold the GPUs
    assert by_port[8080].kind == "generic" and not by_port[8080].preallocates
    assert by_port[8080].url == "http://5.0.0.10:8080/metrics"  # bound to one address: read there
    assert by_port[8080].reason.startswith("not read: its command line names no vllm")  # nginx is left alone
    assert not s.targets[8080].read and s.targets[8000].read
    assert not any(r.known for r in part.servers) and by_port[8000].reason == "not read yet"
    assert part.preallocating_pids == frozenset({100, 101, 200, 201, 202}) and part.processes_known


def test_a_listener_whose_process_cannot_be_seen_is_listed_and_not_read(tmp_path: Path) -> None:
    root = host(tmp_path)
    (root / "proc" / "300" / "fd" / "10").unlink()  # nginx's fds: another user's, unreadable without a capability
    s = Scraper(HostFS(root), None, [8080])
    s.rediscover()
    r = s.part().servers[0]
    assert (r.port, r.pid, r.known) == (8080, None, False) and "its process cannot be seen" in r.reason
    assert not s.targets[8080].read


def test_a_new_pid_on_the_same_port_is_a_restart_and_drops_the_old_reading(tmp_path: Path) -> None:
    root = host(tmp_path)
    now = [100.0]
    s = Scraper(HostFS(root), [ServerConfig(port=8000, kind="vllm")], [], clock=lambda: now[0])
    s.rediscover()
    t = s.targets[8000]
    s.record(t, OK, exposition("vllm", LOAD), "")
    assert s.part().servers[0].known and s.part().servers[0].pid == 100
    # The server restarts: another process owns the socket.
    (root / "proc" / "100" / "fd" / "10").unlink()
    proc(root, 400, 1, ["vllm", "serve", "m"], sockets=(5001,))
    s.rediscover()
    r = s.part().servers[0]
    assert r.pid == 400 and r.restarts == 1 and not r.known and "pid 100 -> 400" in r.reason
    # Its process goes away: unknown, said so.
    for f in (root / "proc" / "400" / "fd").iterdir():
        f.unlink()
    s.rediscover()
    r = s.part().servers[0]
    assert r.pid is None and "nothing listens on port 8000" in r.reason


def test_readings_age_out_to_unknown_and_counter_resets_are_counted(tmp_path: Path) -> None:
    now = [100.0]
    s = Scraper(HostFS(tmp_path), [ServerConfig(port=8000, kind="vllm", stale_after="5s")], [],
                clock=lambda: now[0])
    t = s.targets[8000]
    s.record(t, OK, exposition("vllm", {**LOAD, "preemptions": 9}), "")
    now[0] += 1
    s.record(t, OK, exposition("vllm", {**LOAD, "preemptions": 2}), "")  # went backwards
    now[0] += 1
    s.record(t, TIMEOUT, "", "no complete answer within 0.5s")
    r = s.part().servers[0]
    assert r.known and r.kv_cache_usage == 0.42 and r.reason == "no complete answer within 0.5s"
    assert r.counter_resets == 1
    now[0] += 4.5
    r = s.part().servers[0]
    assert not r.known and r.kv_cache_usage is None and r.requests_waiting is None
    assert r.reason == "last good read 5.5s ago (stale after 5s): no complete answer within 0.5s"
    s.record(t, OK, "<html>oops</html>", "")
    r = s.part().servers[0]
    assert r.scrapes == {OK: 2, TIMEOUT: 1, GARBAGE: 1} and "not a metrics exposition" in r.reason
    # A new process_start_time_seconds is a restart even when no pid was seen.
    s.record(t, OK, exposition("vllm", {**LOAD, "start_time": 1.8e9}), "")
    assert s.part().servers[0].restarts == 1 and s.part().servers[0].known


def test_a_refused_connection_ends_the_reading_at_once(tmp_path: Path) -> None:
    """Nothing listens: the server is gone (a crash), so its last queue and slots are not held for stale_after."""
    now = [100.0]
    s = Scraper(HostFS(tmp_path), [ServerConfig(port=8080, kind="llamacpp")], [], clock=lambda: now[0])
    t = s.targets[8080]
    s.record(t, OK, exposition("llamacpp", LOAD), "", LLAMACPP_SLOTS)
    assert s.part().servers[0].requests_waiting == 7
    now[0] += 1
    s.record(t, DOWN, "", REFUSED)
    r = s.part().servers[0]
    assert (r.known, r.requests_waiting, r.requests_running, r.reason) == (False, None, None, REFUSED)
    assert r.scrapes == {OK: 1, DOWN: 1}


def test_generated_tokens_per_second_is_the_counters_rate_between_two_reads(tmp_path: Path) -> None:
    now = [100.0]
    s = Scraper(HostFS(tmp_path), [ServerConfig(port=8000, kind="vllm")], [], clock=lambda: now[0])
    t = s.targets[8000]
    s.record(t, OK, exposition("vllm", {**LOAD, "generated": 1000}), "")
    r = s.part().servers[0]
    assert r.generated_tokens_per_second is None and "a rate needs two" in r.missing["generated_tokens"]
    now[0] += 2
    s.record(t, OK, exposition("vllm", {**LOAD, "generated": 1600}), "")
    r = s.part().servers[0]
    assert (r.generated_tokens_per_second, r.generated_tokens_window_s) == (pytest.approx(300), 2.0)
    assert "generated_tokens" not in r.missing
    now[0] += 1
    s.record(t, OK, exposition("vllm", {**LOAD, "generated": 40}), "")  # went backwards: no rate across it
    r = s.part().servers[0]
    assert r.generated_tokens_per_second is None and r.counter_resets == 1
    now[0] += 1
    s.record(t, OK, exposition("vllm", {**LOAD, "generated": 440}), "")
    assert s.part().servers[0].generated_tokens_per_second == pytest.approx(400)
    # The servers' own throughput gauge is not read: each scrape resets it (kinds.py).
    assert all(src.sample != "llamacpp:predicted_tokens_seconds"
               for srcs in kinds.kind("llamacpp").fields.values() for src in srcs)


def test_llamacpps_token_rate_spans_ten_seconds_of_reads() -> None:
    """Its counter grows only when a request ends, by all its tokens: over one read interval the rate would be 0
    or a request's worth; over 10 s it is the tokens of the requests that ended in that window."""
    llama = kinds.kind("llamacpp")
    reads: collections.deque[tuple[float, float]] = collections.deque()
    got = []
    for i in range(15):  # a read a second; a 200-token request ends every 2 s
        reads.append((float(i), 200.0 * (i // 2)))
        got.append(tokens_rate(reads, llama))
    assert got[1] == (0.0, 1.0, "") and got[2] == (100.0, 2.0, "")  # the window fills from the first read
    assert got[14] == (pytest.approx(100.0), 10.0, "") and got[13] == (pytest.approx(100.0), 10.0, "")
    assert [r[0] for r in reads] == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    # vLLM's counts every step: its rate is between the last two reads.
    assert tokens_rate(collections.deque([(0.0, 0.0), (1.0, 50.0), (2.0, 150.0)]), kinds.kind("vllm")) == (
        100.0, 1.0, "")


def test_a_counter_printed_to_six_digits_gives_a_rate_only_where_its_rounding_is_small() -> None:
    """llama-server prints 1234567 tokens as 1.23457e+06: each read is within 5 tokens of the count."""
    llama = kinds.kind("llamacpp")
    assert resolution(999999, 6) == 0 and resolution(1.23457e6, 6) == 10 and resolution(4.2e8, 6) == 1000
    assert resolution(4.2e8, None) == 0
    # 10 s at 700 tokens/s near 1.2 M: ±10 tokens of 7,000.
    rate, window, why = tokens_rate(collections.deque([(0.0, 1.23457e6), (10.0, 1.24157e6)]), llama)
    assert (rate, window, why) == (pytest.approx(700.0), 10.0, "")
    # Near 420 M the same 7,000 tokens are known to ±1,000: more than 10 % of them.
    rate, window, why = tokens_rate(collections.deque([(0.0, 4.20000e8), (10.0, 4.20007e8)]), llama)
    assert rate is None and why == ("the counter is printed to 6 significant digits: ±1000 tokens over 10.0s, more "
                                    "than 10% of the 7000 counted")
    # Idle past a million: 0 counted of a count known to ±10 is no rate, not "0 tokens/s".
    assert tokens_rate(collections.deque([(0.0, 2.5e6), (10.0, 2.5e6)]), llama)[0] is None


# ---- GPU memory: evidence first (a server's reading speaks for the GPUs it may use) ----

GIB = 1 << 30


def reading(port: int, pids: set[int], kv: float | None = 0.30, **kw: Any) -> ServerReading:
    return ServerReading(port=port, kind=kw.pop("kind", "vllm"), url="", configured=True, known=kw.pop("known", True),
                         pids=frozenset(pids), preallocates=True, kv_cache_usage=kv, requests_waiting=0, **kw)


def evidence(gpus: GpuState, index: int, servers: ServersPart | None) -> tuple[str, str]:
    (g,) = gpu_input(gpus, [index], servers).gpus
    return g.evidence, g.why


def test_gpu_memory_is_evidence_only_where_no_server_reading_may_speak_for_the_gpu() -> None:
    gpus = GpuState(True, gpus=(
        GpuSample(0, "a", 100 * GIB, 92 * GIB, processes=(GpuProcess(101, 90 * GIB),)),  # vLLM's engine
        GpuSample(1, "b", 100 * GIB, 95 * GIB, processes=(GpuProcess(555, 95 * GIB),)),  # a training job
        GpuSample(2, "c", 100 * GIB, 93 * GIB, processes=(GpuProcess(101, 1), GpuProcess(202, 1))),  # shared
        GpuSample(3, "d", 100 * GIB, 91 * GIB, errors=(("processes", "no_permission"),)),
    ))
    servers = ServersPart((reading(8000, {100, 101}), reading(3000, {200, 202}, kv=0.45)),
                          frozenset({100, 101, 200, 202}), True, frozenset({1, 100, 101, 200, 202, 555}))
    assert evidence(gpus, 0, None) == ("memory", "")  # servers: [] : memory is load, as before servers were read
    assert evidence(gpus, 0, servers) == ("server", "the server reports KV 30 % on port 8000")
    assert evidence(gpus, 1, servers) == ("memory", "")  # no server's process on it: memory is all there is
    assert evidence(gpus, 2, servers) == ("server", "the servers report KV up to 45 % on ports 8000, 3000")
    assert evidence(gpus, 3, servers)[0] == "server"  # its process list unreadable: either server may use it
    assert gpu_input(gpus, [2], servers).gpus[0].kv == pytest.approx(0.45)
    # A server that may use the GPU but has no reading: no evidence either way.
    down = ServersPart((reading(8000, {100, 101}, kv=None, known=False, reason="down: connection refused"),),
                       frozenset({100, 101}), True, frozenset({1, 100, 101, 555}))
    assert evidence(gpus, 0, down) == ("missing", "server 8000 may use GPU 0 and has no reading: down: "
                                                  "connection refused")
    assert evidence(gpus, 1, down) == ("memory", "")
    # A process the agent cannot identify (started since the last walk of /proc, or another PID namespace).
    assert evidence(gpus, 1, ServersPart(processes_known=True, known_pids=frozenset({1})))[0] == "missing"
    # Without /proc to tell by: memory, unless a server may use the GPU.
    assert evidence(gpus, 1, ServersPart()) == ("memory", "")
    # A generic server exports no KV cache or queue: it neither speaks for a GPU nor leaves it without evidence.
    generic = ServersPart((reading(8080, {555}, kv=None, kind="generic"),), frozenset(), True, frozenset({1, 555}))
    assert evidence(gpus, 1, generic) == ("memory", "")
    assert gpu_holders(servers, gpus) == {0: [8000], 2: [3000, 8000]}


def test_a_server_whose_processes_nvml_does_not_list_may_use_every_gpu() -> None:
    """What NVML gives inside many containers, on MIG and vGPU slices, behind some drivers: no process list, or
    PIDs of another PID namespace. The server's reading still speaks for the GPUs; without a server, a process
    the agent cannot identify leaves the GPU without evidence."""
    servers = ServersPart((reading(18008, {4121, 4122}),), frozenset({4121, 4122}), True, frozenset({1, 4121, 4122}))
    empty = GpuState(True, gpus=(GpuSample(0, "a", 100, 92), GpuSample(1, "b", 100, 93)))
    assert [(g.evidence, g.why) for g in gpu_input(empty, [], servers).gpus] == [
        ("server", "the server reports KV 30 % on port 18008")] * 2
    foreign = GpuState(True, gpus=(GpuSample(0, "a", 100, 92, processes=(GpuProcess(3_999_999, 90),)),))
    assert evidence(foreign, 0, servers)[0] == "server"
    alone = ServersPart((), frozenset(), True, frozenset({1}))
    assert evidence(foreign, 0, alone) == ("missing", "process 3999999 on GPU 0 not identified (started since the "
                                                      "last walk of /proc, or in another PID namespace)")
    # A pre-allocating server's process that no server entry reads (not on a watched port), NVML listing nothing.
    unread = ServersPart((), frozenset({4121}), True, frozenset({1, 4121}))
    assert evidence(empty, 0, unread) == ("missing", "pre-allocating process 4121 may use GPU 0 and no server "
                                                     "reads it")


def test_discovery_reads_what_a_real_proc_offers() -> None:
    """On this host's /proc: the test process itself is found among the processes, with its parent."""
    procs = discovery.processes(HostFS("/"))
    assert procs[os.getpid()].ppid == os.getppid()


def test_two_servers_on_one_gpu_are_counted_and_reported(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from qosagent.capability import AgentContext
    from qosagent.config import parse as parse_config
    from qosagent.gpu.fake import FakeBackend
    from qosagent.servers.capability import Servers
    from qosagent.snapshot import Snapshot

    cap = Servers(AgentContext(config=parse_config({}, "test"), hostfs=HostFS(tmp_path), gpu=FakeBackend([])))
    part = ServersPart((reading(8000, {100, 101}), reading(8100, {300})), frozenset({100, 101, 300}), True)
    gpus = GpuState(True, gpus=(GpuSample(0, "a", 100, 92, processes=(GpuProcess(101, 1), GpuProcess(300, 1))),
                                GpuSample(1, "b", 100, 50, processes=(GpuProcess(100, 1),))))
    snap = Snapshot.build(1, 1.0, 1.0, {"servers": part, "gpu": gpus})

    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            return cap.metrics(snap)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    assert 'qosagent_server_gpu_holders{gpu="0"} 2.0' in text and 'qosagent_server_gpu_holders{gpu="1"} 1.0' in text
    st = cap.status(snap)
    assert st["shared_gpus"] == {"0": [8000, 8100]}
    assert "GPU 0 is shared by the servers on ports 8000, 8100" in Servers.render(st)


def test_a_failing_round_is_counted_and_the_readings_go_on(tmp_path: Path) -> None:
    class Broken(HostFS):
        def listdir(self, host_path: str) -> list[str]:
            raise RuntimeError("a bug of ours")

    s = Scraper(Broken(tmp_path), [ServerConfig(port=1, kind="vllm")], [], discover_every=0.01)
    s.start()  # the first walk fails: counted, and start goes on
    try:
        deadline = time.monotonic() + 10
        while s.part().round_errors < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert s.part().servers[0].scrapes.get("down", 0) >= 1  # still reading, between the failing walks
    finally:
        s.stop()


def test_the_reading_thread_sleeps_until_something_is_due_and_a_watch_wakes_it(tmp_path: Path) -> None:
    """Counted: with no server to read, the thread passes once per walk of /proc, not every 50 ms; a reload's new
    ports end its wait at once."""
    now = [100.0]
    s = Scraper(HostFS(host(tmp_path)), None, [7000], clock=lambda: now[0], discover_every=10.0)
    assert s.idle_for() == ROUND_S  # the first walk is due
    s.round()
    assert s.idle_for() == 10.0  # nothing read: the next walk, 10 s on
    now[0] += 9.99
    assert s.idle_for() == ROUND_S  # never under one round's time: a failing round does not spin
    now[0] += 0.01
    s.round()
    t = s.targets[9000] = Scraper._target(ServerConfig(port=9000, kind="vllm"), True, "vllm")
    t.next_at = now[0] + 1.0
    assert s.idle_for() == 1.0  # the next read due
    t.read = False
    assert s.idle_for() == 10.0
    del s.targets[9000]
    s.start()
    try:
        deadline = time.monotonic() + 10
        _rounds_reach(s, 1, deadline)
        time.sleep(0.3)  # six 50 ms rounds before
        assert s.rounds == 1
        s.watch([7000, 7001])  # the fake clock does not move: only the wake can bring the next walk
        _rounds_reach(s, 2, deadline)
        assert s.ports == [7000, 7001]
    finally:
        s.stop()


def _rounds_reach(s: Scraper, n: int, deadline: float) -> None:
    """Waits for the thread's nth pass; a bound for a broken thread only, failing the test past the deadline."""
    while s.rounds < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stop_between_the_threads_look_and_its_clear_of_the_wake_is_not_lost(tmp_path: Path) -> None:
    """Ordered, not timed: stop() lands just before the thread clears its wake (what stop() does is done inside
    that clear). The thread must end without another round and without entering a wait with the stop set: that
    wait would last discover_every (an hour here, the clock does not move) while stop() gave up its join."""
    s = Scraper(HostFS(host(tmp_path)), None, [7000], clock=lambda: 100.0, discover_every=3600.0)

    class Wake(threading.Event):
        clears = 0
        waits_stopped: list[bool] = []

        def clear(self) -> None:
            type(self).clears += 1
            if type(self).clears == 2:  # the second pass, as stop() would: the stop, then the wake
                s._stop.set()
                self.set()
            super().clear()

        def wait(self, timeout: float | None = None) -> bool:
            self.waits_stopped.append(s._stop.is_set())
            return True if s._stop.is_set() else super().wait(timeout)  # a lost stop fails the assert, not the clock

    s._wake = Wake()
    s.start()
    try:
        _rounds_reach(s, 1, time.monotonic() + 10)
        s._wake.set()  # end the first wait: the next pass clears the wake with the stop landing just before
        thread = s._thread
        assert thread is not None
        thread.join(30)  # a bound for a broken thread only; the assert below is what fails
        assert not thread.is_alive()
        assert Wake.clears == 2 and s.rounds == 1
        assert True not in Wake.waits_stopped
    finally:
        s.stop()


def test_probe_warns_when_a_tenant_claims_the_port_the_metrics_are_read_on(tmp_path: Path) -> None:
    from qosagent.capability import AgentContext, State
    from qosagent.config import parse as parse_config
    from qosagent.features import Features
    from qosagent.gpu.fake import FakeBackend
    from qosagent.servers.capability import Servers

    def verdict(servers: list[dict[str, object]], match: dict[str, object]) -> tuple[State, str]:
        cfg = parse_config({"servers": servers, "tenants": [{"name": "shop", "tier": "gold", "match": match}]}, "t")
        cap = Servers(AgentContext(config=cfg, hostfs=HostFS(tmp_path), gpu=FakeBackend([])))
        v = cap.probe(Features())
        return v.state, v.reason

    state, why = verdict([{"port": 8000, "kind": "vllm"}], {"ports": [8000]})
    assert state is State.DEGRADED and "tenant 'shop' claims whole" in why
    assert "tenant" not in verdict([{"port": 8000, "kind": "vllm"}], {"ports": [8000], "cidrs": ["10.0.0.0/8"]})[1]
    assert "tenant" not in verdict([{"port": 8000, "kind": "vllm", "metrics": "http://127.0.0.1:9100/metrics"}],
                                   {"ports": [8000]})[1]


def test_a_reload_that_adds_tenant_ports_is_seen_by_discovery_at_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Server discovery looks on the watched ports, which a reload changes with the tenants: the next round
    looks on the new ones, without waiting for the next walk of /proc; an undone reload puts the old ones back."""
    from qosagent.capability import AgentContext
    from qosagent.config import parse as parse_config
    from qosagent.gpu.fake import FakeBackend
    from qosagent.servers.capability import Servers

    def cfg(*tenant_ports: int):
        tenants = [{"name": f"t{p}", "tier": "gold", "match": {"ports": [p]}} for p in tenant_ports]
        return parse_config({"latency": {"ports": [8000], "multiplexed_ports": []}, "tenants": tenants}, "t")

    monkeypatch.setattr(Scraper, "_read", staticmethod(lambda t: ("down", "", "not read in this test", None)))
    now = [100.0]
    ctx = AgentContext(config=cfg(), hostfs=HostFS(host(tmp_path)), gpu=FakeBackend([]), clock=lambda: now[0])
    cap = Servers(ctx)
    cap.scraper.round()
    assert [r.port for r in cap.collect().servers] == [8000]
    new = cfg(3000)
    change = cap.prepare(new)
    change.commit()
    ctx.config = new  # what the daemon does once every capability committed
    now[0] += 1.0  # well inside DISCOVER_EVERY
    cap.scraper.round()
    assert {r.port: (r.kind, r.pid) for r in cap.collect().servers} == {8000: ("vllm", 100), 3000: ("tgi", 201)}
    change.undo()
    assert cap.scraper.ports == [8000]


# ---- the real llama-server's answers, recorded (tests/fixtures/llamacpp/), replayed over loopback ----

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"


@contextlib.contextmanager
def replay(answers: dict[str, bytes]) -> Iterator[int]:
    """A loopback server that answers each path with its recorded bytes (status line, headers, body) and closes:
    a shorter byte string is a server that died mid-answer. Its port."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            with conn:
                path = conn.recv(4096).split(b" ")[1].decode()
                conn.sendall(answers[path])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        lsock.close()


def test_a_real_llama_server_answer_is_read_whole_and_a_cut_one_not_at_all(tmp_path: Path) -> None:
    metrics = (RECORDED / "metrics.http").read_bytes()
    props = (RECORDED / "props.http").read_bytes()
    with replay({"/metrics": metrics, "/props": props}) as port:
        s = Scraper(HostFS(tmp_path), [ServerConfig(port=port, kind="llamacpp")], [])
        t = s.targets[port]
        s.record(t, *Scraper._read(t))
        r = s.part().servers[0]
        # Recorded with 2 slots busy and 3 requests deferred (the engine under 5 clients).
        assert (r.known, r.requests_running, r.requests_waiting, r.kv_cache_usage) == (True, 2, 3, 1.0), r
    # The engine dies while writing /metrics: the answer stops inside `llamacpp:tokens_predicted_total 2400`, at
    # "24", a well-formed line that would read as a counter gone backwards. Nothing of it is read; the last good
    # reading stands, with why.
    cut = metrics[:metrics.index(b"llamacpp:tokens_predicted_total 2400") + len(b"llamacpp:tokens_predicted_total 24")]
    with replay({"/metrics": cut, "/props": props}) as port:
        t.url = f"http://127.0.0.1:{port}/metrics"
        s.record(t, *Scraper._read(t))
        r = s.part().servers[0]
        assert r.scrapes == {OK: 1, HTTP_ERROR: 1} and "IncompleteRead" in r.reason, r
        assert (r.known, r.requests_waiting, r.counter_resets) == (True, 3, 0), r


def test_a_real_llama_server_without_metrics_says_how_to_turn_them_on(tmp_path: Path) -> None:
    with replay({"/metrics": (RECORDED / "metrics-off.http").read_bytes()}) as port:
        s = Scraper(HostFS(tmp_path), [ServerConfig(port=port, kind="llamacpp")], [])
        t = s.targets[port]
        s.record(t, *Scraper._read(t))
        r = s.part().servers[0]
        assert r.reason == ("HTTP 501 Not Implemented: llama-server serves /metrics only when started with "
                            "--metrics")
        t.kind = "vllm"  # a status means what it means for the kind that sent it
        assert Scraper._read(t)[2] == "HTTP 501 Not Implemented"
    assert (r.known, r.requests_waiting, r.kv_cache_usage) == (False, None, None)
    assert r.scrapes == {HTTP_ERROR: 1}
