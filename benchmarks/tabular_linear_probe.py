"""TabICL checkpoints against logistic regression on synthetic noisy-linear tables, in one run.

The real tables on which TabICL trails logistic regression (breast_cancer, wine, pima) look like measurements of
a few latent quantities with a label that is a noisy linear function of them. This probe builds such tables
with a known structure and asks how far a checkpoint is from the model that matches it (standardized logistic
regression), as a function of width and label noise; HistGradientBoosting, RandomForest and kNN (15 neighbours,
standardized) run on the same splits as non-linear references:

* ``K`` = 5 latent factors ``z ~ N(0, I)``; each of the ``F`` features is a sparse random linear mix of them plus
  its own noise (std 0.05..1), and 30% of the features are exponentiated (positive, right-skewed);
* the binary label is ``1[w·z / |w| + noise · e > 0]``, ``e ~ N(0, 1)``;
* ``--rows`` rows, a stratified 70/30 split, one table per seed; every model sees the same splits.

    python -m benchmarks.tabular_linear_probe --checkpoints tabular/weights/tabicl_small.safetensors \\
        training/tabicl_medium/best.safetensors

Results: ``benchmarks/results/tabular_linear_probe.json`` and a Markdown table (mean accuracy over seeds, and
each checkpoint's gap to logistic regression, with the mean fit + predict time) on stdout. With ``--row-probe``
each checkpoint also gets "NAME rows+LR": logistic regression on the model's row vectors (one view, no
ensemble), the input of its ICL stage — near the raw-feature LR when the row embedding keeps the linear signal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, portable_args, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_linear_probe.json"


def make_table(n_rows: int, n_features: int, noise: float, seed: int, n_factors: int = 5):
    """One noisy-linear table: ``X`` (n_rows, n_features) float64, ``y`` (n_rows,) in {0, 1}."""
    if n_rows < 20 or n_features < 1 or noise < 0:
        raise ValueError(f"need n_rows >= 20, n_features >= 1, noise >= 0; got {n_rows}, {n_features}, {noise}")
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n_rows, n_factors))
    load = rng.normal(size=(n_factors, n_features)) * (rng.random((n_factors, n_features)) < 0.5)
    load[rng.integers(0, n_factors, n_features), np.arange(n_features)] += rng.normal(size=n_features)
    X = z @ load + rng.uniform(0.05, 1.0, n_features) * rng.normal(size=(n_rows, n_features))
    skewed = rng.random(n_features) < 0.3
    X[:, skewed] = np.exp(0.5 * X[:, skewed] / X[:, skewed].std(0))
    w = rng.normal(size=n_factors)
    y = ((z @ w) / np.linalg.norm(w) + noise * rng.normal(size=n_rows) > 0).astype(int)
    if len(np.unique(y)) < 2:  # practically impossible (the score is centred), but keep the split valid
        y[: n_rows // 2] = 1 - y[: n_rows // 2]
    return X, y


class RowVectorLR:
    """Logistic regression (standardized, C = 0.1) on a checkpoint's row vectors: the train rows' vectors fit it,
    the test rows' vectors (computed with the train rows' column statistics, as in the model) are scored."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint = checkpoint

    def fit(self, X, y):
        self.X_, self.y_ = np.asarray(X, dtype=np.float32), np.asarray(y)
        return self

    def predict(self, X_test):
        import torch
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        from tabular.weights_io import load_model

        model = load_model(self.checkpoint)
        X = torch.from_numpy(np.concatenate([self.X_, np.asarray(X_test, dtype=np.float32)]))[None]
        with torch.no_grad():
            R = model.encode_rows(X, len(self.y_))[0].numpy()
        n = len(self.y_)
        lr = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=5000)).fit(R[:n], self.y_)
        return lr.predict(R[n:])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_linear_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs="+", required=True, help="TabICL checkpoints to compare (files)")
    p.add_argument("--features", type=int, nargs="+", default=[5, 10, 30], help="table widths")
    p.add_argument("--noise", type=float, nargs="+", default=[0.4], help="label-noise std (score has std 1)")
    p.add_argument("--rows", type=int, default=569, help="rows per table (70%% become the context)")
    p.add_argument("--seeds", type=int, default=8, help="tables per setting")
    p.add_argument("--n-estimators", type=int, default=8, help="TabICL ensemble members")
    p.add_argument("--row-probe", action="store_true",
                   help="also fit logistic regression on each checkpoint's row vectors (the input of its ICL stage), "
                        "to tell what the row embedding keeps from what the ICL stage makes of it")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from tabular import TabICLClassifier

    missing = [c for c in args.checkpoints if not Path(c).is_file()]
    if missing:
        raise SystemExit(f"checkpoint file(s) not found: {missing}")
    torch.set_num_threads(args.threads)
    names = {c: Path(c).stem if Path(c).stem not in ("best", "last") else f"{Path(c).parent.name}/{Path(c).stem}"
             for c in args.checkpoints}
    models = {"LogisticRegression": lambda seed: make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)),
              # non-linear references: where a checkpoint lands between these and logistic regression
              "HistGradientBoosting": lambda seed: HistGradientBoostingClassifier(random_state=seed),
              "RandomForest": lambda seed: RandomForestClassifier(n_estimators=300, random_state=seed, n_jobs=1),
              "kNN": lambda seed: make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=15))}
    for c, name in names.items():
        models[name] = lambda seed, c=c: TabICLClassifier(n_estimators=args.n_estimators, checkpoint=c,
                                                          random_state=seed)
    if args.row_probe:
        for c, name in names.items():
            models[f"{name} rows+LR"] = lambda seed, c=c: RowVectorLR(c)
    rows = []
    for F in args.features:
        for noise in args.noise:
            acc: dict[str, list] = {m: [] for m in models}
            secs: dict[str, list] = {m: [] for m in models}
            for seed in range(args.seeds):
                X, y = make_table(args.rows, F, noise, seed)
                Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=y)
                for mname, make in models.items():
                    t0 = time.perf_counter()
                    pred = make(seed).fit(Xtr, ytr).predict(Xte)
                    secs[mname].append(time.perf_counter() - t0)
                    acc[mname].append(float(np.mean(pred == yte)))
            lr = float(np.mean(acc["LogisticRegression"]))
            for mname in models:
                a = float(np.mean(acc[mname]))
                rows.append({"features": F, "noise": noise, "model": mname, "accuracy": a,
                             "gap_to_lr": a - lr, "accuracy_per_seed": acc[mname],
                             "fit_predict_s": float(np.mean(secs[mname]))})
                print(f"F={F} noise={noise} {mname}: {a:.3f} ({a - lr:+.3f} vs LR)", file=sys.stderr)
    result = {"env": env_info(), "args": portable_args(args), "rows": rows}
    write_json_atomic(args.out, result)
    print(format_table(rows, ["features", "noise", "model", "accuracy", "gap_to_lr", "fit_predict_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
