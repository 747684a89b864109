"""How strong must TC be to act? A λ sweep on validation, then the chosen λ on the test splits.

``python -m benchmarks.ncal_lambda sweep --datasets tmwpl pmtd`` trains :mod:`apps.ncal.train` with ``ce`` and
with ``tc`` at each ``--lambdas`` × ``--starts`` (share of the steps before the TC term enters the loss: 0 =
every step, 0.33 = after a first cross-entropy-only epoch of three) on the train split minus the stratified 10%
hold-out (the test split is not loaded), one seed. Each run writes ``--out/sweep/<dataset>_<config>.json``:
validation metrics and the per-epoch log (TC term, its gradient share ‖∇(λ·TC)‖/‖∇CE‖, NC1/NC2 and the mean
different-class cosine of the validation features). Rule, fixed before the runs: per dataset, the ``tc``
setting with the highest validation macro-F1 is chosen (ties: the smaller λ, then the earlier start).

``python -m benchmarks.ncal_lambda test --seeds 0 1 2 3 4`` trains the chosen setting on the full train split
with each seed and records its test metrics as ``--bench-out/runs/<dataset>_tc_l<λ>_s<start>_<seed>.json``
(the records :mod:`benchmarks.ncal_bench` reads, so its ``ce`` runs of the same seeds pair with them; λ = 0.1 from
step 0 is the benchmark's own ``tc`` setting, whose records are used as they are). The
summary ``--out/summary.{json,md}``: the λ curve per dataset and the paired test difference against ``ce``
(95% t interval over seeds). ``--with-ce`` also trains ``ce`` per seed into ``--bench-out`` (another encoder's
pair, e.g. ``--encoder scratch --bench-out DIR --bench-runs DIR --summary-out DIR``). Every run is resumable and a
recorded run is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import env_info, portable_args, read_json, write_json_atomic
from benchmarks.ncal_bench import paired_t
from core.infra.cli import add_run_options, configure_run
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "config_name", "choose"]

EPOCH_KEYS = ("epoch", "train_loss", "train_tc", "tc_active", "tc_grad_share", "train_nc1", "train_nc2",
              "valid_macro_f1", "valid_accuracy", "valid_nc_nc1", "valid_nc_nc2", "valid_nc_cos_mean")


def config_name(loss: str, lam: float | None = None, start: float | None = None) -> str:
    """``ce`` or ``tc_l<λ>_s<start>`` (e.g. ``tc_l3_s0``, ``tc_l1_s0.33``)."""
    return loss if loss != "tc" else f"tc_l{lam:g}_s{start:g}"


def choose(records: list[dict]) -> dict | None:
    """The tc record with the highest validation macro-F1 (ties: smaller λ, then earlier start)."""
    tc = [r for r in records if r["loss"] == "tc"]
    if not tc:
        return None
    return sorted(tc, key=lambda r: (-r["valid"]["macro_f1"], r["tc_lambda"], r["tc_start"]))[0]


def _epochs(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: rec[k] for k in EPOCH_KEYS if k in rec} for rec in map(json.loads, lines)]


def _sweep(args) -> None:
    from apps.ncal.data import load_split
    from apps.ncal.train import TrainConfig, train

    configs = [("ce", None, None)] + [("tc", lam, st) for st in args.starts for lam in args.lambdas]
    for ds in args.datasets:
        train_ex, classes = load_split(ds, "train", context=args.context)
        for loss, lam, st in configs:
            name = config_name(loss, lam, st)
            rec_path = Path(args.out) / "sweep" / f"{ds}_{name}.json"
            if rec_path.exists():
                continue
            cfg = TrainConfig(dataset=ds, loss=loss, seed=args.seed, epochs=args.epochs, encoder=args.encoder,
                              context=args.context, valid_frac=0.1, tc_lambda=lam if lam is not None else 0.1,
                              tc_start=st or 0.0, out=str(Path(args.runs) / f"{ds}_{name}_{args.seed}"))
            t0 = time.time()
            meta = train(cfg, progress=False, examples=(train_ex, None, classes))
            if meta.get("test") is not None:
                raise RuntimeError(f"{cfg.out} holds test metrics; sweep runs must not see the test split")
            v = meta["valid"]
            write_json_atomic(rec_path, {
                "dataset": ds, "config": name, "loss": loss, "tc_lambda": lam, "tc_start": st, "seed": args.seed,
                "epochs": args.epochs, "encoder": args.encoder, "valid_split": meta["valid_split"],
                "valid": {k: v[k] for k in ("accuracy", "macro_f1", "recall_head", "recall_medium", "recall_tail",
                                            "nc_nc1", "nc_nc2", "nc_cos_mean") if k in v},
                "per_epoch": _epochs(Path(cfg.out)), "wall_s": round(time.time() - t0, 1)})
            logger.info("%s %s: validation macro-F1 %.4f", ds, name, v["macro_f1"])


def _raw_cos(ds: str, run: Path, context: str) -> float | None:
    """Mean cosine between the raw validation class means of a finished sweep run (−1/(K−1) at the ETF)."""
    import torch

    from apps.ncal.data import load_split, stratified_holdout
    from apps.ncal.model import infer, load_checkpoint
    from core.collapse import mean_offdiag_cosine

    if not (run / "ncal.json").is_file():
        return None
    ck = load_checkpoint(run)
    train_ex, classes = load_split(ds, "train", context=context)
    _, held = stratified_holdout([e.label for e in train_ex], ck.meta["valid_split"]["frac"])
    valid = [train_ex[i] for i in held]
    _, feats = infer(ck.model, ck.tokenizer, [e.text for e in valid])
    y = torch.tensor([list(classes).index(e.label) for e in valid])
    return mean_offdiag_cosine(feats, y, len(classes))


def _sweep_records(args) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in sorted((Path(args.out) / "sweep").glob("*.json")):
        r = read_json(p)
        if "valid_cos_raw" not in r:  # the raw class-mean cosine, from the run's checkpoint (once)
            cos = _raw_cos(r["dataset"], Path(args.runs) / f"{r['dataset']}_{r['config']}_{r['seed']}", args.context)
            if cos is not None:
                r["valid_cos_raw"] = cos
                write_json_atomic(p, r)
        out.setdefault(r["dataset"], []).append(r)
    return out


def _test_method(lam: float, st: float) -> str:
    """The test records' method name: the benchmark's own ``tc`` runs are this setting at λ = 0.1 from step 0."""
    return "tc" if (lam, st) == (0.1, 0.0) else config_name("tc", lam, st)


def _test(args, sweep: dict[str, list[dict]]) -> None:
    from apps.ncal.train import TrainConfig, train

    for ds in args.datasets:
        best = choose(sweep.get(ds, []))
        if best is None:
            logger.info("%s: no sweep record; run the sweep first", ds)
            continue
        lam, st = best["tc_lambda"], best["tc_start"]
        method = _test_method(lam, st)
        jobs = [("tc", method)] + ([("ce", "ce")] if args.with_ce else [])
        for seed in args.seeds:
            for loss, name in jobs:
                rec_path = Path(args.bench_out) / "runs" / f"{ds}_{name}_{seed}.json"
                if rec_path.exists():
                    continue
                cfg = TrainConfig(dataset=ds, loss=loss, seed=seed, epochs=args.epochs, encoder=args.encoder,
                                  context=args.context, tc_lambda=lam, tc_start=st,
                                  out=str(Path(args.bench_runs) / f"{ds}_{name}_{seed}"))
                meta = train(cfg, progress=False)
                write_json_atomic(rec_path, {"dataset": ds, "method": name, "seed": seed, "context": args.context,
                                             "epochs": args.epochs, "encoder": args.encoder,
                                             "tc_lambda": lam if loss == "tc" else None,
                                             "tc_start": st if loss == "tc" else None,
                                             "wall_s": meta["train_wall_s"], **meta["test"]})
                logger.info("%s %s seed %d: test macro-F1 %.4f", ds, name, seed, meta["test"]["macro_f1"])


def _paired(ds: str, method: str, bench_out: Path, epochs: int) -> dict:
    recs = [read_json(p) for p in sorted((bench_out / "runs").glob(f"{ds}_*.json"))]
    by = {(r["method"], r["seed"]): r for r in recs if r.get("epochs") in (epochs, None)}
    seeds = sorted(s for (m, s) in by if m == method and ("ce", s) in by)
    diffs = [100 * (by[(method, s)]["macro_f1"] - by[("ce", s)]["macro_f1"]) for s in seeds]
    ci = paired_t(diffs)
    tf = [r["macro_f1"] for r in recs if r["method"] == "tfidf_lr_balanced"]
    return {"method": method, "seeds": seeds, "diff_macro_f1_points": diffs,
            "tc_macro_f1": [100 * by[(method, s)]["macro_f1"] for s in seeds],
            "ce_macro_f1": [100 * by[("ce", s)]["macro_f1"] for s in seeds],
            "mean": ci[0] if ci else (diffs[0] if diffs else None), "ci95": [ci[1], ci[2]] if ci else None,
            "tfidf_balanced_macro_f1": 100 * tf[0] if tf else None}


def summary_markdown(summary: dict) -> str:
    lines = ["Validation macro-F1 % (one seed; 10% stratified hold-out of train) and, at the last epoch, the TC "
             "gradient share, validation NC1/NC2 and the mean cosine between different classes' raw feature means "
             "(the simplex ETF: −1/(K−1), −0.167 for TMWPL's 7 classes, −0.143 for PMTD's 8):", "",
             "| dataset | setting | valid macro-F1 | valid accuracy | grad share (last epoch) | valid NC1 | valid NC2 | "
             "valid cos | chosen |", "|---|---|---|---|---|---|---|---|---|"]
    for ds, e in summary["datasets"].items():
        for r in e["sweep"]:
            last = r["per_epoch"][-1] if r["per_epoch"] else {}
            share = last.get("tc_grad_share")
            v = r["valid"]
            lines.append(f"| {ds} | {r['config']} | {100 * v['macro_f1']:.1f} | {100 * v['accuracy']:.1f} | "
                         f"{'–' if share is None else f'{share:.2f}'} | {v.get('nc_nc1', float('nan')):.2f} | "
                         f"{v.get('nc_nc2', float('nan')):.2f} | {r.get('valid_cos_raw', float('nan')):+.3f} | "
                         f"{'**yes**' if r['config'] == e.get('chosen') else ''} |")
    lines += ["", "Test (official split), chosen setting against ce, paired over seeds (macro-F1 points):"]
    for ds, e in summary["datasets"].items():
        p = e.get("test")
        if not p or p["mean"] is None:
            lines.append(f"- {ds}: no test runs yet")
            continue
        ci = p["ci95"]
        tc_mean = sum(p["tc_macro_f1"]) / len(p["tc_macro_f1"])
        lines.append(f"- {ds} {p['method']}: tc {tc_mean:.1f}, ce {sum(p['ce_macro_f1']) / len(p['ce_macro_f1']):.1f}, "
                     f"tc − ce {p['mean']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else " (one seed)")
                     + f" over seeds {p['seeds']}"
                     + ("" if p["tfidf_balanced_macro_f1"] is None
                        else f"; TF-IDF balanced {p['tfidf_balanced_macro_f1']:.1f}"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncal_lambda", description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=("sweep", "test", "summary"))
    p.add_argument("--datasets", nargs="+", default=["tmwpl", "pmtd"])
    p.add_argument("--lambdas", nargs="+", type=float, default=[0.1, 1.0, 3.0, 10.0])
    p.add_argument("--starts", nargs="+", type=float, default=[0.0, 0.33],
                   help="shares of the steps before TC enters the loss")
    p.add_argument("--seed", type=int, default=0, help="seed of the sweep runs")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds of the test runs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--encoder", default="default")
    p.add_argument("--context", default="past", choices=("past", "window", "none"))
    p.add_argument("--runs", default="runs/ncal_lambda", help="sweep run folders")
    p.add_argument("--bench-runs", default="runs/ncal_bench", help="test run folders")
    p.add_argument("--out", default="benchmarks/results/ncal_lambda")
    p.add_argument("--bench-out", default="benchmarks/results/ncal", help="test records (beside the benchmark's)")
    p.add_argument("--with-ce", action="store_true",
                   help="test: also train ce with each seed into --bench-out (for an encoder the benchmark has no ce "
                        "runs of, e.g. --encoder scratch)")
    p.add_argument("--summary-out", default=None, help="where summary.{json,md} go (default: --out)")
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    configure_run(args)
    if args.phase == "sweep":
        _sweep(args)
    sweep = _sweep_records(args)
    if args.phase == "test":
        _test(args, sweep)
    summary = {"datasets": {}, "args": portable_args(args), "env": env_info(),
               "rule": "per dataset, the tc setting with the highest validation macro-F1 (ties: smaller λ, earlier start)"}
    for ds, recs in sorted(sweep.items()):
        best = choose(recs)
        e = {"sweep": sorted(recs, key=lambda r: (r["loss"] != "ce", r.get("tc_start") or 0, r.get("tc_lambda") or 0)),
             "chosen": best["config"] if best else None}
        if best:
            e["test"] = _paired(ds, _test_method(best["tc_lambda"], best["tc_start"]), Path(args.bench_out), args.epochs)
        summary["datasets"][ds] = e
    out = Path(args.summary_out or args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "summary.json", summary)
    md = summary_markdown(summary)
    write_text_atomic(out / "summary.md", md + "\n")
    print(md)
    return summary


if __name__ == "__main__":
    main()
