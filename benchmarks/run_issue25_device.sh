#!/usr/bin/env bash
# Issue 25: `deploykit serve` and a real Triton Inference Server (2.51, its python backend running
# `deploykit export triton --platform python` of the same bundle) measured one after the other by Triton's
# C++ load generator (benchmarks/perf_analyzer.py: HTTP, one fp32 image or one sequence per request;
# PROTOCOLS="http grpc" measures each server's gRPC endpoint too, serve's with --grpc-port).
# On the H200 (nvidia-h200), run_issue13_device.sh's tuned fp16 bundles, concurrency 1, 16, 64, 128, 256:
#   OUT=/tmp/results STEPS="setup convert serve triton" MODELS="resnet50 bert_base" bash benchmarks/run_issue25_device.sh
# On a CPU machine (DEVICE=cpu), the small pre-activation net (model_zoo:resnetv2_18, BatchNorm statistics
# measured on random images, x:1x3x64x64, batch 1:4:8, fp32), concurrency 1, 8, 32:
#   OUT=/tmp/results DEVICE=cpu STEPS="convert serve triton" bash benchmarks/run_issue25_device.sh
# setup:   unpacks .gpu/triton-cache.tar.xz (this machine's $DEPLOYKIT_CACHE/triton: tritonserver, its python
#          backend, perf_analyzer) into $DEPLOYKIT_CACHE, and puts this checkout on python3's path with a .pth file
#          (Triton's python stub runs the first python3 on PATH and ignores PYTHONPATH).
# convert: run_issue13_device.sh's convert and tune steps (fp16, AOTInductor static packages at batch 1 and 32),
#          in the background (setsid: it outlives the call) when BACKGROUND=1; wait for it with STEPS=wait.
#          On a CPU: the small net converted here (no tuning).
# serve:   deploykit serve --workers $WORKERS (HTTP processes; default auto: half the cores, at most 8, on a GPU; 1 on a CPU) --instances
#          $INSTANCES (runners in the model process; default 2 on a GPU, 1 on a CPU) on $DEVICE; triton: tritonserver
#          on the python export, $TRITON_INSTANCES instances (default 1). $SERVE_ARGS: more options for serve.
# gputests: `pytest tests/gpu` on $GPU_TEST_WORKERS pytest-xdist workers (default 4), one module a worker, after
#          setup (which unpacks .gpu/test-tools.tar.xz: the op library's headers and pytest-xdist); onnxruntime-gpu
#          must be on PYTHONPATH (../shared/GPU.md). Log: $OUT/gpu-tests.log; in the background when BACKGROUND=1
#          (then wait with STEPS=gputests-wait, which copies the log).
# GPU busy %: nvidia-smi's utilization sampled every 200 ms during each concurrency level (busy.txt beside it).
# Inside the servers: each one's /metrics before and after each level (serve_metrics.py): the mean batch, queue
# wait, run and time in the server, which summary.md sets beside perf_analyzer's latency.
# PROFILE_LEVEL=N (with py-spy on PATH; stage_device.sh stages it for the GPU machine): every server process's Python stacks sampled for 10 s during level N
# (py-spy-PID.txt beside its CSV; raw format: one line per distinct stack, then its sample count).
# ROUNDS=N: the serve and triton steps repeated N times, one server after the other (results in roundK/;
# summary.md has the medians and each throughput's range).
# INTERVAL_MS, STABILITY: perf_analyzer's window (ms) and stability percentage (3000, 10); a noisy machine needs more.
# Results: $OUT/summary.md, and $OUT/results.tgz with every level's perf_analyzer CSV and log, busy samples,
# and the servers' logs.
set -uo pipefail
: "${OUT:?set OUT to a results folder}"
root=$(cd "$(dirname "$0")/.." && pwd)
callers_path=${PYTHONPATH:-}  # e.g. /tmp/ortsite (onnxruntime-gpu): setup hands it to Triton's stub too
export PYTHONPATH="$root:$root/tests/helpers:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 COLUMNS=200
export WORK=${WORK:-/tmp/dk-issue13} DEPLOYKIT_CACHE=${DEPLOYKIT_CACHE:-/tmp/dk-cache}
[ ! -d /tmp/test-tools/bin ] || export PATH=/tmp/test-tools/bin:$PATH  # py-spy, from setup (stage_device.sh)
device=${DEVICE:-cuda:0}
if [ "$device" = cpu ]; then
  models=${MODELS:-resnetv2_18} precision=fp32 max_batch=8 levels=${LEVELS:-1 8 32} workers=${WORKERS:-1}
  instances=${INSTANCES:-1}
