"""Batch ingestion: one consolidated memory file per video, resumable, shardable.

    python -m video.batch --videos DIR --out DIR [--shard I/N] [--skip-errors] [--overwrite] [--time-limit S]
    python -m video.batch --model hf:DIR --videos DIR --out DIR [--prompt TEXT] [--questions FILE] [--max-new-tokens N]

For each video (sorted by name; shard ``I`` of ``N`` takes every ``N``-th starting at ``I``) it writes
``OUT/<file name>.safetensors`` (``a.mp4.safetensors``: ``a.mp4`` and ``a.mkv`` do not collide) holding the
query embeddings of every chunk (``chunk_outputs`` (C, Q, D), ``chunk_times`` (C,)) and, for the ∞-Video methods,
each Q-former layer's memory (``layer<i>.coef`` (N, D) basis coefficients and ``layer<i>.density`` (T,), the last
attention density), with the reading settings in the metadata.

With ``--model hf:DIR`` (a local transformers InstructBLIP-Video, :mod:`video.hf`) each video is read once for all
of its questions (``--prompt`` for every video, and ``--questions FILE``: a ``.txt`` file with one question per line
for every video, or JSON / JSONL / CSV records ``{video, question}``), since the Q-former reads each question as its
instruction. One file per video and question, ``OUT/<file name>.q<12 hex digits of the question's SHA-256>.safetensors``,
holds ``features`` (the LLM inputs, mean over chunks, ``(F * Q, D_llm)``) and each cross-attention layer's memory
(``layer<i>.coef``, ``layer<i>.density``), with the question and the generated answer (``--max-new-tokens``, default 32;
0 = none) in its metadata; ``answers.jsonl`` and ``answers.csv`` beside them list ``video, question, answer, file`` for
every answered question in the folder's videos (``answers_<I>of<N>.*`` per shard). A new question for the same
``--out`` adds files; a question asked before is skipped.

Settings: each file's metadata holds ``settings`` (JSON) and ``settings_fingerprint``: every reading setting
(method, chunk size, fps, memory settings, ...) and the model's identity (its config, frame encoder included, and
a SHA-256 digest of its weights). A rerun whose settings differ from an existing file's refuses before any work
and names the differences; ``--overwrite`` redoes those files, or choose a new ``--out``.

Writes go to a temp file renamed into place, so a killed run leaves no partial file; a rerun skips every finished
video. ``OUT/locks/<file name>.lock`` keeps two workers (on any host sharing the folder) off the same video.
``--time-limit`` runs each video in a worker process killed past the limit (recorded as failed). ``manifest.csv``
(``manifest_<I>of<N>.csv`` per shard) lists each video's status: ``done``, ``exists`` (done by an earlier run),
``failed`` or ``locked``. The job machinery is :mod:`core.infra.jobs`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import io
import json
import logging
import time
from pathlib import Path

from core.infra.cli import UsageError, capped_int, fraction, nonempty_path, positive_float, run_cli
from core.infra.device import add_device_options, device_from_args
from core.infra.fileio import check_writable
from core.infra.guard import check_outputs
from core.infra.jobs import (
    Item,
    JobConfig,
    SettingsMismatch,
    add_job_arguments,
    atomic_write,
    batch_parser,
    canonical_settings,
    job_config_from_args,
    parse_shard,
    run_job,
    settings_fingerprint,
)

logger = logging.getLogger(__name__)

__all__ = ["list_videos", "parse_shard", "model_settings", "process_video", "run_batch", "build_parser", "main"]


def list_videos(folder, shard: tuple[int, int] = (0, 1)) -> list[Path]:
    """Video files directly in ``folder`` (by extension), sorted by name, this shard's share; a link to a missing
    file is listed (it fails, with a manifest row, rather than vanishing)."""
    from video.io import is_video_file

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"videos folder not found: {str(folder)!r}")
    files = sorted(p for p in folder.iterdir() if (p.is_file() or p.is_symlink()) and is_video_file(p))
    i, n = shard
    return files[i::n]


def model_settings(model) -> dict:
    """The model's identity: its config (frame encoder included) and a SHA-256 digest of its weights."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    cfg = getattr(model, "config", None)
    return {"config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "weights_sha256": h.hexdigest()}


def process_video(iv, path: Path, out_file: Path, *, settings: dict | None = None) -> dict:
    """Ingest one video and write its memory file atomically (with ``settings`` in its metadata); returns manifest
    fields."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    mem = iv.ingest(path, progress=False)  # the job's bar counts videos
    tensors = {"chunk_outputs": mem.chunk_outputs.contiguous(), "chunk_times": mem.chunk_times.contiguous()}
    for i, c in enumerate(mem.coefficients):
        tensors[f"layer{i}.coef"] = c.contiguous()
    for i, d in enumerate(mem.densities):
        tensors[f"layer{i}.density"] = d.contiguous()
    meta = {
        "video": path.name, "method": mem.method, "num_frames": str(mem.num_frames), "duration": str(mem.duration),
        "frames_read": str(mem.frames_read), "chunk_bounds": json.dumps(mem.chunk_bounds),
        "config": json.dumps(vars(iv.config)), "timings": json.dumps(mem.timings),
    }
    if settings is not None:
        meta["settings"] = json.dumps(canonical_settings(settings), sort_keys=True)
        meta["settings_fingerprint"] = settings_fingerprint(settings)
    with atomic_write(out_file) as tmp:
        save_file(tensors, tmp, metadata=meta)
    return {"frames": mem.frames_read, "chunks": len(mem.chunk_times), "seconds": round(time.perf_counter() - t0, 3)}


class _VideoJob:
    """The per-video work of a batch run (a :class:`core.infra.jobs.Job`)."""

    key_field = "video"
    extra_fields = ("frames", "chunks")

    def __init__(self, iv, out: Path):
        self.iv, self.out = iv, Path(out)
        self._settings: dict | None = None

    def outputs(self, item: Item) -> list[str]:
        return [str(self.out / f"{item.key}.safetensors")]

    def run_settings(self) -> dict:
        if self._settings is None:
            self._settings = {"reader": vars(self.iv.config), "model": model_settings(self.iv.model)}
        return self._settings

    def settings(self, item: Item) -> dict[str, dict]:
        return {self.outputs(item)[0]: self.run_settings()}

    def stored_settings(self, path: str) -> dict | None:
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                text = (f.metadata() or {}).get("settings")
            return json.loads(text) if text else None
        except Exception:  # noqa: BLE001 - an unreadable file holds no record: it is refused, or redone
            return None

    def process(self, item: Item) -> dict:
        fields = process_video(self.iv, Path(item.path), Path(self.outputs(item)[0]), settings=self.run_settings())
        return {k: v for k, v in fields.items() if k != "seconds"}


def run_batch(videos, out, *, iv=None, shard: tuple[int, int] = (0, 1), skip_errors: bool = False,
              overwrite: bool = False, time_limit: float | None = None, stale_after: float = 600.0,
              progress: bool = False) -> dict[str, dict]:
    """Process every video of this shard; returns the manifest rows by video file name.

    Raises :class:`core.infra.jobs.SettingsMismatch` before any work when existing files were made with other settings
    (unless ``overwrite``), and the first failure unless ``skip_errors``.
    """
    cfg = JobConfig(out=str(out), shard=shard, skip_errors=skip_errors, overwrite=overwrite, time_limit=time_limit,
                    stale_after=stale_after, heartbeat=min(30.0, stale_after / 4), progress=progress, desc="videos")
    return _run(videos, cfg, iv)


DEFAULT_PROMPT = "Describe what happens in the video."


def question_id(question: str) -> str:
    """The file tag of a question: ``q`` + 12 hex digits of its SHA-256."""
    return "q" + hashlib.sha256(question.encode("utf-8")).hexdigest()[:12]


def parse_records(text: str, suffix: str):
    """The records of a questions file's ``text``: CSV rows as dicts, JSONL lines, or the JSON value (the caller
    checks it is a list); raises ``json.JSONDecodeError`` / ``csv.Error`` for a malformed file."""
    if suffix.lower() == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    if suffix.lower() == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def load_prompts(path) -> tuple[dict[str, list[str]], list[str]]:
    """Questions per video and questions for every video from a ``--questions`` file.

    ``.txt``: one question per line, for every video. JSON (a list), JSONL or CSV: records with ``video`` and
    ``question`` (or ``text``, or a ``questions`` list of strings or such records); a record without ``video`` is
    asked of every video. Answers in the file, if any, are ignored (``video.recipes.instructblip_video`` scores them).
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--questions: file not found: {str(path)!r}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".txt":
        qs = [line.strip() for line in text.splitlines() if line.strip()]
        if not qs:
            raise UsageError(f"--questions {path}: no questions (one per line)")
        return {}, qs
    try:
        records = parse_records(text, path.suffix)
    except (json.JSONDecodeError, csv.Error) as err:
        raise UsageError(f"--questions {path}: not a questions file ({err}); expected .txt (one question per line), "
                         f"JSON, JSONL or CSV records with video and question") from None
    if not isinstance(records, list):
        raise UsageError(f"--questions {path}: expected a list of records with video and question")
    per_video: dict[str, list[str]] = {}
    every: list[str] = []
    for r in records:
        if not isinstance(r, dict):
            raise UsageError(f"--questions {path}: each record must be an object, got {str(r)[:80]!r}")
        items = r["questions"] if isinstance(r.get("questions"), list) else [r]
        for q in items:
            qt = q if isinstance(q, str) else (q.get("question") or q.get("text")) if isinstance(q, dict) else None
            if not qt or not str(qt).strip():
                raise UsageError(f"--questions {path}: each record needs 'question' (or 'text'), got {str(q)[:80]!r}")
            (per_video.setdefault(str(r["video"]), []) if r.get("video") else every).append(str(qt).strip())
    if not per_video and not every:
        raise UsageError(f"--questions {path}: no questions")
    return per_video, every


