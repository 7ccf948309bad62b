#!/usr/bin/env bash
# Run bench/gpu_check.py on the GPU machine (no network): install the carried wheels, check, write to $OUT.
#
# Needs .gpu-wheels/ from bench/gpu_check_prepare.sh (carried by the device tool: carry [".gpu-wheels"]).
# Installs powerprof and what the machine lacks into a venv over the system packages (torch,
# transformers, pynvml, ... stay the system's); if that venv cannot be made, unpacks the wheels onto
# PYTHONPATH instead. Never changes a GPU setting: the check is read-only and proves it (see docs/hardware.md).
#
# Usage: bash bench/gpu_check_run.sh [gpu_check.py options...]     env: OUT, GPU_CHECK_TIMEOUT_S (default 300)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
RES="$OUT/gpu_check"
mkdir -p "$RES"
exec > >(tee -a "$RES/run.log") 2>&1
echo "gpu_check_run: $(date -u +%FT%TZ) on $(hostname)"

# The Python that has torch and NVML bindings (the machine's own).
PY=""
for cand in ${PYTHON:-} python3 python python3.12; do
  if command -v "$cand" >/dev/null && "$cand" -c "import torch, transformers, pynvml" 2>/dev/null; then PY=$cand; break; fi
done
if [[ -z "$PY" ]]; then echo "no python with torch, transformers and pynvml found" >&2; exit 3; fi
"$PY" - <<'PY'
import sys, torch, transformers, pynvml
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| available", torch.cuda.is_available())
PY
nvidia-smi > "$RES/nvidia-smi.txt" 2>&1 || true   # read-only: the driver's own view, for the record
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$RES/nvidia-smi-q.txt" 2>&1 || true

ls .gpu-wheels/*.whl >/dev/null 2>&1 || { echo "no .gpu-wheels/: run bench/gpu_check_prepare.sh first and carry it" >&2; exit 3; }
VENV=${VENV:-/tmp/powerprof-gpu-check-venv}
RUNPY=""
if "$PY" -m venv --system-site-packages "$VENV" 2>"$RES/venv.err"; then
  if "$VENV/bin/python" -m pip install -q --no-index --find-links .gpu-wheels powerprof openpyxl pyRAPL; then
    RUNPY="$VENV/bin/python"
  else
    echo "pip could not resolve powerprof's requirements from the system packages; installing without them"
    "$VENV/bin/python" -m pip install -q --no-index --no-deps .gpu-wheels/*.whl && RUNPY="$VENV/bin/python"
  fi
  ls .gpu-wheels/duckdb-*.whl >/dev/null 2>&1 && "$VENV/bin/python" -m pip install -q --no-index --no-deps .gpu-wheels/duckdb-*.whl
  [[ -n "$RUNPY" ]] && "$RUNPY" -m pip check > "$RES/pip-check.txt" 2>&1
  # A venv over a Python that is itself a venv or conda env does not see that env's packages.
  if [[ -n "$RUNPY" ]] && ! "$RUNPY" -c "import torch, transformers, pynvml, numpy, pyarrow, aiohttp, powerprof" 2>>"$RES/venv.err"; then
    echo "the venv does not see the machine's packages (see venv.err)"
    RUNPY=""
  fi
fi
if [[ -z "$RUNPY" ]]; then
  echo "no usable venv (see venv.err): the machine's Python with the wheels unpacked onto PYTHONPATH"
  SITE=/tmp/powerprof-gpu-check-site
  rm -rf "$SITE" && mkdir -p "$SITE"
  for w in .gpu-wheels/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  RUNPY=$PY
fi
# Run from outside the tree so the installed powerprof is what the check imports.
cd "$RES"
"$RUNPY" -c "import powerprof, sys; print('powerprof', powerprof.__version__, 'from', powerprof.__file__)"
timeout -k 15 "${GPU_CHECK_TIMEOUT_S:-300}" "$RUNPY" "$ROOT/bench/gpu_check.py" --out "$RES" "$@"
rc=$?
echo "gpu_check exit $rc"
# Killed past its cleanup: end the decode server it started (by its recorded pid only).
if [[ -f "$RES/server.pid" ]]; then kill "$(cat "$RES/server.pid")" 2>/dev/null && echo "stopped the leftover decode server"; fi
nvidia-smi --query-gpu=power.limit,enforced.power.limit,clocks.sm,power.draw --format=csv >> "$RES/nvidia-smi.txt" 2>&1 || true
exit $rc