else
  models=${MODELS:-resnet50 bert_base} precision=fp16 max_batch=32 levels=${LEVELS:-1 16 64 128 256}
  workers=${WORKERS:-auto} instances=${INSTANCES:-2}
fi
convert_models=${CONVERT_MODELS:-$models}  # converted side by side (CPU-bound): all of them in a first call
steps=${STEPS:-setup convert serve triton}
has_step() { [[ " $steps " == *" $1 "* ]]; }
mkdir -p "$OUT" "$WORK" "$DEPLOYKIT_CACHE"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

if has_step setup; then
  # .gpu/triton-cache.tar.xz: this machine's $DEPLOYKIT_CACHE/triton/2.51.0, Python 3.12's stub only;
  # .gpu/serve-site.tar.xz: serve's packages for Python 3.12 (fastapi, uvicorn, uvloop, httptools,
  # prometheus-client), unzipped wheels, used only when this Python lacks them.
  mkdir -p "$DEPLOYKIT_CACHE/triton"
  [ -d "$DEPLOYKIT_CACHE/triton/2.51.0" ] || xz -dc "$root/.gpu/triton-cache.tar.xz" | tar x -C "$DEPLOYKIT_CACHE/triton"
  if [ -f "$root/.gpu/test-tools.tar.xz" ] && [ ! -d /tmp/test-site ]; then
    mkdir -p /tmp/test-tools && xz -dc "$root/.gpu/test-tools.tar.xz" | tar x -C /tmp/test-tools
    cp -rn /tmp/test-tools/headers "$DEPLOYKIT_CACHE/" && mv /tmp/test-tools/site /tmp/test-site
  fi
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  rm -f "$site/deploykit-checkout.pth"  # a warm machine's, from an earlier call: judge this Python without it
  paths="$root"
  if ! python3 -c 'import fastapi, uvicorn, prometheus_client, pydantic' 2> /dev/null; then
    [ -d /tmp/serve-site ] || { mkdir -p /tmp/serve-site && xz -dc "$root/.gpu/serve-site.tar.xz" | tar x -C /tmp/serve-site; }
    paths="$paths"$'\n'/tmp/serve-site
  fi
  [ -d /tmp/test-site ] && paths="$paths"$'\n'/tmp/test-site
  # A .pth's plain lines land after site-packages, where this Python's own (CPU-only) onnxruntime would win
  # over the caller's onnxruntime-gpu; an import line puts the caller's PYTHONPATH first, as it is for serve.
  [ -z "$callers_path" ] || paths="$paths"$'\n'"import sys; sys.path[:0] = '$callers_path'.split(':')"
  echo "$paths" > "$site/deploykit-checkout.pth"
  python3 -c 'import fastapi, uvicorn, prometheus_client, deploykit; print("serving packages: ok")'
  python3 -c 'import tritonclient.http' 2> /dev/null && echo "tritonclient: installed" || echo "tritonclient: missing"
  stamp "setup"
fi

if has_step convert && [ "$device" = cpu ]; then
  python3 - "$WORK" <<'PY'
import sys, torch
from deploykit.testing import calibrate_batch_norm
import model_zoo
images = torch.Generator().manual_seed(1)
batches = [torch.randn(8, 3, 64, 64, generator=images) for _ in range(4)]
torch.save(calibrate_batch_norm(model_zoo.resnetv2_18(), batches, seed=4).state_dict(), f"{sys.argv[1]}/resnetv2_18.pt")
PY
  python3 -m deploykit convert "$WORK/resnetv2_18.pt" --factory model_zoo:resnetv2_18 --input x:1x3x64x64 \
    --batch 1:4:8 -o "$WORK/resnetv2_18-fp32" --force > "$OUT/convert-resnetv2_18.log" 2>&1
  stamp "convert resnetv2_18: exit $?"
