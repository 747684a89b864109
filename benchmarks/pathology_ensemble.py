"""The fold ensemble as a final model: the 5 fold models of ``pathology.train`` averaged, against each one alone.

On a development cohort (:mod:`benchmarks.pathology_cohort`, the cohort-size curve's shape:
:data:`benchmarks.pathology_cohort_bench.CURVE`, 500-patch bags) of ``--bags`` slides drawn from a cohort seed
>= 100 (seeds under 100 are kept for reported results and refused here), the shipped cross-validation
(:func:`pathology.training.cross_validate` with :func:`pathology.train.recipe_for`'s defaults, as the curve runs it)
writes its fold models, which are read back as a user of ``pathology.train`` would read them and evaluated on a fresh
external cohort of ``--test-bags`` slides from the same generator (cohort seed + ``--test-offset``):

- each fold model alone: AUC of its class-1 probability; balanced accuracy at its own validation-chosen threshold;
- the fold ensemble: the mean of the fold models' class-1 probabilities; AUC, and balanced accuracy at the mean of
  the fold thresholds (and at 0.5).

Every (cohort, model) is one JSON line in ``--records`` (a rerun skips what is recorded; the key holds every setting
the result depends on); the summary (per model and cohort seed: ensemble minus the mean single fold model, and the
paired t 95% interval over cohort seeds) is written atomically to ``--out`` and printed. Chance is AUC 0.5 and
balanced accuracy 0.5.

    OMP_NUM_THREADS=1 python -m benchmarks.pathology_ensemble --seeds 100 101 102 --models mean abmil querent
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.infra.cli import UsageError, nonempty_path, positive_int, run_cli, thread_count
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parent / "results"
RECORDS = RESULTS / "pathology_ensemble_records.jsonl"
OUT = RESULTS / "pathology_ensemble.json"
MODELS = ("mean", "abmil", "transmil", "dense", "querent")
UNIT_KEYS = ("cohort", "n_bags", "cohort_seed", "test_bags", "test_seed", "folds", "model", "recipe", "epochs")
FIRST_DEV_SEED = 100  # cohort seeds below this are the reported splits' (the curve uses 0-4)


def _metrics(prob: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    return {"auc": float(roc_auc_score(y, prob)),
            "bacc": float(balanced_accuracy_score(y, (prob > threshold).astype(np.int64)))}


def ensemble_metrics(prob_KN: np.ndarray, thresholds: Sequence[float], y: np.ndarray) -> dict:
    """Single-model and ensemble metrics of ``K`` fold models' class-1 probabilities ``prob_KN`` on ``N`` test bags.

    Returns ``single`` (one dict per fold: ``auc``, ``bacc`` at that fold's threshold), ``ensemble`` (the mean
    probability: ``auc``, ``bacc`` at the mean threshold, ``bacc_05`` at 0.5, ``threshold``).
    """
    prob_KN, y = np.asarray(prob_KN, np.float64), np.asarray(y)
    single = [_metrics(p, y, t) for p, t in zip(prob_KN, thresholds)]
    t_mean = float(np.mean(thresholds))
    ens = _metrics(prob_KN.mean(0), y, t_mean)
    ens.update(bacc_05=_metrics(prob_KN.mean(0), y, 0.5)["bacc"], threshold=t_mean)
    return {"single": single, "ensemble": ens}


def fold_models(name: str, mcfg, bags: list, tc, *, folds: int) -> tuple[dict, list]:
    """Cross-validate as ``pathology.train`` does and read back the fold models it writes (raw-feature models)."""
    from core.infra.fileio import load_safetensors
    from pathology.mil import build_model
    from pathology.training import cross_validate

    with tempfile.TemporaryDirectory() as d:
        res = cross_validate(name, mcfg, bags, tc, folds=folds, save_dir=d)
        models = []
        for k in range(len(res["folds"])):
            m = build_model(name, mcfg)
            m.load_state_dict(load_safetensors(os.path.join(d, f"{name}_fold{k}.safetensors")))
            models.append(m.eval())
    return res, models


def settings(args, model: str, cseed: int) -> dict:
    """Everything a unit's result depends on (its record key)."""
    from benchmarks.pathology_cohort_bench import CURVE, _cc, recipe

    cohort = {**_cc().as_dict(), **CURVE, "bag_size": args.bag_size}
    r = recipe("auto", args.bags)
    return {"cohort": cohort, "n_bags": args.bags, "cohort_seed": cseed, "test_bags": args.test_bags,
            "test_seed": cseed + args.test_offset, "folds": args.folds, "model": model, "recipe": r,
            "epochs": min(r["epochs"], args.epochs_cap or r["epochs"])}


