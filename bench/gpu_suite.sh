#!/usr/bin/env bash
# The GPU suite on a machine with a GPU and no network, from files prepared on a CPU
# machine (`make gpu-suite-files`; bench/RESULTS.md, "On a GPU", says how):
#
#   Every phase first measures the card (OUT/calibration.json, pdecomp.gate.microbench).
#   bench/gpu_suite.sh speed OUT     pdecomp beside the reference, the gate beside the
#                                    measured peak
#   bench/gpu_suite.sh quality OUT   the robust recipe on SmolLM2, reported as VPD reports
#   bench/gpu_suite.sh all OUT       both
#   bench/gpu_suite.sh flags OUT     the peers' GPU flags, each alone against XLA's defaults
#                                    (bench/gpu_flags.py; FLAGS_BUDGET_S, default 240)
#   bench/gpu_suite.sh kernels OUT   each kernel's forecast beside its time in the step, for
#                                    the SmolLM2 speed steps the forecast misses most
#                                    (bench/kernel_times.py, from a profile)
#   bench/gpu_suite.sh stash         only keep what this transfer brought (below)
#
# Its inputs, under .gpu/ in the checkout at any depth: spd.tar.xz (the reference at
# 3f0bb61), smollm2-meta.tar.xz (SmolLM2's config and tokenizer), model.gguf.xz.part*
# (SmolLM2's GGUF file, xz-compressed and split) and tokens.u16 (+ .json); wheels of what
# the machine's Python lacks in .whl/ (and .whl/reference/: the reference's alone). They
# may come in separate transfers: each call first copies what it finds into the state
# folder, outside the checkout (GPU_SUITE_STATE, default /tmp/pdecomp-gpu-suite), which
# also keeps the installed wheels and the unpacked reference and model between calls.
# REDUCED=1: CPU-sized. SPEED_BUDGET_S (default 240): no speed row starts past it.
# QUALITY_STEPS (default 2000: 49 ms each on one H200), CURVE_BATCHES (default 4): the
# quality run's steps and the held-out batches of its fresh-PGD curve. Measured on one H200:
# `speed` 300 s (four rows of about 30 s for pdecomp and 30 s for the reference), `quality`
# 319 s at CURVE_BATCHES=2 (the model's conversion, a 55 s compile, 100 s of steps).
set -euo pipefail
phase=${1:?speed, quality, all, flags, kernels or stash}
root=$(cd "$(dirname "$0")/.." && pwd)
state=${GPU_SUITE_STATE:-/tmp/pdecomp-gpu-suite}
py=${PYTHON:-python3}
mkdir -p "$state"
if [ -d "$root/.gpu" ]; then
  find "$root/.gpu" -type f \( -name '*.tar.xz' -o -name 'model.gguf.xz.part*' \
    -o -name 'tokens.u16*' \) -exec cp {} "$state/" \;
fi
install() {  # wheels folder, target
  if compgen -G "$1/*.whl" > /dev/null && [ ! -e "$2/.installed" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$2" "$1"/*.whl
    touch "$2/.installed"
  fi
}
install "$root/.whl" "$state/site"
install "$root/.whl/reference" "$state/ref-site"
[ "$phase" = stash ] && { ls "$state"; exit 0; }
out=${2:?an output directory}
mkdir -p "$out"
export PYTHONPATH="$root:$state/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unpack() {  # archive, destination
  [ -e "$2" ] || { mkdir -p "$2" && tar -xJf "$state/$1" -C "$2"; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee "$out/device.txt" || true
# First the card's calibration (pdecomp.gate.microbench, about a minute): the file that
# replaces pdecomp/gate/calibrations/<card>.json, and what this run's gates forecast with.
if [ ! -e "$out/calibration.json" ]; then
  "$py" -c "import sys; from pathlib import Path; from pdecomp.gate import calibration, microbench
calibration.write(microbench.measure(), Path(sys.argv[1]))" "$out/calibration.json"
fi
export PDECOMP_CALIBRATION="$out/calibration.json"
if [ "$phase" = speed ] || [ "$phase" = all ]; then
  unpack spd.tar.xz "$state/spd"
  unpack smollm2-meta.tar.xz "$state/meta"
  "$py" "$root/bench/gpu_suite.py" speed --out "$out" --model "$state/meta/smollm2" \
    --spd "$state/spd" --ref-path "$state/ref-site" \
    --budget-s "${SPEED_BUDGET_S:-240}" ${REDUCED:+--reduced}
fi
if [ "$phase" = flags ]; then
  "$py" "$root/bench/gpu_flags.py" --out "$out" --budget-s "${FLAGS_BUDGET_S:-240}" \
    ${REDUCED:+--reduced}
fi
if [ "$phase" = kernels ]; then
  for job in smollm2_l28_mlp_ci_8x128_bfloat16 smollm2_l28_mlp_ci_64x128_float32 \
      quality_12_sites; do
    "$py" "$root/bench/kernel_times.py" --job "$job" 20 > "$out/kernels_$job.json" || true
  done
fi
if [ "$phase" = quality ] || [ "$phase" = all ]; then
  if [ ! -d "$state/smollm2" ]; then
    ls "$state"/model.gguf.xz.part* | sort -V | xargs cat | xz -d > "$state/model.gguf"
    "$py" -c "import sys; from launcher.app import main; sys.argv[0] = 'pdecomp'; main()" \
      convert "$state/model.gguf" "$state/smollm2"
  fi
  "$py" "$root/bench/gpu_suite.py" quality --out "$out" --model "$state/smollm2" \
    --data "$state/tokens.u16" --run-dir "$state/quality_run" \
    --steps "${QUALITY_STEPS:-2000}" --curve-batches "${CURVE_BATCHES:-4}" \
    ${REDUCED:+--reduced}
fi
