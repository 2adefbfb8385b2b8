#!/usr/bin/env bash
# What the kernel matrix (tests/vm) needs to boot a distro kernel in a VM on this host's root filesystem:
# QEMU, virtme-ng, and Debian 12's 6.1 kernel (image, modules, headers) unpacked into a cache directory.
# Idempotent and quick when all is there. Nothing is installed into /boot, /lib/modules or dpkg's database for the
# VM's kernel, and the host's own kernel set-up is never touched: virtme-ng links the cache's modules directory into
# the guest's /lib/modules itself, and the cache's `build` link points at the cache's headers.
# Called by scripts/setup.sh with QOSAGENT_SETUP_VM=1 (`make setup-kernels`); QOSAGENT_VM_KERNEL=<version> picks
# another kernel, QOSAGENT_VM_CACHE another cache.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# Outside /var/cache and /tmp: virtme-ng mounts a fresh tmpfs on /var/cache in the guest, which would hide it.
CACHE=${QOSAGENT_VM_CACHE:-/var/lib/qosagent-vm}
VNG_VERSION=1.42

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

# The kernel: as asked, else one already in the cache, else the one Debian's current 6.1 headers package names.
kver=${QOSAGENT_VM_KERNEL:-}
if [ -z "$kver" ]; then
  kver=$(for d in "$CACHE"/kernels/*/.complete; do if [ -e "$d" ]; then basename "$(dirname "$d")"; fi; done | sort -V \
         | tail -n 1)
fi
if [ -z "$kver" ]; then
  kver=$(apt-cache depends linux-headers-amd64 2>/dev/null | grep -o 'linux-headers-6\.1\.[0-9]*-[0-9]*-amd64' \
         | head -n 1 | sed 's/^linux-headers-//')
  if [ -z "$kver" ]; then
    apt-get update -qq
    kver=$(apt-cache depends linux-headers-amd64 | grep -o 'linux-headers-6\.1\.[0-9]*-[0-9]*-amd64' | head -n 1 \
           | sed 's/^linux-headers-//')
  fi
fi
[ -n "$kver" ] || { echo "vm-kernel: no Debian 6.1 kernel found in apt's lists" >&2; exit 1; }

dir="$CACHE/kernels/$kver"
if [ ! -e "$dir/.complete" ]; then
  echo "vm-kernel: fetching kernel $kver into $dir" >&2
  flavour=${kver##*-}              # amd64
  common="linux-headers-${kver%-"$flavour"}-common"
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  chmod 755 "$dl"  # apt's sandbox user writes the downloads
  (cd "$dl" && apt-get download -qq "linux-image-$kver-unsigned" "linux-headers-$kver" "$common" 2>/dev/null) || {
    apt-get update -qq
    (cd "$dl" && apt-get download -qq "linux-image-$kver-unsigned" "linux-headers-$kver" "$common")
  }
  rm -rf "$dir"
  mkdir -p "$dir"
  for deb in "$dl"/*.deb; do dpkg-deb -x "$deb" "$dir"; done
  mods="$dir/lib/modules/$kver"
  # The packages' links name the host's /usr/src; the VM must compile against this kernel's headers, in the cache.
  ln -sfn "$dir/usr/src/linux-headers-$kver" "$mods/build"
  ln -sfn "$dir/usr/src/$common" "$mods/source"
  depmod -b "$dir" "$kver"
  touch "$dir/.complete"
fi
