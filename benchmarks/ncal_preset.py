"""The two presets of ``apps.ncal.train`` side by side: ``project`` (the default) against ``reference`` (the released
code's TC pairing within the batch and random ``drop_last`` batches), each with its own validation-chosen λ.

``python -m benchmarks.ncal_preset sweep --datasets tmwpl`` trains ``tc`` with each preset at each ``--lambdas``
(TC from step 0, seed 0, 3 epochs) on the train split minus the stratified 10% hold-out (the test split is never
loaded) and records validation metrics in ``--out/sweep/<dataset>_<preset>_l<λ>.json``. Rule fixed before the
runs: per dataset and preset, the λ with the highest validation macro-F1 (ties: the smaller λ).

``python -m benchmarks.ncal_preset test --seeds 0 1 2 3 4`` trains each preset at its chosen λ on the full train
split with every seed and records the test metrics in ``--out/runs/<dataset>_<preset>_<seed>.json``; the summary
(``--out/summary.{json,md}``) pairs the presets seed by seed: reference − project macro-F1 with a 95% Student-t
interval.

The project preset is this project's default recipe, unchanged: its sweep and test runs made earlier by
:mod:`benchmarks.ncal_lambda` (same settings, same split, same seeds) are imported when ``--import-project`` names
their records (the record keeps ``imported_from``) instead of being trained again; ``verify --seeds 0`` trains
one of them again and records whether the numbers are the same. Every run resumes from its folder and a recorded
run is skipped; a run another process is training (``<run folder>.lock`` naming a live process) is skipped too,
so several processes can share one sweep or one test phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import env_info, portable_args, read_json, write_json_atomic
from benchmarks.ncal_bench import paired_t
from core.infra.cli import add_run_options, configure_run
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "choose", "summary_markdown"]

PRESETS = ("project", "reference")
METRICS = ("accuracy", "macro_f1", "recall_head", "recall_medium", "recall_tail", "nc_nc1", "nc_nc2", "nc_cos_mean")


def choose(records: list[dict]) -> dict | None:
    """The record with the highest validation macro-F1 (ties: the smaller λ)."""
    return sorted(records, key=lambda r: (-r["valid"]["macro_f1"], r["tc_lambda"]))[0] if records else None


def _lam(lam: float) -> str:
    return f"l{lam:g}"


def _imported(path: Path, **extra) -> dict | None:
    if not path.is_file():
        return None
    r = read_json(path)
    return {**r, **extra, "imported_from": path.as_posix()}


@contextlib.contextmanager
def _claim(folder: Path):
    """Yields True when this process may train ``folder`` (its lock taken), False when a live process holds it."""
    lock = folder.with_name(folder.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists():
        try:
            os.kill(int(lock.read_text().strip() or 0), 0)
            yield False
            return
        except (ProcessLookupError, ValueError):
            lock.unlink()  # left by a process that died
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        yield False
        return
    os.write(fd, str(os.getpid()).encode()); os.close(fd)
    try:
        yield True
    finally:
        lock.unlink(missing_ok=True)


def _cfg(args, ds, preset, lam, seed, out, **kw):
    from apps.ncal.train import TrainConfig

    return TrainConfig(dataset=ds, loss="tc", preset=preset, tc_lambda=lam, seed=seed, epochs=args.epochs,
                       encoder=args.encoder, context=args.context, out=str(out), **kw)


def _sweep(args) -> None:
    from apps.ncal.data import load_split
    from apps.ncal.train import train

    for ds in args.datasets:
        train_ex, classes = load_split(ds, "train", context=args.context)
        for preset in args.presets:
            for lam in args.lambdas:
                rec_path = Path(args.out) / "sweep" / f"{ds}_{preset}_{_lam(lam)}.json"
                if rec_path.exists():
                    continue
                if preset == "project" and args.import_project:
                    rec = _imported(Path(args.import_project) / "sweep" / f"{ds}_tc_l{lam:g}_s0.json", preset=preset)
                    if rec is not None and rec.get("seed") == 0 and rec.get("epochs") == args.epochs:
                        write_json_atomic(rec_path, rec)
                        continue
                cfg = _cfg(args, ds, preset, lam, 0, Path(args.runs) / f"sweep_{ds}_{preset}_{_lam(lam)}",
                           valid_frac=0.1)
                t0 = time.time()
                with _claim(Path(cfg.out)) as mine:
                    if not mine:
                        continue
                    meta = train(cfg, progress=False, examples=(train_ex, None, classes))
                if meta.get("test") is not None:
                    raise RuntimeError(f"{cfg.out} holds test metrics; sweep runs must not see the test split")
                lines = (Path(cfg.out) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
                write_json_atomic(rec_path, {
                    "dataset": ds, "preset": preset, "loss": "tc", "tc_lambda": lam, "tc_start": 0.0, "seed": 0,
                    "epochs": args.epochs, "encoder": args.encoder, "settings": meta["settings"] | {"out": None},
                    "valid_split": meta["valid_split"],
                    "valid": {k: meta["valid"][k] for k in METRICS if k in meta["valid"]},
                    "per_epoch": [json.loads(x) for x in lines], "wall_s": round(time.time() - t0, 1)})
                logger.info("%s %s λ=%g: validation macro-F1 %.4f", ds, preset, lam, meta["valid"]["macro_f1"])


def _sweep_records(out: Path) -> dict[tuple[str, str], list[dict]]:
    by: dict[tuple[str, str], list[dict]] = {}
    for p in sorted((out / "sweep").glob("*.json")):
        r = read_json(p)
        by.setdefault((r["dataset"], r["preset"]), []).append(r)
    return by


def _test(args, sweep, *, verify: bool = False) -> None:
    from apps.ncal.train import train

    for ds in args.datasets:
        for preset in (("project",) if verify else args.presets):
            best = choose(sweep.get((ds, preset), []))
            if best is None:
                logger.info("%s %s: no sweep record; run the sweep first", ds, preset)
                continue
            lam = best["tc_lambda"]
            for seed in args.seeds:
                name = f"{ds}_{preset}_{seed}"
                rec_path = Path(args.out) / ("verify" if verify else "runs") / f"{name}.json"
                if rec_path.exists():
                    continue
                method = "tc" if lam == 0.1 else f"tc_l{lam:g}_s0"
                if preset == "project" and args.import_project and not verify:
                    rec = _imported(Path(args.import_bench) / "runs" / f"{ds}_{method}_{seed}.json", preset=preset)
                    if rec is not None and rec.get("epochs") == args.epochs:
                        write_json_atomic(rec_path, rec)
                        continue
                folder = Path(args.runs) / (("verify_" if verify else "") + f"{ds}_{preset}_{_lam(lam)}_{seed}")
                with _claim(folder) as mine:
                    if not mine:
                        continue
                    meta = train(_cfg(args, ds, preset, lam, seed, folder), progress=False)
                rec = {"dataset": ds, "preset": preset, "method": method, "seed": seed, "epochs": args.epochs,
                       "encoder": args.encoder, "context": args.context, "tc_lambda": lam, "tc_start": 0.0,
                       "wall_s": meta["train_wall_s"], **meta["test"]}
                if verify:
                    old = read_json(Path(args.out) / "runs" / f"{name}.json")
                    rec["same_as_recorded"] = {k: (old.get(k), rec.get(k)) for k in ("accuracy", "macro_f1")}
                    rec["identical"] = all(a == b for a, b in rec["same_as_recorded"].values())
                write_json_atomic(rec_path, rec)
                logger.info("%s seed %d: test macro-F1 %.4f", name, seed, meta["test"]["macro_f1"])


def _summary(args, sweep) -> dict:
    out = Path(args.out)
    summary = {"datasets": {}, "args": portable_args(args), "env": env_info(),
               "rule": "per dataset and preset, the λ with the highest validation macro-F1 (ties: smaller λ)"}
    for ds in args.datasets:
        e = {"sweep": {}, "chosen": {}, "test": {}}
        for preset in PRESETS:
            recs = sorted(sweep.get((ds, preset), []), key=lambda r: r["tc_lambda"])
            e["sweep"][preset] = [{"tc_lambda": r["tc_lambda"], "valid_macro_f1": 100 * r["valid"]["macro_f1"],
                                   "valid_accuracy": 100 * r["valid"]["accuracy"],
                                   "imported_from": r.get("imported_from")} for r in recs]
            best = choose(recs)
            e["chosen"][preset] = best["tc_lambda"] if best else None
            runs = {}
            for p in sorted((out / "runs").glob(f"{ds}_{preset}_*.json")):
                r = read_json(p)
                runs[r["seed"]] = r
            e["test"][preset] = {str(s): {k: r.get(k) for k in METRICS} for s, r in sorted(runs.items())}
        seeds = sorted(set(map(int, e["test"]["project"])) & set(map(int, e["test"]["reference"])))
        pair = {}
        for k in ("macro_f1", "accuracy", "recall_tail"):
            d = [100 * (e["test"]["reference"][str(s)][k] - e["test"]["project"][str(s)][k]) for s in seeds]
            ci = paired_t(d)
            pair[k] = {"diffs": d, "mean": ci[0] if ci else (d[0] if d else None),
                       "ci95": [ci[1], ci[2]] if ci else None}
        e["paired_reference_minus_project"] = {"seeds": seeds, **pair}
        ver = [read_json(p) for p in sorted((out / "verify").glob(f"{ds}_project_*.json"))]
        e["verify"] = [{"seed": v["seed"], "identical": v["identical"], "values": v["same_as_recorded"]} for v in ver]
        summary["datasets"][ds] = e
    return summary


def summary_markdown(summary: dict) -> str:
    lines = ["| dataset | preset | λ (valid macro-F1 %, 10% hold-out, seed 0) | chosen λ | seeds | test accuracy | "
             "test macro-F1 | test tail recall |", "|---|---|---|---|---|---|---|---|"]
    import statistics

    def ms(v):
        return f"{statistics.fmean(v):.1f} ± {statistics.stdev(v):.1f}" if len(v) > 1 else (f"{v[0]:.1f}" if v else "–")

    for ds, e in summary["datasets"].items():
        for preset in PRESETS:
            sw = ", ".join(f"{r['tc_lambda']:g}: {r['valid_macro_f1']:.1f}" for r in e["sweep"][preset]) or "–"
            t = e["test"][preset]
            col = {k: [100 * r[k] for r in t.values() if r.get(k) is not None] for k in ("accuracy", "macro_f1",
                                                                                       "recall_tail")}
            lam = e["chosen"][preset]
            lines.append(f"| {ds} | {preset} | {sw} | {'–' if lam is None else f'{lam:g}'} | {len(t)} | "
                         f"{ms(col['accuracy'])} | {ms(col['macro_f1'])} | {ms(col['recall_tail'])} |")
    lines += ["", "Reference − project, paired by seed (points, 95% t interval):"]
    for ds, e in summary["datasets"].items():
        p = e["paired_reference_minus_project"]
        parts = []
        for k in ("macro_f1", "accuracy", "recall_tail"):
            q = p[k]
            if q["mean"] is None:
                continue
            ci = q["ci95"]
            parts.append(f"{k} {q['mean']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else " (one seed)"))
        lines.append(f"- {ds}: " + ("; ".join(parts) if parts else "no paired seeds yet") + f" over seeds {p['seeds']}")
        for v in e["verify"]:
            lines.append(f"- {ds} project seed {v['seed']} trained again: "
                         + ("identical to the imported record" if v["identical"] else f"differs: {v['values']}"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncal_preset", description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=("sweep", "test", "verify", "summary"))
    p.add_argument("--datasets", nargs="+", default=["tmwpl"], choices=("tmwpl", "pmtd"))
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--lambdas", nargs="+", type=float, default=[0.1, 1.0, 3.0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds of the test runs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--encoder", default="default")
    p.add_argument("--context", default="past", choices=("past", "window", "none"))
    p.add_argument("--runs", default="runs/ncal_preset", help="run folders")
    p.add_argument("--out", default="benchmarks/results/ncal_preset")
    p.add_argument("--import-project", default=None,
                   help="benchmarks.ncal_lambda's results folder: its project-recipe sweep records are imported")
    p.add_argument("--import-bench", default="benchmarks/results/ncal",
                   help="benchmarks.ncal_bench's results folder (its test records, with --import-project)")
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    configure_run(args)
    if args.phase == "sweep":
        _sweep(args)
    sweep = _sweep_records(Path(args.out))
    if args.phase in ("test", "verify"):
        _test(args, sweep, verify=args.phase == "verify")
    summary = _summary(args, sweep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "summary.json", summary)
    md = summary_markdown(summary)
    write_text_atomic(out / "summary.md", md + "\n")
    print(md)
    return summary


if __name__ == "__main__":
    main()
