"""A diagnostic table on which a rule on one level of one column must be found among noise columns.

Synthetic, so nothing here is a suite table: ``width`` columns of DNA-like letters (A, C, G, T, uniform), class 1
when column ``p0`` is "C" (a middle code: not a threshold on the codes), class 2 when column ``p2`` is "G", else 0,
with 5% of labels redrawn at random; every other column is noise. The same rule is offered three ways:

- ``codes``: the letters as a categorical column (TabICL reads one column of codes per letter column);
- ``onehot``: ``TabICLClassifier(onehot_max_levels=10)`` (four 0/1 columns per letter column);
- ``bands``: a numeric column per letter column, ``code / 4 + U(0, 1/4)``: the rule is a band of values.

Peers on the same split: LogisticRegression (one-hot categories) and HistGradientBoosting (native categories), the
majority rate beside them. It measures whether a model reads a non-monotone effect of one column once a few
irrelevant columns are present (docs/experiments/tabular.md, 2026-12-03 late).

    python -m benchmarks.tabular_level_probe --widths 2,5,20,60 --seeds 0,1 --out benchmarks/results/tabular_level_probe.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, read_json, write_json_atomic

ENCODINGS = ("codes", "onehot", "bands")


def make_table(n: int, width: int, seed: int, encoding: str):
    """``(X DataFrame, y)``: the rule table of the module docstring in one of :data:`ENCODINGS`."""
    import pandas as pd

    if width < 3:
        raise ValueError(f"width must be at least 3 (the rule reads columns p0 and p2), got {width}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    rng = np.random.default_rng(seed)
    letters = rng.choice(list("ACGT"), size=(n, width))
    y = np.where(letters[:, 0] == "C", 1, np.where(letters[:, 2] == "G", 2, 0))
    noisy = rng.random(n) < 0.05
    y[noisy] = rng.integers(0, 3, int(noisy.sum()))
    cols = [f"p{i}" for i in range(width)]
    if encoding == "bands":
        codes = np.searchsorted(np.array(list("ACGT")), letters).astype(np.float64)
        return pd.DataFrame(codes / 4 + rng.random(codes.shape) / 4, columns=cols), y
    return pd.DataFrame(letters, columns=cols).astype("category"), y


def run_case(n: int, width: int, seed: int, encoding: str, n_estimators: int) -> dict:
    from sklearn.model_selection import train_test_split

    from tabular import TabICLClassifier
    from tabular.compare import baseline_models

    X, y = make_table(n, width, seed, encoding)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, stratify=y, random_state=seed)
    out = {"width": width, "seed": seed, "encoding": encoding, "rows": n,
           "majority": float(np.bincount(yte).max() / len(yte))}
    t = time.process_time()
    kw = {"onehot_max_levels": 10} if encoding == "onehot" else {}
    clf = TabICLClassifier(random_state=0, n_estimators=n_estimators, **kw).fit(Xtr, ytr)
    out["TabICL"] = float((clf.predict(Xte) == yte).mean())
    out["tabicl_cpu_s"] = round(time.process_time() - t, 1)
    if encoding != "onehot":  # the peers read codes and one-hot alike (their own encodings)
        for name, make in baseline_models(0).items():
            if name in ("LogisticRegression", "HistGradientBoosting"):
                out[name] = float((make().fit(Xtr, ytr).predict(Xte) == yte).mean())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="3,5,20,60", help="comma-separated column counts (each at least 3)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (table and split)")
    p.add_argument("--encodings", default=",".join(ENCODINGS))
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--n-estimators", type=int, default=8, help="TabICL ensemble members (its default: 8)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tabular_level_probe.json"))
    p.add_argument("--summarize", action="store_true",
                   help="only (re)write the summary table of the rows already in --out (a stopped run); fit nothing")
    args = p.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--widths and --seeds take comma-separated ints, got {args.widths!r} and {args.seeds!r}")
    encodings = args.encodings.split(",")
    bad = [e for e in encodings if e not in ENCODINGS]
    if bad or any(w < 3 for w in widths):
        p.error(f"--encodings must be among {ENCODINGS} (got {bad}) and every width at least 3 (got {widths})")
    if args.summarize:
        old = read_json(args.out)
        if not old or "rows" not in old:
            p.error(f"--summarize needs a result JSON with rows at {args.out}")
        rows, env, run_args = old["rows"], old["env"], old["args"]
    else:
        rows, env, run_args = [], env_info(), {**vars(args), "out": str(args.out)}
        for width in widths:
            for enc in encodings:
                for seed in seeds:
                    rows.append(run_case(args.rows, width, seed, enc, args.n_estimators))
                    print(rows[-1], file=sys.stderr, flush=True)
                    write_json_atomic(args.out, {"env": env, "args": run_args, "rows": rows})
    # mean over the seeds found per (width, encoding)
    table = []
    for width in sorted({r["width"] for r in rows}):
        for enc in [e for e in ENCODINGS if any(r["encoding"] == e for r in rows)]:
            sel = [r for r in rows if r["width"] == width and r["encoding"] == enc]
            if not sel:
                continue
            line = {"width": width, "encoding": enc, "seeds": len(sel),
                    "majority": round(float(np.mean([r["majority"] for r in sel])), 3),
                    "TabICL": round(float(np.mean([r["TabICL"] for r in sel])), 3)}
            for peer in ("LogisticRegression", "HistGradientBoosting"):
                if peer in sel[0]:
                    line[peer] = round(float(np.mean([r[peer] for r in sel])), 3)
            table.append(line)
    print(format_table(table, ["width", "encoding", "seeds", "majority", "TabICL", "LogisticRegression",
                               "HistGradientBoosting"]))
    write_json_atomic(args.out, {"env": env, "args": run_args, "rows": rows, "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