def key_of(s: dict) -> str:
    return json.dumps(s, sort_keys=True)


def run_unit(s: dict) -> dict:
    """Cross-validate one model on one development cohort; evaluate its fold models and their ensemble externally."""
    import torch

    from benchmarks.pathology_cohort import CohortConfig, make_cohort
    from benchmarks.pathology_cohort_bench import REGION_SIZE
    from pathology.querent import QuerentConfig
    from pathology.training import TrainConfig, predict_outputs

    r, coh = s["recipe"], s["cohort"]
    bags = make_cohort(s["n_bags"], s["cohort_seed"], CohortConfig(**coh))
    test = make_cohort(s["test_bags"], s["test_seed"], CohortConfig(**coh))
    mcfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=r["dim"], depth=r["depth"], num_heads=r["heads"],
                         pool_hidden=r["pool_hidden"], dropout=r["dropout"], num_classes=2,
                         region_size=REGION_SIZE.get(coh["bag_size"], 8), topk=8)
    tc = TrainConfig(epochs=s["epochs"], lr=r["lr"], weight_decay=r["weight_decay"], batch_slides=r["batch_slides"],
                     max_patches=r["max_patches"], feature_dropout=r["feature_dropout"], monitor=r["monitor"],
                     smooth=r["smooth"], patience=r["patience"], min_epochs=r["min_epochs"], seed=0)
    torch.manual_seed(0)
    c0 = time.process_time()
    res, models = fold_models(s["model"], mcfg, bags, tc, folds=s["folds"])
    prob_KN = np.stack([torch.softmax(predict_outputs(m, test), -1)[:, 1].numpy() for m in models])
    thresholds = [f["threshold"] if f["threshold"] is not None else 0.5 for f in res["folds"]]
    y = np.array([b.label for b in test])
    return {**s, **ensemble_metrics(prob_KN, thresholds, y), "thresholds": thresholds,
            "oof_auc": res["pooled"]["auc"], "fold_val_auc": [f["auc"] for f in res["folds"]],
            "best_epochs": [f["best_epoch"] for f in res["folds"]],
            "warnings": sum(len(f["warnings"]) for f in res["folds"]), "cpu_s": round(time.process_time() - c0, 1),
            "test_labels": y.tolist(), "test_probs": np.round(prob_KN, 6).tolist()}


def read_records(path: str | os.PathLike) -> dict[str, dict]:
    from benchmarks.pathology_cohort_bench import read_records as read_jsonl

    return read_jsonl(path, key=lambda rec: key_of({k: rec[k] for k in UNIT_KEYS}))



