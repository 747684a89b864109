"""Long-video QA with a real InstructBLIP-Video and the ∞-Video memory (meant for a GPU and a real checkpoint).

    python -m video.recipes.instructblip_video --model DIR --videos DIR --questions FILE [--out DIR]
        [--methods uniform,chunks,infinite_nosticky,infinite] [--alpha 0.75] [--chunk-size N] [--fps F]
        [--num-basis N] [--max-new-tokens N] [--device auto|cpu|cuda] [--dtype auto|bfloat16] [--limit N] [--overwrite]

``--model`` is a local folder holding ``InstructBlipVideoForConditionalGeneration`` and its processor (e.g. a
downloaded ``Salesforce/instructblip-vicuna-7b``-style video checkpoint; nothing is downloaded here). Every video
is streamed once per method and answers all of its questions (the Q-former reads each question as its
instruction). Methods: ``uniform`` (the model's native use: 4 frames spread over the whole video), ``chunks``
(every chunk, no memory, LLM input averaged over chunks), ``infinite_nosticky`` and ``infinite`` (the continuous
long-term memory at ``--alpha``, evenly spaced or sticky resampling).

``--questions`` is a JSON list (records ``{"video", "question", "answer"}``, or ``{"video", "questions": [{"text" |
"question", "answer"}]}`` as ``python -m video.synthetic`` writes them), a JSONL file of flat records, or a CSV with
columns ``video``, ``question``, ``answer``. A generated answer is right when, lower-cased and without punctuation,
it equals the reference or starts with it as whole words.

Outputs under ``--out`` (default ``runs/instructblip_video``): ``<method>/<video>.json`` per video (questions,
generated answers, right/wrong; written atomically, so a rerun resumes), ``settings.json`` (a rerun with other
settings is refused unless ``--overwrite``), and ``summary.json`` / ``summary.md`` (accuracy per method with Wilson
95% intervals, and the majority answer's accuracy as the trivial baseline).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import re
import shutil
import time
from collections import Counter
from pathlib import Path

from core.infra.cli import UsageError, capped_int, fraction, nonempty_path, nonnegative_int, positive_int, run_cli
from core.infra.device import add_device_options, device_from_args
from core.infra.fileio import check_writable
from core.infra.guard import check_outputs
from core.infra.jobs import atomic_write, settings_diff
from video.batch import MAX_CHUNK, fps_arg, parse_records

logger = logging.getLogger(__name__)

__all__ = ["load_questions", "is_right", "evaluate", "build_parser", "main"]


def load_questions(path) -> dict[str, list[dict]]:
    """``{video file name: [{"question", "answer"}, ...]}`` from a JSON, JSONL or CSV file (see the module docs)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"questions file not found: {str(path)!r}")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        records = parse_records(text, path.suffix)
    except (json.JSONDecodeError, csv.Error) as err:
        raise ValueError(f"{path}: not a questions file ({err}); expected JSON, JSONL or CSV with video, question, "
                         f"answer") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a list of records with video, question, answer")
    out: dict[str, list[dict]] = {}
    for r in records:
        if not isinstance(r, dict) or "video" not in r:
            raise ValueError(f"{path}: every record needs a 'video' field, got {str(r)[:80]!r}")
        items = r.get("questions") if isinstance(r.get("questions"), list) else [r]
        for q in items:
            text_q = q.get("question", q.get("text")) if isinstance(q, dict) else None
            if not text_q or "answer" not in q:
                raise ValueError(f"{path}: each question needs 'question' (or 'text') and 'answer', got {str(q)[:80]!r}")
            out.setdefault(str(r["video"]), []).append({"question": str(text_q), "answer": str(q["answer"])})
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def _norm(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def is_right(generated: str, answer: str) -> bool:
    """Lower-cased, without punctuation: equal to the answer, or starting with it as whole words."""
    g, a = _norm(generated), _norm(answer)
    return bool(a) and g[: len(a)] == a


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def evaluate(lm, videos: dict[str, Path], questions: dict[str, list[dict]], out: Path, methods: list[str],
             max_new_tokens: int) -> dict:
    """Run every method over every video (resuming finished ones); returns the summary."""
    from dataclasses import replace

    base = lm.config
    for method in methods:
        lm.config = replace(base, method=method)
        (out / method).mkdir(parents=True, exist_ok=True)
        for name, path in videos.items():
            target = out / method / f"{name}.json"
            if target.exists():
                continue
            qs = questions[name]
            t0 = time.perf_counter()
            answers = lm.answer(path, [q["question"] for q in qs], max_new_tokens=max_new_tokens)
            res = lm.last_result
            rows = [{**q, "generated": a, "right": is_right(a, q["answer"])} for q, a in zip(qs, answers)]
            record = {"video": name, "method": method, "frames": res.frames_read, "chunks": res.num_chunks,
                      "seconds": round(time.perf_counter() - t0, 3), "questions": rows}
            with atomic_write(target) as tmp:
                Path(tmp).write_text(json.dumps(record, indent=1))
            logger.info("%s %s: %d/%d right", method, name, sum(r["right"] for r in rows), len(rows))
    lm.config = base
    summary = {"methods": {}, "videos": len(videos), "questions": sum(len(questions[v]) for v in videos)}
    for method in methods:
        rows = [r for v in videos for r in json.loads((out / method / f"{v}.json").read_text())["questions"]]
        k = sum(r["right"] for r in rows)
        summary["methods"][method] = {"accuracy": k / len(rows), "ci95": wilson(k, len(rows)), "n": len(rows)}
    answers = [q["answer"] for v in videos for q in questions[v]]
    top, count = Counter(_norm_answer(a) for a in answers).most_common(1)[0]
    summary["majority"] = {"answer": top, "accuracy": count / len(answers)}
    return summary


def _norm_answer(a: str) -> str:
    return " ".join(_norm(a))


def _markdown(summary: dict, settings: dict) -> str:
    lines = [f"# InstructBLIP-Video with ∞-Video: {summary['videos']} videos, {summary['questions']} questions", "",
             f"alpha {settings['reader']['alpha']}, chunk size {settings['chunk_size']}, fps {settings['reader']['fps']}, "
             f"{settings['reader']['num_basis']} basis functions", "", "| method | accuracy | 95% interval |", "|---|---|---|"]
    for m, r in summary["methods"].items():
        lines.append(f"| {m} | {r['accuracy']:.3f} | {r['ci95'][0]:.3f}–{r['ci95'][1]:.3f} |")
    maj = summary["majority"]
    lines.append(f"| majority answer ({maj['answer']!r}) | {maj['accuracy']:.3f} | |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    from video.hf import HF_METHODS

    p = argparse.ArgumentParser(prog="python -m video.recipes.instructblip_video", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=nonempty_path, help="local InstructBLIP-Video folder (model + processor)")
    p.add_argument("--videos", required=True, type=nonempty_path, help="folder of the videos named in --questions")
    p.add_argument("--questions", required=True, type=nonempty_path, help="questions file (JSON, JSONL or CSV)")
    p.add_argument("--out", type=nonempty_path, default="runs/instructblip_video", help="output folder")
    p.add_argument("--methods", default="uniform,chunks,infinite_nosticky,infinite",
                   help=f"comma list of {', '.join(HF_METHODS)}")
    p.add_argument("--alpha", type=fraction, default=0.75, help="weight of the chunk's own attention (published 0.75)")
    p.add_argument("--chunk-size", type=capped_int(MAX_CHUNK, why="frames held in memory at once"), default=16,
                   help="frames per chunk (default 16, as VideoChat2 reads them; the LLM reads 32 queries per frame)")
    p.add_argument("--fps", type=fps_arg, default=1.0, help="frames read per second of video (default 1)")
    p.add_argument("--num-basis", type=positive_int, default=None,
                   help="basis functions of each memory (default: the chunk size, so every function gets frames)")
    p.add_argument("--max-new-tokens", type=capped_int(4096, why="tokens of one answer"), default=16,
                   help="tokens generated per answer")
    p.add_argument("--limit", type=nonnegative_int, default=0, help="first N videos only (0 = all)")
    add_device_options(p)
    p.add_argument("--overwrite", action="store_true", help="discard results made with other settings")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    device, dtype = device_from_args(args)  # a missing GPU: one line, exit 2, before any work
    check_outputs([("--out", args.out)], inputs=[args.model, args.videos, args.questions])
    from video.hf import HF_METHODS, HFVideoConfig, InfiniteVideoLM
    from video.io import is_video_file

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in HF_METHODS]
    if bad or not methods:
        raise UsageError(f"--methods: unknown {bad or args.methods!r}; choose from {list(HF_METHODS)}")
    questions = load_questions(args.questions)
    folder = Path(args.videos)
    if not folder.is_dir():
        raise UsageError(f"--videos: no folder {str(folder)!r}")
    videos = {n: folder / n for n in sorted(questions) if (folder / n).is_file() and is_video_file(folder / n)}
    missing = sorted(set(questions) - set(videos))
    if not videos:
        raise UsageError(f"--videos: none of the {len(questions)} videos named in {args.questions} is in {folder}")
    if missing:
        logger.warning("%d video(s) named in the questions are not in %s (skipped), e.g. %s", len(missing), folder, missing[0])
    if args.limit:
        videos = dict(list(videos.items())[: args.limit])
    out = Path(args.out)
    check_writable(out, what="--out", folder=True)
    cfg = HFVideoConfig(method=methods[0], chunk_size=args.chunk_size, fps=args.fps, alpha=args.alpha,
                        num_basis=args.num_basis)
    lm = InfiniteVideoLM.from_hf(args.model, config=cfg, device=device, dtype=dtype)
    settings = {**lm.settings(), "chunk_size": lm.chunk_size, "max_new_tokens": args.max_new_tokens,
                "questions": Path(args.questions).name}
    settings["reader"].pop("method")
    settings_file = out / "settings.json"
    if settings_file.exists():
        diff = settings_diff(json.loads(settings_file.read_text()), settings)
        if diff and not args.overwrite:
            raise UsageError(f"{out} holds results made with other settings ({'; '.join(diff)[:300]}); "
                             f"rerun with --overwrite or choose another --out")
        if diff:
            for m in HF_METHODS:
                shutil.rmtree(out / m, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(settings_file) as tmp:
        Path(tmp).write_text(json.dumps(settings, indent=1, sort_keys=True))
    summary = evaluate(lm, videos, questions, out, methods, args.max_new_tokens)
    summary["settings"] = settings
    with atomic_write(out / "summary.json") as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1))
    with atomic_write(out / "summary.md") as tmp:
        Path(tmp).write_text(_markdown(summary, settings))
    for m, r in summary["methods"].items():
        logger.info("%s: %.3f (%.3f-%.3f) on %d questions", m, r["accuracy"], *r["ci95"], r["n"])
    logger.info("majority answer %r: %.3f", summary["majority"]["answer"], summary["majority"]["accuracy"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
