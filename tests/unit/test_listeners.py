"""The listeners room on fixture /proc trees: listening sockets from /proc/net/tcp{,6} text (the agent's own
namespace and any process's), their addresses, and the processes that hold them."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from pathlib import Path
from typing import Iterator

import pytest

from qosagent import listeners
from qosagent.hostfs import HostFS
from qosagent.listeners import Listener, holders, listening_ports, on_ports, parse
from tests.unit.test_netns_pure import TCP, TCP6

# Every column the kernel writes; inodes 5001.. for the listeners. 0100007F is 127.0.0.1, 0A000005 5.0.0.10.
V4 = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5001 1 0 100 0 0 10 0
   1: 0A000005:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5002 1 0 100 0 0 10 0
   2: 0100007F:1F40 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 5009 1 0 20 4 30 10 -1
"""
V6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5003 1 0 100 0 0 10 0
   1: 0000000000000000FFFF00000500000A:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5004 1 0 100 0 0 10 0
"""  # noqa: E501 - the kernel's rows as it writes them


def test_listening_ports_are_the_listen_rows_only() -> None:
    assert listening_ports(TCP.splitlines()) == {8000, 8080}  # the established socket on 8000 is not a listener
    assert listening_ports(TCP6.splitlines()) == {3000}
    assert listening_ports(["header only"]) == set()


def test_the_first_row_of_another_state_ends_the_listeners() -> None:
    def rows():
        yield from TCP.splitlines()
        raise AssertionError("read past the listeners")

    assert listening_ports(rows()) == {8000, 8080}


def test_a_listener_says_its_port_address_and_socket() -> None:
    got = list(parse(V4.splitlines())) + list(parse(V6.splitlines()))
    assert [(s.port, s.address, s.inode) for s in got] == [
        (8000, "0.0.0.0", 5001), (8080, "5.0.0.10", 5002), (3000, "::", 5003), (8001, "::ffff:10.0.0.5", 5004)]
    assert Listener(1, "0100007F", 0).address == "127.0.0.1"


def tables(d: Path, v4: str, v6: str | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tcp").write_text(v4)
    if v6 is not None:
        (d / "tcp6").write_text(v6)


def test_the_agents_own_namespace_and_another_processes_are_read_alike(tmp_path: Path) -> None:
    tables(tmp_path / "proc" / "net", V4, V6)  # the agent's own (/proc/net is /proc/self/net)
    tables(tmp_path / "proc" / "40" / "net", TCP)  # a process in a pod: only 8000 and 8080 there, no tcp6
    fs = HostFS(tmp_path)
    assert {(s.port, s.inode) for s in on_ports(fs, [8000, 3000, 9])} == {(8000, 5001), (3000, 5003)}
    assert [s.port for s in on_ports(fs, [8000, 8080], pid=40)] == [8000, 8080]
    assert listeners.listeners(fs, pid=41) is None  # gone (or never there): no namespace to tell about
    assert on_ports(fs, [8000], pid=41) == []


def proc(root: Path, pid: int, sockets: tuple[int, ...]) -> None:
    d = root / "proc" / str(pid) / "fd"
    d.mkdir(parents=True)
    os.symlink("/dev/null", d / "0")
    os.symlink("anon_inode:[eventfd]", d / "1")
    for i, inode in enumerate(sockets):
        os.symlink(f"socket:[{inode}]", d / str(10 + i))


def test_holders_first_or_every_process_of_a_shared_socket(tmp_path: Path) -> None:
    # A pre-forking server: the master (100) and its workers (101, 102) share the listening socket 5001.
    for pid, socks in ((1, ()), (100, (5001, 7)), (101, (5001,)), (102, (5001,)), (200, (5002,))):
        proc(tmp_path, pid, socks)
    fs = HostFS(tmp_path)
    pids = listeners.pids(fs)
    assert pids == [1, 100, 101, 102, 200]
    assert holders(fs, [5001, 5002], pids) == {5001: [100], 5002: [200]}
    assert holders(fs, [5001, 5002], pids, every=True) == {5001: [100, 101, 102], 5002: [200]}
    assert holders(fs, [5003], pids) == {}


@contextlib.contextmanager
def bound() -> Iterator[set[int]]:
    """Listeners of both families, wildcard and loopback, on ports the kernel picks: their ports."""
    socks = []
    try:
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1"),
                             (socket.AF_INET6, "::")):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((addr, 0))
            s.listen()
        yield {s.getsockname()[1] for s in socks}
    finally:
        for s in socks:
            s.close()


def test_the_kernels_sock_diag_answers_as_the_agents_own_tables_do() -> None:
    """sock_diag itself (listeners() would fall back to the tables unseen): for the test's own listeners, the same
    rows, address text and inode included, as /proc/net/tcp{,6} on this host. Only the test's ports are compared:
    other listeners on the host may come and go between the two reads."""
    with bound() as ours:
        diag = [s for s in listeners._diag(socket.AF_INET) + listeners._diag(socket.AF_INET6) if s.port in ours]
        files = []
        for name in listeners.TABLES:
            with open(f"/proc/net/{name}", encoding="ascii") as f:
                files.extend(s for s in parse(f) if s.port in ours)
        assert len(diag) == 4 and all(s.inode for s in diag)
        assert sorted(diag, key=repr) == sorted(files, key=repr)
        fs = HostFS("/")
        assert listeners.own_netns(fs)
        assert {s.address for s in on_ports(fs, ours)} == {"127.0.0.1", "0.0.0.0", "::1", "::"}


@pytest.mark.parametrize("error", [OSError(93, "Protocol not supported"), struct.error("unpack_from requires 72")])
def test_a_failing_sock_diag_falls_back_to_the_tables_and_is_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception) -> None:
    """No inet_diag in the kernel, or an answer shorter than its header says: the agent's own tables are read, the
    failure logged the first time only; discovery sees the listeners all the same."""

    def broken(family: int) -> list[Listener]:
        raise error

    monkeypatch.setattr(listeners, "_diag", broken)
    monkeypatch.setattr(listeners, "_diag_failed", False)
    with bound() as ours, caplog.at_level("WARNING", logger="qosagent.listeners"):
        for _ in range(2):
            got = listeners.listeners(HostFS("/"))
            assert got is not None and ours <= {s.port for s in got}
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["sock_diag failed"]


class OneAnswer:
    """A netlink socket whose dump answers with one datagram: `data`."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.recvs = 0

    def __call__(self, *_: object) -> "OneAnswer":
        self.recvs = 0  # a socket anew
        return self

    def __enter__(self) -> "OneAnswer":
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def send(self, _req: bytes) -> None:
        pass

    def recv(self, _n: int) -> bytes:
        self.recvs += 1
        assert self.recvs == 1, "one datagram: a second read is a loop that did not end"
        return self.data


