#!/bin/bash
# Result cells and the loop-vs-vmap bench on a GPU machine, inside a fixed time budget.
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
# WORK must be a path git ignores (default gpu-cells/, in .git/info/exclude; a second protocol:
# WORK=gpu-cells/5fold): the device tool deletes untracked, unignored folders before each call, so
# only there does a second call on a warm machine resume the interrupted cells from their checkpoints.
# Measured on an H200 (SosicFL protocol, 100 clients, all scored every 5 rounds): a training round
# took 0.21-0.25 s with two cells side by side, 0.24-0.36 s with six and 0.38-0.55 s with nine; six
# reached 390-455 rounds in 6.3 min of wall time, of which the rounds took 2.8-3.6 min (the rest,
# unmeasured: start-up, checkpoints, final pass), so give each cell ~3 min per 400 rounds and run
# at most six at a time. A checkpoint of 100 clients' models is ~290 MB (0.3-0.5 s to write on the
# CPU machine), so the cells checkpoint every CKPT rounds (default 25, not the configs' 5): an
# interrupt loses ~10 s. Where the cells fit in one call, turn checkpoints off (CKPT above the
# rounds): with CKPT=1000 six 500-round SosicFL cells finished in 315-346 s a call on an H200,
# where six with checkpoints every 5 rounds reached rounds 388-455 in 6.3 min.
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-480}; DEVICE=${DEVICE:-cuda}; PFLKIT=${PFLKIT:-pflkit}
CONFIG=${CONFIG:-configs/reproduce/sosicfl-mnist.toml}
OUT=${OUT:-/tmp/out}; WORK=${WORK:-gpu-cells}
BENCH_S=${BENCH_S:-110}; CKPT=${CKPT:-25}; BENCH_CLIENTS=${BENCH_CLIENTS-20 1000}
: "${PFLKIT_DATA:?set PFLKIT_DATA to the folder that holds mnist/}"
export PFLKIT_DATA PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK/logs"
if git rev-parse --git-dir > /dev/null 2>&1 && ! git check-ignore -q "$WORK"; then
    echo "warning: $WORK is not ignored by git: a second call on a warm machine will not find its checkpoints" >&2
fi
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
        "seeds=[[$seed]]" device="$DEVICE" checkpoint_every="$CKPT" ${EXTRA:-} --out "$WORK/$alg-$seed" --quiet \
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
