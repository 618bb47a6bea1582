#!/usr/bin/env bash
# The GPU suite on a machine with a GPU and no network, from files prepared on a CPU
# machine (bench/gpu_suite.py's docstring; bench/RESULTS.md, "On a GPU", says how):
#
#   bench/gpu_suite.sh speed OUT     pdecomp beside the reference, the gate beside the
#                                    measured peak, the quality job's step time
#   bench/gpu_suite.sh quality OUT   the robust recipe on SmolLM2, reported as VPD reports
#   bench/gpu_suite.sh all OUT       both
#
# Reads, under .gpu/ in the checkout (what `make gpu-suite-files` writes; the parts of the
# model may come in separate transfers): spd.tar.xz (the reference at 3f0bb61),
# smollm2-meta.tar.xz (SmolLM2's config and tokenizer), model.gguf.xz.part* (SmolLM2's
# GGUF file, xz-compressed and split) and tokens.u16 (+ .json). Wheels of what the machine's
# Python lacks (.whl/*.whl) are installed into .gpu/site once. REDUCED=1: CPU-sized.
set -euo pipefail
phase=${1:?speed, quality or all}
out=${2:?an output directory}
root=$(cd "$(dirname "$0")/.." && pwd)
gpu=$root/.gpu
py=${PYTHON:-python3}
mkdir -p "$out" "$gpu"
if compgen -G "$root/.whl/*.whl" > /dev/null && [ ! -e "$gpu/site/.installed" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$gpu/site" "$root"/.whl/*.whl
  touch "$gpu/site/.installed"
fi
export PYTHONPATH="$root:$gpu/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
found() { find "$gpu" -name "$1" -print -quit; }
unpack() {  # archive name, destination
  [ -e "$2" ] || { mkdir -p "$2" && tar -xJf "$(found "$1")" -C "$2"; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee "$out/device.txt" || true
budget_speed=${SPEED_BUDGET_S:-300}
budget_quality=${QUALITY_BUDGET_S:-240}
if [ "$phase" = speed ] || [ "$phase" = all ]; then
  unpack spd.tar.xz "$gpu/spd"
  unpack smollm2-meta.tar.xz "$gpu/meta"
  "$py" "$root/bench/gpu_suite.py" speed --out "$out" --model "$gpu/meta/smollm2" \
    --spd "$gpu/spd" --calib "$gpu/calib.json" --budget-s "$budget_speed" ${REDUCED:+--reduced}
fi
if [ "$phase" = quality ] || [ "$phase" = all ]; then
  if [ ! -d "$gpu/smollm2" ]; then
    find "$gpu" -name 'model.gguf.xz.part*' | awk -F'.part' '{print $NF "\t" $0}' \
      | sort -n | cut -f2- | xargs cat | xz -d > "$gpu/model.gguf"
    "$py" -c "import sys; from launcher.app import main; sys.argv[0] = 'pdecomp'; main()" \
      convert "$gpu/model.gguf" "$gpu/smollm2"
  fi
  "$py" "$root/bench/gpu_suite.py" quality --out "$out" --model "$gpu/smollm2" \
    --data "$(found tokens.u16)" --calib "$gpu/calib.json" --budget-s "$budget_quality" \
    ${REDUCED:+--reduced}
fi
