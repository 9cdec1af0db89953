#!/usr/bin/env bash
# A/B of a kernel change in one GPU call: the working tree's csrc/ against a base revision's,
# both built on the GPU machine from one tree, benchmarked alternately in the same run.
#   bash benchmarks/ab_device.sh prepare REV   # here: writes ab/base/ (csrc files that differ from REV)
#   bash benchmarks/ab_device.sh run           # on the GPU machine (carry: ab)
# `run` runs $TESTS on the new build, then $ROUNDS rounds of bench_batch_norm.py (base, then new),
# and writes tests.log, ab.md (medians of the rounds, new / base) and ab_runs.tgz (every table) to
# $OUT: few files, as the device tool brings back at most 8.
set -u -o pipefail
cd "$(dirname "$0")/.."

prepare() {
  rm -rf ab/base && mkdir -p ab/base
  git diff --name-only "$1" -- csrc | while read -r f; do
    mkdir -p "ab/base/$(dirname "$f")" && git show "$1:$f" > "ab/base/$f"
  done
  echo "ab/base: $(find ab/base -type f | wc -l) file(s) of $1"
}

build() {  # build TREE DEST LOG -> prints the library path
  (cd "$1" && python3 -c "from deploykit import kernels; print(kernels.build_library('$2', cuda_architectures='${ARCH:-90}', jobs=8))") >"$3" 2>&1 \
    && tail -1 "$3" || { tail -30 "$3" >&2; return 1; }
}

run() {
  local out=${OUT:-/tmp/deploykit-ab} work=/tmp/deploykit-ab-work base_tree=/tmp/deploykit-ab-base
  mkdir -p "$out" && rm -rf "$work" "$base_tree" && mkdir -p "$work" "$base_tree"
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  cp -r deploykit csrc benchmarks pyproject.toml "$base_tree/" && cp -r ab/base/. "$base_tree/"
  build "$PWD" /tmp/deploykit-ab-new "$work/build_new.log" >"$work/new" &
  build "$base_tree" /tmp/deploykit-ab-old "$work/build_base.log" >"$work/base" &
  wait
  local new base; new=$(cat "$work/new") base=$(cat "$work/base")
  [ -n "$new" ] && [ -n "$base" ] || { echo "build failed"; exit 1; }
  DEPLOYKIT_KERNELS_LIB=$new timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider \
    -o addopts="" -rfE ${TESTS:-tests/gpu/test_batch_norm_cuda.py} >"$out/tests.log" 2>&1
  echo "rc=$?" >>"$out/tests.log"; tail -2 "$out/tests.log"
  for round in $(seq "${ROUNDS:-2}"); do
    for variant in base new; do
      local lib=$base; [ "$variant" = new ] && lib=$new
      timeout "${BENCH_S:-150}" python3 benchmarks/bench_batch_norm.py --lib "$lib" \
        --out "$work/${variant}_$round.md" >"$work/${variant}_$round.log" 2>&1 || tail -5 "$work/${variant}_$round.log"
    done
  done
  python3 benchmarks/compare_ab.py --base "$work"/base_*.json --new "$work"/new_*.json | tee "$out/ab.md"
  tar czf "$out/ab_runs.tgz" -C "$work" .
}

case "${1:-}" in
  prepare) prepare "${2:?a base revision}" ;;
  run) run ;;
  *) echo "usage: $0 prepare REV | run" >&2; exit 2 ;;
esac
