"""Decision Mixer's two presets trained side by side: ``project`` (this project's routing) against ``reference``
(the released code's routed layer: capacity without gradient, strict threshold, ``s·f(x)``; ``rl.train --preset``).

    python -m benchmarks.rl_preset --seeds 0,1,2,3,4 --steps 1000 --eval-episodes 20

Everything but the preset is the decisive pilot's setting (``benchmarks/rl_pilot.sh``): hopper-medium-replay from
``behaviour_hopper_long`` (200K transitions, 10% of the episodes held out), context 20, width 64, 4 blocks with
1 and 3 routed, batch 64, lr 1e-3, warm-up 200, no capacity cost, evaluation at the data's best return on the
environment seeds ``10000 + i``; ``--steps`` and ``--eval-episodes`` set the budget, the same for both presets.
Per seed, both presets train on the same batch stream and are evaluated on the same episodes; each (preset,
seed) is one ``benchmarks.rl_bench`` case in ``--parts/<preset>.json`` (a finished case is reused, a killed run
resumes from its checkpoint, a case run with other settings is refused). The summary (``--out``) holds each
preset's normalized score (mean, 95% Student-t interval over seeds), the paired difference reference − project
(Student-t and paired-bootstrap 95% intervals), the held-out action MSE, the routed fraction, and the trivial
baseline: the training data's mean episode return, normalized.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, portable_args, read_json, write_json_atomic
from benchmarks.ncal_bench import paired_t
from benchmarks.rl_bench import paired_bootstrap

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "DATASET", "bench_argv", "summarize", "build_parser", "main"]

PRESETS = ("project", "reference")
DATASET = "hopper-medium-replay"
# benchmarks/rl_pilot.sh's settings, less the arms, steps and episodes
COMMON = ["--datasets", DATASET, "--behaviour", "hopper=rl/weights/behaviour_hopper_long.safetensors",
          "--dataset-steps", "200000", "--algos", "dm", "--batch-size", "64", "--lr", "1e-3", "--warmup", "200",
          "--context", "20", "--embed-dim", "64", "--heads", "1", "--dm-layers", "4", "--routed-layers", "1,3",
          "--capacity-cost", "0", "--target-mode", "data-best", "--target-factors", "1.0", "--holdout-frac", "0.1",
          "--holdout-seed", "0", "--bootstrap", "0"]


def bench_argv(preset: str, seed: int, args) -> list[str]:
    """The ``benchmarks.rl_bench`` command line of one (preset, seed) case."""
    return COMMON + ["--preset", preset, "--seeds", str(seed), "--steps", str(args.steps), "--eval-episodes",
                     str(args.eval_episodes), "--data-dir", args.data_dir, "--work-dir", args.work_dir,
                     "--out", str(Path(args.parts) / f"{preset}.json")]


def _interval(vals: list[float]) -> dict:
    """Mean with its 95% Student-t interval (:func:`benchmarks.ncal_bench.paired_t` on the values themselves)."""
    t = paired_t(vals)
    if t is None:
        return {"mean": statistics.fmean(vals), "lo": None, "hi": None, "n": len(vals)}
    return {"mean": t[0], "lo": t[1], "hi": t[2], "sd": statistics.stdev(vals), "n": len(vals)}


def summarize(cases: dict[str, dict[int, dict]], baseline: dict | None = None, bootstrap: int = 10_000) -> dict:
    """``cases[preset][seed]``: rl_bench case results. Per preset: score and held-out MSE intervals, routed fraction;
    reference − project over the seeds both finished (paired)."""
    out: dict = {"presets": {}, "baseline": baseline}
    for p, by_seed in cases.items():
        if not by_seed:
            continue
        cs = [by_seed[s] for s in sorted(by_seed)]
        out["presets"][p] = {"seeds": sorted(by_seed), "score": _interval([c["score"] for c in cs]),
                             "scores": [c["score"] for c in cs],
                             "heldout_mse": _interval([c["heldout_mse"] for c in cs
                                                       if c.get("heldout_mse") is not None]),
                             "routed_fraction": statistics.fmean([c["routed_fraction"] for c in cs]),
                             "cpu_sec_per_1k_steps": statistics.fmean([c["cpu_sec_per_1k_steps"] for c in cs])}
    both = sorted(set(cases.get("reference", {})) & set(cases.get("project", {})))
    diff = {}
    for metric in ("score", "heldout_mse"):
        d = [cases["reference"][s][metric] - cases["project"][s][metric] for s in both]
        if len(d) >= 2:
            t = paired_t(d)
            b = paired_bootstrap({DATASET: np.array(d)}, bootstrap)[DATASET]
            diff[metric] = {"mean": t[0], "t_lo": t[1], "t_hi": t[2], "boot_lo": b["lo"], "boot_hi": b["hi"],
                            "per_seed": d, "seeds": both}
    out["reference - project"] = diff
    return out


def _table(summary: dict) -> str:
    rows = []
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for p, r in summary["presets"].items():
        s = r["score"]
        rows.append({"preset": p, "seeds": s["n"], "score (95% CI)": f"{f(s['mean'])} [{f(s['lo'])}, {f(s['hi'])}]",
                     "held-out MSE": f"{r['heldout_mse']['mean']:.4f}", "routed": f"{r['routed_fraction']:.2f}",
                     "CPU s/1K steps": f"{r['cpu_sec_per_1k_steps']:.0f}"})
    d = summary["reference - project"].get("score")
    if d:
        m = summary["reference - project"]["heldout_mse"]
        rows.append({"preset": "reference − project (paired)", "seeds": len(d["seeds"]),
                     "score (95% CI)": f"{d['mean']:+.1f} [{d['t_lo']:+.1f}, {d['t_hi']:+.1f}] (bootstrap "
                                       f"[{d['boot_lo']:+.1f}, {d['boot_hi']:+.1f}])",
                     "held-out MSE": f"{m['mean']:+.4f} [{m['t_lo']:+.4f}, {m['t_hi']:+.4f}]"})
    b = summary.get("baseline")
    if b:
        rows.append({"preset": "training data: mean episode (best)", "score (95% CI)":
                     f"{b['mean_score']:.1f} ({b['best_score']:.1f})"})
    return format_table(rows, ["preset", "seeds", "score (95% CI)", "held-out MSE", "routed", "CPU s/1K steps"])


def _baseline(args) -> dict | None:
    """The training split's mean and best episode returns, normalized (the trivial baseline)."""
    from rl.data import load_dataset
    from rl.references import normalized_score

    part = read_json(Path(args.parts) / "project.json") or read_json(Path(args.parts) / "reference.json")
    if not part or DATASET not in part.get("datasets", {}):
        return None
    info = part["datasets"][DATASET]
    rets = load_dataset(Path(args.data_dir) / info["train_file"]).episode_returns()
    return {"train_file": info["train_file"], "episodes": int(len(rets)), "mean_return": float(rets.mean()),
            "mean_score": float(normalized_score(info["env"], np.array([rets.mean()]))[0]),
            "best_score": float(normalized_score(info["env"], np.array([rets.max()]))[0])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_preset", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (each runs both presets)")
    p.add_argument("--steps", type=int, default=1000, help="training steps per run (both presets)")
    p.add_argument("--eval-episodes", type=int, default=20, help="evaluation episodes per run (both presets)")
    p.add_argument("--presets", default=",".join(PRESETS), help="which presets to run (the summary pairs both)")
    p.add_argument("--report-only", action="store_true", help="summarize the finished cases; run nothing")
    p.add_argument("--bootstrap", type=int, default=10_000, help="paired bootstrap resamples")
    p.add_argument("--data-dir", default="data/rl")
    p.add_argument("--work-dir", default="runs/rl_preset/work")
    p.add_argument("--parts", default="benchmarks/results/rl_preset", help="folder of the per-preset rl_bench JSONs")
    p.add_argument("--out", default="benchmarks/results/rl_preset.json")
    return p