elif has_step convert; then
  convert() {
    # logs in $WORK (not $OUT, which a call's end packs up and empties while this may still run)
    OUT="$WORK/convert-logs" STEPS="convert tune" PRECISIONS=fp16 bash "$root/benchmarks/run_issue13_device.sh" $convert_models
    touch "$WORK/converted"
  }
  rm -f "$WORK/converted"
  if [ "${BACKGROUND:-0}" = 1 ]; then
    export -f convert; export OUT root convert_models
    setsid nohup bash -c convert > "$WORK.convert.log" 2>&1 < /dev/null &
    stamp "converting in the background (log: $WORK.convert.log)"
  else
    convert; stamp "converted"
  fi
fi
gpu_tests_done() {  # the log into $OUT, and pytest's last line
  cp "$WORK.gpu-tests.log" "$OUT/gpu-tests.log"; stamp "tests/gpu: $(tail -n 2 "$OUT/gpu-tests.log" | head -n 1)"
}
if has_step gputests; then
  gpu_tests() {
    cd "$root" && python3 -m pytest tests/gpu -n "${GPU_TEST_WORKERS:-4}" --dist loadscope -p no:cacheprovider \
      -rfEs --tb=short --durations=20 > "$WORK.gpu-tests.log" 2>&1
    echo "exit $?" >> "$WORK.gpu-tests.log"
  }
  if [ "${BACKGROUND:-0}" = 1 ]; then
    export -f gpu_tests; export root WORK
    setsid nohup bash -c gpu_tests > /dev/null 2>&1 < /dev/null &
    stamp "tests/gpu in the background (log: $WORK.gpu-tests.log)"
  else
    gpu_tests; gpu_tests_done
  fi
fi
if has_step gputests-wait; then
  until grep -q '^exit ' "$WORK.gpu-tests.log" 2> /dev/null; do sleep 5; done
  gpu_tests_done
fi
if has_step wait; then
  while [ ! -f "$WORK/converted" ]; do sleep 5; done
  mkdir -p "$OUT/convert"; cp -r "$WORK.convert.log" "$WORK"/convert-logs/* "$OUT/convert/" 2>/dev/null
  stamp "conversions done"
fi

# perf_analyzer's inputs: zeros for images; token ids inside model_zoo's BERT vocabulary (1000 ids: an id beyond
# it fails the embedding's device-side bounds check, which poisons the CUDA context) and a full mask (zeros would
# mask every token)
declare -A shapes=([resnet50]="--shape x:3,224,224" [bert_base]="--input-data $WORK/bert-inputs.json"
                   [resnetv2_18]="--shape x:3,64,64")
python3 - "$WORK/bert-inputs.json" <<'PY'
import json, sys
ids = [101] + [(7 * i) % 800 + 150 for i in range(126)] + [102]
json.dump({"data": [{"input_ids": {"content": ids, "shape": [128]},
                     "attention_mask": {"content": [1] * 128, "shape": [128]}}]}, open(sys.argv[1], "w"))
PY

profile() {  # DIR SERVER_PID: py-spy (raw stacks, 10 s, not stopping them) of the server and its child processes
  local pid
  for pid in $2 $(awk -v parent="$2" '$4 == parent {print $1}' /proc/[0-9]*/stat 2> /dev/null); do
    py-spy record --pid "$pid" --duration 10 --nonblocking --format raw -o "$1/py-spy-$pid.txt" > /dev/null 2>&1 &
  done
}
protocols=${PROTOCOLS:-http}
endpoints() {  # HTTP_PORT GRPC_PORT: perf_analyzer.py's endpoint options for $protocols
  [[ " $protocols " != *" http "* ]] || echo "--http 127.0.0.1:$1"
  [[ " $protocols " != *" grpc "* ]] || echo "--grpc 127.0.0.1:$2"
}
sweep() {  # NAME MODEL HTTP_PORT GRPC_PORT SERVER_PID METRICS_URL: perf_analyzer at each level, GPU busy sampled beside it
  for level in $levels; do
    local dir="$results/$1/c$level" sampler=; mkdir -p "$dir"
    if [ "$device" != cpu ]; then
      nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 > "$dir/busy.txt" &
      sampler=$!
    fi
    if [ "${PROFILE_LEVEL:-}" = "$level" ] && command -v py-spy > /dev/null; then
      (sleep 5; profile "$dir" "$5") &
    fi
    python3 "$root/benchmarks/serve_metrics.py" snapshot "$6" "$dir/metrics-before.txt"
    # shellcheck disable=SC2086
    python3 "$root/benchmarks/perf_analyzer.py" "$2" $(endpoints "$3" "$4") --concurrency "$level" \
      --measurement-interval-ms ${INTERVAL_MS:-3000} --stability-percentage ${STABILITY:-10} ${shapes[${2%-*}]} --out "$dir" > "$dir/run.log" 2>&1
    [ -z "$sampler" ] || { kill $sampler; wait $sampler 2>/dev/null; }
    python3 "$root/benchmarks/serve_metrics.py" snapshot "$6" "$dir/metrics-after.txt"
    stamp "$1 c$level: $(tail -n 1 "$dir/run.log")"
  done
}
wait_for() {  # LOG TEXT SECONDS PID: until LOG says TEXT; fails at once when the process PID has exited
  local deadline=$(( $(date +%s) + $3 ))
  until grep -q "$2" "$1" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ] || ! kill -0 "$4" 2> /dev/null; then
      echo "not ready: $1"; tail -n 20 "$1"; return 1
    fi
    sleep 1
  done
}

