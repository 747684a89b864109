"""Choose the shipped NCAL loss per dataset on a validation split, never on the test split.

``python -m benchmarks.ncal_select --datasets tmwpl pmtd --losses ce tc cb la focal etf --seed 0 --valid-frac 0.1``

For each dataset and loss, trains :mod:`apps.ncal.train` with one seed on the train split minus a stratified
hold-out (``--valid-frac``; :func:`apps.ncal.data.stratified_holdout`, a fixed split seed, so every loss sees the
same validation items) into ``--runs/<dataset>_<loss>_<seed>`` (resumable; a finished run is read, not rerun).
The test split is not loaded by these runs. The rule: the loss with the highest validation macro-F1 wins; ties
go to the loss listed first in ``--losses``. ``--out`` (``benchmarks/results/ncal/selection.json``) gets, per
dataset, every loss's validation metrics, the chosen loss, the rule, and the benchmark run to ship
(``runs/ncal_bench/<dataset>_<loss>_<seed>``: the same recipe trained on the full train split, whose seed was
fixed before any choice). It is rewritten after every run, with ``"complete": false`` until all runs are done,
and so is its table (``selection.md`` beside it: validation macro-F1 of every loss per dataset).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import env_info, portable_args, write_json_atomic
from core.infra.cli import add_run_options, configure_run
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "choose", "selection_markdown", "RULE"]

RULE = ("highest validation macro-F1 (stratified hold-out of the train split, fixed split seed); "
        "ties go to the loss listed first")

#: Metrics kept per run in the selection file.
KEEP = ("n", "accuracy", "macro_f1", "recall_head", "recall_medium", "recall_tail", "recall", "f1")


def choose(valid_f1: dict[str, float], order: Sequence[str]) -> str:
    """The loss with the highest validation macro-F1; ties go to the earliest in ``order``.

    Raises:
        ValueError: no loss of ``order`` has a score.
    """
    scored = [loss for loss in order if valid_f1.get(loss) is not None]
    if not scored:
        raise ValueError(f"no validation scores for any of {list(order)}")
    best = max(valid_f1[loss] for loss in scored)
    return next(loss for loss in scored if valid_f1[loss] == best)


def _entry(ds: str, losses: Sequence[str], per_loss: dict[str, dict], args) -> dict:
    f1 = {loss: per_loss[loss]["valid"]["macro_f1"] for loss in losses if loss in per_loss}
    done = [loss for loss in losses if loss in per_loss]
    entry = {"valid_split": per_loss[done[0]]["valid_split"] if done else None,
             "losses": {loss: {k: v for k, v in per_loss[loss].items() if k != "valid_split"} for loss in done},
             "complete": len(done) == len(losses)}
    if f1:
        chosen = choose(f1, losses)
        entry["best_so_far" if not entry["complete"] else "chosen"] = chosen
        if entry["complete"]:
            entry["ship_run"] = str(Path(args.bench_runs) / f"{ds}_{chosen}_{args.seed}")
    return entry


def selection_markdown(result: dict) -> str:
    """Validation macro-F1 (accuracy) of every loss per dataset, the chosen loss in bold, the hold-out sizes."""
    losses = list(dict.fromkeys(loss for e in result["datasets"].values() for loss in e["losses"]))
    lines = ["| dataset | validation items | " + " | ".join(losses) + " | chosen |",
             "|---|---|" + "---|" * len(losses) + "---|"]
    for ds, e in result["datasets"].items():
        chosen = e.get("chosen")
        cells = []
        for loss in losses:
            r = e["losses"].get(loss)
            cell = "–" if r is None else f"{100 * r['valid']['macro_f1']:.1f} ({100 * r['valid']['accuracy']:.1f})"
            cells.append(f"**{cell}**" if loss == chosen else cell)
        vs = e["valid_split"]
        lines.append(f"| {ds} | {vs['n_valid']} of {vs['n_valid'] + vs['n_train']} | " + " | ".join(cells)
                     + f" | {chosen or 'not yet (' + str(len(e['losses'])) + ' of ' + str(len(losses)) + ' runs)'} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncal_select", description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["tmwpl", "pmtd"])
    p.add_argument("--losses", nargs="+", default=["ce", "tc", "cb", "la", "focal", "etf"])
    p.add_argument("--seed", type=int, default=0, help="training seed of every run (the shipped benchmark seed)")
    p.add_argument("--valid-frac", type=float, default=0.1, help="stratified share of train held out")
    p.add_argument("--epochs", type=int, default=3, help="as the benchmark runs that get shipped")
    p.add_argument("--encoder", default="default", help="as apps.ncal.train --encoder")
    p.add_argument("--context", default="past", choices=("past", "window", "none"), help="PMTD context")
    p.add_argument("--runs", default="runs/ncal_select", help="run folders (checkpoints)")
    p.add_argument("--bench-runs", default="runs/ncal_bench", help="where the full-train benchmark runs live")
    p.add_argument("--out", default="benchmarks/results/ncal/selection.json")
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    configure_run(args)
    from apps.ncal.data import VALID_SEED, load_split
    from apps.ncal.train import TrainConfig, train

    out = Path(args.out)
    result = {"rule": RULE, "seed": args.seed, "valid_frac": args.valid_frac, "valid_seed": VALID_SEED,
              "epochs": args.epochs, "encoder": args.encoder, "context": args.context, "datasets": {},
              "args": portable_args(args), "env": env_info()}
    per: dict[str, dict[str, dict]] = {ds: {} for ds in args.datasets}
    t0 = time.time()
    for ds in args.datasets:
        train_ex, classes = load_split(ds, "train", context=args.context)
        for loss in args.losses:
            cfg = TrainConfig(dataset=ds, loss=loss, seed=args.seed, epochs=args.epochs, encoder=args.encoder,
                              context=args.context, valid_frac=args.valid_frac,
                              out=str(Path(args.runs) / f"{ds}_{loss}_{args.seed}"))
            meta = train(cfg, examples=(train_ex, None, classes))  # no test split: it never steers the choice
            if meta.get("test") is not None:
                raise RuntimeError(f"{cfg.out} holds test metrics; selection runs must not see the test split")
            v = meta["valid"]
            per[ds][loss] = {"run": cfg.out, "valid": {k: v[k] for k in KEEP if k in v},
                             "valid_split": meta["valid_split"], "train_wall_s": meta["train_wall_s"]}
            logger.info("%s %s: validation macro-F1 %.4f (%.0f min so far)", ds, loss, v["macro_f1"],
                        (time.time() - t0) / 60)
            result["datasets"] = {d: _entry(d, args.losses, per[d], args) for d in args.datasets if per[d]}
            result["complete"] = all(per[d].keys() >= set(args.losses) for d in args.datasets)
            write_json_atomic(out, result)
            write_text_atomic(out.with_suffix(".md"), selection_markdown(result) + "\n")
    for ds, e in result["datasets"].items():
        table = ", ".join(f"{loss} {100 * r['valid']['macro_f1']:.1f}" for loss, r in e["losses"].items())
        logger.info("%s: chosen %s (validation macro-F1: %s)", ds, e.get("chosen"), table)
    return result


if __name__ == "__main__":
    main()