class _HFVideoJob(_VideoJob):
    """The per-video work with a transformers Q-former video-LLM (:class:`video.hf.InfiniteVideoLM`): one read of the
    video for all of its questions, one output file per question."""

    extra_fields = ("frames", "chunks", "questions")

    def __init__(self, lm, out: Path, questions: dict[str, list[str]], max_new_tokens: int):
        super().__init__(lm, out)
        self.max_new_tokens = max_new_tokens
        # questions answered before first: the runner counts a video done when its last output exists
        done = lambda v, q: (self.out / f"{v}.{question_id(q)}.safetensors").exists()  # noqa: E731
        self.questions = {v: sorted(qs, key=lambda q: not done(v, q)) for v, qs in questions.items()}

    def outputs(self, item: Item) -> list[str]:
        return [str(self.out / f"{item.key}.{question_id(q)}.safetensors") for q in self.questions[item.key]]

    def run_settings(self) -> dict:
        if self._settings is None:
            self._settings = {**self.iv.settings(), "max_new_tokens": self.max_new_tokens}
        return self._settings

    def settings(self, item: Item) -> dict[str, dict]:
        return {p: {**self.run_settings(), "question": q}
                for p, q in zip(self.outputs(item), self.questions[item.key])}

    def process(self, item: Item) -> dict:
        from safetensors.torch import save_file

        todo = [(p, q) for p, q in zip(self.outputs(item), self.questions[item.key]) if not Path(p).exists()]
        if not todo:
            return {"frames": 0, "chunks": 0, "questions": 0}
        res = self.iv.ingest(item.path, [q for _, q in todo])
        wanted = self.settings(item)
        for k, (p, q) in enumerate(todo):
            tensors = {"features": res.features[k].float().contiguous().cpu()}
            for i, c in enumerate(res.coefficients or []):
                tensors[f"layer{i}.coef"] = c[k].contiguous()
            for i, d in enumerate(res.densities or []):
                tensors[f"layer{i}.density"] = d[k].contiguous()
            meta = {"video": Path(item.path).name, "method": res.method, "num_frames": str(res.num_frames),
                    "frames_read": str(res.frames_read), "chunks": str(res.num_chunks), "question": q, "prompt": q}
            if self.max_new_tokens:
                ids = self.iv.generate(res.features[k], q, max_new_tokens=self.max_new_tokens)
                meta["answer"] = self.iv.tokenizer.decode(ids, skip_special_tokens=True).strip()
            meta["settings"] = json.dumps(canonical_settings(wanted[p]), sort_keys=True)
            meta["settings_fingerprint"] = settings_fingerprint(wanted[p])
            with atomic_write(Path(p)) as tmp:
                save_file(tensors, tmp, metadata=meta)
        return {"frames": res.frames_read, "chunks": res.num_chunks, "questions": len(todo)}


