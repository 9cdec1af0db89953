#!/usr/bin/env bash
# A/B of a change to `deploykit serve --workers` on a CPU machine: a base revision's serving code against
# the working tree's, one server after the other, ROUNDS times, each driven by perf_analyzer (HTTP).
# The bundle is made to stress what --workers adds around the model, not the model: 3x224x224 fp32 rows
# (602 KB requests, as resnet50's) into a global average pool and a linear layer, batch 1:8:32.
#   bash benchmarks/ab_serve_cpu.sh REV            # e.g. HEAD~1; results in $OUT (default /tmp/ab-serve)
# WORKERS (2), LEVELS ("8 32"), ROUNDS (3), INTERVAL_MS (3000), STABILITY (15). Prints one line per
# server and level (perf_analyzer.py's row) and writes them to $OUT/ab.md.
set -u -o pipefail
rev=${1:?usage: ab_serve_cpu.sh REV}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/ab-serve} workers=${WORKERS:-2} levels=${LEVELS:-8 32} rounds=${ROUNDS:-3}
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
base=$out/base-tree
rm -rf "$base" && mkdir -p "$base" && git -C "$root" archive "$rev" deploykit | tar x -C "$base"

if [ ! -f "$out/pool/manifest.json" ]; then
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

: > "$out/ab.md"
for round in $(seq "$rounds"); do
  for variant in base new; do
    tree=$root; [ "$variant" = base ] && tree=$base
    log=$out/$variant-r$round
    PYTHONPATH=$tree "$python" -m deploykit serve "$out/pool" --device cpu --workers "$workers" --max-batch 32 \
      --no-access-log --port 18100 > "$log.serve.log" 2>&1 &
    server=$!
    until grep -q "serving at" "$log.serve.log"; do kill -0 $server 2> /dev/null || { cat "$log.serve.log"; exit 1; }; sleep 0.5; done
    for level in $levels; do
      PYTHONPATH=$root "$python" "$root/benchmarks/perf_analyzer.py" pool --http 127.0.0.1:18100 --concurrency "$level" \
        --measurement-interval-ms "${INTERVAL_MS:-3000}" --stability-percentage "${STABILITY:-15}" --shape x:3,224,224 \
        --out "$log-c$level" > "$log-c$level.log" 2>&1
      echo "$variant round $round: $(tail -n 1 "$log-c$level.log")" | tee -a "$out/ab.md"
    done
    kill -TERM $server; wait $server
  done
done
