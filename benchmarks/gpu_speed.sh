#!/bin/bash
# The GPU speed measurements in one call, inside a time budget: the CUDA tests of the vmap and
# vmap-graphs engines, where a batched step's time goes (eager against graphs, and the profiler's
# table), the three ways of one step (vmap_step.py), then the bench of 20 MNIST clients on the loop,
# vmap and vmap-graphs engines, and of 1,000 clients while time is left. Each part writes its output
# to $OUT (bench JSON included) and the script ends with a summary.
#
#   PFLKIT_DATA=.gpu BUDGET=540 OUT=/tmp/out benchmarks/gpu_speed.sh
#
# PFLKIT_DATA: the folder that holds mnist/ (its four IDX files). PYTHON, PFLKIT: the interpreter
# and the pflkit command (defaults: python, pflkit). BENCH_ENGINES: the 20-client bench's engines
# (default loop,vmap,vmap-graphs). PARTS: the parts to run, comma-separated (default all of
# tests-graphs,step,vmap-step,bench-20,tests-cuda,bench-1000; an unknown name stops the script).
# On a machine without pflkit's dependencies,
# install wheels first as docs/explanations/performance.md ("Running cells on an offline GPU
# machine") shows, and set PYTHONPATH and PFLKIT accordingly.
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-540}; OUT=${OUT:-/tmp/out}; PYTHON=${PYTHON:-python}; PFLKIT=${PFLKIT:-pflkit}
: "${PFLKIT_DATA:?set PFLKIT_DATA to the folder that holds mnist/}"
export PFLKIT_DATA PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ALL_PARTS=tests-graphs,step,vmap-step,bench-20,tests-cuda,bench-1000
PARTS=${PARTS:-$ALL_PARTS}; PARTS=${PARTS// /}
for name in ${PARTS//,/ }; do
    [[ ",$ALL_PARTS," == *",$name,"* ]] || { echo "PARTS: unknown part '$name' (known: $ALL_PARTS)" >&2; exit 2; }
done
mkdir -p "$OUT"
rm -f "$OUT/summary.txt"; for name in ${ALL_PARTS//,/ }; do rm -f "$OUT/$name.txt"; done  # no earlier output
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
part() {  # part NAME SECONDS COMMAND...: run it with at most SECONDS (or what is left), output to $OUT/NAME.txt
    local name=$1 limit=$2; shift 2
    [[ ",$PARTS," == *",$name,"* ]] || return 0
    local budget; budget=$(left)
    (( budget < limit )) && limit=$budget
    if (( limit < 20 )); then echo "== $name: skipped (no time left)" | tee -a "$OUT/summary.txt"; return; fi
    local t=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi -L; "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > "$OUT/machine.txt" 2>&1
part tests-graphs 150 "$PYTHON" -m pytest -q -p no:cacheprovider tests/engines/test_graphs.py \
    tests/engines/test_engines.py -k "cuda_graphs or graphs"
part step 90 "$PYTHON" benchmarks/gpu_step.py --device cuda --clients 20 --steps 100
part vmap-step 45 "$PYTHON" benchmarks/vmap_step.py --device cuda --clients 20 --batch 10
part bench-20 200 "$PFLKIT" bench --device cuda --engines "${BENCH_ENGINES:-loop,vmap,vmap-graphs}" --clients 20 \
    --algorithms fedavg,fedala --rounds 4 --data-dir "$PFLKIT_DATA/mnist" --out "$OUT/bench-20.json"
part tests-cuda 170 "$PYTHON" -m pytest -q -p no:cacheprovider tests/engines/test_engines.py -k "cuda and not graphs"
part bench-1000 "$(left)" "$PFLKIT" bench --device cuda --engines vmap,vmap-graphs --clients 1000 \
    --algorithms fedavg --rounds 3 --data-dir "$PFLKIT_DATA/mnist" --out "$OUT/bench-1000.json"

echo; cat "$OUT/machine.txt"
for name in tests-graphs tests-cuda; do [ -f "$OUT/$name.txt" ] && { echo "-- $name"; tail -3 "$OUT/$name.txt"; }; done
[ -f "$OUT/step.txt" ] && { echo "-- step"; sed -n '1,5p' "$OUT/step.txt"; grep "per eager step" "$OUT/step.txt"; }
[ -f "$OUT/vmap-step.txt" ] && { echo "-- vmap-step"; tail -5 "$OUT/vmap-step.txt"; }
for name in bench-20 bench-1000; do [ -f "$OUT/$name.txt" ] && { echo "-- $name"; tail -12 "$OUT/$name.txt"; }; done