def main(argv=None) -> None:
    from benchmarks import rl_bench

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    presets = [p for p in args.presets.split(",") if p]
    bad = [p for p in presets if p not in PRESETS]
    if bad:
        raise SystemExit(f"unknown presets {bad}; accepted: {list(PRESETS)}")
    Path(args.parts).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in seeds:  # seed-major: every finished seed has both presets
            for preset in presets:
                logger.info("preset %s seed %d", preset, seed)
                rl_bench.main(bench_argv(preset, seed, args))
    cases: dict[str, dict[int, dict]] = {p: {} for p in PRESETS}
    for p in PRESETS:
        part = read_json(Path(args.parts) / f"{p}.json") or {"cases": {}}
        want = rl_bench.case_settings("dm", rl_bench.build_parser().parse_args(bench_argv(p, 0, args)))
        for s in seeds:
            c = part["cases"].get(f"{DATASET}/dm/{s}")
            if c is not None and c.get("settings") == want:
                cases[p][s] = c
    summary = summarize(cases, _baseline(args), args.bootstrap)
    summary["table"] = _table(summary)
    write_json_atomic(args.out, {"env": env_info(), "settings": portable_args(args),
                                 "bench_argv": {p: bench_argv(p, 0, args) for p in PRESETS}, **summary})
    print(summary["table"])


if __name__ == "__main__":
    main()
