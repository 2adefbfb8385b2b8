"""Shared test plumbing: privileged tests run for real, and under CI=true a missing capability fails."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from testkit.fixtures import sysfs_snapshot

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, why: str) -> None:
    """Skip when a privilege or tool is missing here; under CI=true the same is a failure, never a skip."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and {why}: privileged tests must run in CI", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def root() -> None:
    require(os.geteuid() == 0, "not root")


@pytest.fixture
def bpf(root: None) -> Iterator[None]:
    from qosagent.config import parse
    from qosagent.ebpf import pinned
    from qosagent.ebpf.loader import headers_present

    try:
        import bcc  # noqa: F401
    except ImportError:
        require(False, "bcc not importable")
    require(headers_present(), "no kernel headers (run make setup)")
    yield
    # A stopped agent keeps its latency build pinned for the next one (qosagent/ebpf/pinned.py): what the test's
    # agents left on the default pin root goes with the test, as `qosagent detach` would remove it.
    pinned.remove_builds(parse({}, "default").bpf.pin_root, "latency")


@pytest.fixture
def cgroup(root: None) -> Iterator[str]:
    """A fresh child cgroup under the host's cgroup2 mount (host path), removed even when the test fails."""
    from qosagent.cgroups import cgroup2_mount
    from qosagent.hostfs import HostFS

    mount = cgroup2_mount(HostFS("/"))
    require(mount is not None, "no cgroup2 hierarchy mounted")
    path = f"{mount}/qosagent-test-{secrets.token_hex(4)}"
    os.mkdir(path)
    try:
        yield path
    finally:
        os.rmdir(path)


@pytest.fixture(scope="session")
def node_exporter_sysfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the real host snapshot (tests/fixtures), shared by tests: do not write to it."""
    return sysfs_snapshot(tmp_path_factory.mktemp("sysfs") / "node-exporter-host")


@pytest.fixture
def copied_sysfs(node_exporter_sysfs: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the real host snapshot."""
    dst = tmp_path / "host"
    shutil.copytree(node_exporter_sysfs, dst, symlinks=True)
    return dst


@contextlib.contextmanager
def netns(owner: str) -> Iterator[str]:
    """A throwaway network namespace `qa-<owner>-<random>` with its lo up, deleted even when the test fails."""
    name = f"qa-{owner}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
