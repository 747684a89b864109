"""What each in-context readout of TabICL offers on its own, on the small real tables, against logistic regression.

TabICL's optional readouts (``icl_ridge`` on the row vectors, ``icl_logistic`` on the standardized cells; see
``tabular/model.py`` and ``tabular/readout.py``) are closed-form fits inside the forward pass whose outputs the
ICL stage reads. This benchmark asks how good those outputs are before any transformer uses them, on the same
stratified splits as ``benchmarks/tabular_bench.py``:

* ``LR cells``: scikit-learn's LogisticRegression (C = 1) on the model's own input — the table encoded by
  ``tabular.preprocess`` (categories as ordinal codes), standardized with the train rows' statistics, NaN -> 0,
  clipped — the reference each readout is held against;
* ``<readout> argmax``: the readout's class scores of the test rows, argmax;
* ``<readout> calibrated``: a multinomial logistic regression fitted on the train rows' leave-one-out readout
  features and applied to the test rows' features — what an ideal reader of the features (the ICL stage at best)
  makes of them;
* readouts: ``logistic cells`` (``tabular.readout.logistic_readout``, penalty alpha · n), ``ridge rows`` (the
  model's ``ridge_fit`` on a checkpoint's standardized row vectors) and ``LR rows`` (logistic regression on the
  row vectors, C = 0.1, what the row embedding keeps).

    python -m benchmarks.tabular_readouts --checkpoint training/tabicl_medium/last.safetensors

Results: ``benchmarks/results/tabular_readouts.json`` and a Markdown table of mean accuracy over splits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, portable_args, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_readouts.json"
SMALL = ("iris", "wine", "breast_cancer", "penguins", "biopsy", "pima")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_readouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="TabICL checkpoint whose row vectors the row readouts use")
    p.add_argument("--datasets", nargs="+", default=list(SMALL), help="tables from benchmarks.tabular_bench")
    p.add_argument("--repeats", type=int, default=5, help="stratified splits per table (as tabular_bench)")
    p.add_argument("--test-size", type=float, default=0.3, help="held-out share of each split")
    p.add_argument("--logistic-alpha", type=float, default=0.002, help="penalty of the logistic readout")
    p.add_argument("--ridge-alpha", type=float, default=0.003, help="penalty of the ridge readout (alpha · n)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    return p


def _calibrated(loo: np.ndarray, y_train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Predictions of a logistic regression read from leave-one-out readout features."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=5000).fit(loo, y_train).predict(test)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedShuffleSplit

    from benchmarks.tabular_bench import datasets
    from tabular.model import standardize_columns
    from tabular.preprocess import TablePreprocessor
    from tabular.readout import logistic_readout, logistic_scores
    from tabular.weights_io import load_model

    if not Path(args.checkpoint).is_file():
        raise SystemExit(f"checkpoint not found: {args.checkpoint}")
    loaders = datasets()
    unknown = [d for d in args.datasets if d not in loaders]
    if unknown:
        raise SystemExit(f"unknown datasets {unknown}; known: {sorted(loaders)}")
    torch.set_num_threads(args.threads)
    model = load_model(args.checkpoint)
    rows_out = []
    for name in args.datasets:
        X_df, y_raw = loaders[name]()
        y = np.unique(np.asarray(y_raw), return_inverse=True)[1]
        C = int(y.max()) + 1
        acc: dict[str, list[float]] = {}
        splitter = StratifiedShuffleSplit(n_splits=args.repeats, test_size=args.test_size, random_state=0)
        for tr, te in splitter.split(np.zeros(len(y)), y):
            pre = TablePreprocessor()
            Xtr, _ = pre.fit_transform(X_df.iloc[tr])
            X = torch.from_numpy(np.concatenate([Xtr, pre.transform(X_df.iloc[te])]))[None]
            n = len(tr)
            ytr, yte = y[tr], y[te]
            Z = standardize_columns(X, n, model.config.clip_value)
            Ztr, Zte = Z[0, :n].double().numpy(), Z[0, n:].double().numpy()
            preds = {"LR cells": LogisticRegression(max_iter=5000).fit(Ztr, ytr).predict(Zte)}
            W, loo = logistic_readout(Z[:, :n], torch.from_numpy(ytr)[None], (args.logistic_alpha,), C)
            test = logistic_scores(Z[:, n:], W)[0].numpy()
            preds["logistic cells argmax"] = test.argmax(1)
            preds["logistic cells calibrated"] = _calibrated(loo[0].numpy(), ytr, test)
            with torch.no_grad():
                R = model.encode_rows(X, n)
            mean, std = model.icl.row_stats(R[:, :n])
            R = (R - mean) / std
            preds["LR rows"] = LogisticRegression(C=0.1, max_iter=5000).fit(R[0, :n].numpy(), ytr).predict(R[0, n:].numpy())
            Wr, loo_r = model.icl.ridge_fit(R[:, :n], torch.from_numpy(ytr)[None], alphas=(args.ridge_alpha,))
            test_r = (R[:, n:] @ Wr)[0, :, :C].numpy()
            preds["ridge rows argmax"] = test_r.argmax(1)
            preds["ridge rows calibrated"] = _calibrated(loo_r[0, :, :C].numpy(), ytr, test_r)
            for k, p in preds.items():
                acc.setdefault(k, []).append(float(np.mean(p == yte)))
        ref = float(np.mean(acc["LR cells"]))
        for k, v in acc.items():
            rows_out.append({"dataset": name, "readout": k, "accuracy": float(np.mean(v)),
                             "gap_to_lr": float(np.mean(v)) - ref, "accuracy_per_split": v})
            print(f"{name} {k}: {np.mean(v):.3f}", file=sys.stderr)
    write_json_atomic(args.out, {"env": env_info(), "args": portable_args(args), "rows": rows_out})
    print(format_table(rows_out, ["dataset", "readout", "accuracy", "gap_to_lr"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
