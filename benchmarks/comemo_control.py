"""CoMemo control that isolates the memory path: the same network with its memory gates frozen at 0.

``python -m benchmarks.comemo_control --out DIR --runs RUNS --seeds 1 2 3 4 5``

Arms (``--arms``), each trained with the staged recipe of ``apps.comemo.train`` (stage 1: projector + memory
path, stage 2: the same without the gates, LLM and ViT frozen, stage 3: everything; ``--steps S1 S2 S3``), all from
the same start (``--init-from``: every tensor that matches, by default the shipped model's ViT, projector and
decoder; the memory blocks at the reference placement are new and start with their gates at 0):

- ``comemo``: the memory path trained;
- ``frozen``: the same network, same parameters, data and steps, with every gate frozen at 0 (``--freeze-gates``):
  the memory blocks add exactly 0, so any difference to ``comemo`` is the memory path's;
- ``lvlm-1d`` / ``lvlm-dhr``: the context-only variants (no memory blocks). With one tile per image RoPE-DHR ids
  are the 1-D ids and a frozen-gate block adds 0, so both compute what ``frozen`` computes.

Each (arm, seed) is evaluated on the needle task (stream ``--eval-seed``; needles at evenly spread positions) at
``--images`` counts, and written to ``DIR/<arm>_s<seed>.json`` (skipped when present: the command is resumable;
an interrupted training stage resumes from its ``last.pt``). ``DIR/summary.json`` (rewritten after every run):
per seed and third of needle positions, the ``comemo - frozen`` difference at the longest count (full answer and
the digit alone), its mean over seeds with a t-interval over seeds (95%, n - 1 degrees of freedom), and the issue's
targets. Beyond the trained image count no arm can name the image (labels never seen in training), so retrieval
is read from the digit alone.

``--image-grid RxC`` (default 1x1): needles of R x C tiles (+ thumbnail) per image in training and evaluation; only
then do ``lvlm-1d`` (each image token its own position) and ``lvlm-dhr`` (an image keeps one tile's ids) differ.
Another grid gets other names (``<arm>_g<R>x<C>_s<seed>``, records and runs); a record made with other settings
(stored in it, with the SHA-256 of the start weights: the shipped file changes under the same path) is refused, never
reused, and training runs live under ``RUNS/settings_<hash of the settings>``. The records in
``benchmarks/results/comemo_control`` and ``comemo_dhr`` started from the shipped file of before 2026-12-05 (the
first memory layout; ``git show 2f64433:apps/comemo/weights/comemo.safetensors``). With both arms, the summary's ``dhr_vs_1d``: ``lvlm-dhr - lvlm-1d`` per
seed and over seeds (``t_interval``), exact match and digit alone, at every count and by third at the longest, and
the target *RoPE-DHR >= 1-D beyond the trained length*, read (fixed before any run) as: per seed the mean over the
counts above ``--max-images`` of the digit-alone difference; **met when its mean over seeds is >= 0** (the interval
says whether the sign is resolved; exact match is reported, not read: labels above ``--max-images`` are never
trained). Records hold per count a prompt's image tokens and last position id (the arms' layouts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
from pathlib import Path

import torch

from core.infra.cli import UsageError, nonempty_path_obj, positive_int, run_cli, thread_count
from core.infra.fileio import file_sha256
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["ARMS", "build_parser", "dhr_vs_1d", "main", "summarise", "t_interval"]

ARMS = ("comemo", "frozen", "lvlm-1d", "lvlm-dhr")
DEFAULT_INIT = Path(__file__).resolve().parents[1] / "apps" / "comemo" / "weights" / "comemo.safetensors"
THIRDS = ("first", "middle", "last")


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """``(mean, low, high)``: Student-t interval of the mean over ``values`` (None for fewer than 2)."""
    n = len(values)
    if n < 2:
        return None
    from scipy import stats

    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _thirds(records: list, n: int, col: int) -> list[float | None]:
    bins = [[], [], []]
    for pos, *hits in records:
        bins[min(2, pos * 3 // n)].append(hits[col - 1])
    return [sum(b) / len(b) if b else None for b in bins]


def summarise(results: dict[tuple[str, int], dict], *, longest: int, trained: int) -> dict:
    """Per-seed and over-seed ``comemo - frozen`` differences by third at ``longest`` images, and the targets."""
    seeds = sorted(s for (a, s) in results if a == "comemo" and ("frozen", s) in results)
    out: dict = {"longest": longest, "seeds": seeds, "per_seed": {}, "over_seeds": {}, "targets": {},
                 "accuracy": {}, "samples_per_third": None}
    for (arm, seed), r in sorted(results.items()):
        out["accuracy"].setdefault(arm, {})[str(seed)] = r["accuracy"].get("needle", {})
    for key, col in (("exact", 1), ("digit", 2)):
        diffs = {s: None for s in seeds}
        for s in seeds:
            a = results[("comemo", s)]["needle_records"].get(str(longest))
            b = results[("frozen", s)]["needle_records"].get(str(longest))
            if a is None or b is None:
                continue
            ta, tb = _thirds(a, longest, col), _thirds(b, longest, col)
            diffs[s] = [None if x is None or y is None else x - y for x, y in zip(ta, tb)]
            out["per_seed"].setdefault(key, {})[str(s)] = {"comemo": ta, "frozen": tb, "difference": diffs[s]}
            out["samples_per_third"] = [sum(1 for p, *_ in a if min(2, p * 3 // longest) == i) for i in range(3)]
        got = [d for d in diffs.values() if d is not None]
        out["over_seeds"][key] = {part: t_interval([d[i] for d in got if d[i] is not None])
                                  for i, part in enumerate(THIRDS)}
        arms = {arm: [_thirds(results[(arm, s)]["needle_records"][str(longest)], longest, col)
                      for s in seeds if str(longest) in results[(arm, s)]["needle_records"]]
                for arm in ("comemo", "frozen")}
        out["over_seeds"][key + "_mean_accuracy"] = {
            arm: [_mean([v[i] for v in vals]) for i in range(3)] for arm, vals in arms.items()}
    counts = sorted({n for s in seeds for n in results[("comemo", s)]["accuracy"].get("needle", {})}, key=int)
    out["exact_difference_by_count"] = {  # comemo - frozen, whole answer, all positions: per seed and over seeds
        n: {"per_seed": d, "over_seeds": t_interval(list(d.values()))}
        for n in counts
        for d in [{str(s): results[("comemo", s)]["accuracy"]["needle"][n] - results[("frozen", s)]["accuracy"]["needle"][n]
                   for s in seeds if n in results[("frozen", s)]["accuracy"].get("needle", {})}]}
    mid = out["over_seeds"].get("digit", {}).get("middle")
    ends = [out["over_seeds"].get("digit", {}).get(p) for p in ("first", "last")]
    out["targets"] = {
        "middle_gain_ge_0.10_with_interval_above_0": None if mid is None else bool(mid[0] >= 0.10 and mid[1] > 0),
        "ends_within_2_points_or_better": None if None in ends else bool(all(e[0] >= -0.02 for e in ends)),
        "note": f"read on the digit alone (retrieval); beyond {trained} images no arm names the image",
    }
    if {"lvlm-dhr", "lvlm-1d"} <= {a for a, _ in results}:
        out["dhr_vs_1d"] = dhr_vs_1d(results, trained=trained)
    return out


def dhr_vs_1d(results: dict[tuple[str, int], dict], *, trained: int) -> dict:
    """``lvlm-dhr - lvlm-1d`` per seed and over seeds: exact match and digit alone at every count both arms were
    evaluated at, by third at the longest, and the target read as the module docs say."""
    seeds = sorted(s for (a, s) in results if a == "lvlm-dhr" and ("lvlm-1d", s) in results)
    recs = {(a, s): results[(a, s)]["needle_records"] for a in ("lvlm-1d", "lvlm-dhr") for s in seeds}
    counts = sorted(set.intersection(*(set(r) for r in recs.values())), key=int) if recs else []
    rate = lambda rows, col: sum(r[col] for r in rows) / len(rows)  # noqa: E731
    out: dict = {"seeds": seeds, "trained": trained, "by_count": {}, "by_third_at_longest": {}, "target": {}}
    for key, col in (("exact", 1), ("digit", 2)):
        for n in counts:
            per = {str(s): {arm: rate(recs[(arm, s)][n], col) for arm in ("lvlm-1d", "lvlm-dhr")} for s in seeds}
            for v in per.values():
                v["difference"] = v["lvlm-dhr"] - v["lvlm-1d"]
            out["by_count"].setdefault(key, {})[n] = {
                "per_seed": per, "over_seeds": t_interval([v["difference"] for v in per.values()]),
                **{f"mean_{arm}": _mean([v[arm] for v in per.values()]) for arm in ("lvlm-1d", "lvlm-dhr")}}
        if counts:
            n = counts[-1]
            per = {str(s): [None if x is None or y is None else x - y for x, y in
                            zip(_thirds(recs[("lvlm-dhr", s)][n], int(n), col), _thirds(recs[("lvlm-1d", s)][n], int(n), col))]
                   for s in seeds}
            out["by_third_at_longest"][key] = {
                "count": n, "per_seed": per, "over_seeds": {
                    part: t_interval([d[i] for d in per.values() if d[i] is not None]) for i, part in enumerate(THIRDS)}}
    beyond = [n for n in counts if int(n) > trained]
    for key in ("digit", "exact"):
        per = {str(s): _mean([out["by_count"][key][n]["per_seed"][str(s)]["difference"] for n in beyond]) for s in seeds}
        vals = [v for v in per.values() if v is not None]
        out["target"][f"{key}_beyond_trained"] = {"counts": beyond, "per_seed": per, "mean": _mean(vals),
                                                  "over_seeds": t_interval(vals)}
    mean = out["target"]["digit_beyond_trained"]["mean"]
    out["target"]["dhr_ge_1d_beyond_trained_length"] = None if mean is None else bool(mean >= 0)
    out["target"]["reading"] = (f"mean over seeds of the per-seed mean over counts > {trained} of the digit-alone "
                                "difference lvlm-dhr - lvlm-1d, met when >= 0")
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _wall_time(run: Path) -> float:
    """Training seconds of a stage (its last metrics record; resumed runs included)."""
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return float(json.loads(lines[-1])["wall_time_s"]) if lines else 0.0


def _stage_done(run: Path, steps: int) -> bool:
    from core.infra.fileio import torch_load

    last = run / "last.pt"
    if not ((run / "model.safetensors").is_file() and last.is_file()):
        return False
    return int(torch_load(last, what="a training state of apps.comemo.train")["step"]) >= steps


def tag(arm: str, grid: tuple[int, int]) -> str:
    """The arm's name in record and run names: ``arm`` on one tile per image, else ``arm_g<R>x<C>``."""
    return arm if tuple(grid) == (1, 1) else f"{arm}_g{grid[0]}x{grid[1]}"


