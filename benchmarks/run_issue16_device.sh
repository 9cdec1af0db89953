#!/usr/bin/env bash
# On the machine of two GPUs (nvidia-h200-x2, onnxruntime-gpu importable, see ../shared/GPU.md): issue 16,
# how `deploykit serve` and `deploykit bench` scale from one GPU to two, on resnet50 fp16 (batch 1..32).
#   OUT=/tmp/results STEPS="convert serve bench" bash benchmarks/run_issue16_device.sh
# convert: run_issue13_device.sh's resnet50 fp16 bundle (STEPS=convert PRECISIONS=fp16 there), in $WORK.
# serve:   benchmarks/serve_load.py, batching on, 32 and 128 clients: one instance on cuda:0, then one
#          instance per GPU (--device cuda --instances 2).
# bench:   `deploykit bench` of deploykit.load at batch 1 and 32 on GPU 0 alone, then one process per GPU
#          at once (CUDA_VISIBLE_DEVICES=K each; they start together, so their timed windows overlap).
# Steps can go in separate 10-minute device calls (the bundle stays in $WORK while the machine is warm);
# each call's summary covers the steps it ran. Results: $OUT/summary.md and $OUT/results.tgz (serve_load's
# tables, JSON and server logs, bench.json files, every step's log).
set -uo pipefail
: "${OUT:?set OUT to a results folder}"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/tests/helpers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 COLUMNS=200
export WORK=${WORK:-/tmp/dk-issue13}  # run_issue13_device.sh's bundles
bundle=$WORK/resnet50-fp16
steps=${STEPS:-convert serve bench}
has_step() { [[ " $steps " == *" $1 "* ]]; }
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

gpus=$(nvidia-smi --list-gpus | wc -l)
stamp "$gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
[ "$gpus" -ge 2 ] || echo "warning: fewer than 2 GPUs, the 2-GPU runs will fail" >&2

if has_step convert; then
  OUT="$OUT/convert" STEPS=convert PRECISIONS=fp16 bash "$root/benchmarks/run_issue13_device.sh" resnet50
  stamp "converted"
fi

serve_load() {  # NAME DEVICE INSTANCES
  python3 "$root/benchmarks/serve_load.py" "$bundle" --device "$2" --instances "$3" --clients 32,128 \
    --requests 200 --batching on --out "$OUT/serve-$1" > "$OUT/serve-$1.log" 2>&1
  stamp "serve_load $1: exit $?"
}
if has_step serve; then
  serve_load 1gpu cuda:0 1
  serve_load 2gpu cuda 2
fi

bench() {  # NAME GPU
  CUDA_VISIBLE_DEVICES=$2 python3 -m deploykit bench "$bundle" --device cuda --batch 1,32 --only deploykit-load \
    --iterations 300 --max-seconds 10 -o "$OUT/bench-$1" > "$OUT/bench-$1.log" 2>&1
  stamp "bench $1 (GPU $2): exit $?"
}
if has_step bench; then
  bench alone 0
  for gpu in $(seq 0 $((gpus - 1))); do bench "gpu$gpu" "$gpu" & done
  wait
fi

python3 "$root/benchmarks/summarize_issue16.py" "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
(cd "$OUT" && shopt -s nullglob && tar czf results.tgz --remove-files ./convert* ./serve-* ./bench-*)
