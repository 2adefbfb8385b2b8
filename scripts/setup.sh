#!/usr/bin/env bash
# Installs what the agent and its tests need and is missing; quick when nothing is.
# Idempotent: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
want_apt=()
need() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || want_apt+=("$1"); }

# Runtime: BCC's Python bindings exist only as the distro package; bpftool and tc for inspection and tests.
for p in python3-bpfcc python3-venv iproute2 bpftool; do need "$p"; done
# Test and benchmark tools: real servers, load generators and Prometheus' own tools.
if [ "${QOSAGENT_SETUP_TEST:-0}" = 1 ]; then
  for p in nginx wrk prometheus; do need "$p"; done
  # Pods tenants against a real container runtime (tests/integration/test_pods_containerd.py): containerd's CRI,
  # runc, the CNI bridge plugin, and busybox for the test's own sandbox image. Installing does not start it here:
  # the test runs its own, with its own socket, root and state.
  for p in containerd runc containernetworking-plugins busybox-static; do need "$p"; done
  # Fleet quotas' engine (tests/integration/test_fleet.py): the test runs its own etcd with its own data dir on
  # loopback; the package's own service is not started by the tests.
  need etcd-server
  # A real inference engine (tests/integration/test_llamacpp_*.py): llama.cpp's llama-server, built from source.
  for p in cmake g++ make; do need "$p"; done
fi

kver=$(uname -r)
if [ ! -e "/lib/modules/$kver/build" ]; then
  # The exact headers are preferred; the distro's generic ones work because our BPF C only uses stable ABIs.
  if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
    want_apt+=("linux-headers-$kver")
  else
    need linux-headers-amd64
  fi
fi

if [ ${#want_apt[@]} -gt 0 ]; then
  echo "setup: installing ${want_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want_apt[@]}" >/dev/null
fi

if [ ! -e "/lib/modules/$kver/build" ]; then
  build=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$build" ] || [ -z "$common" ]; then
    echo "setup: no kernel headers found under /usr/src; BPF programs cannot compile" >&2
    exit 1
  fi
  echo "setup: WARNING: no headers for kernel $kver; linking $build (generic distro headers)." >&2
  echo "setup: this is safe for qosagent's BPF C (tracepoint arguments and UAPI structs only)." >&2
  mkdir -p "/lib/modules/$kver"
  ln -sfn "$build" "/lib/modules/$kver/build"
  ln -sfn "$common" "/lib/modules/$kver/source"
fi

# bcc is only in the distro's Python, so the venv is made from it and sees its site packages.
if [ ! -x "$VENV/bin/python" ]; then
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.qosagent-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
  touch "$stamp"
fi
"$VENV/bin/python" -c 'import bcc, pyroute2, qosagent' || { echo "setup: imports failed" >&2; exit 1; }

# llama-server, cached outside the repository by version and build flags (scripts/llama-server.sh): a cold build is
# 5-6 minutes on a fresh machine's 2 CPUs (324 s, 2026-12-02), 13-18 on busy shared ones (791 s, and 1,102 s beside
# eight other builds and test runs), the warm check instant.
if [ "${QOSAGENT_SETUP_TEST:-0}" = 1 ]; then
  VENV="$VENV" scripts/llama-server.sh build
fi

# The oldest Python the agent supports (Ubuntu 22.04's 3.10): the unit suite runs on it too
# (tests/integration/test_ship_python.py), in a venv of its own. Taken from PATH or, where the machine keeps its
# interpreters under pyenv, from pyenv's versions; Debian 12 packages none.
if [ "${QOSAGENT_SETUP_TEST:-0}" = 1 ] && [ ! -x .venv-py310/bin/python ]; then
  py310=
  # A pyenv shim answers `command -v` without running: ask the interpreter itself where it is.
  if command -v python3.10 >/dev/null 2>&1; then py310=$(python3.10 -c 'import sys; print(sys.executable)' 2>/dev/null || true); fi
  if [ -z "$py310" ] && command -v pyenv >/dev/null 2>&1; then
    py310=$(ls -d "$(pyenv root)"/versions/3.10*/bin/python3.10 2>/dev/null | sort -V | tail -n 1)
  fi
  if [ -n "$py310" ]; then
    "$py310" -m venv .venv-py310
    .venv-py310/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  else
    echo "setup: no Python 3.10 found; the unit suite will not run on the oldest supported Python" >&2
  fi
fi

# The kernel matrix (tests/vm, `make test-kernels`): QEMU, virtme-ng and Debian 12's 6.1 kernel in a cache, never
# installed on the host.
if [ "${QOSAGENT_SETUP_VM:-0}" = 1 ]; then
  VENV="$VENV" scripts/vm-kernel.sh
fi
