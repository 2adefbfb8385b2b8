"""The one way tests and benches start an agent, wait for it and stop it.

Two forms, one readiness rule (the first tick done and its Snapshot published):
- `AgentProcess`: `qosagent run` of this checkout in a child process (optionally behind a prefix such as nsenter
  or setpriv), ready when its status socket reports `self.ready_seconds`, stopped with SIGTERM like systemd does;
  its output goes to a log file that every failure quotes.
- `AgentThread`: the daemon's `Agent` in this process with its loop in a thread, ready on its `ready` event, for
  callers that read the agent's objects; stopped by `request_stop`, then `Agent.stop()` rolls everything back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
# Waits for the agent's start are multiplied by this: the kernel matrix's VMs (tests/vm) run under emulation when
# KVM is not available, where compiling a BPF program takes tens of seconds instead of one.
TIME_SCALE = float(os.environ.get("QOSAGENT_TEST_TIME_SCALE", "1"))
READY_S = 60.0 * TIME_SCALE  # compiling and loading both BPF programs takes a few seconds here
STOP_S = 30.0 * TIME_SCALE


class AgentFailed(AssertionError):
    """The agent exited, or did not get ready, or did not stop: the message ends with its log."""


def agent_argv(*args: str) -> list[str]:
    """The agent of this checkout (not whatever `qosagent` is on PATH)."""
    return [sys.executable, "-m", "qosagent", *args]


def agent_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def status_socket() -> str:
    """A status socket path of its own under /run (a test's tmp path can exceed a unix socket's 108 bytes)."""
    return os.path.join(tempfile.mkdtemp(prefix="qosagent-test-", dir="/run" if os.access("/run", os.W_OK) else None),
                        "status.sock")


class AgentProcess:
    """`qosagent run --config config` in a child process, its status socket at `socket` (the config's
    status.socket). Use as a context manager, or call start() and stop()."""

    def __init__(self, config: Path | str, socket: str, log: Path | str, *, prefix: Sequence[str] = (),
                 args: Sequence[str] = (), env: dict[str, str] | None = None, argv: Sequence[str] | None = None):
        self.config, self.socket, self.log = str(config), socket, Path(log)
        self.prefix, self.args = list(prefix), list(args)
        # The command that runs the agent, when it is not this checkout's `qosagent run` (another version's).
        self.argv = list(argv) if argv is not None else agent_argv("run", "--config", self.config, *self.args)
        self.env = env if env is not None else agent_env()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = self.ready_s = 0.0

    def start(self, timeout: float = READY_S) -> dict[str, Any]:
        """Start it and wait until it is ready; its status then."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start it without waiting (for a test of how it fails to start: then `wait()`)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.prefix, *self.argv],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = READY_S, poll: float = 0.1) -> dict[str, Any]:
        """The one readiness wait: the status socket answers and reports the first tick done. `ready_s` is then
        the time from launch, as the caller saw it."""
        from qosagent.status import NoAgent, request

        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AgentFailed(f"agent exited with {self.proc.returncode} before it was ready\n{self.output()}")
            try:
                st = request(self.socket, {"cmd": "status"}, timeout=2)
            except (NoAgent, OSError, ValueError):
                st = {}
            if st.get("self", {}).get("ready_seconds") is not None:
                self.ready_s = time.monotonic() - self.started
                return st
            time.sleep(poll)
        self.kill()
        raise AgentFailed(f"agent not ready in {timeout:.0f} s\n{self.output()}")

    def status(self, decisions: bool = False) -> dict[str, Any]:
        from qosagent.status import request

        return request(self.socket, {"cmd": "status", "decisions": decisions}, timeout=15 * TIME_SCALE)

    def reload(self) -> dict[str, Any]:
        from qosagent.status import request

        return request(self.socket, {"cmd": "reload"}, timeout=30 * TIME_SCALE)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = STOP_S) -> int:
        """Its exit status, once it has exited on its own."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AgentFailed(f"agent still running after {timeout:.0f} s\n{self.output()}") from None

    def stop(self, timeout: float = STOP_S) -> int:
        """SIGTERM, as systemd and the kubelet stop it; its exit status (SIGKILL after timeout, then AgentFailed)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.wait(timeout)
        run_dir = os.path.dirname(self.socket)
        if os.path.basename(run_dir).startswith("qosagent-test-"):
            shutil.rmtree(run_dir, ignore_errors=True)
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "AgentProcess":
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()


class AgentThread:
    """An `Agent` started in this process, its loop ticking in a thread until the context ends."""

    def __init__(self, agent: Any, timeout: float = READY_S, notify: Any = None):
        self.agent = agent
        self.timeout, self.notify = timeout, notify
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.agent.run(notify=self.notify)
        except BaseException as e:  # noqa: BLE001 - handed to the caller at the readiness wait or the stop
            self._error = e
            self.agent.ready.set()

    def __enter__(self) -> Any:
        self.agent.start()
        self._thread = threading.Thread(target=self._run, name="agent-loop", daemon=True)
        self._thread.start()
        if not self.agent.ready.wait(self.timeout) or self._error is not None:
            self.__exit__()
            raise AgentFailed(f"agent not ready in {self.timeout:.0f} s: {self._error!r}")
        return self.agent

    def __exit__(self, *_exc: object) -> None:
        self.agent.request_stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(STOP_S)
        self.agent.stop()
        if thread is not None and thread.is_alive():
            raise AgentFailed(f"the agent's loop did not stop in {STOP_S:.0f} s of a stop request")
        if self._error is not None:
            raise AgentFailed(f"the agent's loop failed: {self._error!r}") from self._error