def write_answers(videos: list[Path], out: Path, shard: tuple[int, int]) -> Path | None:
    """``answers.jsonl`` / ``answers.csv`` (``answers_<I>of<N>.*`` for a shard): every answered question of these
    videos found in ``out`` (this run's and earlier runs'), read back from the files' metadata; written atomically.
    Returns the JSONL path."""
    from safetensors import safe_open

    import glob

    rows = []
    for v in videos:
        files = sorted(out.glob(f"{glob.escape(v.name)}.q" + "[0-9a-f]" * 12 + ".safetensors"),
                       key=lambda p: (p.stat().st_mtime_ns, p.name))  # in the order they were answered
        for p in files:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
            if "question" not in meta:
                continue
            rows.append({"video": v.name, "question": meta["question"], "answer": meta.get("answer", ""),
                         "file": p.name, "chunks": int(meta.get("chunks", 0)),
                         "frames_read": int(meta.get("frames_read", 0))})
    if not rows:
        return None
    stem = "answers" if shard == (0, 1) else f"answers_{shard[0]}of{shard[1]}"
    jsonl = out / f"{stem}.jsonl"
    with atomic_write(jsonl) as tmp:
        Path(tmp).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    with atomic_write(out / f"{stem}.csv") as tmp:
        Path(tmp).write_text(buf.getvalue(), encoding="utf-8")
    return jsonl


