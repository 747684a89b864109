"""∞-Video benchmark: accuracy against video length, peak memory against length, throughput split.

Same trained weights for every method (``video.infinite.METHODS``): uniform subsampling to the training
length, chunk by chunk without memory (alpha = 1), ∞-Video without and with sticky memories, MovieChat-style
merging. Videos come from ``video.synthetic`` (written as H.264 MP4 once, cached in ``--data``), each with
five closed-answer questions (first, last, count, order, exists); accuracy is the fraction answered right.

Peak memory: each (method, length) case runs in a fresh process (``benchmarks.common.run_isolated``) and
reports the growth of the resident set at its peak while ingesting one video (``PeakRSS``).
Throughput: frames read per second of ingest time, split into decode, encode (frame encoder) and memory
(Q-former + memory consolidation) seconds as measured inside ``InfiniteVideo.ingest``.

    python -m benchmarks.video_bench --quick        # small run, a pipeline check
    python -m benchmarks.video_bench                # 64..16K frames
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import PeakRSS, env_info, format_table, parse_size, read_parts, run_isolated, write_json_atomic

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"


def _dataset(root: Path, length: int, n: int, seed: int) -> list[dict]:
    from video.synthetic import load_dataset, write_dataset

    folder = root / f"len{length}_seed{seed}"
    # resumable and deterministic per index: a larger n reuses the videos already written
    write_dataset(folder, n=n, frames=[length], seed=seed + length, size=32)
    return load_dataset(folder)[:n]


def _peak_case(method: str, path: str, weights: str | None) -> None:
    """Child process: ingest one video with ``method``, print its peak memory growth as JSON."""
    import torch

    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    torch.set_num_threads(1)
    iv = InfiniteVideo(weights, InfiniteVideoConfig(method=method), device="cpu")
    peak = PeakRSS()
    peak.start()
    mem = iv.ingest(path)
    print(json.dumps({"status": "ok", "peak_mb": peak.peak_mb(), "peak_method": peak.method,
                      "frames_read": mem.frames_read, "timings": mem.timings}))


def run(args) -> dict:
    import torch

    from video.infinite import METHODS, InfiniteVideo, InfiniteVideoConfig

    torch.set_num_threads(args.threads)
    lengths = [parse_size(s) for s in args.lengths.split(",")]
    methods = [m for m in args.methods.split(",")] if args.methods else list(METHODS)
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {list(METHODS)}")
    data = Path(args.data)
    args_rec = {k: v for k, v in vars(args).items()}
    try:  # record the output path relative to the repository, not the machine's layout
        args_rec["out"] = str(Path(args.out).resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        args_rec["out"] = Path(args.out).name
    result = {"env": env_info(), "args": args_rec, "accuracy": [], "peak_memory": [],
              "throughput": []}
    readers = {m: InfiniteVideo(args.weights, InfiniteVideoConfig(method=m, aggregate=args.aggregate), device="cpu")
               for m in methods}
    from tqdm import tqdm

    for length in [] if args.peak_only else lengths:
        n = args.videos if length < 8192 else max(2, args.videos // 4)
        records = _dataset(data, length, n, args.seed)
        for m in methods:
            iv = readers[m]
            correct, total, per_type, marks = 0, 0, {}, []
            times = {"decode": 0.0, "encode": 0.0, "memory": 0.0}
            frames = 0
            t0 = time.perf_counter()
            for r in tqdm(records, desc=f"{m} @ {length}", unit="video", leave=False):
                mem = iv.ingest(r["path"])
                frames += mem.frames_read
                for k in times:
                    times[k] += mem.timings[k]
                for q in r["questions"]:
                    ans, _ = iv.answer(mem, q)
                    ok = int(ans == q.answer)
                    correct += ok
                    marks.append(str(ok))
                    total += 1
                    c = per_type.setdefault(q.qtype, [0, 0])
                    c[0] += ok
                    c[1] += 1
            wall = time.perf_counter() - t0
            row = {"method": m, "frames": length, "videos": len(records), "questions": total,
                   "accuracy": correct / total, **{f"acc_{k}": v[0] / v[1] for k, v in per_type.items()},
                   "correct": "".join(marks)}  # per question, same order for every method: paired comparisons
            result["accuracy"].append(row)
            result["throughput"].append({"method": m, "frames": length, "frames_read": frames, "wall_s": wall,
                                         "frames_per_s": frames / max(wall, 1e-9),
                                         **{f"{k}_s": v for k, v in times.items()}})
            logger.info("%s @ %d frames: accuracy %.3f", m, length, row["accuracy"])
            write_json_atomic(args.out, result)
    # peak memory against length, one fresh process per case
    peak_lengths = [L for L in lengths if L >= 1024] or lengths[-1:]
    peak_methods = [] if args.skip_peak else args.peak_methods.split(",")
    for m in [m for m in methods if m in peak_methods]:
        for length in peak_lengths:
            n = args.videos if length < 8192 else max(2, args.videos // 4)
            path = _dataset(data, length, n, args.seed)[0]["path"]
            argv = [sys.executable, "-m", "benchmarks.video_bench", "--peak-case", m, path]
            if args.weights:
                argv += ["--weights", args.weights]
            out = run_isolated(argv, timeout_s=args.case_timeout)
            result["peak_memory"].append({"method": m, "frames": length, **out})
            write_json_atomic(args.out, result)
    write_json_atomic(args.out, result)
    return result


def merge(paths: list[str], out: str) -> dict:
    """Rows of several result files in one (sorted by length, then method); each part's args and env are kept.

    A (method, length) case found in several files is taken from the first file that has it."""
    from video.infinite import METHODS

    parts = read_parts(paths)
    order = {m: i for i, m in enumerate(METHODS)}
    result = {"parts": [{"file": Path(p).name, "env": r["env"], "args": r["args"]} for p, r in zip(paths, parts)]}
    for key in ("accuracy", "throughput", "peak_memory"):
        seen, rows = set(), []
        for r in parts:
            for row in r.get(key, []):
                if (row["method"], row["frames"]) not in seen:
                    seen.add((row["method"], row["frames"]))
                    rows.append(row)
        if key == "peak_memory":
            rows.sort(key=lambda r: (order.get(r["method"], 99), r["frames"]))
        else:
            rows.sort(key=lambda r: (r["frames"], order.get(r["method"], 99)))
        result[key] = rows
    write_json_atomic(out, result)
    return result


def report(result: dict, plot: Path | None) -> str:
    acc_cols = ["method", "frames", "videos", "accuracy", "acc_first", "acc_last", "acc_count", "acc_order", "acc_exists"]
    text = ["## Accuracy", format_table(result["accuracy"], acc_cols)]
    paired = _paired_rows(result["accuracy"])
    if paired:
        text += ["", "## Paired: questions one method gets right and the other wrong",
                 format_table(paired, ["frames", "a", "b", "questions", "a_only", "b_only", "diff", "se_diff"])]
    text += ["", "## Throughput (frames/s of ingest; seconds split)",
             format_table(result["throughput"], ["method", "frames", "frames_per_s", "decode_s", "encode_s", "memory_s"])]
    if result["peak_memory"]:
        rows = []
        for r in result["peak_memory"]:
            rows.append({"method": r["method"], "frames": r["frames"], "peak_mb": r.get("peak_mb"),
                         "status": r.get("status")})
        text += ["", "## Peak memory growth while ingesting one video", format_table(rows, ["method", "frames", "peak_mb", "status"])]
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for m in sorted({r["method"] for r in result["accuracy"]}):
                rows = [r for r in result["accuracy"] if r["method"] == m]
                ax.plot([r["frames"] for r in rows], [r["accuracy"] for r in rows], marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("video length (frames)")
            ax.set_ylabel("accuracy")
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(plot, dpi=110)
            plt.close(fig)
        except ImportError:  # pragma: no cover
            logger.warning("matplotlib missing: no plot")
    return "\n".join(text)


PAIRS = (("infinite", "chunks"), ("infinite", "infinite_nosticky"), ("infinite", "uniform"))


def _paired_rows(accuracy: list[dict]) -> list[dict]:
    """Per length and method pair: questions only ``a`` answers right, only ``b``, and the accuracy
    difference with its paired standard error ``sqrt(a_only + b_only - (a_only - b_only)^2 / n) / n``."""
    by_key = {(r["method"], r["frames"]): r.get("correct") for r in accuracy}
    rows = []
    for length in sorted({r["frames"] for r in accuracy}):
        for a, b in PAIRS:
            ca, cb = by_key.get((a, length)), by_key.get((b, length))
            if not ca or not cb or len(ca) != len(cb):
                continue
            n = len(ca)
            a_only = sum(x == "1" and y == "0" for x, y in zip(ca, cb))
            b_only = sum(x == "0" and y == "1" for x, y in zip(ca, cb))
            var = max(a_only + b_only - (a_only - b_only) ** 2 / n, 0.0)
            rows.append({"frames": length, "a": a, "b": b, "questions": n, "a_only": a_only, "b_only": b_only,
                         "diff": (a_only - b_only) / n, "se_diff": var**0.5 / n})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.video_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run: 6 videos per length (2 from 8K up)")
    p.add_argument("--lengths", default="64,256,1K,4K,16K", help="video lengths in frames (comma list)")
    p.add_argument("--videos", type=int, default=16, help="videos per length (a quarter, at least 2, from 8K up)")
    p.add_argument("--methods", default=None, help="comma list of methods (default: all)")
    p.add_argument("--peak-methods", default="uniform,chunks,infinite,moviechat", help="methods whose peak memory is measured")
    p.add_argument("--skip-peak", action="store_true", help="do not measure peak memory")
    p.add_argument("--peak-only", action="store_true", help="measure only peak memory (no accuracy runs)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="combine result files of runs made side by side (other lengths / methods) into --out")
    p.add_argument("--weights", default=None, help="model weights (default: the shipped model)")
    p.add_argument("--aggregate", default="attention", choices=("attention", "mean", "last"),
                   help="answer head pooling over chunks: attention over all, mean over chunks (as published), "
                        "or the last chunk only (the past reaches it only through the memory)")
    p.add_argument("--data", default="artifacts/video_bench_data", help="cache folder for the generated videos")
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--seed", type=int, default=1234, help="dataset seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--case-timeout", type=float, default=1800, help="seconds per peak-memory case")
    p.add_argument("--peak-case", nargs=2, metavar=("METHOD", "PATH"), help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.peak_case:
        _peak_case(args.peak_case[0], args.peak_case[1], args.weights)
        return 0
    if args.quick:
        args.videos = min(args.videos, 6)
        args.peak_methods = "infinite,chunks"
    name = ("video_bench_quick" if args.quick else "video_bench") + ("" if args.aggregate == "attention" else f"_{args.aggregate}")
    args.out = args.out or str(RESULTS / f"{name}.json")
    result = merge(args.merge, args.out) if args.merge else run(args)
    table = report(result, Path(args.out).with_suffix(".png"))
    print(table)
    md = Path(args.out).with_suffix(".md")
    md.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
