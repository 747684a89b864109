"""Procedural long-video question answering: rendered videos with timed events and closed answers.

Each video is a drifting, noisy background on which coloured squares ("events") flash for a few frames
at known times. Questions need information from anywhere in the video:

- ``first``: which colour appeared first?          answer: a colour
- ``last``: which colour appeared last?            answer: a colour
- ``count``: how many times did colour c appear?   answer: 0..4
- ``order``: did colour a appear before colour b?  answer: yes / no
- ``exists``: did colour c appear at all?          answer: yes / no (the colour is rare: 0 or 1 times)
- ``next``: which colour came right after the first c?        answer: a colour
- ``after``: did colour a appear after the last b?             answer: yes / no

``next`` and ``after`` depend on order and context: on a long video read in chunks, the two events
involved usually lie in different chunks.

Everything is a pure function of a :class:`VideoSpec` (seeded), so any frame range can be rendered
without rendering the rest: training draws short clips in memory, the CLI writes long videos as H.264
MP4 with PyAV chunk by chunk.

CLI::

    python -m video.synthetic --out DIR --n 20 --frames 4096 --seed 0
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from core.infra.cli import capped_int, nonempty_path, positive_float, positive_int, run_cli
from core.infra.fileio import set_file_mode
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = [
    "COLOURS",
    "COLOUR_RGB",
    "QUESTION_TYPES",
    "ANSWERS",
    "Event",
    "VideoSpec",
    "Question",
    "make_spec",
    "render_frames",
    "iter_frames",
    "make_questions",
    "make_question",
    "answer_options",
    "AnswerBalancer",
    "random_next_question",
    "random_after_question",
    "question_text",
    "load_dataset",
    "write_video",
    "write_dataset",
    "build_parser",
    "main",
]

COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan")
COLOUR_RGB = np.array(
    [[230, 40, 40], [40, 200, 60], [50, 80, 240], [240, 220, 40], [220, 50, 220], [40, 220, 230]], dtype=np.float32
)
QUESTION_TYPES = ("first", "last", "count", "order", "exists", "next", "after")
MAX_COUNT = 4
ANSWERS = (*COLOURS, *(str(i) for i in range(MAX_COUNT + 1)), "yes", "no")
ANSWER_INDEX = {a: i for i, a in enumerate(ANSWERS)}


@dataclass(frozen=True)
class Event:
    """One coloured square shown on frames ``[start, start + length)``."""

    colour: int  # index into COLOURS
    start: int  # first frame
    length: int  # frames
    x: int  # top-left corner, pixels
    y: int
    side: int  # square side, pixels


@dataclass(frozen=True)
class VideoSpec:
    """Everything needed to render a video deterministically."""

    num_frames: int
    size: int  # frames are size x size pixels
    fps: float
    seed: int
    events: tuple[Event, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        d = asdict(self)
        d["events"] = [asdict(e) for e in self.events]
        return d

    @staticmethod
    def from_json(d: dict) -> "VideoSpec":
        return VideoSpec(num_frames=d["num_frames"], size=d["size"], fps=d["fps"], seed=d["seed"],
                         events=tuple(Event(**e) for e in d["events"]))


@dataclass(frozen=True)
class Question:
    """A closed-answer question about one video."""

    qtype: str  # one of QUESTION_TYPES
    arg1: int  # colour index or -1
    arg2: int  # colour index or -1
    answer: str  # one of ANSWERS
    text: str  # the question in words

    @property
    def qtype_id(self) -> int:
        return QUESTION_TYPES.index(self.qtype)

    @property
    def answer_id(self) -> int:
        return ANSWER_INDEX[self.answer]


def make_spec(
    num_frames: int,
    *,
    seed: int,
    size: int = 64,
    fps: float = 25.0,
    event_length: tuple[int, int] = (4, 8),
    num_events: tuple[int, int] | None = None,
) -> VideoSpec:
    """Draw a video: events that never overlap, spread anywhere over ``num_frames``.

    Common colours may appear up to ``MAX_COUNT`` times; one colour (chosen at random) is "rare" and
    appears at most once, so ``exists`` questions are not trivial.
    """
    if num_frames < 8:
        raise ValueError(f"num_frames must be >= 8, got {num_frames}")
    if size < 16:
        raise ValueError(f"size must be >= 16 pixels, got {size}")
    rng = np.random.default_rng(seed)
    lo_len, hi_len = event_length
    hi_len = max(1, min(hi_len, num_frames // 8))
    lo_len = max(1, min(lo_len, hi_len))
    lo_n, hi_n = num_events if num_events is not None else (2, 8)
    slots = num_frames // (hi_len + 1)
    n = int(rng.integers(lo_n, hi_n + 1))
    n = max(1, min(n, slots))
    rare = int(rng.integers(len(COLOURS)))
    counts = np.zeros(len(COLOURS), dtype=int)
    colours = []
    for _ in range(n):
        allowed = [c for c in range(len(COLOURS)) if counts[c] < (1 if c == rare else MAX_COUNT)]
        c = int(rng.choice(allowed))
        counts[c] += 1
        colours.append(c)
    slot_ids = np.sort(rng.choice(slots, size=n, replace=False))
    events = []
    for c, s in zip(colours, slot_ids):
        length = int(rng.integers(lo_len, hi_len + 1))
        start = int(s * (hi_len + 1) + rng.integers(0, hi_len + 1 - length + 1))
        side = int(rng.integers(size // 5, size // 3 + 1))
        x, y = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        events.append(Event(colour=c, start=start, length=length, x=x, y=y, side=side))
    return VideoSpec(num_frames=num_frames, size=size, fps=fps, seed=seed, events=tuple(events))


def render_frames(spec: VideoSpec, start: int, stop: int) -> np.ndarray:
    """Frames ``[start, stop)`` of the video as ``(L, size, size, 3)`` uint8 RGB."""
    if not 0 <= start <= stop <= spec.num_frames:
        raise ValueError(f"frame range [{start}, {stop}) must lie within [0, {spec.num_frames}]")
    S = spec.size
    L = stop - start
    t = np.arange(start, stop, dtype=np.float32)[:, None, None]  # (L, 1, 1)
    yy, xx = np.mgrid[0:S, 0:S].astype(np.float32)
    phase = (spec.seed % 997) * 0.37
    # Slowly drifting grey gradient background.
    bg = 90 + 40 * np.sin(2 * np.pi * (xx / S + yy / (2 * S)) + t * 0.01 + phase)  # (L, S, S)
    frames = np.repeat(bg[..., None], 3, axis=-1).astype(np.float32)  # (L, S, S, 3)
    # Distractor: a slow grey disc wandering around (always present, no answer depends on it).
    cx = S / 2 + S / 3 * np.sin(t * 0.013 + phase)
    cy = S / 2 + S / 3 * np.cos(t * 0.017 + 2 * phase)
    disc = ((xx - cx) ** 2 + (yy - cy) ** 2) < (S / 8) ** 2  # (L, S, S)
    frames[disc] = 160.0
    for e in spec.events:
        a, b = max(e.start, start), min(e.start + e.length, stop)
        if a < b:
            frames[a - start : b - start, e.y : e.y + e.side, e.x : e.x + e.side] = COLOUR_RGB[e.colour]
    noise = np.random.default_rng([spec.seed, start, stop]).standard_normal(frames.shape, dtype=np.float32) * 6
    frames += noise
    return np.clip(frames, 0, 255, out=frames).astype(np.uint8)


def iter_frames(spec: VideoSpec, chunk: int = 256) -> Iterator[np.ndarray]:
    """Render the whole video chunk by chunk (never all frames at once)."""
    for s in range(0, spec.num_frames, chunk):
        yield render_frames(spec, s, min(s + chunk, spec.num_frames))


def _answer(spec: VideoSpec, qtype: str, a1: int, a2: int) -> str:
    order = [e.colour for e in sorted(spec.events, key=lambda e: e.start)]
    if qtype == "first":
        return COLOURS[order[0]]
    if qtype == "last":
        return COLOURS[order[-1]]
    if qtype == "count":
        return str(order.count(a1))
    if qtype == "exists":
        return "yes" if a1 in order else "no"
    if qtype == "order":
        return "yes" if order.index(a1) < order.index(a2) else "no"
    if qtype == "next":
        i = order.index(a1)
        if i + 1 >= len(order):
            raise ValueError(f"no event follows the first {COLOURS[a1]} one")
        return COLOURS[order[i + 1]]
    if qtype == "after":
        last_b = len(order) - 1 - order[::-1].index(a2)
        return "yes" if a1 in order[last_b + 1:] else "no"
    raise ValueError(f"unknown question type {qtype!r}; choose one of {list(QUESTION_TYPES)}")


def question_text(qtype: str, a1: int, a2: int) -> str:
    c1 = COLOURS[a1] if a1 >= 0 else ""
    c2 = COLOURS[a2] if a2 >= 0 else ""
    return {
        "first": "Which colour appeared first?",
        "last": "Which colour appeared last?",
        "count": f"How many times did a {c1} square appear?",
        "order": f"Did the {c1} square appear before the {c2} square?",
        "exists": f"Did a {c1} square appear at all?",
        "next": f"Which colour came right after the first {c1} square?",
        "after": f"Did a {c1} square appear after the last {c2} square?",
    }[qtype]


def make_question(spec: VideoSpec, qtype: str, arg1: int = -1, arg2: int = -1) -> Question:
    """The question of type ``qtype`` with the given colour arguments, and its true answer.

    ``order`` needs both colours present, ``next`` a present colour that is followed by another event,
    ``after`` a present second colour; otherwise a ``ValueError`` says so.
    """
    if qtype not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {qtype!r}; choose one of {list(QUESTION_TYPES)}")
    present = {e.colour for e in spec.events}
    need = {"order": (arg1, arg2), "next": (arg1,), "after": (arg2,)}.get(qtype, ())
    for c in need:
        if c not in present:
            raise ValueError(f"a {qtype!r} question needs colour {c} to appear in the video (present: {sorted(present)})")
    return Question(qtype=qtype, arg1=arg1, arg2=arg2, answer=_answer(spec, qtype, arg1, arg2),
                    text=question_text(qtype, arg1, arg2))


def make_questions(spec: VideoSpec, rng: np.random.Generator | int) -> list[Question]:
    """One question of each type (where it makes sense), with arguments drawn to balance the answers."""
    rng = np.random.default_rng(rng)
    present = sorted({e.colour for e in spec.events})
    out = [make_question(spec, "first"), make_question(spec, "last")]
    out.append(make_question(spec, "count", int(rng.integers(len(COLOURS)))))
    first_occ = {}
    for e in sorted(spec.events, key=lambda e: e.start):
        first_occ.setdefault(e.colour, e.start)
    if len(present) >= 2:
        a, b = (int(v) for v in rng.choice(present, size=2, replace=False))
        out.append(make_question(spec, "order", a, b))
    counts = np.bincount([e.colour for e in spec.events], minlength=len(COLOURS))
    rare = [c for c in range(len(COLOURS)) if counts[c] <= 1]
    c = int(rng.choice(rare)) if rare else int(rng.integers(len(COLOURS)))
    out.append(make_question(spec, "exists", c))
    q = random_next_question(spec, rng)
    if q is not None:
        out.append(q)
    q = random_after_question(spec, rng, want=str(rng.choice(["yes", "no"])))
    if q is not None:
        out.append(q)
    return out


def answer_options(spec: VideoSpec, qtype: str) -> dict[str, list[tuple[int, int]]]:
    """Every question of ``qtype`` this video allows, grouped by answer: ``{answer: [(arg1, arg2), ...]}``."""
    present = sorted({e.colour for e in spec.events})
    C = range(len(COLOURS))
    if qtype in ("first", "last"):
        args = [(-1, -1)]
    elif qtype in ("count", "exists"):
        args = [(c, -1) for c in C]
    elif qtype in ("order", "after"):
        args = [(a, b) for a in present for b in present if a != b]
    elif qtype == "next":
        order = [e.colour for e in sorted(spec.events, key=lambda e: e.start)]
        args = [(c, -1) for c in present if order.index(c) + 1 < len(order)]
    else:
        raise ValueError(f"unknown question type {qtype!r}; choose one of {list(QUESTION_TYPES)}")
    out: dict[str, list[tuple[int, int]]] = {}
    for a1, a2 in args:
        out.setdefault(_answer(spec, qtype, a1, a2), []).append((a1, a2))
    return out


#: The answers each balanced question type is spread over uniformly. Counts stop at 3: a colour shown 4 times is
#: rare in these videos (2 of 40 videos of 2-8 events), so "4" is not asked.
BALANCED_RANGES = {"count": ("0", "1", "2", "3"), "exists": ("yes", "no"), "order": ("yes", "no"),
                   "after": ("yes", "no"), "next": COLOURS}


class AnswerBalancer:
    """Questions whose answers are balanced over a whole dataset: for each question type, each new question takes,
    among the answers this video allows, the one given least often so far (ties at random), then random arguments
    with that answer; when every answer left here is ahead of the least given one of the type's range
    (:data:`BALANCED_RANGES`), the video gets no more questions of that type. Yes/no answers come out 50/50, counts
    uniform over 0-3 and ``next`` colours uniform, within one question; ``first`` / ``last`` are fixed by the video
    (their colours are drawn uniformly by :func:`make_spec`).
    Sequential: the questions of the first ``n`` videos do not depend on the videos after them."""

    def __init__(self, per_type: int = 3, seed: int = 0) -> None:
        if per_type < 1:
            raise ValueError(f"per_type must be >= 1, got {per_type}")
        self.per_type = per_type
        self.rng = np.random.default_rng(seed)
        self.counts: dict[str, dict[str, int]] = {t: {} for t in QUESTION_TYPES}

    def questions(self, spec: VideoSpec) -> list[Question]:
        out = []
        for qtype in QUESTION_TYPES:
            options = answer_options(spec, qtype)
            used: set[tuple[int, int]] = set()
            for _ in range(1 if qtype in ("first", "last") else self.per_type):
                avail = {a: [x for x in args if x not in used] for a, args in options.items()}
                avail = {a: args for a, args in avail.items() if args}
                if not avail:
                    break
                seen = self.counts[qtype]
                rng_answers = BALANCED_RANGES.get(qtype)
                if rng_answers is not None:
                    avail = {a: args for a, args in avail.items() if a in rng_answers}
                    if not avail:
                        break
                least = min(seen.get(a, 0) for a in avail)
                if rng_answers is not None and least > min(seen.get(a, 0) for a in rng_answers):
                    break  # only over-asked answers left here: skip, so every answer of the range stays equally likely
                pick = sorted(a for a in avail if seen.get(a, 0) == least)
                answer = pick[int(self.rng.integers(len(pick)))]
                a1, a2 = avail[answer][int(self.rng.integers(len(avail[answer])))]
                used.add((a1, a2))
                seen[answer] = seen.get(answer, 0) + 1
                out.append(Question(qtype=qtype, arg1=a1, arg2=a2, answer=answer, text=question_text(qtype, a1, a2)))
        return out


def random_next_question(spec: VideoSpec, rng: np.random.Generator) -> Question | None:
    """A ``next`` question about a colour whose first event is followed by another (None if there is none)."""
    order = [e.colour for e in sorted(spec.events, key=lambda e: e.start)]
    ok = sorted({c for c in order if order.index(c) + 1 < len(order)})
    if not ok:
        return None
    return make_question(spec, "next", int(rng.choice(ok)))


def random_after_question(spec: VideoSpec, rng: np.random.Generator, want: str | None = None) -> Question | None:
    """An ``after`` question about two different present colours, with answer ``want`` when some pair has it."""
    present = sorted({e.colour for e in spec.events})
    pairs = [(a, b) for a in present for b in present if a != b]
    if not pairs:
        return None
    qs = [make_question(spec, "after", a, b) for a, b in pairs]
    pool = [q for q in qs if q.answer == want] or qs
    return pool[int(rng.integers(len(pool)))]


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("writing videos needs PyAV: pip install 'longctx-suite[video]'") from e
    return av


def write_video(path, frames: Iterator[np.ndarray] | Sequence[np.ndarray], *, fps: float = 25.0, crf: int = 20,
                frame_times: Sequence[float] | None = None) -> None:
    """Write RGB frames (chunks ``(L, H, W, 3)`` uint8) as H.264 MP4, atomically (temp file + rename).

    Even sizes are encoded in yuv420p; odd widths or heights (which yuv420p cannot hold) in yuv444p.
    ``frame_times`` (seconds, one per frame) gives a variable frame rate; default is constant ``fps``.
    """
    av = _av()
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a finite number > 0, got {fps}")
    rate = Fraction(fps).limit_denominator(1000)
    if rate == 0:
        raise ValueError(f"fps {fps} is too low: the frame rate is kept to 1/1000 (give at least 0.001)")
    tb = Fraction(1, 1000) if frame_times is not None else 1 / rate
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".mp4")
    try:  # from here on, any failure removes the temp file
        os.close(fd)
        with av.open(tmp, "w", format="mp4") as container:
            stream = None
            i = 0
            for chunk in frames:
                chunk = np.asarray(chunk)
                if chunk.ndim == 3:
                    chunk = chunk[None]
                for img in chunk:
                    if stream is None:
                        h, w = img.shape[:2]
                        stream = container.add_stream("libx264", rate=rate)
                        stream.width, stream.height = w, h
                        stream.pix_fmt = "yuv420p" if w % 2 == 0 and h % 2 == 0 else "yuv444p"
                        stream.options = {"crf": str(crf), "preset": "veryfast"}
                        stream.codec_context.time_base = tb
                    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                    frame.time_base = tb
                    frame.pts = int(round(frame_times[i] / tb)) if frame_times is not None else i
                    for packet in stream.encode(frame):
                        container.mux(packet)
                    i += 1
            if stream is None:
                raise ValueError("no frames to write")
            for packet in stream.encode():
                container.mux(packet)
        set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, path)


def write_dataset(out, *, n: int, frames: Sequence[int], seed: int, size: int = 32, fps: float = 25.0,
                  progress: bool = False, balanced: int = 0) -> list[dict]:
    """Write ``n`` videos and their questions under ``out`` (resumable: finished videos are skipped).

    Files: ``video_XXXXX.mp4``, ``questions.json`` (specs + questions) and ``questions.csv``.
    Video ``i`` has ``frames[i % len(frames)]`` frames and seed ``seed * 100003 + i``. ``balanced = k > 0`` asks
    answer-balanced questions (:class:`AnswerBalancer`, up to ``k`` per type and video) instead of one per type.
    """
    balancer = AnswerBalancer(balanced, seed=seed) if balanced else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    it = range(n)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="videos", unit="video")
    for i in it:
        vseed = seed * 100003 + i
        spec = make_spec(int(frames[i % len(frames)]), seed=vseed, size=size, fps=fps)
        name = f"video_{i:05d}.mp4"
        if not (out / name).exists():
            write_video(out / name, iter_frames(spec), fps=fps)
        qs = balancer.questions(spec) if balancer else make_questions(spec, vseed)
        records.append({"video": name, "spec": spec.to_json(), "questions": [asdict(q) for q in qs]})
    _atomic_write_text(out / "questions.json", json.dumps(records, indent=1))
    rows = [["video", "num_frames", "qtype", "arg1", "arg2", "question", "answer"]]
    for r in records:
        for q in r["questions"]:
            rows.append([r["video"], r["spec"]["num_frames"], q["qtype"], q["arg1"], q["arg2"], q["text"], q["answer"]])
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".questions.csv.")
    with os.fdopen(fd, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, out / "questions.csv")
    return records


def load_dataset(root) -> list[dict]:
    """Read ``questions.json`` written by :func:`write_dataset` (specs become :class:`VideoSpec`)."""
    root = Path(root)
    path = root / "questions.json"
    if not path.exists():
        raise FileNotFoundError(f"no questions.json in {str(root)!r}; write one with python -m video.synthetic")
    records = json.loads(path.read_text())
    for r in records:
        r["spec"] = VideoSpec.from_json(r["spec"])
        r["questions"] = [Question(**q) for q in r["questions"]]
        r["path"] = str(root / r["video"])
    return records


#: the most videos per call and the largest frame side (4K frames; H.264 levels stop there)
MAX_VIDEOS = 100_000
MAX_SIDE = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m video.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder")
    p.add_argument("--n", type=capped_int(MAX_VIDEOS, why="videos per call"), default=10, help="number of videos")
    p.add_argument("--frames", default="256", help="frames per video, or a comma list cycled over the videos")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--size", type=capped_int(MAX_SIDE, why="frame side; the shipped model reads 32"), default=32,
                   help=f"frame side in pixels (the shipped model reads 32; at most {MAX_SIDE})")
    p.add_argument("--fps", type=positive_float, default=25.0, help="frame rate of the written files")
    p.add_argument("--balanced", type=positive_int, default=None,
                   help="answer-balanced questions, up to this many per type and video (default: one per type)")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    try:
        frames = [int(f) for f in str(args.frames).split(",") if f.strip()]
    except ValueError:
        raise SystemExit(f"--frames must be an integer or a comma list of integers, got {args.frames!r}")
    for f in frames:
        if not 64 <= f <= 50_000:
            raise SystemExit(f"--frames values must lie in [64, 50000], got {f}")
    write_dataset(args.out, n=args.n, frames=frames, seed=args.seed, size=args.size, fps=args.fps, progress=True,
                  balanced=args.balanced or 0)
    logger.info("wrote %d videos and their questions to %s", args.n, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
