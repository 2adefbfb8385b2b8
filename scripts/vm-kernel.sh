#!/usr/bin/env bash
# What the kernel matrix (tests/vm) needs to boot distro kernels in a VM on this host's root filesystem: QEMU,
# virtme-ng, each kernel of tests/vm/kernels.txt (image, modules, headers) unpacked into a cache directory, and a
# wheelhouse for the agent's install inside the VM (tests/vm/test_systemd_unit.py runs `make install` there, with
# no network). Idempotent and quick when all is there. Nothing is installed into /boot, /lib/modules or dpkg's
# database for the VM's kernels, and the host's own kernel and apt set-up are never touched: each suite's package
# lists live in an apt state of their own under the cache (Debian's archive, deb.debian.org, the same registry the
# host's apt uses), virtme-ng links the cache's modules directory into the guest's /lib/modules itself, and the
# cache's `build` link points at the cache's headers.
# Called by scripts/setup.sh with QOSAGENT_SETUP_VM=1 (`make setup-kernels`); QOSAGENT_VM_KERNEL=<version> fetches
# that kernel instead of the list's (its suite: QOSAGENT_VM_SUITE, default bookworm), QOSAGENT_VM_CACHE another
# cache.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# Outside /var/cache and /tmp: virtme-ng mounts a fresh tmpfs on /var/cache in the guest, which would hide it.
CACHE=${QOSAGENT_VM_CACHE:-/var/lib/qosagent-vm}
VNG_VERSION=1.42
MIRROR=http://deb.debian.org/debian

want_apt=()
need() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || want_apt+=("$1"); }
# qemu-system-x86 runs the VM; kmod's depmod indexes the cache's modules; virtme-ng builds its initramfs with a
# static busybox; the guest's init runs the host's udevd to name the virtio-serial ports its commands talk over
# (without it the guest's output and exit status are lost). udev is not started on the host by this install.
for p in qemu-system-x86 kmod busybox-static udev; do need "$p"; done
if [ ${#want_apt[@]} -gt 0 ]; then
  echo "vm-kernel: installing ${want_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/vng" ]; then
  echo "vm-kernel: installing virtme-ng $VNG_VERSION into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "virtme-ng==$VNG_VERSION"
fi

# apt-get or apt-cache for one suite, on lists of its own (never the host's sources or lists).
suite_apt() {
  local tool=$1 suite=$2; shift 2
  local state="$CACHE/apt/$suite"
  "$tool" -o Dir::State="$state" -o Dir::State::status=/dev/null -o Dir::Cache="$state/cache" \
    -o Dir::Etc::SourceList="$state/sources.list" -o Dir::Etc::SourceParts=/dev/null \
    -o APT::Sandbox::User=root "$@"
}
suite_update() {
  local suite=$1 state="$CACHE/apt/$1"
  mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
  printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s %s main\n' "$MIRROR" "$suite" \
    >"$state/sources.list"
  echo "vm-kernel: reading $suite's package lists" >&2
  suite_apt apt-get "$suite" update -qq
}
# The kernel release (5.10.0-35-amd64) linux-headers-amd64 names in a suite.
suite_kernel() {
  suite_apt apt-cache "$1" depends linux-headers-amd64 2>/dev/null | grep -o 'linux-headers-[0-9][^ ]*-amd64' | head -n 1 \
    | sed 's/^linux-headers-//'
}
cached() {  # the newest complete kernel of a series in the cache
  for d in "$CACHE"/kernels/"$1".*/.complete "$CACHE"/kernels/"$1"-*/.complete; do
    if [ -e "$d" ]; then basename "$(dirname "$d")"; fi
  done | sort -V | tail -n 1
}

fetch() {  # fetch <suite> <kernel release>
  local suite=$1 kver=$2
  local dir="$CACHE/kernels/$kver"
  [ -e "$dir/.complete" ] && return 0
  echo "vm-kernel: fetching kernel $kver ($suite) into $dir" >&2
  local flavour=${kver##*-}         # amd64
  local common="linux-headers-${kver%-"$flavour"}-common"
  local dl
  dl=$(mktemp -d)
  # shellcheck disable=SC2064 # the directory is known now
  trap "rm -rf '$dl'" RETURN
  (cd "$dl" && suite_apt apt-get "$suite" download -qq "linux-image-$kver-unsigned" "linux-headers-$kver" "$common")
  rm -rf "$dir"
  mkdir -p "$dir"
  for deb in "$dl"/*.deb; do dpkg-deb -x "$deb" "$dir"; done
  # Debian 13's packages ship modules under /usr/lib (merged /usr); depmod and virtme-ng look under lib/.
  if [ ! -e "$dir/lib" ] && [ -d "$dir/usr/lib/modules" ]; then ln -s usr/lib "$dir/lib"; fi
  local mods="$dir/lib/modules/$kver"
  # The packages' links name the host's /usr/src; the VM must compile against this kernel's headers, in the cache.
  ln -sfn "$dir/usr/src/linux-headers-$kver" "$mods/build"
  ln -sfn "$dir/usr/src/$common" "$mods/source"
  depmod -b "$dir" "$kver"
  touch "$dir/.complete"
}

if [ -n "${QOSAGENT_VM_KERNEL:-}" ]; then
  suite=${QOSAGENT_VM_SUITE:-bookworm}
  suite_update "$suite"
  fetch "$suite" "$QOSAGENT_VM_KERNEL"
else
  # Each series once: a cached kernel of it is kept (CI's cached machines boot what they have); a fresh machine
  # gets the suite's current one.
  while read -r suite series _; do
    case "$suite" in ''|'#'*) continue ;; esac
    [ -n "$(cached "$series")" ] && continue
    suite_update "$suite"
    kver=$(suite_kernel "$suite")
    [ -n "$kver" ] || { echo "vm-kernel: no $series kernel found in $suite's lists" >&2; exit 1; }
    case "$kver" in "$series".*|"$series"-*) ;; *)
      echo "vm-kernel: $suite's kernel is $kver, not the $series series tests/vm/kernels.txt expects" >&2; exit 1 ;;
    esac
    fetch "$suite" "$kver"
  done <tests/vm/kernels.txt
fi

# The agent's install in the VM (pip, offline): this checkout's dependencies and its build backend as wheels.
wheels="$CACHE/wheels"
stamp="$wheels/.complete-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  echo "vm-kernel: building the install's wheelhouse in $wheels" >&2
  rm -rf "$wheels"
  mkdir -p "$wheels"
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check -d "$wheels" "setuptools>=61" wheel
  src=$(mktemp -d)
  # pip builds in the source tree: a copy, so that the checkout gets no build/ of its own.
  git ls-files -z | xargs -0 cp --parents -t "$src"
  "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check -w "$wheels" "$src"
  rm -rf "$src"
  rm -f "$wheels"/qosagent-*.whl  # the VM installs this checkout, not a copy of it
  touch "$stamp"
fi
