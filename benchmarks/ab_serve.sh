#!/usr/bin/env bash
# A/B of a change to `deploykit serve --workers`: a base revision's serving code against the working tree's, one
# server after the other, ROUNDS times, each driven by perf_analyzer (HTTP).
#   bash benchmarks/ab_serve.sh REV            # e.g. HEAD~1 (git archive of REV's deploykit/); results in $OUT
#   BASE_TREE=DIR bash benchmarks/ab_serve.sh  # a folder holding the base's deploykit/ (where there is no .git,
#                                              # as on the GPU machine: `git archive REV deploykit | tar x -C DIR`
#                                              # here, in a git-ignored folder the device call carries)
# By default the bundle is made to stress what --workers adds around the model, not the model, on a CPU: 3x224x224
# fp32 rows (602 KB requests, as resnet50's) into a global average pool and a linear layer, batch 1:8:32.
# BUNDLE (a converted bundle instead; its folder's name is the model's), DEVICE (cpu), WORKERS (2), INSTANCES (1),
# MAX_BATCH (32), INPUT ("--shape x:3,224,224": perf_analyzer.py's input options), LEVELS ("8 32"), ROUNDS (3),
# INTERVAL_MS (3000), STABILITY (15), OUT (/tmp/ab-serve). Prints one line per server and level (perf_analyzer.py's
# row, then the CPU time each server process spent per request answered during the level: the server's own
# process first, then its children as they started, with --workers the model process and then the workers;
# a change that saves CPU shows there even where this machine's throughput drifts) and writes them to $OUT/ab.md. On the GPU machine (after run_issue25_device.sh's setup and convert):
#   BASE_TREE=ab/serve-base BUNDLE=/tmp/dk-issue13/resnet50-fp16 DEVICE=cuda:0 WORKERS=8 INSTANCES=2 LEVELS=128 \
#     bash benchmarks/ab_serve.sh
set -u -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/ab-serve} workers=${WORKERS:-2} levels=${LEVELS:-8 32} rounds=${ROUNDS:-3}
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
mkdir -p "$out"
base=${BASE_TREE:-}
if [ -z "$base" ]; then
  rev=${1:?usage: ab_serve.sh REV (or BASE_TREE=DIR ab_serve.sh)}
  base=$out/base-tree
  rm -rf "$base" && mkdir -p "$base" && git -C "$root" archive "$rev" deploykit | tar x -C "$base"
fi
[ -d "$base/deploykit" ] || { echo "$base has no deploykit/" >&2; exit 1; }
base=$(cd "$base" && pwd)

bundle=${BUNDLE:-$out/pool}
if [ -z "${BUNDLE:-}" ] && [ ! -f "$out/pool/manifest.json" ]; then
  "$python" - "$out/pool.pt2" <<'PY'
import sys, torch
class Pool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 10)
    def forward(self, x):
        return self.head(x.mean(dim=(2, 3)))
torch.manual_seed(0)
batch = torch.export.Dim("batch", min=1, max=64)
torch.export.save(torch.export.export(Pool().eval(), (torch.randn(2, 3, 224, 224),), dynamic_shapes={"x": {0: batch}}),
                  sys.argv[1])
PY
  PYTHONPATH=$root "$python" -m deploykit convert "$out/pool.pt2" -o "$out/pool" --batch 1:8:32 --force > "$out/convert.log" 2>&1 \
    || { tail -5 "$out/convert.log"; exit 1; }
fi
model=$(basename "$bundle")
cpu_ticks() {  # PID: user+system clock ticks of the process and of each of its children, in start order
  local pid
  for pid in $1 $(ps -o pid= --ppid "$1" --sort=start_time); do awk '{printf "%d ", $14 + $15}' "/proc/$pid/stat"; done
}

: > "$out/ab.md"
for round in $(seq "$rounds"); do
  for variant in base new; do
    tree=$root; [ "$variant" = base ] && tree=$base
    log=$out/$variant-r$round
    # -P: `python -m` would put the current folder first on the path, and from the repository's root both variants
    # would run the working tree's deploykit (they did until 2026-12-06)
    imported=$(PYTHONPATH=$tree "$python" -P -c 'import deploykit, os; print(os.path.dirname(deploykit.__file__))')
    [ "$imported" = "$tree/deploykit" ] || { echo "the $variant server would run $imported, not $tree/deploykit" >&2; exit 1; }
    PYTHONPATH=$tree "$python" -P -m deploykit serve "$bundle" --device "${DEVICE:-cpu}" --workers "$workers" \
      --instances "${INSTANCES:-1}" --max-batch "${MAX_BATCH:-32}" --no-access-log --port 18100 > "$log.serve.log" 2>&1 &
    server=$!
    until grep -q "serving at" "$log.serve.log"; do kill -0 $server 2> /dev/null || { cat "$log.serve.log"; exit 1; }; sleep 0.5; done
    for level in $levels; do
      "$python" "$root/benchmarks/serve_metrics.py" snapshot http://127.0.0.1:18100 "$log-c$level.before.txt"
      before=$(cpu_ticks $server)
      # shellcheck disable=SC2086
      PYTHONPATH=$root "$python" "$root/benchmarks/perf_analyzer.py" "$model" --http 127.0.0.1:18100 --concurrency "$level" \
        --measurement-interval-ms "${INTERVAL_MS:-3000}" --stability-percentage "${STABILITY:-15}" ${INPUT:---shape x:3,224,224} \
        --out "$log-c$level" > "$log-c$level.log" 2>&1
      after=$(cpu_ticks $server)
      "$python" "$root/benchmarks/serve_metrics.py" snapshot http://127.0.0.1:18100 "$log-c$level.after.txt"
      answered=$("$python" "$root/benchmarks/serve_metrics.py" compare "$log-c$level.before.txt" "$log-c$level.after.txt" \
        | "$python" -c 'import json, sys; print(int(json.load(sys.stdin)["requests"]))')
      cost=$("$python" -c 'import os, sys
before, after = (list(map(int, arg.split())) for arg in sys.argv[1:3])
answered, tick = max(int(sys.argv[3]), 1), os.sysconf("SC_CLK_TCK")
print(" ".join(f"{(b - a) * 1e3 / tick / answered:.3f}" for a, b in zip(before, after)))' \
        "$before" "$after" "$answered")
      echo "$variant round $round: $(tail -n 1 "$log-c$level.log") CPU ms/request: $cost" | tee -a "$out/ab.md"
    done
    kill -TERM $server; wait $server
  done
done
