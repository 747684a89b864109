"""Mixed precision for the official pipeline: TabICL here in bf16 autocast (the default on CUDA) against fp32 here and
against the official package's autocast (``use_amp=True``: fp16 on CUDA, bf16 on the CPU), on one random official v2
checkpoint (``--arch v2``: the published sizes; ``lean`` for a quick run).

Cases, in one process: ``here_fp32``, ``here_bf16``, ``here_bf16_kv`` (``kv_cache=True``), ``official_amp``,
``official_fp32``; each one fit + ``predict_proba`` timed (CUDA synchronised), its probabilities compared with
``here_fp32`` and ``official_fp32`` (max abs difference, argmax agreement). A case passes when its probabilities stay
within ``--tol`` of both fp32 results and agree in argmax on at least 95 % of the rows.

    python -m benchmarks.tabular_amp --device cuda --out benchmarks/results/tabular_amp_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from core.infra.cli import positive_float, positive_int, run_cli
from core.infra.fileio import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {"lean": dict(embed_dim=32, col_num_blocks=1, col_nhead=4, col_num_inds=32, row_num_blocks=1, row_nhead=4,
                      row_num_cls=4, icl_num_blocks=2, icl_nhead=4, ff_factor=2),
         "v2": {}}  # the official class's defaults: the published v2 sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_amp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", choices=sorted(ARCHS), default="v2")
    p.add_argument("--rows", type=positive_int, default=4000, help="train rows")
    p.add_argument("--test-rows", type=positive_int, default=1000)
    p.add_argument("--features", type=positive_int, default=20)
    p.add_argument("--n-estimators", type=positive_int, default=4)
    p.add_argument("--tol", type=positive_float, default=2e-2, help="max |probability difference| to fp32")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tabular_amp_gpu.json")
    args = p.parse_args(argv)
    import numpy as np
    import torch
    from tabicl import TabICLClassifier as Official
    from tabicl._model.tabicl import TabICL as OfficialModel

    from core.infra.device import resolve_device
    from tabular import TabICLClassifier

    device = resolve_device(args.device)
    switches = dict(col_affine=False, col_feature_group="same", col_feature_group_size=3, col_target_aware=True,
                    col_ssmax="qassmax-mlp-elementwise", icl_ssmax="qassmax-mlp-elementwise", row_rope_interleaved=False)
    cfg = {"max_classes": 10, **ARCHS[args.arch], **switches, "zero_init": False}
    rng = np.random.default_rng(0)
    n = args.rows + args.test_rows
    X = rng.normal(size=(n, args.features)).astype(np.float32)
    y = (X[:, :3] @ rng.normal(size=(3, 4)) + rng.normal(size=(n, 4))).argmax(1)
    kw = dict(n_estimators=args.n_estimators, random_state=42)
    result = {"command": "python -m benchmarks.tabular_amp " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": str(device), "arch": args.arch, "rows": args.rows, "test_rows": args.test_rows,
              "features": args.features, "n_estimators": args.n_estimators, "tol": args.tol, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        ckpt = Path(tmp) / "tabicl-classifier-v2-20260212.ckpt"
        torch.save({"config": cfg, "state_dict": OfficialModel(**cfg).state_dict()}, ckpt)
        cases = {
            "here_fp32": lambda: TabICLClassifier(checkpoint=ckpt, official=True, device=device, dtype="float32", **kw),
            "here_bf16": lambda: TabICLClassifier(checkpoint=ckpt, official=True, device=device, dtype="bfloat16", **kw),
            "here_bf16_kv": lambda: TabICLClassifier(checkpoint=ckpt, official=True, device=device, dtype="bfloat16",
                                                     kv_cache=True, **kw),
            "official_amp": lambda: Official(model_path=ckpt, allow_auto_download=False, device=str(device),
                                             use_amp=True, **kw),
            "official_fp32": lambda: Official(model_path=ckpt, allow_auto_download=False, device=str(device),
                                              use_amp=False, **kw),
        }
        probs = {}
        for name, make in cases.items():
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            est = make().fit(X[: args.rows], y[: args.rows])
            sync()
            t1 = time.perf_counter()
            probs[name] = est.predict_proba(X[args.rows :])
            sync()
            t2 = time.perf_counter()
            rec = {"case": name, "fit_s": round(t1 - t0, 3), "predict_s": round(t2 - t1, 3)}
            if device.type == "cuda":
                rec["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            result["cases"].append(rec)
        for rec in result["cases"]:
            p_ = probs[rec["case"]]
            for ref in ("here_fp32", "official_fp32"):
                rec[f"max_abs_diff_vs_{ref}"] = float(np.abs(p_ - probs[ref]).max())
                rec[f"argmax_agree_vs_{ref}"] = float((p_.argmax(1) == probs[ref].argmax(1)).mean())
            rec["ok"] = all(rec[f"max_abs_diff_vs_{r}"] <= args.tol and rec[f"argmax_agree_vs_{r}"] >= 0.95
                            for r in ("here_fp32", "official_fp32"))
            print(json.dumps(rec), flush=True)
    result["ok"] = all(r["ok"] for r in result["cases"])
    write_json_atomic(args.out, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
