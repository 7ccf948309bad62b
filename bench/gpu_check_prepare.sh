#!/usr/bin/env bash
# Download, here (with network), every wheel the offline GPU machine lacks, into .gpu-wheels/ (git-ignored).
#
# The device has Python 3.12 with torch, transformers, aiohttp, nvidia-ml-py, pyarrow, scipy, click, rich,
# psutil, prometheus-client and matplotlib, and no network. It lacks powerprof itself, openpyxl and pyRAPL
# (DuckDB is optional: it comes along only while everything stays under the device tool's 64 MiB limit).
# Then run on the device, with .gpu-wheels carried:  bash bench/gpu_check_run.sh   (see docs/hardware.md)
#
# Usage: bash bench/gpu_check_prepare.sh [--no-duckdb]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-wheels
LIMIT_MIB=56   # the device tool carries at most 64 MiB of ignored paths; keep room for the tree itself
PY=${PYTHON:-python3}
rm -rf "$DEST"
mkdir -p "$DEST"
PLAT=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

# powerprof itself, built from this tree (pure Python); setuptools' build/ and egg-info go afterwards
# unless they were there before.
leftovers=()
for d in build powerprof.egg-info; do [[ -e "$d" ]] || leftovers+=("$d"); done
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$DEST" . 2>/dev/null || "$PY" -m pip wheel --no-deps -q -w "$DEST" .
for d in ${leftovers[@]+"${leftovers[@]}"}; do rm -rf "$d"; done

# What the device lacks, by name, without dependencies it already has (pyRAPL and openpyxl need only et-xmlfile).
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" openpyxl et-xmlfile pyRAPL

if [[ "${1:-}" != "--no-duckdb" ]]; then
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" duckdb
fi

total_kib=$(du -sk "$DEST" | cut -f1)
if (( total_kib > LIMIT_MIB * 1024 )); then
  echo "wheels take $((total_kib / 1024)) MiB, over ${LIMIT_MIB} MiB: dropping the optional DuckDB" >&2
  rm -f "$DEST"/duckdb-*.whl
  total_kib=$(du -sk "$DEST" | cut -f1)
fi
ls -l "$DEST"
echo "total: $(awk "BEGIN{printf \"%.1f\", $total_kib/1024}") MiB in $DEST (carry limit 64 MiB)"
