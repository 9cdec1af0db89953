#!/usr/bin/env bash
# One GPU session: build the kernel library for this GPU, run the BatchNorm and kernel GPU tests, then the
# BatchNorm and MatMulRelu benchmarks. Logs and tables go to $OUT (default /tmp/deploykit-bench).
#   bash benchmarks/run_device.sh            # from the repository root
# Steps are time-limited so that a hang still leaves the other logs; $PYTHON picks the python.
set -u -o pipefail
OUT=${OUT:-/tmp/deploykit-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "build sm_$ARCH"
if [ -z "${DEPLOYKIT_KERNELS_LIB:-}" ]; then
  $PY -c "from deploykit import kernels; print(kernels.build_library('/tmp/dk-build', cuda_architectures='$ARCH', jobs=16))" \
    >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  export DEPLOYKIT_KERNELS_LIB=$(tail -1 "$OUT/build.log")
fi
stamp "library $DEPLOYKIT_KERNELS_LIB"

stamp "bench batch_norm"
timeout ${BN_BENCH_S:-150} $PY benchmarks/bench_batch_norm.py --out "$OUT/bench_batch_norm.md" \
  >>"$OUT/bench.log" 2>&1; echo "batch_norm rc=$?" >>"$OUT/bench.log"
stamp "tests"
timeout ${TESTS_S:-180} $PY -m pytest -q -p no:cacheprovider -o addopts="" -rfE --durations=5 \
  ${TESTS:-tests/gpu/test_batch_norm_cuda.py tests/gpu/test_kernels_cuda.py} >"$OUT/tests.log" 2>&1; echo "rc=$?" >>"$OUT/tests.log"
stamp "bench matmul_relu"
timeout ${MM_BENCH_S:-120} $PY benchmarks/bench_matmul_relu.py --out "$OUT/bench_matmul_relu.md" \
  >>"$OUT/bench.log" 2>&1; echo "matmul_relu rc=$?" >>"$OUT/bench.log"
stamp "done"
tail -5 "$OUT/tests.log"
grep -E "^(Traceback|ERRORS)|Error" "$OUT/bench.log" | head -20
cat "$OUT/bench_batch_norm.md" "$OUT/bench_matmul_relu.md" 2>/dev/null
