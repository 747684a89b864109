"""Parity with the official ``tabicl`` package at the published sizes (random weights, fp32 both) on the paths beyond
ten classes and one forward pass: many classes, regression, the reused context and the inference options.

Each release's architecture is built by the official package with random weights (``zero_init=False``, so no branch
is an identity), saved in its checkpoint format and loaded here. Cases:

- ``many_classes``: 12, 30 and 100 classes; the model (the official forward pass with ``return_logits=False`` against
  :meth:`tabular.model.TabICL.build_context` + ``predict_proba``: mixed-radix column views for v2, the class
  hierarchy for both) and the estimator (``predict_proba`` against ``tabicl.TabICLClassifier``, 2 members);
- ``regression``: the published v2 regression architecture (999 quantiles): raw quantiles of the model, and
  ``TabICLRegressor.predict`` against ``tabicl.TabICLRegressor.predict`` for mean, median and quantiles (with and
  without ``kv_cache``); differences also relative to the target's standard deviation;
- ``kv_cache``: ``predict_proba`` with ``kv_cache=True`` against the official ``kv_cache=True``;
- ``options``: ``average_logits=False``, ``batch_size=1``, ``feat_shuffle_method="random"``,
  ``class_shuffle_method="latin"`` against the official estimator with the same option.

    python -m benchmarks.tabular_official_parity --out benchmarks/results/tabular_official_parity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from core.infra.cli import positive_int, run_cli
from core.infra.fileio import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
V1_SWITCHES = dict(col_affine=True, col_feature_group=False, col_target_aware=False, col_ssmax=False, icl_ssmax=False,
                   row_rope_interleaved=True)
V2_SWITCHES = dict(col_affine=False, col_feature_group="same", col_feature_group_size=3, col_target_aware=True,
                   col_ssmax="qassmax-mlp-elementwise", icl_ssmax="qassmax-mlp-elementwise", row_rope_interleaved=False)
V1_SIZES = dict(embed_dim=128, col_num_blocks=3, col_nhead=4, col_num_inds=128, row_num_blocks=3, row_nhead=8,
                row_num_cls=4, icl_num_blocks=12, icl_nhead=4, ff_factor=2)
RELEASES = {  # release -> (official config, released file name); v2 at the official class's defaults
    "v1": ({"max_classes": 10, **V1_SIZES, **V1_SWITCHES, "zero_init": False}, "tabicl-classifier-v1-20250208.ckpt"),
    "v2": ({"max_classes": 10, **V2_SWITCHES, "zero_init": False}, "tabicl-classifier-v2-20260212.ckpt"),
    "v2-regressor": ({"max_classes": 0, "num_quantiles": 999, **V2_SWITCHES, "zero_init": False},
                     "tabicl-regressor-v2-20260212.ckpt"),
}
CASES = ("many_classes", "regression", "kv_cache", "options")


def _fp32():
    from tabicl._model.inference_config import InferenceConfig

    cfg = InferenceConfig()
    cfg.update_from_dict({k: {"use_amp": False, "device": "cpu"} for k in ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")})
    return cfg


def _checkpoint(release: str, folder: Path):
    """The official model of ``release`` (random weights) and its checkpoint path."""
    import torch
    from tabicl._model.tabicl import TabICL as Official

    cfg, name = RELEASES[release]
    torch.manual_seed(0)
    model = Official(**cfg).eval()
    path = folder / name
    if not path.exists():
        torch.save({"config": cfg, "state_dict": model.state_dict()}, path)
    return model, path


def _table(C: int, seed: int, n_test: int = 40, F: int = 8):
    import numpy as np

    rng = np.random.default_rng(seed)
    n = max(3 * C, 60) + n_test
    X = rng.normal(size=(n, F))
    y = (X[:, :2] @ rng.normal(size=2) * C / 3 + rng.normal(size=n) * 2).round().astype(int) % C
    y[:C] = np.arange(C)
    return X, y, n - n_test


def _official_classifier(path, **kw):
    from tabicl import TabICLClassifier

    return TabICLClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw)


def _ours(path, **kw):
    from tabular import TabICLClassifier

    return TabICLClassifier(checkpoint=path, official=True, device="cpu", dtype="float32", **kw)


def case_many_classes(folder: Path) -> list[dict]:
    import numpy as np
    import torch

    from tabular.weights_io import load_model

    rows = []
    for release in ("v1", "v2"):
        official, path = _checkpoint(release, folder)
        ours = load_model(path)
        for C in (12, 30, 100):
            X, y, ntr = _table(C, seed=C)
            Xt = torch.from_numpy(X).float()[None]
            yt = torch.from_numpy(y[:ntr])[None]
            t = time.perf_counter()
            with torch.no_grad():
                ref = official(Xt, yt.float(), return_logits=False, inference_config=_fp32())
                p = ours.predict_proba(Xt[:, ntr:], ours.build_context(Xt[:, :ntr], yt, chunk=256))
            kw = dict(n_estimators=2, random_state=42)
            p_ref = _official_classifier(path, **kw).fit(X[:ntr], y[:ntr]).predict_proba(X[ntr:])
            p_est = _ours(path, **kw).fit(X[:ntr], y[:ntr]).predict_proba(X[ntr:])
            rows.append({"release": release, "classes": C, "train_rows": ntr,
                         "model_proba_max_abs_diff": float((p - ref).abs().max()), "model_proba_max": float(ref.max()),
                         "model_argmax_equal": bool(torch.equal(p.argmax(-1), ref.argmax(-1))),
                         "estimator_proba_max_abs_diff": float(np.abs(p_est - p_ref).max()),
                         "estimator_argmax_equal": bool(np.array_equal(p_est.argmax(1), p_ref.argmax(1))),
                         "seconds": round(time.perf_counter() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def case_regression(folder: Path) -> list[dict]:
    import numpy as np
    import torch
    from tabicl import TabICLRegressor as OfficialRegressor

    from tabular import TabICLRegressor
    from tabular.weights_io import load_model

    official, path = _checkpoint("v2-regressor", folder)
    ours = load_model(path)
    rng = np.random.default_rng(7)
    X = rng.normal(size=(240, 8))
    y = 50 + 10 * (X[:, 0] - 0.5 * X[:, 1] ** 2 + 0.3 * rng.normal(size=240))
    ys = (y - y[:200].mean()) / y[:200].std()
    Xt, yt = torch.from_numpy(X).float()[None], torch.from_numpy(ys[:200]).float()[None]
    with torch.no_grad():
        ref = official(Xt, yt, inference_config=_fp32())
        raw = ours.predict_logits(Xt[:, 200:], ours.build_context(Xt[:, :200], yt, chunk=256))
    rows = [{"what": "model raw quantiles (standardized target)", "max_abs_diff": float((raw - ref).abs().max()),
             "max_abs": float(ref.abs().max())}]
    for kv in (False, True):
        kw = dict(n_estimators=2, random_state=42, kv_cache=kv)
        a = OfficialRegressor(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw).fit(X[:200], y[:200])
        b = TabICLRegressor(checkpoint=path, device="cpu", dtype="float32", **kw).fit(X[:200], y[:200])
        for output in ("mean", "median", "quantiles"):
            pa, pb = a.predict(X[200:], output_type=output), b.predict(X[200:], output_type=output)
            d = float(np.abs(pa - pb).max())
            rows.append({"what": f"predict output_type={output}, kv_cache={kv}", "max_abs_diff": d,
                         "max_abs_diff_over_target_std": d / float(y[:200].std()), "max_abs": float(np.abs(pa).max())})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def _estimator_rows(folder: Path, variants: dict) -> list[dict]:
    import numpy as np

    rows = []
    X, y, ntr = _table(4, seed=3)
    for release in ("v1", "v2"):
        _, path = _checkpoint(release, folder)
        base = _official_classifier(path, n_estimators=4, random_state=42).fit(X[:ntr], y[:ntr]).predict_proba(X[ntr:])
        for name, (ours_kw, ref_kw) in variants.items():
            kw = dict(n_estimators=4, random_state=42)
            p_ref = _official_classifier(path, **kw, **ref_kw).fit(X[:ntr], y[:ntr]).predict_proba(X[ntr:])
            p = _ours(path, **kw, **ours_kw).fit(X[:ntr], y[:ntr]).predict_proba(X[ntr:])
            rows.append({"release": release, "option": name, "proba_max_abs_diff": float(np.abs(p - p_ref).max()),
                         "official_change_vs_default": float(np.abs(p_ref - base).max()),
                         "argmax_equal": bool(np.array_equal(p.argmax(1), p_ref.argmax(1)))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def case_kv_cache(folder: Path) -> list[dict]:
    return _estimator_rows(folder, {"kv_cache=True": (dict(kv_cache=True), dict(kv_cache=True))})


def case_options(folder: Path) -> list[dict]:
    return _estimator_rows(folder, {
        "average_logits=False": (dict(average_logits=False), dict(average_logits=False)),
        "batch_size=1": (dict(batch_size=1), dict(batch_size=1)),
        "feat_shuffle_method=random": (dict(feat_shuffle_method="random"), dict(feat_shuffle_method="random")),
        "class_shuffle_method=latin": (dict(class_shuffle_method="latin"), dict(class_shuffle_method="latin")),
    })


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_official_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tabular_official_parity.json")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown cases {bad}; choose from {list(CASES)}")
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result = old if old.get("threads") == args.threads else {"threads": args.threads, "cases": {}}
    result["command"] = "python -m benchmarks.tabular_official_parity " + " ".join(argv if argv is not None else sys.argv[1:])
    fns = {"many_classes": case_many_classes, "regression": case_regression, "kv_cache": case_kv_cache,
           "options": case_options}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if case in result["cases"]:
                continue
            t = time.perf_counter()
            result["cases"][case] = {"rows": fns[case](Path(tmp)), "seconds": round(time.perf_counter() - t, 1)}
            write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