def _run(videos, cfg: JobConfig, iv, job=None, *, files: list[Path] | None = None) -> dict[str, dict]:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    items = [Item(key=p.name, path=str(p)) for p in (list_videos(videos) if files is None else files)]
    if iv is None:
        from video.infinite import InfiniteVideo

        iv = InfiniteVideo()
    return run_job(job or _VideoJob(iv, Path(cfg.out)), items, cfg)


#: the most frames per chunk (a chunk's frames are decoded and encoded together)
MAX_CHUNK = 4096
#: read rates accepted by --fps: from one frame per 1000 s to 1000 frames/s (no camera records faster; above the
#: file's own rate frames repeat)
MIN_FPS, MAX_FPS = 0.001, 1000.0


def fps_arg(text: str) -> float:
    """An argparse type: a read rate in frames per second in [:data:`MIN_FPS`, :data:`MAX_FPS`]."""
    value = positive_float(text)
    if not MIN_FPS <= value <= MAX_FPS:
        raise argparse.ArgumentTypeError(f"must be frames per second in [{MIN_FPS:g}, {MAX_FPS:g}], got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from video.infinite import METHODS

    p = batch_parser("python -m video.batch", __doc__)
    p.add_argument("--videos", required=True, type=nonempty_path, help="folder of video files")
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder (one .safetensors per video + manifest)")
    p.add_argument("--weights", default=None, help="model weights (default: the shipped model)")
    p.add_argument("--model", default=None, type=nonempty_path,
                   help="hf:DIR for a local transformers InstructBLIP-Video folder (free-text questions, see --prompt, "
                        "--questions); a weights file is the same as --weights")
    p.add_argument("--method", default="infinite", choices=METHODS, help="how each video is read")
    p.add_argument("--chunk-size", type=capped_int(MAX_CHUNK, why="frames held in memory at once"), default=None,
                   help="frames per chunk (default 32; with hf: 16, as VideoChat2 reads them)")
    p.add_argument("--alpha", type=fraction, default=0.75, help="weight of the chunk's own attention; 1 - alpha on the memory (default 0.75)")
    p.add_argument("--prompt", default=None,
                   help=f"a question asked of every video (hf: only; default {DEFAULT_PROMPT!r} when --questions is not "
                        "given)")
    p.add_argument("--questions", default=None, type=nonempty_path,
                   help="hf: questions file: .txt (one per line, every video) or JSON / JSONL / CSV records "
                        "{video, question}; each video is read once for all its questions")
    p.add_argument("--max-new-tokens", type=capped_int(4096, minimum=0, why="tokens of one answer"), default=None,
                   help="tokens generated per answer (hf: only; default 32; 0 = features and memories only)")
    p.add_argument("--fps", type=fps_arg, default=None, help="read rate in frames/s (default: every frame)")
    add_device_options(p)
    add_job_arguments(p, item="video")
    return p


def _is_transformers_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.videos, args.weights, args.model])
    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    # Bad options, a missing videos folder and files made with other settings are bad usage or input: one line,
    # exit 2 (run_cli), before any work. A video that fails stops the run (exit 1) unless --skip-errors.
    from video.hf import HF_METHODS, parse_hf_spec

    for flag, value in (("--model", args.model), ("--weights", args.weights)):
        if value and not str(value).startswith("hf:") and _is_transformers_folder(value):
            raise UsageError(f"{flag} {value}: that is a transformers model folder (config.json); give it as "
                             f"--model hf:{value}")
    hf_dir = parse_hf_spec(args.model) if args.model else None
    if args.model and hf_dir is None:
        if args.weights:
            raise UsageError("give the toy model's weights with --weights or --model, not both")
        args.weights = args.model
    if hf_dir is not None and args.method not in HF_METHODS:
        raise UsageError(f"--method {args.method} is not available with --model hf:; choose one of {list(HF_METHODS)}")
    if hf_dir is None and (args.max_new_tokens is not None or args.dtype != "auto" or args.prompt or args.questions):
        raise UsageError("--prompt, --questions, --max-new-tokens and --dtype apply to --model hf:DIR only")
    device, dtype = device_from_args(args)  # a GPU asked for by name that is not here: one line, exit 2
    videos = list_videos(args.videos)
    check_outputs([("--out", args.out)], inputs=[args.videos, args.weights, hf_dir, args.questions])
    check_writable(args.out, what="--out", folder=True)
    job = None
    if hf_dir is not None:
        from video.hf import HFVideoConfig, InfiniteVideoLM

        per_video, every = load_prompts(args.questions) if args.questions else ({}, [])
        first = [args.prompt] if args.prompt else ([] if args.questions else [DEFAULT_PROMPT])
        questions = {v.name: list(dict.fromkeys(first + every + per_video.get(v.name, []))) for v in videos}
        unknown = sorted(set(per_video) - {v.name for v in videos})
        if unknown:
            logger.warning("%d video(s) named in %s are not in %s, e.g. %s", len(unknown), args.questions, args.videos,
                           unknown[0])
        if not any(questions.values()):
            raise UsageError(f"--questions {args.questions}: no question names a video of {args.videos}")
        hcfg = HFVideoConfig(method=args.method, fps=args.fps, alpha=args.alpha,
                             **({"chunk_size": args.chunk_size} if args.chunk_size else {}))
        iv = InfiniteVideoLM.from_hf(hf_dir, config=hcfg, device=device, dtype=dtype)
        iv.progress = False  # the job's bar counts videos
        job = _HFVideoJob(iv, Path(args.out), {k: v for k, v in questions.items() if v},
                          32 if args.max_new_tokens is None else args.max_new_tokens)
        videos = [v for v in videos if questions.get(v.name)]
    else:
        iv = InfiniteVideo(args.weights, InfiniteVideoConfig(method=args.method, chunk_size=args.chunk_size or 32,
                                                             fps=args.fps, alpha=args.alpha), device=device)
    jcfg = job_config_from_args(args, args.out, desc="videos")
    try:
        rows = _run(args.videos, jcfg, iv, job, files=videos)
    except SettingsMismatch:
        raise
    except Exception as e:  # noqa: BLE001
        logger.error("stopped: %s (use --skip-errors to record failures and continue)", e)
        return 1
    finally:
        if job is not None:
            path = write_answers(videos, Path(args.out), jcfg.shard)
            if path is not None:
                logger.info("answers: %s", path)
    counts: dict[str, int] = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    logger.info("finished: %s", counts)
    return 1 if counts.get("failed") else 0  # 1: some videos failed (recorded in the manifest)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
