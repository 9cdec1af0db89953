#!/usr/bin/env bash
# On the GPU machine (onnxruntime-gpu importable, see ../shared/GPU.md): convert resnet50 and the
# small transformer to fp32 and fp16 bundles, check every bundle in ONNX Runtime's CUDA EP
# against the fp32 reference (and beside PyTorch's own fp16), and time every backend with
# `deploykit bench`, the fp16 bundle against the fp32 one in the same run.
#   OUT=/tmp/results bash benchmarks/run_bundles_device.sh [convert] [check] [bench-resnet50] [bench-transformer]
# With no stage named, all run. Bundles live in $WORK (default /tmp/dk-bundles), so stages can
# be split over several calls on a warm machine.
set -uo pipefail
: "${OUT:?set OUT to a results folder}"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root:$root/tests/helpers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
work=${WORK:-/tmp/dk-bundles}
mkdir -p "$work" "$OUT"
stages=${*:-convert check bench-resnet50 bench-transformer}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
wants() { [[ " $stages " == *" $1 "* ]]; }

# resnet50: random weights; BatchNorm affine parameters random and running statistics measured
# on random images (deploykit.testing.calibrate_batch_norm), so activations stay trained-sized.
# With random statistics instead, activations reach ~5e4 and no fp16 graph can hold them.
models() {
  python3 - "$work" <<'PY'
import sys, torch, torchvision
from deploykit.testing import calibrate_batch_norm
import model_zoo
torch.manual_seed(0)
images = torch.Generator().manual_seed(1)
batches = [torch.randn(8, 3, 224, 224, generator=images) for _ in range(4)]
torch.save(calibrate_batch_norm(torchvision.models.resnet50(), batches, seed=4).state_dict(), f"{sys.argv[1]}/resnet50.pt")
torch.save(model_zoo.small_transformer().state_dict(), f"{sys.argv[1]}/transformer.pt")
PY
}

# A convert whose validation fails still writes its bundle (exit 1): keep going, say so.
convert() { python3 -m deploykit convert "$@" --force 2>&1 | tee -a "$OUT/convert.log" | tail -3; }

if wants convert; then
  stamp "models"; models
  for precision in fp32 fp16; do
    # Random deep networks amplify rounding: rounding only resnet50's weights to fp16 moves its
    # logits by 1.8% (relative norm, measured in PyTorch), so fp16 gets atol=0.1 on logits of
    # magnitude ~3; cosine >= 0.999 and top-1 agreement are the default fp16 checks.
    tolerance=(); [ "$precision" = fp16 ] && tolerance=(--tolerance atol=0.1)
    stamp "convert resnet50 $precision"
    convert "$work/resnet50.pt" --factory torchvision.models:resnet50 --input x:1x3x224x224 \
      --batch 1:1:32 --precision "$precision" "${tolerance[@]}" -o "$work/resnet50-$precision"
    stamp "convert transformer $precision"
    convert "$work/transformer.pt" --factory model_zoo:small_transformer --input x:1x16x12 \
      --batch 1:1:32 --precision "$precision" -o "$work/transformer-$precision"
  done
fi

if wants check; then
  stamp "accuracy in the CUDA EP"
  { python3 "$root/benchmarks/check_bundles_cuda.py" --factory torchvision.models:resnet50 \
      "$work"/resnet50-fp32 "$work"/resnet50-fp16
    python3 "$root/benchmarks/check_bundles_cuda.py" --factory model_zoo:small_transformer \
      "$work"/transformer-fp32 "$work"/transformer-fp16; } 2>&1 | tee "$OUT/accuracy_cuda.txt"
fi

# `deploykit bench` over one bundle. The fp32 run times every contender; the fp16 run times the
# fp16 bundle against the fp32 bundle (--baseline) and PyTorch in fp32 and fp16 (what the fp32
# run already timed alone, the plain export and torch.compile fp32, is left out to save time).
FP16_CONTENDERS=pytorch,pytorch-fp16,torch-compile-fp16,ort-functions,ort-deploykit,ort-cuda-graph,baseline,baseline-cuda-graph
bench() {  # NAME FACTORY PRECISION
  local name=$1 factory=$2 precision=$3 extra=(--export-plain)
  [ "$precision" = fp16 ] && extra=(--baseline "$work/$name-fp32" --only "$FP16_CONTENDERS")
  stamp "bench $name $precision"
  python3 -m deploykit bench "$work/$name-$precision" --model "$work/$name.pt" --factory "$factory" \
    "${extra[@]}" --batch 1,32 --device cuda --iterations 200 --max-seconds 2 --allow-failed \
    -o "$OUT/$name-$precision" 2>&1 | tee "$OUT/bench-$name-$precision.log" | tail -30
}
if wants bench-resnet50; then
  bench resnet50 torchvision.models:resnet50 fp32
  bench resnet50 torchvision.models:resnet50 fp16
fi
wants bench-transformer && bench transformer model_zoo:small_transformer fp16
stamp "done"
