"""CoMemo benchmark: the four variants at equal sizes and training steps on the synthetic tasks.

``python -m benchmarks.comemo_bench --runs runs/comemo_bench --train-steps N``

For each variant (``lvlm-1d``, ``lvlm-dhr``, ``flamingo``, ``comemo``) the run folder ``RUNS/<variant>`` is
trained with ``apps.comemo.train`` (stage ``--stage``, same seed, sizes and steps for all) unless it already
holds ``model.safetensors``; then, on held-out samples (stream seed ``--eval-seed``, not the training stream):

- exact-match accuracy of greedy answers by number of images (``--images``; training used at most
  ``--max-images``) and, for the needle task, by needle position decile (``floor(10 * pos / N)``) and third
  (first / middle / last); the needle is placed at evenly spread positions so every decile is filled;
- retrieval alone: the needle answer's digit right whatever image number it names, by third of positions
  (``needle_digit_accuracy_by_third``);
- the issue's checks (``targets`` in the JSON, :func:`issue_targets`): comemo against lvlm-1d on the middle
  and end thirds at the longest count (full answer, and digit alone), lvlm-dhr against lvlm-1d beyond the
  trained image count;
- attention mass per image position on the context path: the attention probability that the last prompt
  token gives to each image's tokens, averaged over layers and heads, binned by the image's position decile
  (the "lost in the middle" curve); summed per sample so a bin is the mean mass per image in that decile;
- the tanh of every gate; the parameter count; the mean wall time per answer (encoding + generation on
  this machine, one thread unless ``--threads``; compare variants by their ratio, not absolute seconds).

Results: a Markdown table on stdout and JSON written atomically to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import env_info, format_table, portable_args, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "evaluate_variant", "issue_targets", "majority_baseline"]

VARIANTS = ("lvlm-1d", "lvlm-dhr", "flamingo", "comemo")


def _deciles(pos: int, n: int) -> int:
    return min(9, pos * 10 // n)


def _third(pos: int, n: int) -> int:
    """0 (first third of the images), 1 (middle third) or 2 (last third)."""
    return min(2, pos * 3 // n)


def issue_targets(variants: dict, *, max_images: int) -> dict:
    """The issue's checks, from ``evaluate_variant`` results (None where a variant or count is missing).

    - ``comemo_middle_gain``: comemo minus lvlm-1d needle accuracy on the middle third of positions at the
      longest image count (target >= 0.10); ``comemo_end_gaps``: the same for the first and last thirds (target:
      both within 0.02 of lvlm-1d, or better);
    - ``dhr_beyond_training``: mean needle accuracy over the image counts above ``max_images`` (trained length),
      lvlm-dhr and lvlm-1d (target: lvlm-dhr >= lvlm-1d).
    """
    out: dict = {"longest": None, "comemo_middle_gain": None, "comemo_end_gaps": None, "dhr_beyond_training": None,
                 "digit_comemo_middle_gain": None, "digit_comemo_end_gaps": None}
    one, co, dhr = variants.get("lvlm-1d"), variants.get("comemo"), variants.get("lvlm-dhr")
    if one is None or "needle_accuracy_by_third" not in one:
        return out
    counts = sorted(int(n) for n in one["needle_accuracy_by_third"])
    if counts:
        longest = str(counts[-1])
        out["longest"] = int(longest)
        if co is not None and longest in co.get("needle_accuracy_by_third", {}):
            a, b = co["needle_accuracy_by_third"][longest], one["needle_accuracy_by_third"][longest]
            if None not in a + b:
                out["comemo_middle_gain"] = a[1] - b[1]
                out["comemo_end_gaps"] = [a[0] - b[0], a[2] - b[2]]
            a, b = co.get("needle_digit_accuracy_by_third", {}).get(longest), one.get("needle_digit_accuracy_by_third", {}).get(longest)
            if a is not None and b is not None and None not in a + b:
                out["digit_comemo_middle_gain"] = a[1] - b[1]
                out["digit_comemo_end_gaps"] = [a[0] - b[0], a[2] - b[2]]
    beyond = [str(n) for n in sorted(int(k) for k in one["accuracy"].get("needle", {})) if n > max_images]
    if dhr is not None and beyond and all(n in dhr["accuracy"].get("needle", {}) for n in beyond):
        mean = lambda v: sum(v["accuracy"]["needle"][n] for n in beyond) / len(beyond)  # noqa: E731
        out["dhr_beyond_training"] = {"counts": [int(n) for n in beyond], "lvlm-dhr": mean(dhr), "lvlm-1d": mean(one)}
    return out


@torch.no_grad()
def attention_by_position(model, tok, images, question) -> list[float] | None:
    """Mean attention mass (layers, heads) of the last prompt token on each image's context tokens."""
    from apps.comemo.batch import build_batch

    if not model.cfg.uses_context:
        return None
    batch = build_batch([(images, question, None)], tok, model.cfg)
    q = batch.input_ids.shape[1] - 1
    out = model.decoder(**model.decoder_inputs(batch), use_cache=False, attn_queries=torch.tensor([q]),
                        logits_index=torch.tensor([q]))
    probs = torch.stack([a[0, :, 0].float() for a in out.attentions])  # (layers, H, S)
    mass = probs.mean(dim=(0, 1))  # (S,)
    return [float(mass[s:e].sum()) for s, e in batch.image_spans[0]]


