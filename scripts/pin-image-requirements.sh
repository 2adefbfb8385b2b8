#!/usr/bin/env bash
# Writes deploy/requirements.txt: the image's Python dependencies (pyproject's, with the pods extra), each pinned to
# one version with the sha256 of its wheel for every architecture the image is built for, so that
# `pip install --require-hashes` in deploy/Dockerfile installs exactly what was reviewed, on amd64 and arm64 alike.
# Run after changing pyproject's dependencies; commit the result. Needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Debian 12's python3 (the image's interpreter: bcc's bindings exist only for it).
PYVER=3.11
mapfile -t reqs < <("$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"]["pods"]:
    print(r)
PYEOF
)
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
for arch in x86_64 aarch64; do
  plats=()
  for p in manylinux2014 manylinux_2_17 manylinux_2_28 manylinux_2_34; do plats+=(--platform "${p}_$arch"); done
  "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --abi "cp${PYVER/./}" "${plats[@]}" -d "$dl/$arch" "${reqs[@]}"
done
"$PY" - "$dl" > deploy/requirements.txt <<'PYEOF'
import hashlib, pathlib, re, sys
wheels: dict[tuple[str, str], list[str]] = {}
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*/*.whl")):
    name, version = whl.name.split("-")[:2]
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    wheels.setdefault((re.sub(r"[-_.]+", "-", name).lower(), version), []).append(digest)
names = [n for n, _ in wheels]
dup = {n for n in names if names.count(n) > 1}
if dup:
    sys.exit(f"pin-image-requirements: architectures resolved different versions of {sorted(dup)}")
print("# Written by scripts/pin-image-requirements.sh: the image's Python dependencies, with the wheels' hashes for")
print("# amd64 and arm64 (deploy/Dockerfile installs them with --require-hashes). Do not edit by hand.")
for (name, version), digests in sorted(wheels.items()):
    hashes = " ".join(f"--hash=sha256:{d}" for d in sorted(set(digests)))
    print(f"{name}=={version} {hashes}")
PYEOF
echo "pin-image-requirements: wrote deploy/requirements.txt ($(grep -c '==' deploy/requirements.txt) packages)" >&2