def _nlmsg(length: int, kind: int, body: bytes = b"") -> bytes:
    return listeners._NLMSG.pack(length, kind, 2, 1, 0) + body


LISTENING = listeners._MSG.pack(socket.AF_INET, 10, 0, 0, (8080).to_bytes(2, "big"), bytes(16), 7001)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("data", [
    _nlmsg(0, listeners.SOCK_DIAG_BY_FAMILY) + LISTENING,  # length 0: off never moved, the thread spun for ever
    _nlmsg(8, listeners.NLMSG_DONE),  # shorter than its own header
    _nlmsg(16, listeners.SOCK_DIAG_BY_FAMILY) + LISTENING,  # a header alone: the next message's bytes taken as its
    _nlmsg(400, listeners.SOCK_DIAG_BY_FAMILY) + LISTENING,  # past the datagram's end
], ids=["zero", "short-done", "header-only", "past-end"])
def test_a_netlink_length_that_does_not_fit_is_eproto_and_falls_back(
        monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """A message length that cannot be the message's: EPROTO, not an endless loop in the discovery thread nor another
    message's bytes read as this one's; listeners() reads the tables instead."""
    with bound() as ours:
        monkeypatch.setattr(listeners.socket, "socket", OneAnswer(data))
        with pytest.raises(OSError) as e:
            listeners._diag(socket.AF_INET)
        assert e.value.errno == errno.EPROTO, e.value
        got = listeners.listeners(HostFS("/"))
        assert got is not None and ours <= {s.port for s in got}


def test_a_well_formed_answer_still_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    length = listeners._NLMSG.size + len(LISTENING)
    data = _nlmsg(length, listeners.SOCK_DIAG_BY_FAMILY) + LISTENING + _nlmsg(20, listeners.NLMSG_DONE, bytes(4))
    monkeypatch.setattr(listeners.socket, "socket", OneAnswer(data))
    assert listeners._diag(socket.AF_INET) == [Listener(8080, "00000000", 7001)]


def test_a_fixture_root_is_not_the_agents_namespace(tmp_path: Path) -> None:
    tables(tmp_path / "proc" / "net", V4, V6)
    assert not listeners.own_netns(HostFS(tmp_path))
    assert {s.inode for s in listeners.listeners(HostFS(tmp_path)) or ()} == {5001, 5002, 5003, 5004}