def train_arm(arm: str, seed: int, runs: Path, *, steps: list[int], init_from: Path, extra: list[str],
              grid: tuple[int, int] = (1, 1)) -> Path:
    """The three stages of one arm (each resumable); returns the final weights."""
    from apps.comemo.train import main as train_main

    variant = {"comemo": "comemo", "frozen": "comemo"}.get(arm, arm)
    prev = init_from
    for stage, n in zip((1, 2, 3), steps):
        run = runs / f"{tag(arm, grid)}_s{seed}" / f"stage{stage}"
        if not _stage_done(run, n):
            argv = ["--variant", variant, "--stage", str(stage), "--out", str(run), "--steps", str(n), "--seed", str(seed),
                    *(["--freeze-gates"] if arm == "frozen" else []), *extra]
            if (run / "last.pt").is_file():
                argv.append("--resume")
            else:
                argv += ["--init-from", str(prev)]
            train_main(argv)
        prev = run / "model.safetensors"
    return prev


def _load_record(path: Path, settings: dict) -> dict:
    """An earlier run's record, refused if made with other settings (older records: none stored, one tile)."""
    rec = json.loads(path.read_text())
    had = rec.get("settings", {"image_grid": "1x1"})
    diff = sorted(k for k in settings if k in had and had[k] != settings[k])
    if diff:
        raise UsageError(f"{path} was made with other settings ({', '.join(f'{k}={had[k]}' for k in diff)}); "
                         "use another --out or the same settings")
    return rec


