#!/usr/bin/env bash
# The CoMemo evidence runs behind apps/comemo/README.md, one benchmark invocation per (experiment, seed, variant),
# so that two of them can run at once on two cores. Resumable: a finished invocation (its JSON exists) is skipped.
#
#   bash benchmarks/comemo_evidence.sh seeds hires tasks labelrange ship  # any of the parts, in order
#   RUNS=runs/comemo OUT=benchmarks/results/comemo bash benchmarks/comemo_evidence.sh seeds
#
# seeds:      the needle recipe, training seeds 11 12 13, lvlm-1d (--mlp-ratio 7: the memory variants' parameter
#             count) and comemo; flamingo on seed 11
# hires:      high-resolution needles (--image-grid 1x2: two tiles + thumbnail per image), lvlm-1d, comemo and
#             lvlm-dhr (--mlp-ratio 7), seed 11
# tasks:      all four tasks, 3000 steps, lvlm-1d, comemo, lvlm-dhr, seed 11
# labelrange: --label-range 64 (answers name images up to 64 in training), 4000 steps, lvlm-1d and comemo, seed 11
# ship:       the shipped model's recipe (comemo, seed 11, 2000 steps) in the reference memory layout (the defaults);
#             then python -m apps.comemo.ship --run $RUNS/ship/comemo --bench $OUT/ship_s11_comemo.json ...
# Then: python -m benchmarks.comemo_summary $OUT/seed_s1{1,2,3}_{lvlm-1d,comemo}.json --out ... --plot ...
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-python}
RUNS=${RUNS:-runs/comemo}
OUT=${OUT:-benchmarks/results/comemo}
VIT=$RUNS/vit_pre1500/model.safetensors
mkdir -p "$RUNS" "$OUT"
# the first memory-path layout, which these runs used (docs/experiments/comemo.md); the defaults now follow the reference
LAYOUT="--cross-placement first --memory-queries text --memory-norm own"
recipe() {  # recipe SEED [LAYOUT]: the needle recipe; the first layout unless a second argument (e.g. "") is given
  echo "--batch-size 8 --lr 2e-3 --warmup 50 --seed $1 --min-images 1 --val-every 250 --val-samples 32 --init-from $VIT --image-labels after --vision-lr-scale 0.1 ${2-$LAYOUT}"
}
NEEDLE_EVAL="--images 2 4 8 16 32 64 --tasks needle --per-count 40 --eval-seed 777 --threads 1 --no-progress --max-images 8"
TASKS_EVAL="--images 2 4 8 16 --tasks needle count describe detail --per-count 20 --eval-seed 777 --threads 1 --no-progress --max-images 8"
EQUAL="--variant-args lvlm-1d=--mlp-ratio=7 --variant-args lvlm-dhr=--mlp-ratio=7"

job() {  # job OUT.json ARGS...: one benchmark invocation (trains the variant when its run folder is missing)
  local out=$1; shift
  [ -f "$out" ] && { echo "skip $out (done)"; return 0; }
  echo "$(date -u +%FT%TZ) start $out"
  if $PY -m benchmarks.comemo_bench "$@" --out "$out.tmp" > "$out.log" 2>&1; then
    mv "$out.tmp" "$out"; echo "$(date -u +%FT%TZ) done $out"
  else
    echo "$(date -u +%FT%TZ) FAILED $out (see $out.log)"
  fi
}

[ -f "$VIT" ] || $PY -m apps.comemo.vision_pretrain --out "$RUNS/vit_pre1500" --steps 1500 --batch-size 64 --lr 2e-3 \
  --seed 0 --threads 1 --no-progress
for part in "$@"; do
  case $part in
    seeds)
      for s in 11 12 13; do
        for v in lvlm-1d comemo; do
          job "$OUT/seed_s${s}_$v.json" --runs "$RUNS/seeds/s$s" --variants $v --train-steps 2000 \
            --train-args "$(recipe $s) --tasks needle" $EQUAL $NEEDLE_EVAL
        done
      done
      job "$OUT/seed_s11_flamingo.json" --runs "$RUNS/seeds/s11" --variants flamingo --train-steps 2000 \
        --train-args "$(recipe 11) --tasks needle" $EQUAL $NEEDLE_EVAL ;;
    hires)
      for v in lvlm-1d comemo lvlm-dhr; do
        job "$OUT/hires_s11_$v.json" --runs "$RUNS/hires/s11" --variants $v --train-steps 2000 \
          --train-args "$(recipe 11) --tasks needle --image-grid 1x2" $EQUAL $NEEDLE_EVAL --image-grid 1x2
      done ;;
    tasks)
      for v in lvlm-1d comemo lvlm-dhr; do
        job "$OUT/tasks_s11_$v.json" --runs "$RUNS/tasks/s11" --variants $v --train-steps 3000 \
          --train-args "$(recipe 11) --tasks needle count describe detail" $EQUAL $TASKS_EVAL
      done ;;
    labelrange)
      for v in lvlm-1d comemo; do
        job "$OUT/labelrange_s11_$v.json" --runs "$RUNS/labelrange/s11" --variants $v --train-steps 4000 \
          --train-args "$(recipe 11) --tasks needle --label-range 64" $EQUAL $NEEDLE_EVAL
      done ;;
    ship)
      job "$OUT/ship_s11_comemo.json" --runs "$RUNS/ship" --variants comemo --train-steps 2000 \
        --train-args "$(recipe 11 "") --tasks needle" $NEEDLE_EVAL ;;
    *) echo "unknown part $part: expected seeds, hires, tasks, labelrange or ship" >&2; exit 2 ;;
  esac
done
