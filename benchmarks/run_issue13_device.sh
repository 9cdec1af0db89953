#!/usr/bin/env bash
# On the GPU machine (onnxruntime-gpu importable, see ../shared/GPU.md): the bundles of issue 13 —
# resnet50, vit_b_16 and a BERT-base-sized encoder (12 layers, hidden 768, sequence 128), fp32 and
# fp16, batch 1..32 — converted with AOTInductor packages (static, batch 1 and 32) and --tune, then
# one `deploykit bench` per bundle beside eager PyTorch and torch.compile(mode="reduce-overhead") in
# the bundle's precision.
#   OUT=/tmp/results bash benchmarks/run_issue13_device.sh [MODEL...]   (default: all three)
# One model per call fits the device's 10-minute calls; bundles stay in $WORK on a warm machine.
# Results: $OUT/<model>-<precision>/bench.json, $OUT/convert-*.log, $OUT/summary.md.
set -uo pipefail
: "${OUT:?set OUT to a results folder}"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/tests/helpers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
work=${WORK:-/tmp/dk-issue13}
mkdir -p "$work" "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

# resnet50's BatchNorm statistics measured on random images (as run_bundles_device.sh does), so
# activations stay trained-sized; vit_b_16's zero-initialised head gets random weights.
models=${*:-resnet50 vit_b_16 bert_base}
python3 - "$work" <<'PY'
import sys, torch, torchvision
from deploykit.testing import calibrate_batch_norm
import model_zoo
torch.manual_seed(0)
images = torch.Generator().manual_seed(1)
batches = [torch.randn(8, 3, 224, 224, generator=images) for _ in range(4)]
torch.save(calibrate_batch_norm(torchvision.models.resnet50(), batches, seed=4).state_dict(), f"{sys.argv[1]}/resnet50.pt")
torch.save(model_zoo.vit_b_16().state_dict(), f"{sys.argv[1]}/vit_b_16.pt")
torch.save(model_zoo.bert_base().state_dict(), f"{sys.argv[1]}/bert_base.pt")
PY
stamp "models saved"

declare -A factory=([resnet50]=torchvision.models:resnet50 [vit_b_16]=model_zoo:vit_b_16 [bert_base]=model_zoo:bert_base)
declare -A inputs=([resnet50]="--input x:1x3x224x224" [vit_b_16]="--input x:1x3x224x224"
                   [bert_base]="--input input_ids:1x128:int64 --input attention_mask:1x128:int64")
convert() {  # model precision
  local extra=(); [ "$1" = resnet50 ] && [ "$2" = fp16 ] && extra=(--tolerance atol=0.1)  # see run_bundles_device.sh
  # shellcheck disable=SC2086
  python3 -m deploykit convert "$work/$1.pt" --factory "${factory[$1]}" ${inputs[$1]} --batch 1:1:32 \
    --precision "$2" "${extra[@]}" --backend aoti --aoti-shapes static --tune -o "$work/$1-$2" --force \
    > "$OUT/convert-$1-$2.log" 2>&1
  echo "convert $1 $2: exit $?"
}
for model in $models; do  # fp16 and fp32 side by side: validation and compiling are CPU-bound
  for precision in fp16 fp32; do convert "$model" "$precision" & done
  wait
  stamp "converted $model"
done

only=pytorch,reduce-overhead,ort-deploykit,ort-cuda-graph,aoti-static,deploykit-load
for model in $models; do
  for precision in fp16 fp32; do
    keys=$only; [ "$precision" != fp32 ] && keys="$keys,pytorch-$precision,reduce-overhead-$precision"
    python3 -m deploykit bench "$work/$model-$precision" --model "$work/$model.pt" --factory "${factory[$model]}" \
      --device cuda --batch 1,32 --only "$keys" --iterations 100 --max-seconds 5 -o "$OUT/$model-$precision" \
      > "$OUT/bench-$model-$precision.log" 2>&1
    stamp "bench $model $precision: exit $?"
  done
done
python3 "$root/benchmarks/summarize_issue13.py" "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