rounds=${ROUNDS:-1}
for round in $(seq "$rounds"); do  # ROUNDS=N: the servers one after the other, N times (roundK/)
  results=$OUT; [ "$rounds" = 1 ] || results=$OUT/round$round
  mkdir -p "$results"
  for model in $models; do
    bundle=$WORK/$model-$precision
    if has_step serve; then
      python3 -m deploykit serve "$bundle" --device "$device" --workers "$workers" --instances "$instances" --max-batch $max_batch ${SERVE_ARGS:-} \
        --no-access-log --port 18000 --grpc-port 18004 > "$results/serve-$model.log" 2>&1 &
      server=$!
      wait_for "$results/serve-$model.log" "serving at" 240 $server && sweep "serve-$model" "$model-$precision" 18000 18004 $server \
        http://127.0.0.1:18000
      kill -TERM $server; wait $server; stamp "deploykit serve $model: exit $?"
    fi
    if has_step triton; then
      rm -rf "$WORK/repo"
      python3 -m deploykit export triton "$bundle" "$WORK/repo" --platform python --device "$device" \
        --instances "${TRITON_INSTANCES:-1}" > "$results/export-$model.log" 2>&1
      python3 - "$WORK/repo" > "$results/triton-$model.log" 2>&1 <<'PY' &
import os, sys
from deploykit.tools import triton_tools
server = triton_tools.tritonserver()
os.execvpe(server.command[0], [*server.command, "--model-repository", sys.argv[1], "--http-port", "18001",
                               "--grpc-port", "18002", "--metrics-port", "18003"], server.env)
PY
      server=$!
      wait_for "$results/triton-$model.log" "Started HTTPService" 300 $server && sweep "triton-$model" "$model-$precision" 18001 18002 $server \
        http://127.0.0.1:18003
      kill -TERM $server; wait $server; stamp "tritonserver $model: exit $?"
    fi
  done
done

if has_step serve || has_step triton; then
  python3 "$root/benchmarks/summarize_issue25.py" "$OUT" > "$OUT/summary.md"
  cat "$OUT/summary.md"
  (cd "$OUT" && shopt -s nullglob && tar czf results.tgz --remove-files ./serve-* ./triton-* ./export-* ./convert* ./round*)
fi
