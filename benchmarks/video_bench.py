"""∞-Video benchmark: questions only a long-term memory can answer, every peer at an equal budget.

Videos come from ``video.synthetic`` (written as H.264 MP4 once, cached in ``--data``): 1K-16K frames with
2-8 coloured events of 4-8 frames each. Questions of every type (first, last, count, order, exists, next,
after) are answer-balanced over the dataset (``--balanced K``: up to K per type and video, yes/no 50/50,
counts uniform over 0-3, ``next`` colours uniform; ``--balanced 0``: the older one question per type);
``next`` ("which colour came right after the first red?") and ``after`` ("did green appear after the last
blue?") depend on order and context across chunks. The trivial baseline (row ``majority``) gives each type's
most frequent answer counted on as many development questions (another seed).

The answer head reads a fixed-size output for every method (``--aggregate``: the mean over reads of the Q
queries, as the released ∞-Video pipeline feeds its LLM, by default; or the last read's), never a per-chunk
list. ``NAME@ALPHA`` runs a memory method at another alpha on the same decoded video. Peers, all with the
same weights and the same videos:

- ``uniform``: ``--num-basis`` frames (as many as the memory holds vectors) spread over the video, read once;
- ``chunks``: every chunk of ``--chunk-size`` frames read without memory (alpha = 1);
- ``infinite`` / ``infinite_nosticky``: the continuous memory (``--num-basis`` box functions), with and
  without sticky memories, mixed at ``--alpha`` (default 0.1, chosen on the development videos of
  ``--dev``; the published default is 0.75); the Q-former was trained without it (training-free: the
  default weights are ``video/weights/videoqa_nomem.safetensors``);
- ``moviechat``: MovieChat's short-term buffer (18 frames, merged to 2) and long-term memory (256 frames, its
  released size); ``moviechat@N`` keeps a long-term memory of ``N`` frames (``N`` = the basis functions: an equal
  budget);
- ``infinite_memtrained`` (with ``--weights-memory``): ∞-Video with a model trained with the memory in the
  loop — not the published, training-free recipe, reported apart.

Each video is decoded and encoded once per model and fed to every method (``InfiniteVideo.feed``).
Accuracy gets a Wilson 95% interval and a 95% bootstrap over whole videos; method pairs get the paired
difference on the same questions with a 95% normal interval and the same video bootstrap. Resumable: the JSON keeps every video's per-question marks and a rerun with the same
settings skips the videos done; ``--videos`` can grow between runs. Peak memory: each (method, length) case
in a fresh process (``benchmarks.common.run_isolated``), growth of the resident set while ingesting one video.

    python -m benchmarks.video_bench --quick        # 4 videos per length, 1K and 4K frames
    python -m benchmarks.video_bench                # 16 videos per length, 1K, 4K and 16K frames
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    PeakRSS,
    env_info,
    format_table,
    parse_size,
    portable_args,
    read_json,
    run_isolated,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_WEIGHTS = Path(__file__).resolve().parents[1] / "video" / "weights" / "videoqa_nomem.safetensors"
METHODS_ALL = ("uniform", "chunks", "infinite", "infinite_nosticky", "moviechat", "infinite_memtrained")
PAIRS = (("infinite", "chunks"), ("infinite", "uniform"), ("infinite", "infinite_nosticky"),
         ("infinite", "moviechat"), ("infinite_memtrained", "infinite"), ("infinite_memtrained", "chunks"))
# settings that change the answers: a result file is only resumed with the same values
SETTINGS = ("seed", "aggregate", "chunk_size", "num_basis", "alpha", "weights", "weights_memory", "dev", "balanced")
DEV_OFFSET = 7_777_777  # seed offset of the development videos


def split_method(name: str, alpha: float) -> tuple[str, float]:
    """``"infinite@0.25"`` -> ``("infinite", 0.25)``; a name without ``@`` reads at ``alpha``."""
    base, _, a = name.partition("@")
    if a:
        try:
            val = float(a)
        except ValueError:
            raise SystemExit(f"bad alpha in method {name!r}: {a!r}") from None
        if not 0.0 <= val <= 1.0:
            raise SystemExit(f"alpha in method {name!r} must lie in [0, 1]")
        return base, val
    return base, alpha


def pairs_for(methods: list[str]) -> list[tuple[str, str]]:
    """The paired comparisons: every ∞-Video variant against the peers (every MovieChat memory size) and its
    non-sticky twin at the same alpha."""
    out = list(PAIRS)
    movie = [m for m in methods if m.partition("@")[0] == "moviechat" and m != "moviechat"]
    for m in methods:
        base, _, a = m.partition("@")
        if base == "infinite" and a:
            out += [(m, "chunks"), (m, "uniform"), (m, f"infinite_nosticky@{a}"), (m, "moviechat")]
            out += [(m, mc) for mc in movie]
        elif base == "infinite" and m == "infinite":
            out += [(m, mc) for mc in movie]
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def paired(a: list[int], b: list[int], z: float = 1.96) -> dict:
    """Accuracy difference of ``a`` over ``b`` on the same questions, with a 95% normal interval."""
    n = len(a)
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    mean = float(d.mean()) if n else float("nan")
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"questions": n, "a_only": int((d > 0).sum()), "b_only": int((d < 0).sum()), "diff": mean,
            "ci_lo": mean - z * se, "ci_hi": mean + z * se}


def video_bootstrap(per_video: list[list[float]], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean over questions when whole videos are resampled (questions of one video are not
    independent: the same reading answers them all)."""
    if len(per_video) < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    sums = np.array([sum(v) for v in per_video], dtype=float)
    counts = np.array([len(v) for v in per_video], dtype=float)
    idx = rng.integers(0, len(per_video), size=(reps, len(per_video)))
    means = sums[idx].sum(1) / np.maximum(counts[idx].sum(1), 1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return (float(lo), float(hi))


def dataset(root: Path, length: int, n: int, seed: int, balanced: int = 0) -> list[dict]:
    """``n`` videos of ``length`` frames (written once; deterministic per index, so a larger ``n`` reuses them);
    ``balanced = k`` asks answer-balanced questions, up to ``k`` per type and video."""
    from video.synthetic import load_dataset, write_dataset

    folder = root / (f"len{length}_seed{seed}" + (f"_bal{balanced}" if balanced else ""))
    write_dataset(folder, n=n, frames=[length], seed=seed + length, size=32, balanced=balanced)
    return load_dataset(folder)[:n]


def majority_answers(length: int, n: int, seed: int, balanced: int) -> dict[str, str]:
    """Each question type's most frequent answer on ``n`` development videos of ``length`` frames (questions only:
    no video is written or read)."""
    from collections import Counter, defaultdict

    from video.synthetic import AnswerBalancer, make_questions, make_spec

    s = seed + DEV_OFFSET + length
    bal = AnswerBalancer(balanced, seed=s) if balanced else None
    counts: dict[str, Counter] = defaultdict(Counter)
    for i in range(n):
        spec = make_spec(length, seed=s * 100003 + i, size=32)
        for q in (bal.questions(spec) if bal else make_questions(spec, s * 100003 + i)):
            counts[q.qtype][q.answer] += 1
    return {t: c.most_common(1)[0][0] for t, c in counts.items()}


def _moviechat_size(name: str) -> int:
    """``"moviechat@32"`` -> 32 (the long-term memory's frames)."""
    size = name.partition("@")[2]
    if not size.isdigit() or int(size) < 2:
        raise SystemExit(f"moviechat@N needs a whole number of frames >= 2, got {name!r}")
    return int(size)


def _readers(args) -> dict[str, tuple]:
    """Method name -> (InfiniteVideo, model key); methods sharing a model share one encoding per video."""
    import torch

    from video.infinite import InfiniteVideo, InfiniteVideoConfig
    from video.train import load_model

    torch.set_num_threads(args.threads)
    models = {"main": load_model(args.weights) if args.weights else None}
    if args.weights_memory:
        models["memory"] = load_model(args.weights_memory)
    out = {}
    for m in args.method_list:
        key = "memory" if m == "infinite_memtrained" else "main"
        movie = {}
        if m.partition("@")[0] == "moviechat" and "@" in m:  # moviechat@N: a long-term memory of N frames
            base, alpha, movie = "moviechat", args.alpha, {"moviechat_long": _moviechat_size(m)}
        else:
            base, alpha = split_method(m, args.alpha)
        cfg = InfiniteVideoConfig(method="infinite" if key == "memory" else base, chunk_size=args.chunk_size,
                                  num_basis=args.num_basis, num_frames=args.num_basis, alpha=alpha,
                                  aggregate=args.aggregate, seed=args.seed, **movie)
        iv = InfiniteVideo(models[key], cfg, device="cpu")
        models[key] = iv.model  # the shipped model, loaded once
        out[m] = (iv, key)
    return out


def run_video(readers: dict, record: dict, chunk_size: int) -> dict[str, dict]:
    """Decode and encode one video once per model, feed every method, answer every question."""
    import torch

    from video.io import VideoStream

    stream = VideoStream(record["path"], chunk_size=chunk_size)
    n_total, duration = stream.info.num_frames, stream.info.duration
    states = {m: iv.start(record["path"], n_total, duration, stream.indices) for m, (iv, _) in readers.items()}
    enc_by_key = {}
    for m, (iv, key) in readers.items():
        enc_by_key.setdefault(key, iv)
    secs = {m: 0.0 for m in readers}
    shared = {"decode": 0.0, "encode": 0.0}
    t0 = time.perf_counter()
    with torch.no_grad():
        for chunk in stream:
            t1 = time.perf_counter()
            shared["decode"] += t1 - t0
            toks = {key: iv.encode(chunk.frames, chunk.indices, n_total) for key, iv in enc_by_key.items()}
            t2 = time.perf_counter()
            shared["encode"] += t2 - t1
            for m, (iv, key) in readers.items():
                ta = time.perf_counter()
                iv.feed(states[m], toks[key], chunk.indices)
                secs[m] += time.perf_counter() - ta
            t0 = time.perf_counter()
    out = {}
    for m, (iv, _) in readers.items():
        ta = time.perf_counter()
        mem = iv.finish(states[m])
        secs[m] += time.perf_counter() - ta
        marks = [int(iv.answer(mem, q)[0] == q.answer) for q in record["questions"]]
        out[m] = {"marks": marks, "memory_s": secs[m], "frames_read": mem.frames_read, **shared}
    return out


def summarize(result: dict) -> dict:
    """Accuracy rows (per method and length, overall and per question type, with Wilson intervals) and paired rows."""
    from video.synthetic import QUESTION_TYPES

    acc, pairs, speed = [], [], []
    for length in sorted({int(k.split("/")[0]) for k in result["videos"]}):
        vids = sorted(k for k in result["videos"] if int(k.split("/")[0]) == length)
        methods = [m for m in result["methods"] if all(m in result["videos"][v]["runs"] for v in vids)]
        for m in methods:
            marks, types = [], []
            for v in vids:
                marks += result["videos"][v]["runs"][m]["marks"]
                types += result["videos"][v]["qtypes"]
            k, n = sum(marks), len(marks)
            lo, hi = wilson(k, n)
            blo, bhi = video_bootstrap([result["videos"][v]["runs"][m]["marks"] for v in vids])
            row = {"method": m, "frames": length, "videos": len(vids), "questions": n, "accuracy": k / n,
                   "ci_lo": lo, "ci_hi": hi, "boot_lo": blo, "boot_hi": bhi}
            for t in QUESTION_TYPES:
                sel = [x for x, tt in zip(marks, types) if tt == t]
                if sel:
                    row[f"acc_{t}"] = sum(sel) / len(sel)
                    row[f"n_{t}"] = len(sel)
            acc.append(row)
            runs = [result["videos"][v]["runs"][m] for v in vids]
            frames = sum(r["frames_read"] for r in runs)
            speed.append({"method": m, "frames": length, "read_s": sum(r["memory_s"] for r in runs),
                          "frames_read": frames, "decode_s": sum(r["decode"] for r in runs),
                          "encode_s": sum(r["encode"] for r in runs)})
        base = [int(str(a) == result.get("majority", {}).get(str(length), {}).get(t))
                for v in vids for t, a in zip(result["videos"][v]["qtypes"], result["videos"][v]["answers"])]
        if result.get("majority", {}).get(str(length)):
            k, n = sum(base), len(base)
            lo, hi = wilson(k, n)
            acc.append({"method": "majority", "frames": length, "videos": len(vids), "questions": n,
                        "accuracy": k / n, "ci_lo": lo, "ci_hi": hi})
            maj = result["majority"][str(length)]
            per_type = {}
            for v in vids:
                for t, a in zip(result["videos"][v]["qtypes"], result["videos"][v]["answers"]):
                    per_type.setdefault(t, []).append(int(str(a) == maj.get(t)))
            acc[-1].update({f"acc_{t}": sum(x) / len(x) for t, x in per_type.items()})
        for a, b in pairs_for(methods):
            if a in methods and b in methods:
                ma = [x for v in vids for x in result["videos"][v]["runs"][a]["marks"]]
                mb = [x for v in vids for x in result["videos"][v]["runs"][b]["marks"]]
                diffs = [[x - y for x, y in zip(result["videos"][v]["runs"][a]["marks"], result["videos"][v]["runs"][b]["marks"])]
                         for v in vids]
                blo, bhi = video_bootstrap(diffs)
                pairs.append({"frames": length, "a": a, "b": b, **paired(ma, mb), "boot_lo": blo, "boot_hi": bhi})
                if b == "chunks" and result.get("majority", {}).get(str(length)) and len(base) == len(ma):
                    pairs.append({"frames": length, "a": a, "b": "majority", **paired(ma, base)})
                for t in ("next", "after", "first", "order"):
                    ta = [x for v in vids for x, tt in zip(result["videos"][v]["runs"][a]["marks"], result["videos"][v]["qtypes"]) if tt == t]
                    tb = [x for v in vids for x, tt in zip(result["videos"][v]["runs"][b]["marks"], result["videos"][v]["qtypes"]) if tt == t]
                    if ta:
                        pairs.append({"frames": length, "a": a, "b": b, "qtype": t, **paired(ta, tb)})
    return {"accuracy": acc, "paired": pairs, "throughput": speed}


def run(args) -> dict:
    lengths = [parse_size(s) for s in args.lengths.split(",")]
    data = Path(args.data)
    settings = {k: getattr(args, k) for k in SETTINGS}
    settings = {k: (Path(v).name if k.startswith("weights") and v else v) for k, v in settings.items()}
    result = read_json(args.out)
    if result is not None and result.get("settings") != settings:
        raise SystemExit(f"{args.out} holds a run with other settings ({result.get('settings')}); "
                         f"use another --out or the same settings ({settings})")
    if result is None:
        result = {"settings": settings, "methods": list(args.method_list), "videos": {}, "peak_memory": []}
    result["methods"] = list(dict.fromkeys(result["methods"] + list(args.method_list)))
    result["env"] = env_info()  # of the latest invocation; every invocation is kept in "invocations"
    result["args"] = portable_args(args)
    result.setdefault("invocations", []).append({"env": result["env"], "args": result["args"]})
    readers = _readers(args)
    from tqdm import tqdm

    for length in [] if args.peak_only else lengths:
        n = args.videos
        records = dataset(data, length, n, args.seed + (DEV_OFFSET if args.dev else 0), args.balanced)
        if not args.dev:  # the trivial baseline: majority answers counted on as many development videos
            result.setdefault("majority", {})[str(length)] = majority_answers(length, n, args.seed, args.balanced)
        for r in tqdm(records, desc=f"{length} frames", unit="video"):
            key = f"{length}/{r['video']}"
            entry = result["videos"].setdefault(key, {"qtypes": [q.qtype for q in r["questions"]],
                                                      "answers": [q.answer for q in r["questions"]], "runs": {}})
            todo = {m: v for m, v in readers.items() if m not in entry["runs"]}
            if not todo:
                continue
            entry["runs"].update(run_video(todo, r, args.chunk_size))
            write_json_atomic(args.out, result)  # after every video: a killed run loses at most one
        logger.info("%d frames: %d videos done", length, len(records))
    if not args.skip_peak:
        for m in [m for m in args.method_list if m in args.peak_methods.split(",")]:
            for length in [L for L in lengths if L >= 1024] or lengths[-1:]:
                if any(p["method"] == m and p["frames"] == length for p in result["peak_memory"]):
                    continue
                path = dataset(data, length, 1, args.seed + (DEV_OFFSET if args.dev else 0), args.balanced)[0]["path"]
                argv = [sys.executable, "-m", "benchmarks.video_bench", "--peak-case", m, path,
                        "--chunk-size", str(args.chunk_size), "--num-basis", str(args.num_basis), "--alpha", str(args.alpha)]
                if args.weights:
                    argv += ["--weights", args.weights]
                out = run_isolated(argv, timeout_s=args.case_timeout)
                result["peak_memory"].append({"method": m, "frames": length, **out})
                write_json_atomic(args.out, result)
    result.update(summarize(result))
    write_json_atomic(args.out, result)
    return result


def _peak_case(method: str, path: str, args) -> None:
    """Child process: ingest one video with ``method``, print its peak memory growth as JSON."""
    import torch

    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    torch.set_num_threads(1)
    cfg = InfiniteVideoConfig(method=method, chunk_size=args.chunk_size, num_basis=args.num_basis,
                              num_frames=args.num_basis, alpha=args.alpha)
    iv = InfiniteVideo(args.weights, cfg, device="cpu")
    peak = PeakRSS()
    peak.start()
    mem = iv.ingest(path)
    print(json.dumps({"status": "ok", "peak_mb": peak.peak_mb(), "peak_method": peak.method,
                      "frames_read": mem.frames_read, "timings": mem.timings}))


def report(result: dict, plot: Path | None) -> str:
    from video.synthetic import QUESTION_TYPES

    s = result["settings"]
    text = [f"Settings: aggregate {s['aggregate']}, chunk {s['chunk_size']} frames, {s['num_basis']} basis functions "
            f"(uniform reads as many frames), alpha {s['alpha']}, weights {s['weights'] or 'shipped'}"
            + (f", memory-trained weights {s['weights_memory']}" if s.get("weights_memory") else "")
            + (" — development set" if s.get("dev") else ""), ""]
    acc_cols = ["method", "frames", "videos", "questions", "accuracy", "ci_lo", "ci_hi", "boot_lo", "boot_hi",
                *[f"acc_{t}" for t in QUESTION_TYPES]]
    text += ["## Accuracy (Wilson 95% interval over questions; boot: 95% interval resampling whole videos)",
             format_table(result["accuracy"], acc_cols)]
    if result["paired"]:
        text += ["", "## Paired differences on the same questions (a - b, 95% interval)",
                 format_table(result["paired"], ["frames", "a", "b", "qtype", "questions", "a_only", "b_only",
                                                 "diff", "ci_lo", "ci_hi", "boot_lo", "boot_hi"])]
    text += ["", "## Reading time (s, all videos of a length; decode and encode are shared by the methods)",
             format_table(result["throughput"], ["method", "frames", "frames_read", "read_s", "decode_s", "encode_s"])]
    if result.get("peak_memory"):
        rows = [{"method": r["method"], "frames": r["frames"], "peak_mb": r.get("peak_mb"), "status": r.get("status")}
                for r in result["peak_memory"]]
        text += ["", "## Peak memory growth while ingesting one video",
                 format_table(rows, ["method", "frames", "peak_mb", "status"])]
    if plot is not None and result["accuracy"]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6.5, 4))
            for m in list(dict.fromkeys(r["method"] for r in result["accuracy"])):
                rows = [r for r in result["accuracy"] if r["method"] == m]
                x = np.array([r["frames"] for r in rows], dtype=float)
                y = np.array([r["accuracy"] for r in rows])
                err = np.array([[r["accuracy"] - r["ci_lo"] for r in rows], [r["ci_hi"] - r["accuracy"] for r in rows]])
                err = np.maximum(err, 0.0)  # the Wilson bounds of 0 or n right answers are off by rounding
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("video length (frames)")
            ax.set_ylabel("accuracy (95% interval)")
            ax.set_title(f"read-out: {s['aggregate']}")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(plot, dpi=110)
            plt.close(fig)
        except ImportError:  # pragma: no cover
            logger.warning("matplotlib missing: no plot")
    return "\n".join(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.video_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run: 4 videos per length, 1K and 4K frames")
    p.add_argument("--lengths", default="1K,4K,16K", help="video lengths in frames (comma list)")
    p.add_argument("--videos", type=int, default=16, help="videos per length (each asked every question type)")
    p.add_argument("--methods", default="uniform,chunks,infinite,infinite_nosticky,moviechat",
                   help=f"comma list out of {list(METHODS_ALL)}; NAME@ALPHA reads a memory method at another alpha "
                        "(e.g. infinite@0.75), sharing the decoded video")
    p.add_argument("--weights", default=str(DEFAULT_WEIGHTS),
                   help="model weights (default: video/weights/videoqa_nomem.safetensors, trained without the memory)")
    p.add_argument("--weights-memory", default=None,
                   help="weights of a model trained with the memory in the loop (adds infinite_memtrained)")
    p.add_argument("--aggregate", default="mean", choices=("last", "mean"),
                   help="fixed-size answer read-out: mean over chunks (the reference, default) or the last chunk's")
    p.add_argument("--balanced", type=int, default=3,
                   help="answer-balanced questions, up to this many per type and video (0: the old one per type)")
    p.add_argument("--chunk-size", type=int, default=32, help="frames per chunk")
    p.add_argument("--num-basis", type=int, default=None,
                   help="basis functions of the memory = frames uniform reads (default: the chunk size, so every "
                        "function gets frames from the first chunk on)")
    p.add_argument("--alpha", type=float, default=0.1,
                   help="short-term weight of the memory methods (0.1: chosen on the development videos; published 0.75)")
    p.add_argument("--dev", action="store_true", help="the development videos (another seed), not the reported ones")
    p.add_argument("--peak-methods", default="uniform,chunks,infinite,moviechat", help="methods whose peak memory is measured")
    p.add_argument("--skip-peak", action="store_true", help="do not measure peak memory")
    p.add_argument("--peak-only", action="store_true", help="measure only peak memory (no accuracy runs)")
    p.add_argument("--data", default="artifacts/video_bench_data", help="cache folder for the generated videos")
    p.add_argument("--out", default=None, help="JSON result path (resumed when it exists)")
    p.add_argument("--seed", type=int, default=1234, help="dataset seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--case-timeout", type=float, default=1800, help="seconds per peak-memory case")
    p.add_argument("--report-only", action="store_true", help="only rewrite the table and plot from --out")
    p.add_argument("--peak-case", nargs=2, metavar=("METHOD", "PATH"), help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.peak_case:
        _peak_case(args.peak_case[0], args.peak_case[1], args)
        return 0
    if args.quick:
        args.videos = min(args.videos, 4)
        args.lengths = "1K,4K" if args.lengths == "1K,4K,16K" else args.lengths
        args.peak_methods = "infinite,chunks"
    args.method_list = [m for m in args.methods.split(",") if m]
    if args.weights_memory and "infinite_memtrained" not in args.method_list:
        args.method_list.append("infinite_memtrained")
    for m in args.method_list:
        if m.startswith("moviechat@"):
            _moviechat_size(m)
        elif split_method(m, args.alpha)[0] not in METHODS_ALL:
            raise SystemExit(f"unknown method {m!r}; choose from {list(METHODS_ALL)}")
    if "infinite_memtrained" in args.method_list and not args.weights_memory:
        raise SystemExit("infinite_memtrained needs --weights-memory")
    if args.num_basis is None:
        args.num_basis = args.chunk_size
    if args.videos < 1 or args.chunk_size < 1 or args.num_basis < 1:
        raise SystemExit(f"--videos ({args.videos}), --chunk-size ({args.chunk_size}) and --num-basis "
                         f"({args.num_basis}) must be >= 1")
    if args.aggregate is None:
        from video.infinite import default_weights_path
        from video.train import load_model

        readout = load_model(args.weights or default_weights_path()).config.readout
        args.aggregate = readout if readout in ("last", "mean") else "last"
    name = ("video_bench_bounded" + ("_balanced" if args.balanced else "") + ("_quick" if args.quick else "")
            + ("_dev" if args.dev else "") + f"_{args.aggregate}")
    args.out = args.out or str(RESULTS / f"{name}.json")
    if args.report_only:
        result = read_json(args.out)
        if result is None:
            raise SystemExit(f"no results at {args.out}")
        result.update(summarize(result))
    else:
        result = run(args)
    table = report(result, Path(args.out).with_suffix(".png"))
    print(table)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
