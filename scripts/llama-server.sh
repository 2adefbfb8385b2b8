#!/usr/bin/env bash
# llama.cpp's `llama-server`, the one real inference engine the suite runs (tests/integration/test_llamacpp_*.py):
# built on CPU from the llama.cpp that llama-cpp-python's sdist vendors, because PyPI is the one source of C++ this
# host's network reaches. The build and the unpacked source (whose gguf-py writes the tests' model) live in a cache
# outside the repository, one directory per sdist version and build flags, so a second run (or CI on the same
# machine) only checks that the binary is there.
#
#   scripts/llama-server.sh build   fetch the sdist and build the binary unless the cache has it (a no-op when it does)
#   scripts/llama-server.sh path    print the cache directory (bin/llama-server, src/gguf-py); exit 1 if not built
#
# Called by scripts/setup.sh with QOSAGENT_SETUP_TEST=1. QOSAGENT_LLAMA_CACHE picks another cache root.
# A cold build (download included) took 791 s (13 min) on 2 shared, busy CPUs at -j2, and 1,102 s (18 min) with
# eight other sessions' builds and tests beside it; the warm check is instant.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VERSION=0.3.36
CACHE=${QOSAGENT_LLAMA_CACHE:-/var/lib/qosagent-llama}
JOBS=${QOSAGENT_LLAMA_JOBS:-2}
# CPU only and nothing fetched at build or run time: no curl/OpenSSL (models come from a file), no web UI (neither
# built with npm nor downloaded from Hugging Face), static libraries so the binary stands alone. GGML_NATIVE tunes
# ggml for this CPU, so the CPU's flags are part of the key: a cache copied to another CPU is rebuilt, not crashed.
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
)
cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
key=$(printf '%s\n' "$VERSION" "${FLAGS[@]}" "$cpu" "$(uname -m)" | sha256sum | cut -c1-12)
dir="$CACHE/$VERSION-$key"

case "${1:-build}" in
  path)
    [ -e "$dir/.complete" ] || { echo "llama-server: not built (run scripts/llama-server.sh build); expected $dir" >&2
                                 exit 1; }
    echo "$dir"
    exit 0 ;;
  build) ;;
  *) echo "usage: $0 build|path" >&2; exit 2 ;;
esac

[ -e "$dir/.complete" ] && exit 0
# Two set-ups at once (two checkouts on one machine) build once: the second waits, then finds it built.
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
[ -e "$dir/.complete" ] && exit 0
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null || { echo "llama-server: $tool is missing (setup.sh installs it)" >&2; exit 1; }
done
echo "llama-server: building llama-cpp-python $VERSION's llama.cpp into $dir (cold: ~13 minutes at -j$JOBS)" >&2
start=$(date +%s)
rm -rf "$dir"
mkdir -p "$dir/dl"
# Only the package itself as source: its build backend (scikit-build-core, for pip's metadata step) comes as a wheel.
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
  -d "$dir/dl" "llama-cpp-python==$VERSION"
tar -xzf "$dir/dl/llama_cpp_python-$VERSION.tar.gz" -C "$dir/dl"
mv "$dir/dl/llama_cpp_python-$VERSION/vendor/llama.cpp" "$dir/src"
rm -rf "$dir/dl"
nice -n 19 cmake -S "$dir/src" -B "$dir/build" "${FLAGS[@]}" >"$dir/cmake.log" 2>&1 \
  || { tail -n 30 "$dir/cmake.log" >&2; exit 1; }
nice -n 19 cmake --build "$dir/build" --target llama-server -j "$JOBS" >"$dir/build.log" 2>&1 \
  || { tail -n 30 "$dir/build.log" >&2; exit 1; }
mkdir -p "$dir/bin"
cp "$dir/build/bin/llama-server" "$dir/bin/llama-server"
"$dir/bin/llama-server" --version >/dev/null 2>&1 || { echo "llama-server: the built binary does not run" >&2; exit 1; }
# The object files are 10x the binary; the source stays for gguf-py.
rm -rf "$dir/build"
echo "$(( $(date +%s) - start ))" >"$dir/build-seconds"
touch "$dir/.complete"
echo "llama-server: built in $(cat "$dir/build-seconds") s" >&2
