#!/usr/bin/env bash
# Decision Mixer pilot: DM and DT on the wide Hopper datasets of the stronger behaviour set, one rl_bench
# invocation per (dataset, seed), so that two run at once on two cores. It measures the spread of the paired
# DM - DT difference per seed, which sizes the seeds of the full experiment (docs/experiments/rl.md).
# Resumable: a case already in its JSON with these settings is reused; a killed case continues from its last
# 1,000-step checkpoint under $RUNS.
#
#   bash benchmarks/rl_pilot.sh prep            # generate / mask / split the datasets once (one process)
#   bash benchmarks/rl_pilot.sh cases | xargs -P 2 -L 1 bash benchmarks/rl_pilot.sh case   # every case
#   bash benchmarks/rl_pilot.sh merge           # the table with paired-bootstrap intervals (runs no missing case)
#   bash benchmarks/rl_pilot.sh controls DATASET SEED   # dt-small, dm-random, dm-fixed after that case's DM
#                                    (CONTROLS=dm,dm-random runs a subset; an arm that takes DM's value needs dm)
#   bash benchmarks/rl_pilot.sh peer DATASET SEED       # d3rlpy's DT, the same data, evaluation seeds and steps
#   bash benchmarks/rl_pilot.sh merge-controls DATASET  # DM, DT, the controls and d3rlpy's DT on one dataset
#
# The decisive run (docs/experiments/rl.md, "the decisive run at the pilot's settings") is this script with its
# default seeds, 0-9, then the controls on hopper-medium-replay for the same seeds (each after its case: both
# write that case's JSON).
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-python}
RUNS=${RUNS:-runs/rl_pilot}
OUT=${OUT:-benchmarks/results/rl_pilot}
DATASETS=${DATASETS:-hopper-medium-replay,hopper-medium-expert,hopper-medium-replay-po}
SEEDS=${SEEDS:-0 1 2 3 4 5 6 7 8 9}
COMMON="--behaviour hopper=rl/weights/behaviour_hopper_long.safetensors --dataset-steps 200000 --algos dm,dt
  --steps 2000 --batch-size 64 --lr 1e-3 --warmup 200 --context 20 --embed-dim 64 --heads 1 --dt-layers 4
  --dm-layers 4 --routed-layers 1,3 --capacity-cost 0 --eval-episodes 50 --target-mode data-best
  --target-factors 1.0 --holdout-frac 0.1 --holdout-seed 0 --data-dir data/rl --work-dir $RUNS/work"
mkdir -p "$RUNS" "$OUT"
run_case() {  # DATASET SEED ALGOS LOG [WHAT]: these arms of one case, written into that case's JSON
  $PY -m benchmarks.rl_bench --datasets "$1" --seeds "$2" $COMMON --algos "$3" --bootstrap 0 --out "$OUT/$1-s$2.json" \
    > "$RUNS/$4.log" 2>&1 && echo "done ${5:+$5 }$1 seed $2" || echo "FAILED ${5:+$5 }$1 seed $2"
}
merge_cases() {  # DATASETS ALGOS JSONS OUT: the tables of the finished cases, with paired-bootstrap intervals
  $PY -m benchmarks.rl_bench --datasets "$1" --seeds "$(echo $SEEDS | tr ' ' ,)" $COMMON --algos "$2" --report-only \
    --merge "$3" --out "$4"
}
case "${1:-}" in
  prep) $PY -m benchmarks.rl_bench --datasets "$DATASETS" $COMMON --algos "" --out "$RUNS/prep.json" ;;
  cases) for s in $SEEDS; do for d in ${DATASETS//,/ }; do echo "$d $s"; done; done ;;
  case) run_case "$2" "$3" dm,dt "$2-s$3" ;;
  controls) run_case "$2" "$3" "${CONTROLS:-dm,dt-small,dm-random,dm-fixed}" "$2-s$3-controls" controls ;;
  peer) run_case "$2" "$3" d3rlpy-dt "$2-s$3-peer" peer ;;
  merge-controls) merge_cases "$2" dm,dt,dt-small,dm-random,dm-fixed,d3rlpy-dt "$(ls "$OUT"/$2-s*.json | paste -sd,)" \
          "$OUT/merged-controls-$2.json" ;;
  merge) merge_cases "$DATASETS" dm,dt "$(ls "$OUT"/hopper-*.json | paste -sd,)" "$OUT/merged.json" ;;
  *) echo "usage: $0 prep | cases | case DATASET SEED | merge | controls DATASET SEED | peer DATASET SEED" \
          "| merge-controls DATASET" >&2; exit 2 ;;
esac