def _all_results(out: Path, settings: dict) -> dict[tuple[str, int], dict]:
    """Every ``<arm>_s<seed>.json`` of this grid in ``out`` (other invocations may fill it with other seeds)."""
    found = {}
    for arm in ARMS:
        name = tag(arm, tuple(int(v) for v in settings["image_grid"].split("x")))
        for path in out.glob(f"{name}_s*.json"):
            tail = path.stem[len(name) + 2:]
            if tail.lstrip("-").isdigit():
                found[(arm, int(tail))] = _load_record(path, settings)
    return found


def prompt_layout(model, tok, *, images: list[int], seed: int, grid: tuple[int, int]) -> dict:
    """Per count, a needle prompt's tokens, image tokens and last position id (set by the count and grid alone)."""
    from apps.comemo.batch import build_batch
    from benchmarks.comemo_bench import evaluation_samples

    out = {}
    for _, n, group in evaluation_samples(tasks=["needle"], images=images, per_count=1, seed=seed,
                                          tile=model.cfg.vision.tile, image_grid=grid):
        b = build_batch([(group[0].images, group[0].question, None)], tok, model.cfg)
        out[str(n)] = {"tokens": int(b.input_ids.shape[1]), "image_tokens": int((b.image_slot >= 0).sum()),
                       "last_position": int(b.position_ids.max())}
    return out


