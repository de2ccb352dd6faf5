#!/usr/bin/env bash
# Wheels for the Python packages scripts/gpu_check.sh needs that the lent GPU machine's image
# lacks. That machine reaches no package registry, so they are fetched here, into .whl/ (git
# ignores it), and travel with the device run, which installs them before anything else:
#
#   scripts/gpu_wheels.sh                       # here: msgspec for CPython 3.12
#   device run: command "scripts/gpu_check.sh", carry [".whl"], timeout_s 420
#
# The default list is what the engine imports and the 'nvidia-h200' image did not hold when
# its package list was read (2026-11-17: torch 2.11+cu130, safetensors, tokenizers, numpy,
# jinja2, pytest, hypothesis and ninja are there; msgspec is not). gpu_check.sh names any
# module still missing on the machine, so a change in the image shows up as one clear line.
#   PY_VERSION=3.12 scripts/gpu_wheels.sh PACKAGE[==VERSION] ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=${KVSENTRY_WHEELS:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PACKAGES=("$@")
[ ${#PACKAGES[@]} -gt 0 ] || PACKAGES=(msgspec)
mkdir -p "$DEST"
# pip matches each manylinux tag exactly: list the common ones. --no-deps: msgspec needs none;
# name any dependency of another package explicitly (one version of each).
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${PACKAGES[@]}"
ls -1 "$DEST"/*.whl
echo "carry [\"$DEST\"] in the device run; gpu_check.sh installs these before it imports anything"
