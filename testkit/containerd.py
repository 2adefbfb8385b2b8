"""A real containerd of the test's own: its config, root, state, socket, CNI config and runc root all under a
directory of the test's, in a network namespace of the test's (so the CNI bridge and its veths stay out of the
host's), with a pause image built from busybox (nothing is pulled). close() removes what it made: its sandboxes,
the daemon and its shims, their mounts, cgroups and network namespaces. A host containerd is never touched."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from qosagent.pods.cri import SERVICE
from testkit import cri

PAUSE = "qosagent.test/pause:1"
BUSYBOX = "/bin/busybox"


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def pause_image(dst: Path) -> Path:
    """An OCI image archive whose entrypoint sleeps (busybox), tagged PAUSE, for `ctr images import`."""
    layout = dst / "pause-oci"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for d in ("bin", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
    layer = raw.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    gz, gz_size = _blob(blobs, gzip.compress(layer, mtime=0))
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {
        "Entrypoint": ["/bin/busybox", "sleep", "1000000"]}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
    ).encode()
    cfg, cfg_size = _blob(blobs, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg,
                                      "size": cfg_size},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": gz,
                                       "size": gz_size}]}).encode()
    man, man_size = _blob(blobs, manifest)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man, "size": man_size,
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": PAUSE, "org.opencontainers.image.ref.name": "1"}}]}))
    out = dst / "pause.tar"
    with tarfile.open(out, "w") as tar:
        for f in sorted(layout.rglob("*")):
            tar.add(f, str(f.relative_to(layout)), recursive=False)
    return out


class Containerd:
    def __init__(self, base: Path, netns: str, tag: str, subnet: str):
        self.base, self.netns, self.tag = base, netns, tag
        self.socket = str(base / "containerd.sock")
        self.cgroup_root = f"/qa-{tag}"  # every pod's cgroup_parent lies below it
        self.log = base / "containerd.log"
        self.proc: subprocess.Popen | None = None
        self.sandboxes: list[str] = []
        self._client = None
        # containerd 1.6 puts shim sockets under /run/containerd/s whatever its state dir: made here if absent,
        # and removed again by close().
        self._made_run = not os.path.exists("/run/containerd")
        for d in ("root", "state", "cni-conf", "cni-data", "runc", "opt", "logs"):
            (base / d).mkdir(parents=True, exist_ok=True)
        (base / "cni-conf" / "10-qa.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": f"qa-{tag}", "plugins": [{
                "type": "bridge", "bridge": "qa-br0", "isGateway": True, "ipMasq": False,
                "ipam": {"type": "host-local", "subnet": subnet, "dataDir": str(base / "cni-data")}}]}))
        runc = 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc'
        (base / "config.toml").write_text(f"""version = 2
root = "{base}/root"
state = "{base}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{base}/containerd.sock.ttrpc"
[debug]
  address = "{base}/debug.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{base}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # The pods' network namespaces under our state dir, not the host's /run/netns: one a failed removal leaves is
  # unmounted by close()'s sweep with the rest of our mounts, and `ip netns` never lists them meanwhile.
  netns_mounts_under_state_dir = true
  # The sandbox asks for oom_score_adj -998, which needs CAP_SYS_RESOURCE: no lower than containerd's own instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{base}/cni-conf"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
  [{runc}]
    runtime_type = "io.containerd.runc.v2"
  [{runc}.options]
    SystemdCgroup = false
    Root = "{base}/runc"
""")

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns}", "containerd", "--config",
                                      str(self.base / "config.toml")], stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        from qosagent.pods.cri import CriClient, CriError

        self._client = CriClient(self.socket, 2.0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._client.version()
                return
            except CriError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"containerd did not start:\n{self.log.read_text()[-3000:]}") from None
                time.sleep(0.2)

    def ctr(self, *args: str) -> str:
        return subprocess.run(["ctr", "--address", self.socket, "--namespace", "k8s.io", *args], check=True,
                              capture_output=True, text=True, timeout=60).stdout

    def call(self, method: str, request: bytes, timeout: float = 60.0) -> bytes:
        assert self._client is not None
        return self._client.channel.unary_unary(SERVICE + method)(request, timeout=timeout)

    def run_pod(self, name: str, uid: str, namespace: str, labels: dict[str, str]) -> str:
        """A pod sandbox through CRI RunPodSandbox, as a kubelet with the cgroupfs driver makes it."""
        parent = f"{self.cgroup_root}/kubepods/besteffort/pod{uid}"
        sid = cri.sandbox_id(self.call("RunPodSandbox", cri.run_pod_sandbox_request(
            name, uid, namespace, labels, parent, str(self.base / "logs"))))
        self.sandboxes.append(sid)
        return sid

    def sandbox_pid(self, uid: str) -> int:
        """The sandbox's (pause) process: the one in the pod's cgroup."""
        for procs in Path("/sys/fs/cgroup").glob(f"*{self.cgroup_root}/kubepods/besteffort/pod{uid}/*/cgroup.procs"):
            pids = procs.read_text().split()
            if pids:
                return int(pids[0])
        raise AssertionError(f"no process in pod{uid}'s cgroup")

    def close(self) -> None:
        for sid in reversed(self.sandboxes):
            for method in ("StopPodSandbox", "RemovePodSandbox"):
                try:
                    self.call(method, cri.by_sandbox_id(sid), timeout=30)
                except Exception:  # noqa: BLE001 - a half-started sandbox: the sweep below removes the rest
                    pass
        if self._client is not None:
            self._client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._sweep()

    def _sweep(self) -> None:
        """What a sandbox that could not be removed leaves: its shim and pause processes, mounts, namespaces,
        cgroups; every one found by our paths, never by a name others could share."""
        base = str(self.base)
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                cg = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
            if base in cmd or f"{self.cgroup_root}/" in cg:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.2)
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for m in reversed(mounts):
            if m.startswith(base):
                subprocess.run(["umount", "-l", m], capture_output=True)
        for d in {p.resolve() for p in Path("/sys/fs/cgroup").glob(f"*{self.cgroup_root}")}:
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [d]:
                try:
                    sub.rmdir()
                except OSError:  # gone already, or still busy: the fixtures assert that none is left
                    pass
        if self._made_run:
            shutil.rmtree("/run/containerd", ignore_errors=True)