def _append(path: str | os.PathLike, rec: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def summarize(recs: list[dict]) -> dict:
    """Per model: per cohort seed the single models' mean/min/max and the ensemble, the ensemble's gain over the mean
    single model, and its paired t 95% interval over cohort seeds."""
    from benchmarks.pathology_cohort_bench import t_interval

    out: dict = {}
    for m in MODELS:
        rs = sorted((r for r in recs if r["model"] == m), key=lambda r: r["cohort_seed"])
        if not rs:
            continue
        rows = []
        for r in rs:
            row = {"cohort_seed": r["cohort_seed"], "test_seed": r["test_seed"], "oof_auc": r["oof_auc"],
                   "best_epochs": r["best_epochs"], "cpu_s": r["cpu_s"]}
            for met in ("auc", "bacc"):
                v = [f[met] for f in r["single"]]
                row[f"single_{met}"] = {"mean": float(np.mean(v)), "min": float(min(v)), "max": float(max(v))}
                row[f"ensemble_{met}"] = r["ensemble"][met]
                row[f"gain_{met}"] = r["ensemble"][met] - float(np.mean(v))
            row["ensemble_bacc_05"] = r["ensemble"]["bacc_05"]
            row["ensemble_above_best_single_auc"] = r["ensemble"]["auc"] >= row["single_auc"]["max"]
            rows.append(row)
        entry = {"per_seed": rows}
        for met in ("auc", "bacc"):
            mean, lo, hi = t_interval([row[f"gain_{met}"] for row in rows])
            entry[f"gain_{met}"] = {"mean": mean, "lo": lo, "hi": hi, "n_seeds": len(rows),
                                    "positive_seeds": sum(row[f"gain_{met}"] > 0 for row in rows)}
        entry["seeds_ensemble_above_best_single_auc"] = sum(row["ensemble_above_best_single_auc"] for row in rows)
        out[m] = entry
    return out


def _table(summary: dict) -> str:
    lines = ["model  seed  single AUC mean [min, max]  ensemble AUC  gain | single bacc mean [min, max]  ensemble bacc"
             "  gain | OOF AUC"]
    for m, e in summary.items():
        for r in e["per_seed"]:
            sa, sb = r["single_auc"], r["single_bacc"]
            lines.append(f"{m:7s}{r['cohort_seed']:4d}  {sa['mean']:.3f} [{sa['min']:.3f}, {sa['max']:.3f}]  "
                         f"{r['ensemble_auc']:.3f}  {r['gain_auc']:+.3f} | {sb['mean']:.3f} [{sb['min']:.3f}, "
                         f"{sb['max']:.3f}]  {r['ensemble_bacc']:.3f}  {r['gain_bacc']:+.3f} | {r['oof_auc']:.3f}")
        g, h = e["gain_auc"], e["gain_bacc"]
        lines.append(f"{m:7s} gain AUC {g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}], bacc {h['mean']:+.3f} "
                     f"[{h['lo']:+.3f}, {h['hi']:+.3f}] (paired t 95% over {g['n_seeds']} cohort seeds); ensemble >= "
                     f"the best fold model's AUC in {e['seeds_ensemble_above_best_single_auc']} of them")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_ensemble", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=["mean", "abmil", "querent"])
    p.add_argument("--seeds", nargs="+", type=positive_int, default=[100, 101, 102],
                   help=f"development cohort seeds, >= {FIRST_DEV_SEED}")
    p.add_argument("--bags", type=positive_int, default=120, help="slides in the development cohort")
    p.add_argument("--test-bags", type=positive_int, default=200, help="slides in the external test cohort, >= 4")
    p.add_argument("--test-offset", type=positive_int, default=1000, help="test cohort seed = cohort seed + this")
    p.add_argument("--folds", type=positive_int, default=5, help="cross-validation folds, >= 2")
    p.add_argument("--bag-size", type=positive_int, default=500, help="patches per bag, >= 64")
    p.add_argument("--epochs-cap", type=positive_int, default=None, help="at most this many epochs (tests)")
    p.add_argument("--records", type=nonempty_path, default=str(RECORDS), help="resumable JSON lines, one per unit")
    p.add_argument("--out", type=nonempty_path, default=str(OUT), help="summary JSON")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--summary-only", action="store_true", help="summarize --records without running anything")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from core.infra.fileio import check_writable, write_json_atomic

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out), ("--records", args.records)])
    if min(args.seeds) < FIRST_DEV_SEED:
        raise UsageError(f"--seeds must be development cohort seeds >= {FIRST_DEV_SEED} (lower seeds are kept for "
                         f"reported results), got {sorted(args.seeds)}")
    clash = sorted({s + args.test_offset for s in args.seeds} & set(args.seeds))
    if clash:
        raise UsageError(f"--test-offset {args.test_offset} makes test cohort seeds {clash} equal to development "
                         "cohort seeds; give a larger offset")
    if args.folds < 2 or args.test_bags < 4 or args.bag_size < 64:
        raise UsageError(f"need --folds >= 2 (got {args.folds}), --test-bags >= 4 (got {args.test_bags}) and "
                         f"--bag-size >= 64 (got {args.bag_size})")
    if args.bags < 2 * args.folds:
        raise UsageError(f"--bags ({args.bags}) must be at least twice --folds ({args.folds}): each fold needs a "
                         "slide of each class")
    check_writable(args.out, what="--out")
    check_writable(args.records, what="--records")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.summary_only:
        import torch

        torch.set_num_threads(args.threads)
        for model in args.models:
            for seed in args.seeds:
                s = settings(args, model, seed)
                if key_of(s) in read_records(args.records):  # also one another process has written meanwhile
                    continue
                rec = run_unit(s)
                _append(args.records, rec)
                logger.info("%s seed %d: single AUC %s, ensemble AUC %.3f (cpu %.0f s)", model, seed,
                            [round(f["auc"], 3) for f in rec["single"]], rec["ensemble"]["auc"], rec["cpu_s"])
    wanted = {key_of(settings(args, m, s)) for m in args.models for s in args.seeds}
    recs = [r for k, r in read_records(args.records).items() if k in wanted]
    summary = summarize(recs)
    write_json_atomic(args.out, {"settings": {k: v for k, v in vars(args).items() if k not in ("records", "out")},
                                 "models": summary})
    print(_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
