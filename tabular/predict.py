"""Predict a CSV's rows with TabICL, the rows of another CSV as context.

    python -m tabular.predict --train train.csv --test test.csv --target label --out preds.csv
    python -m tabular.predict --checkpoint v2 --official --train train.csv --test test.csv --target label --out p.csv
    python -m tabular.predict --checkpoint v2-regressor --train train.csv --test test.csv --target price --out p.csv

``--checkpoint``: the shipped classifier (default), a file (``.safetensors``, official ``.ckpt``) or an official
release name ("v1", "v1.1", "v2", "v2-regressor") found in the local Hugging Face cache (never downloaded). A
regression checkpoint predicts values (``TabICLRegressor``), any other classes (``TabICLClassifier``). The test
CSV needs the train CSV's feature columns (any order; a target column there is ignored, other extra columns too).

Output (written atomically; never over an input or inside a shipped ``weights/`` folder): classification ``row``,
``prediction`` and one ``proba_<class>`` column per class; regression ``row``, ``prediction`` (the mean) and with
``--quantiles`` one ``q<level>`` column per level. ``row`` is the test row's position (0-based).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from core.infra.cli import UsageError, add_run_options, configure_run, positive_int, run_cli
from core.infra.device import add_device_options, device_from_args
from core.infra.fileio import check_writable, write_text_atomic
from core.infra.guard import check_output

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "read_table"]


def _levels(text: str) -> list[float]:
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated levels in (0, 1), got {text!r}") from None
    if not levels or not all(0 < a < 1 for a in levels):
        raise argparse.ArgumentTypeError(f"expected comma-separated levels in (0, 1), got {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tabular.predict", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--train", type=Path, required=True, help="CSV of labelled rows (the context)")
    p.add_argument("--test", type=Path, required=True, help="CSV of rows to predict")
    p.add_argument("--target", required=True, help="the target column of --train")
    p.add_argument("--out", type=Path, required=True, help="output CSV")
    p.add_argument("--checkpoint", default=None,
                   help="file or official release name (v1, v1.1, v2, v2-regressor); default the shipped classifier")
    p.add_argument("--official", action="store_true",
                   help="classification with an official checkpoint: the official package's pipeline (tabicl==2.2.0)")
    p.add_argument("--n-estimators", type=positive_int, default=8, help="ensemble members (default 8)")
    p.add_argument("--seed", type=int, default=None, help="ensemble seed (default: the estimator's)")
    p.add_argument("--quantiles", type=_levels, default=None, metavar="A,B,...",
                   help="regression: also these quantile levels, e.g. 0.1,0.9")
    add_device_options(p)
    add_run_options(p)
    return p


def read_table(path: Path, flag: str):
    """A CSV as a DataFrame; a missing, empty or unreadable file is a one-line error naming ``flag``."""
    import pandas as pd

    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file (expected a CSV with a header row)")
    try:
        df = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as err:
        raise UsageError(f"{flag} {path}: not a readable CSV ({' '.join(str(err).split())[:200]})") from None
    if df.shape[0] == 0 or df.shape[1] == 0:
        raise UsageError(f"{flag} {path}: the CSV has no rows or no columns")
    return df


def _estimator(args, device, dtype):
    """The estimator for the checkpoint's task, built before any table is read (a bad checkpoint fails first)."""
    from tabular import TabICLClassifier, TabICLRegressor
    from tabular.sklearn_base import get_model

    try:
        regression = args.checkpoint is not None and get_model(args.checkpoint, device, official=True).config.regression
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"--checkpoint {args.checkpoint}: {err}") from None
    seed = {} if args.seed is None else {"random_state": args.seed}
    if regression:
        return TabICLRegressor(checkpoint=args.checkpoint, n_estimators=args.n_estimators, device=device, dtype=dtype,
                               **seed)
    if args.quantiles:
        raise UsageError("--quantiles: only a regression checkpoint (e.g. v2-regressor) predicts quantiles")
    official = dict(official=True, dtype=dtype) if args.official else {}
    return TabICLClassifier(checkpoint=args.checkpoint, n_estimators=args.n_estimators, device=device, **official, **seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_run(args)
    check_output(args.out, inputs=[args.train, args.test, args.checkpoint if args.checkpoint else None])
    check_writable(args.out, what="--out")
    device, dtype = device_from_args(args)
    est = _estimator(args, device, dtype)
    train, test = read_table(args.train, "--train"), read_table(args.test, "--test")
    if args.target not in train.columns:
        raise UsageError(f"--target {args.target!r} is not a column of --train {args.train} "
                         f"(columns: {', '.join(map(str, train.columns[:20]))}{' ...' if train.shape[1] > 20 else ''})")
    features = [c for c in train.columns if c != args.target]
    if not features:
        raise UsageError(f"--train {args.train} has no column besides the target {args.target!r}")
    missing = [c for c in features if c not in test.columns]
    if missing:
        raise UsageError(f"--test {args.test} lacks the train feature column(s) {', '.join(map(str, missing[:10]))}")
    y = train[args.target]
    if y.isna().any():
        raise UsageError(f"--target {args.target!r} has {int(y.isna().sum())} empty value(s) in --train; drop or "
                         "fill those rows")
    regression = type(est).__name__ == "TabICLRegressor"
    if regression and not (y.dtype.kind in "iuf"):
        raise UsageError(f"--target {args.target!r} holds non-numbers ({y.dtype}); a regression checkpoint needs a "
                         "numeric target")
    if not regression and y.nunique() < 2:
        raise UsageError(f"--target {args.target!r} has a single class in --train; nothing to predict")
    t0 = time.perf_counter()
    try:
        est.fit(train[features], y)
        X = test[features]
        if regression:
            kinds = ["mean"] + (["quantiles"] if args.quantiles else [])
            out = est.predict(X, output_type=kinds, alphas=args.quantiles)
            table = {"prediction": out["mean"]}
            for j, a in enumerate(args.quantiles or []):
                table[f"q{a:g}"] = out["quantiles"][:, j]
        else:
            proba = est.predict_proba(X)
            table = {"prediction": est.classes_[proba.argmax(1)]}
            table.update({f"proba_{c}": proba[:, j] for j, c in enumerate(est.classes_)})
    except (ValueError, TypeError) as err:  # the estimator's refusals of the tables' contents
        raise UsageError(str(err)) from None
    import pandas as pd

    frame = pd.DataFrame({"row": range(len(X)), **table})
    write_text_atomic(args.out, frame.to_csv(index=False))
    logger.info("predicted %d rows (%s, %d train rows) in %.1f s", len(X), "regression" if regression else
                f"{len(est.classes_)} classes", len(train), time.perf_counter() - t0)
    print(f"wrote {args.out} ({len(X)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
