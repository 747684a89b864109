#!/usr/bin/env bash
# The sparse-regime Querent benchmark rerun on the co-occurrence label with a recipe under which the attention
# models learn it (docs/experiments/pathology.md, 2026-12-03 evening): 200 bags, lr 2e-3, 4 bags per step, up to 30
# epochs with early stopping. Resumable: finished fits are records, a stopped fit resumes from its last epoch
# (checkpoints under $WORK). Then the summary over these records:
#
#   bash benchmarks/pathology_sparse_cooccur.sh            # the fits (seeds 0 and 1), one process
#   bash benchmarks/pathology_sparse_cooccur.sh fit-seed S # or one seed per process, in parallel (own records)
#   bash benchmarks/pathology_sparse_cooccur.sh approx     # selection vs dense on the trained dense weights (seed 0)
#   bash benchmarks/pathology_sparse_cooccur.sh summary    # table, intervals, curve
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PY:-python}
WORK=${WORK:-runs/pathology_sparse_cooccur}
REC=benchmarks/results/pathology_sparse_cooccur200_records.jsonl
REC1=benchmarks/results/pathology_sparse_cooccur200_seed1_records.jsonl  # seed 1 run in its own process
RECA=benchmarks/results/pathology_sparse_cooccur200_approx_records.jsonl  # approximation on trained weights
ARGS="--labels cooccur --bags 200 --epochs 30 --min-epochs 10 --patience 5 --lr 2e-3 --batch-bags 4
  --models mean,abmil,transmil,querent_region,dense --work $WORK"
COMMON="$ARGS --seeds 0,1 --records $REC,$REC1,$RECA"
case "${1:-fit}" in
  fit) $PY -m benchmarks.pathology_sparse --stages cv $COMMON --no-progress ;;
  fit-seed) [ "${2:-0}" = 0 ] && R=$REC,$REC1 || R=$REC1,$REC   # new records go to the first file
            $PY -m benchmarks.pathology_sparse --stages cv $ARGS --seeds "${2:-0}" --records $R --no-progress ;;
  approx) $PY -m benchmarks.pathology_sparse --stages approx $ARGS --seeds 0 --records $RECA,$REC --no-progress ;;
  summary) $PY -m benchmarks.pathology_sparse --stages summary $COMMON \
             --out benchmarks/results/pathology_sparse_cooccur200.json ;;
  *) echo "usage: $0 [fit | fit-seed S | approx | summary]" >&2; exit 2 ;;
esac
