#!/bin/sh
# Points /lib/modules/$(uname -r)/{build,source} at kernel headers BCC can compile against, then runs qosagent.
# The node's own headers win: its /lib/modules is mounted at $QOSAGENT_HOST_MODULES and its /usr/src at /usr/src,
# so the node's links resolve unchanged. Otherwise the image's generic Debian headers are used, with a warning,
# as scripts/setup.sh does on a host: safe because qosagent's BPF C uses only tracepoint arguments and UAPI structs.
set -eu
kver=${QOSAGENT_KERNEL_RELEASE:-$(uname -r)}
host_modules=${QOSAGENT_HOST_MODULES:-/host/lib/modules}
modules=${QOSAGENT_MODULES_DIR:-/lib/modules}
fallback=${QOSAGENT_FALLBACK_HEADERS:-/usr/share/qosagent/headers}

say() { echo "qosagent-entrypoint: $*" >&2; }

if [ ! -d "$modules/$kver/build/include" ]; then
  mkdir -p "$modules/$kver"
  if [ -d "$host_modules/$kver/build/include" ]; then
    ln -sfn "$(readlink "$host_modules/$kver/build")" "$modules/$kver/build"
    if [ -L "$host_modules/$kver/source" ]; then
      ln -sfn "$(readlink "$host_modules/$kver/source")" "$modules/$kver/source"
    fi
    if [ ! -d "$modules/$kver/build/include" ]; then
      say "the node's headers link to $(readlink "$host_modules/$kver/build"), which is not mounted here"
      rm -f "$modules/$kver/build" "$modules/$kver/source"
    fi
  fi
  if [ ! -d "$modules/$kver/build/include" ]; then
    # The image's headers are its architecture's flavour (-amd64, -arm64) beside the shared -common ones.
    build=$(ls -d "$fallback"/linux-headers-* 2>/dev/null | grep -v -- '-common$' | sort -V | tail -n 1)
    common=$(ls -d "$fallback"/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$build" ] || [ -z "$common" ]; then
      say "no kernel headers for $kver on the node and none in the image ($fallback); BPF programs cannot compile"
      exit 1
    fi
    say "WARNING: no headers for kernel $kver on the node; using the image's generic $(basename "$build")"
    ln -sfn "$build" "$modules/$kver/build"
    ln -sfn "$common" "$modules/$kver/source"
  fi
fi
[ "${QOSAGENT_HEADERS_ONLY:-0}" = 1 ] && exit 0
exec qosagent "$@"
