#!/bin/bash
# Result cells and the loop-vs-vmap bench on a lent GPU machine, inside a fixed time budget.
#
# Cells run in parallel, one process and one --out folder each (a small model leaves the GPU mostly
# idle; two SosicFL cells side by side on an H200 took 0.21-0.25 s a round each); every sweep is sent
# SIGINT at the deadline, so an unfinished cell keeps its rounds and says "interrupted". Then
# the bench runs for each client count while time is left. Everything ends up in $OUT/cells.tgz
# (checkpoints and client states left out): unpack it and move the cells into docs/results/.
#
#   BUDGET=540 CONFIG=configs/reproduce/sosicfl-mnist.toml CELLS="sosicfl_plus:0 ditto:0" \
#       PFLKIT_DATA=.gpu benchmarks/gpu_cells.sh
#
# CELLS: method:seed pairs; EXTRA: more config overrides for every cell (e.g. "num_folds=5");
# BENCH_CLIENTS: client counts for the bench ("" skips it); BENCH_S: seconds kept for it.
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-480}; DEVICE=${DEVICE:-cuda}; PFLKIT=${PFLKIT:-pflkit}
CONFIG=${CONFIG:-configs/reproduce/sosicfl-mnist.toml}
OUT=${OUT:-/tmp/out}; WORK=${WORK:-gpu-cells}
BENCH_S=${BENCH_S:-110}; BENCH_CLIENTS=${BENCH_CLIENTS-20 1000}
: "${PFLKIT_DATA:?set PFLKIT_DATA to the folder that holds mnist/}"
export PFLKIT_DATA PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK/logs"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

nvidia-smi -L 2>/dev/null
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.cuda.is_available())"
cell_s=$(( $(left) - BENCH_S - 25 ))
if [ -n "${CELLS:-}" ] && [ "$cell_s" -lt 30 ]; then
    echo "only ${cell_s} s left for the cells (BUDGET=$BUDGET, BENCH_S=$BENCH_S): raise BUDGET or lower BENCH_S" >&2
    exit 2
fi
for cell in ${CELLS:-}; do
    alg=${cell%%:*}; seed=${cell##*:}
    # shellcheck disable=SC2086  # EXTRA is a list of overrides
    timeout -k 15 -s INT "$cell_s" "$PFLKIT" sweep "$CONFIG" "algorithms=[[\"$alg\"]]" \
        "seeds=[[$seed]]" device="$DEVICE" ${EXTRA:-} --out "$WORK/$alg-$seed" --quiet \
        > "$WORK/logs/$alg-$seed.log" 2>&1 &
done
wait
echo "cells done at $(( $(date +%s) - T0 )) s"
for n in $BENCH_CLIENTS; do
    t=$(( $(left) - 20 )); [ "$t" -lt 30 ] && break
    timeout -k 10 -s INT "$t" "$PFLKIT" bench --device "$DEVICE" --engines loop,vmap --clients "$n" \
        --algorithms fedavg,fedala --rounds "${BENCH_ROUNDS:-4}" --data-dir "$PFLKIT_DATA/mnist" \
        --out "$WORK/bench-$n.json" > "$WORK/logs/bench-$n.log" 2>&1
    echo "bench $n: exit $? at $(( $(date +%s) - T0 )) s"
done
tar czf "$OUT/cells.tgz" --exclude=checkpoints --exclude=states --exclude='*.pt' --exclude=.lock "$WORK"
tail -n 4 "$WORK"/logs/*.log
echo "total $(( $(date +%s) - T0 )) s"