def _write_summary(args) -> dict:
    from benchmarks.comemo_bench import majority_baseline
    from benchmarks.common import portable_args, write_json_atomic

    summary = summarise(_all_results(args.out, args.settings), longest=max(args.images), trained=args.max_images)
    # the trivial baseline: the most frequent answer / digit of the evaluation samples (answers do not depend on the tile)
    summary["majority_baseline"] = majority_baseline(images=args.images, tasks=["needle"], per_count=args.per_count,
                                                     seed=args.eval_seed, tile=32, image_grid=args.grid)
    write_json_atomic(args.out / "summary.json", {"args": portable_args(args), **summary})
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.comemo_control", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path_obj, required=True, help="folder of the per-run JSONs and summary.json")
    p.add_argument("--runs", type=nonempty_path_obj, default=Path("runs/comemo_control"), help="training run folders")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="training seeds (data stream, new weights)")
    p.add_argument("--arms", nargs="+", default=["comemo", "frozen"], choices=ARMS, help="arms to train and evaluate")
    p.add_argument("--steps", type=positive_int, nargs=3, default=[60, 30, 160], metavar=("S1", "S2", "S3"),
                   help="optimizer steps of stages 1, 2 and 3")
    p.add_argument("--init-from", type=Path, default=DEFAULT_INIT,
                   help="weights every arm starts from (matching tensors; tokenizer.json beside them)")
    p.add_argument("--lr", default="1e-3", help="peak learning rate of every stage")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step")
    p.add_argument("--min-images", type=positive_int, default=9, help="training uses --min-images..--max-images images")
    p.add_argument("--max-images", type=positive_int, default=16, help="training uses --min-images..--max-images images")
    p.add_argument("--images", type=positive_int, nargs="+", default=[16, 64], help="image counts evaluated")
    p.add_argument("--per-count", type=positive_int, default=60, help="evaluation samples per image count")
    p.add_argument("--eval-seed", type=int, default=777, help="stream seed of the evaluation samples")
    p.add_argument("--image-grid", default="1x1", metavar="RxC",
                   help="tiles per needle image in training and evaluation (1x2: two tiles + thumbnail)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    return p


def main(argv: list[str] | None = None) -> int:
    from apps.comemo.api import CoMemo
    from apps.comemo.train import parse_grid
    from benchmarks.comemo_bench import evaluate_variant
    from benchmarks.common import portable_args, write_json_atomic

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out), ("--runs", args.runs)])
    if not args.init_from.is_file():
        raise UsageError(f"--init-from {args.init_from}: no such weights file")
    if not (args.init_from.parent / "tokenizer.json").is_file():
        raise UsageError(f"--init-from {args.init_from}: no tokenizer.json beside it")
    try:
        lr = float(args.lr)
    except ValueError:
        lr = float("nan")
    if not lr > 0 or math.isinf(lr):
        raise UsageError(f"--lr must be a positive number, got {args.lr!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.min_images > args.max_images:
        raise UsageError(f"--min-images ({args.min_images}) must be <= --max-images ({args.max_images})")
    try:
        args.grid = parse_grid(args.image_grid)
    except ValueError as e:
        raise UsageError(f"--image-grid: {e}") from None
    args.image_grid = f"{args.grid[0]}x{args.grid[1]}"
    args.settings = {"image_grid": args.image_grid, "steps": list(args.steps), "lr": lr, "batch_size": args.batch_size,
                     "min_images": args.min_images, "max_images": args.max_images, "per_count": args.per_count,
                     "eval_seed": args.eval_seed, "images": list(args.images), "init_from": portable_args(args)["init_from"],
                     "init_sha256": file_sha256(args.init_from)}
    # training runs of other settings (another start, lr, ...) live in another folder: never resumed from
    run_root = args.runs / ("settings_" + hashlib.sha256(json.dumps(args.settings, sort_keys=True).encode()).hexdigest()[:10])
    extra = ["--min-images", str(args.min_images), "--max-images", str(args.max_images), "--batch-size", str(args.batch_size), "--lr", str(lr),
             "--warmup", "10", "--vision-lr-scale", "0.1", "--image-labels", "after", "--tasks", "needle",
             "--val-every", "1000000", "--val-samples", "4", "--ckpt-every", "20", "--threads", str(args.threads),
             "--image-grid", args.image_grid, "--no-progress"]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for arm in args.arms:
            path = args.out / f"{tag(arm, args.grid)}_s{seed}.json"
            if path.is_file():
                results[(arm, seed)] = _load_record(path, args.settings)
                continue
            weights = train_arm(arm, seed, run_root, steps=args.steps, init_from=args.init_from, extra=extra,
                                grid=args.grid)
            train_s = sum(_wall_time(run_root / f"{tag(arm, args.grid)}_s{seed}" / f"stage{k}") for k in (1, 2, 3))
            model = CoMemo.load(weights)
            layout = prompt_layout(model.model, model.tokenizer, images=args.images, seed=args.eval_seed, grid=args.grid)
            logger.info("%s prompt layout per count (tokens, image tokens, last position id): %s", arm, layout)
            res = evaluate_variant(model.model, model.tokenizer, images=args.images, tasks=["needle"],
                                   per_count=args.per_count, seed=args.eval_seed, tile=model.model.cfg.vision.tile,
                                   max_new_tokens=16, image_grid=args.grid)
            res.update({"arm": arm, "seed": seed, "train_seconds": round(train_s, 1), "steps": args.steps,
                        "init_from": portable_args(args)["init_from"], "settings": args.settings,
                        "prompt_layout": layout})
            write_json_atomic(path, res)
            results[(arm, seed)] = res
            logger.info("%s seed %d: needle %s (train %.0f s)", arm, seed, res["accuracy"]["needle"], train_s)
            _write_summary(args)
    summary = _write_summary(args)
    print(json.dumps(summary["over_seeds"], indent=1))
    print(json.dumps(summary["targets"], indent=1))
    if "dhr_vs_1d" in summary:
        print(json.dumps(summary["dhr_vs_1d"]["target"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