def evaluation_samples(*, tasks: list[str], images: list[int], per_count: int, seed: int, tile: int,
                       image_grid: tuple[int, int] = (1, 1)):
    """The evaluation stream: ``(task, image count, samples)`` per cell, in the order every variant and the majority
    baseline see it (sample ``i`` of the stream drawn from ``sample_seed(seed, i)``; needles at evenly spread
    positions; ``detail`` at one image; ``image_grid`` tiles per needle image)."""
    from apps.comemo.synthetic import make_sample, sample_seed

    index = 0
    for task in tasks:
        for n in ([1] if task == "detail" else images):
            group = []
            for k in range(per_count):
                needle = (k * n // per_count) if task == "needle" else None
                grid_kw = {"image_grid": image_grid} if task == "needle" else {}
                group.append(make_sample(task, n, sample_seed(seed, index), tile=tile, needle=needle, **grid_kw))
                index += 1
            yield task, n, group


def evaluate_variant(model, tok, *, images: list[int], tasks: list[str], per_count: int, seed: int, tile: int,
                     max_new_tokens: int, progress=None, image_grid: tuple[int, int] = (1, 1)) -> dict:
    """Exact-match accuracy by task, image count and needle decile; attention mass by image decile; time.
    ``image_grid``: tiles per needle image (high-resolution needles)."""
    from apps.comemo.infer import generate_answer

    acc: dict[str, dict[str, list[int]]] = {}
    needle_dec: dict[str, list[list[int]]] = {}
    needle_third: dict[str, list[list[int]]] = {}
    digit_third: dict[str, list[list[int]]] = {}
    attn_dec: dict[str, list[list[float]]] = {}
    records: dict[str, list[list[int]]] = {}
    times = []
    for task, n, group in evaluation_samples(tasks=tasks, images=images, per_count=per_count, seed=seed, tile=tile,
                                             image_grid=image_grid):
        hits = []
        for k, s in enumerate(group):
            res = generate_answer(model, tok, s.images, s.question, max_new_tokens=max_new_tokens)
            times.append(res["seconds"])
            ok = int(res["answer"].strip() == s.answer)
            hits.append(ok)
            if task == "needle":
                needle_dec.setdefault(str(n), [[] for _ in range(10)])[_deciles(s.needle, n)].append(ok)
                needle_third.setdefault(str(n), [[] for _ in range(3)])[_third(s.needle, n)].append(ok)
                # retrieval alone: the digit of "image K shows D" right, whatever K
                got, want = res["answer"].split(), s.answer.split()
                digit_ok = int(len(got) == len(want) and got[-1] == want[-1] and got[2] == want[2])
                digit_third.setdefault(str(n), [[] for _ in range(3)])[_third(s.needle, n)].append(digit_ok)
                records.setdefault(str(n), []).append([s.needle, ok, digit_ok])
                if k < 4:  # attention curve on a few samples per count
                    mass = attention_by_position(model, tok, s.images, s.question)
                    if mass is not None:
                        bins = attn_dec.setdefault(str(n), [[] for _ in range(10)])
                        for pos, m in enumerate(mass):
                            bins[_deciles(pos, n)].append(m)
            if progress is not None:
                progress.update(1)
        acc.setdefault(task, {})[str(n)] = hits
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
    return {
        "accuracy": {t: {n: mean(h) for n, h in d.items()} for t, d in acc.items()},
        "samples": {t: {n: len(h) for n, h in d.items()} for t, d in acc.items()},
        "needle_accuracy_by_decile": {n: [mean(b) for b in bins] for n, bins in needle_dec.items()},
        "needle_accuracy_by_third": {n: [mean(b) for b in bins] for n, bins in needle_third.items()},
        "needle_samples_by_third": {n: [len(b) for b in bins] for n, bins in needle_third.items()},
        "needle_digit_accuracy_by_third": {n: [mean(b) for b in bins] for n, bins in digit_third.items()},
        # per sample, in evaluation order: [needle position, full answer right, digit right] (for paired intervals)
        "needle_records": records,
        "attention_mass_by_decile": {n: [mean(b) for b in bins] for n, bins in attn_dec.items()},
        "seconds_per_answer": mean(times),
        "gates": model.gates(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def majority_baseline(*, images: list[int], tasks: list[str], per_count: int, seed: int, tile: int = 32,
                      image_grid: tuple[int, int] = (1, 1)) -> dict:
    """The trivial baseline: exact match of the most frequent answer among the evaluation samples of each task and
    image count (the same samples ``evaluate_variant`` draws; an upper bound on any constant answer). Needle
    answers are also scored on the digit alone (the most frequent digit)."""
    from collections import Counter

    out: dict = {"accuracy": {}, "needle_digit": {}, "tile": tile}
    for task, n, group in evaluation_samples(tasks=tasks, images=images, per_count=per_count, seed=seed, tile=tile,
                                             image_grid=image_grid):
        answers = [s.answer for s in group]
        out["accuracy"].setdefault(task, {})[str(n)] = Counter(answers).most_common(1)[0][1] / len(answers)
        if task == "needle":
            digits = [a.split()[-1] for a in answers]
            out["needle_digit"][str(n)] = Counter(digits).most_common(1)[0][1] / len(digits)
    return out


def plot_needle_curves(results: dict, path: Path) -> Path:
    """PNG: needle accuracy by position decile (left) and attention mass by decile (right), one line per
    variant, one row per image count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = results["variants"]
    counts = sorted({int(n) for v in variants.values() for n in v.get("needle_accuracy_by_decile", {})})
    if not counts:
        raise ValueError("no needle results to plot")
    fig, axes = plt.subplots(len(counts), 2, figsize=(9, 2.2 * len(counts)), squeeze=False)
    colours = {name: f"C{i}" for i, name in enumerate(VARIANTS)}  # the same colour in every panel
    for row, n in zip(axes, counts):
        for name, v in variants.items():
            for ax, key in zip(row, ("needle_accuracy_by_decile", "attention_mass_by_decile")):
                ys = v.get(key, {}).get(str(n))
                if ys:
                    xs = [i for i, y in enumerate(ys) if y is not None]
                    ax.plot(xs, [ys[i] for i in xs], marker="o", label=name, color=colours.get(name), alpha=0.8)
        row[0].set_ylabel(f"{n} images")
        row[0].set_ylim(-0.05, 1.05)
    axes[0][0].set_title("needle exact match by position decile")
    axes[0][1].set_title("attention mass per image by decile")
    axes[0][0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("needle / image position decile")
    fig.tight_layout()
    from core.infra.fileio import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return path


_NOT_COMPARED = ("out", "threads", "no_progress", "resume", "device", "max_minutes")  # they leave the weights unchanged


def training_key(argv: list[str]) -> dict:
    """A training command's settings as ``apps.comemo.train`` parses them (defaults filled in, order of the options
    irrelevant), without those that leave the weights unchanged (output folder, threads, progress bars)."""
    from apps.comemo.train import build_parser as train_parser

    ns = vars(train_parser().parse_args(argv))
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(ns.items()) if k not in _NOT_COMPARED}


def recorded_training(weights: Path) -> dict | None:
    """The training settings recorded in a run's weights (its first command), or None when none are recorded."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        meta = f.metadata() or {}
    try:
        command = json.loads(meta["commands"])[0]["command"]
    except (KeyError, IndexError, ValueError, TypeError):
        return None
    words = shlex.split(command)
    return training_key(words[3:] if words[:3] == ["python", "-m", "apps.comemo.train"] else words)


def _differences(recorded: dict, requested: dict) -> str:
    keys = sorted(k for k in set(recorded) | set(requested) if recorded.get(k) != requested.get(k))
    return ", ".join(f"{k}: {recorded.get(k)!r} (recorded) vs {requested.get(k)!r} (requested)" for k in keys)


def parse_variant_args(items: list[str]) -> dict[str, str]:
    """``["lvlm-1d=--mlp-ratio 7", ...]`` -> ``{"lvlm-1d": "--mlp-ratio 7"}`` (a variant named twice is refused)."""
    out: dict[str, str] = {}
    for item in items:
        variant, sep, extra = item.partition("=")
        if not sep or variant not in VARIANTS:
            raise SystemExit(f"--variant-args {item!r}: expected VARIANT=ARGS with VARIANT one of {list(VARIANTS)}")
        if variant in out:
            raise SystemExit(f"--variant-args: {variant} given twice")
        out[variant] = extra
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.comemo_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=Path("runs/comemo_bench"), help="one run folder per variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="variants to compare")
    p.add_argument("--train-steps", type=int, default=300, help="training steps per variant (the same for all)")
    p.add_argument("--stage", type=int, default=3, help="training stage used for every variant (3: all parameters)")
    p.add_argument("--train-args", default="", help="extra arguments for apps.comemo.train (sizes, lr), same for all")
    p.add_argument("--variant-args", action="append", default=[], metavar="VARIANT=ARGS",
                   help="extra training arguments for one variant only, after --train-args (repeatable), e.g. "
                        "'lvlm-1d=--mlp-ratio 7' to give a context-only variant the memory variants' parameter count")
    p.add_argument("--overwrite", action="store_true",
                   help="retrain a variant whose run folder was trained with other arguments (default: refuse)")
    p.add_argument("--max-images", type=int, default=8, help="training uses 1..N images per sample")
    p.add_argument("--images", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64], help="image counts evaluated")
    p.add_argument("--tasks", nargs="+", default=["needle", "count", "describe", "detail"], help="tasks evaluated")
    p.add_argument("--image-grid", default="1x1", metavar="RxC",
                   help="tiles per needle image in the evaluation (as apps.comemo.train --image-grid; pass the same "
                        "value in --train-args to train on it)")
    p.add_argument("--per-count", type=int, default=20, help="samples per task and image count")
    p.add_argument("--eval-seed", type=int, default=777, help="stream seed of the evaluation samples")
    p.add_argument("--max-new-tokens", type=int, default=200, help="longest generated answer")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/comemo_bench.json"), help="JSON results")
    p.add_argument("--plot", type=Path, help="also write a PNG of the needle and attention curves")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from apps.comemo.api import CoMemo
    from apps.comemo.train import main as train_main
    from apps.comemo.train import parse_grid

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    results = {"args": portable_args(args), "env": env_info(), "variants": {}}
    rows = []
    extra = parse_variant_args(args.variant_args)
    try:
        grid = parse_grid(args.image_grid)
    except ValueError as e:
        raise SystemExit(f"--image-grid: {e}") from None
    for variant in args.variants:
        run = args.runs / variant
        train_argv = ["--variant", variant, "--stage", str(args.stage), "--out", str(run), "--steps",
                      str(args.train_steps), "--max-images", str(args.max_images), "--threads", str(args.threads),
                      *(["--no-progress"] if args.no_progress else []), *shlex.split(args.train_args),
                      *shlex.split(extra.get(variant, ""))]
        if (run / "model.safetensors").is_file():
            recorded = recorded_training(run / "model.safetensors")
            if recorded is not None and recorded != training_key(train_argv):
                if not args.overwrite:
                    raise SystemExit(f"{run} was trained with other arguments: "
                                     f"{_differences(recorded, training_key(train_argv))}; "
                                     "choose another --runs folder, or pass --overwrite to retrain it")
                logger.warning("%s: trained with other arguments; retraining (--overwrite)", run)
                shutil.rmtree(run)
        if not (run / "model.safetensors").is_file():
            t0 = time.time()
            train_main(train_argv)
            logger.info("trained %s in %.0f s", variant, time.time() - t0)
        model = CoMemo.load(run)
        n_eval = args.per_count * sum(1 if t == "detail" else len(args.images) for t in args.tasks)
        with tqdm(total=n_eval, desc=f"eval {variant}", disable=args.no_progress) as bar:
            res = evaluate_variant(model.model, model.tokenizer, images=args.images, tasks=args.tasks,
                                   per_count=args.per_count, seed=args.eval_seed, tile=model.model.cfg.vision.tile,
                                   max_new_tokens=args.max_new_tokens, progress=bar,
                                   image_grid=grid)
        results["variants"][variant] = res
        write_json_atomic(args.out, results)  # partial results survive an interrupted run
        row = {"variant": variant, "params": res["parameters"], "s/answer": res["seconds_per_answer"]}
        for task, by_n in res["accuracy"].items():
            for n, a in by_n.items():
                row[f"{task}@{n}"] = a
        rows.append(row)
    tile = model.model.cfg.vision.tile if args.variants else 32
    results["majority_baseline"] = majority_baseline(images=args.images, tasks=args.tasks, per_count=args.per_count,
                                                     seed=args.eval_seed, tile=tile, image_grid=grid)
    rows.append({"variant": "majority answer", "params": 0, "s/answer": 0.0,
                 **{f"{t}@{n}": a for t, by_n in results["majority_baseline"]["accuracy"].items() for n, a in by_n.items()}})
    columns = ["variant", "params", "s/answer"] + [c for c in rows[0] if "@" in c] if rows else []
    print(format_table(rows, columns))
    results["targets"] = issue_targets(results["variants"], max_images=args.max_images)
    thirds = [{"variant": v, **{f"needle@{n} {part}": t[i] for n, t in r.get("needle_accuracy_by_third", {}).items()
                                for i, part in enumerate(("first", "middle", "last"))}}
              for v, r in results["variants"].items()]
    if thirds and len(thirds[0]) > 1:
        print(format_table(thirds, list(thirds[0])))
    digits = [{"variant": v, **{f"digit@{n} {part}": t[i] for n, t in r.get("needle_digit_accuracy_by_third", {}).items()
                                for i, part in enumerate(("first", "middle", "last"))}}
              for v, r in results["variants"].items()]
    if digits and len(digits[0]) > 1:
        print(format_table(digits, list(digits[0])))
    logger.info("issue targets: %s", results["targets"])
    write_json_atomic(args.out, results)
    if args.plot is not None and any(v.get("needle_accuracy_by_decile") for v in results["variants"].values()):
        plot_needle_curves(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
