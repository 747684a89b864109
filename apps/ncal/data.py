"""NCAL data: the shipped TMWPL and PMTD sets, any JSONL with the same fields, validation, long-tail bins.

Two record layouts are read (one JSON object per line, UTF-8):

- TMWPL layout: ``{"id": ..., "question": text, "class": label}``;
- PMTD layout: ``{"id": ..., "dialog_content": text, "class": label, "dialog_history": [{"teacher"|"student": text}, ...]}``.

``class`` may be missing when ``require_label=False`` (texts to predict). :func:`format_record` turns one record
into the model input; training, evaluation and prediction from rows all go through it. Every problem (bytes that
are not UTF-8, a line that is not a JSON object, a missing or empty text field, a label outside the classes)
raises a ``ValueError`` naming the file and line.

PMTD's ``dialog_history`` is the window ``[previous, current, next]`` around the labelled turn (see
``data/README.md``). The next turn is in the future of a real-time tool, so by default (``context="past"``) the
model input is the previous turn and the current one, each with its speaker::

    学生：<previous turn>
    老师：<current turn>

``context="window"`` appends the next turn as the paper's code did (it leaks the future: an upper bound only);
``context="none"`` is the current turn with its speaker alone.

Long-tail bins come from train frequencies: ``head`` = classes with at least half the largest class's count,
``tail`` = classes with under a tenth of it, ``medium`` = the rest (:func:`longtail_bins`).

A validation split is cut from a train set by :func:`stratified_holdout`: per class, ``round(frac · n)`` items,
at least 1 and at most ``n − 1``; a class with a single item stays whole in train (it has no validation item).
The draw uses a fixed seed (:data:`VALID_SEED`) independent of any training seed, so every run of a train set
sees the same validation items.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "DATA_DIR",
    "DATASETS",
    "CONTEXTS",
    "DatasetSpec",
    "Example",
    "read_jsonl",
    "load_split",
    "resolve_dataset",
    "format_turn",
    "format_record",
    "LAYOUTS",
    "longtail_bins",
    "check_texts",
    "stratified_holdout",
    "VALID_SEED",
]

DATA_DIR = Path(__file__).resolve().parent / "data"

#: How PMTD turns are put in context (module docs).
CONTEXTS = ("past", "window", "none")

#: Record layouts of :func:`format_record`: a shipped set's (its fields required), or ``"keys"`` (each record's
#: own text field decides, as :func:`read_jsonl` reads any file).
LAYOUTS = ("tmwpl", "pmtd", "keys")

SPEAKERS = {"teacher": "老师", "student": "学生"}

#: Seed of the validation draw (:func:`stratified_holdout`); fixed, never a training seed.
VALID_SEED = 20250711


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A shipped dataset: its files and its classes in a fixed order (the label index order)."""

    name: str  # short name used on the command line
    train: str  # file name in DATA_DIR
    test: str  # file name in DATA_DIR
    classes: tuple[str, ...]  # label names; their order fixes the logits' order
    fields: tuple[str, ...]  # a record's input fields, text field first (a row to predict must have them all)
    description: str  # one line for the UI and model cards


DATASETS: dict[str, DatasetSpec] = {
    "tmwpl": DatasetSpec(
        name="tmwpl",
        train="TMWPL_train.jsonl",
        test="TMWPL_test.jsonl",
        classes=("回忆", "识别", "表征建模", "选取策略", "过程实施", "推断", "分析"),
        fields=("question",),
        description="maths word problems → 7 TIMSS cognitive levels (Recall … Analyze)",
    ),
    "pmtd": DatasetSpec(
        name="pmtd",
        train="PMTD_train.jsonl",
        test="PMTD_test.jsonl",
        classes=("I-Q", "I-H", "R-RR", "R-SR", "R-FR", "F-I", "F-F", "U"),
        fields=("dialog_content", "dialog_history"),
        description="teacher–student dialogue turns → 8 dialogue acts",
    ),
}


@dataclass(frozen=True, kw_only=True)
class Example:
    """One record: the model's input text, its label (None when unlabelled) and where it came from."""

    text: str  # model input (PMTD: formatted with its context)
    label: str | None  # class name
    id: str  # the record's id (or "<file>:<line>" when it has none)
    line: int  # 1-based line in its file


def format_turn(content: str, *, speaker: str | None = None, previous: str | None = None,
                previous_speaker: str | None = None, following: str | None = None,
                following_speaker: str | None = None) -> str:
    """The model input for one dialogue turn: optional previous turn, the turn, optional next turn.

    Speakers are ``"teacher"``, ``"student"`` or None (unknown: no prefix).
    """
    def line(text: str, who: str | None) -> str:
        if who is not None and who not in SPEAKERS:
            raise ValueError(f"speaker must be one of {sorted(SPEAKERS)} or None, got {who!r}")
        return (SPEAKERS[who] + "：" if who else "") + text.strip()

    parts = []
    if previous is not None and previous.strip():
        parts.append(line(previous, previous_speaker))
    parts.append(line(content, speaker))
    if following is not None and following.strip():
        parts.append(line(following, following_speaker))
    return "\n".join(parts)


def _history_turns(history, where: str) -> list[tuple[str | None, str]]:
    if not isinstance(history, list):
        raise ValueError(f"{where}: 'dialog_history' must be a list of {{speaker: text}} objects, got {type(history).__name__}")
    turns = []
    for t in history:
        if not (isinstance(t, dict) and len(t) == 1):
            raise ValueError(f"{where}: each 'dialog_history' entry must be one {{speaker: text}} object, got {t!r}")
        (who, text), = t.items()
        if not isinstance(text, str):
            raise ValueError(f"{where}: dialog_history text must be a string, got {text!r}")
        turns.append((who if who in SPEAKERS else None, text))
    return turns


def _pmtd_text(content: str, history, context: str, where: str) -> str:
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
    if history is None:
        return format_turn(content)
    turns = _history_turns(history, where)
    texts = [t for _, t in turns]
    # The labelled turn: the middle of a 3-turn window when it matches, else the first match.
    if len(texts) == 3 and texts[1].strip() == content.strip():
        i = 1
    else:
        matches = [j for j, t in enumerate(texts) if t.strip() == content.strip()]
        if not matches:
            # Not found: the history is taken to be past turns only (a user's own real-time data).
            prev = turns[-1] if turns else (None, None)
            return format_turn(content, previous=prev[1] if context != "none" else None, previous_speaker=prev[0])
        i = matches[0]
    speaker = turns[i][0]
    prev = turns[i - 1] if i >= 1 and context != "none" else (None, None)
    nxt = turns[i + 1] if i + 1 < len(turns) and context == "window" else (None, None)
    return format_turn(content, speaker=speaker, previous=prev[1], previous_speaker=prev[0],
                       following=nxt[1], following_speaker=nxt[0])


def format_record(rec: dict, *, layout: str = "keys", context: str = "past", where: str = "record") -> str:
    """The model input of one record (a TMWPL or PMTD row, module docs), exactly as training made it.

    Args:
        rec: the record, e.g. one parsed JSONL line.
        layout: ``"keys"``: TMWPL when the record has ``question``, else PMTD when it has ``dialog_content``
            (how :func:`read_jsonl` reads a file); ``"tmwpl"`` or ``"pmtd"``: that set's :attr:`DatasetSpec.fields`
            are required (a PMTD row without ``dialog_history`` has no speaker, so it is refused).
        context: PMTD context, one of :data:`CONTEXTS`.
        where: what the error messages call the record (``"x.jsonl line 3"``).

    Raises:
        ValueError: a missing or empty field (named, with the record's keys), a bad ``dialog_history``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "keys":
        if "question" in rec:
            field = "question"
        elif "dialog_content" in rec:
            field = "dialog_content"
        else:
            raise ValueError(f"{where}: missing the text field: one of 'question' (TMWPL) or "
                             f"'dialog_content' (PMTD) is required; keys are {sorted(rec)}")
    else:
        spec = DATASETS[layout]
        for f in spec.fields:
            if rec.get(f) is None:
                raise ValueError(f"{where}: missing field {f!r}: a {layout.upper()} record needs "
                                 f"{list(spec.fields)}; keys are {sorted(rec)}")
        field = spec.fields[0]
    content = rec[field]
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{where}: field {field!r} must be non-empty text, got {content!r}")
    if field == "dialog_content":
        return _pmtd_text(content, rec.get("dialog_history"), context, where)
    return content.strip()


def read_jsonl(path: str | os.PathLike, *, classes: tuple[str, ...] | None = None, require_label: bool = True,
               context: str = "past", layout: str = "keys") -> list[Example]:
    """Read and validate a TMWPL- or PMTD-layout JSONL file (module docs).

    Args:
        path: the file.
        classes: accepted labels; a label outside them raises. None accepts any label.
        require_label: raise on a record without ``class`` (False: such records get ``label=None``).
        context: PMTD context, one of :data:`CONTEXTS`.
        layout: record layout, one of :data:`LAYOUTS` (:func:`format_record`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a bad line (named), or no records at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out: list[Example] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path.name} line {n}"
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not s.strip():
                continue
            try:
                rec = json.loads(s)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            text = format_record(rec, layout=layout, context=context, where=where)
            label = rec.get("class")
            if label is None:
                if require_label:
                    raise ValueError(f"{where}: missing field 'class'")
            elif not isinstance(label, str):
                raise ValueError(f"{where}: 'class' must be a string, got {label!r}")
            elif classes is not None and label not in classes:
                raise ValueError(f"{where}: label {label!r} is not one of the classes {list(classes)}")
            out.append(Example(text=text, label=label, id=str(rec.get("id", f"{path.name}:{n}")), line=n))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def resolve_dataset(name: str) -> DatasetSpec:
    """The shipped dataset called ``name`` (case-insensitive); ``ValueError`` lists the known names."""
    spec = DATASETS.get(str(name).lower())
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {sorted(DATASETS)} (or a path to a .jsonl file)")
    return spec


def load_split(dataset: str, split: str, *, context: str = "past") -> tuple[list[Example], tuple[str, ...]]:
    """``(examples, classes)`` of a shipped dataset's ``"train"`` or ``"test"`` split."""
    spec = resolve_dataset(dataset)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return read_jsonl(DATA_DIR / getattr(spec, split), classes=spec.classes, context=context), spec.classes


def classes_from(examples: list[Example]) -> tuple[str, ...]:
    """Classes of a user file: sorted by train frequency (most frequent first), ties by name."""
    counts = Counter(e.label for e in examples if e.label is not None)
    if len(counts) < 2:
        raise ValueError(f"need at least 2 classes to train, got {sorted(counts)}")
    return tuple(sorted(counts, key=lambda c: (-counts[c], c)))


def longtail_bins(labels: list[str], classes: tuple[str, ...]) -> dict[str, str]:
    """``{class: "head" | "medium" | "tail"}`` from train label frequencies.

    head: count ≥ max/2; tail: count < max/10; medium otherwise. Classes absent from ``labels`` are tail.
    """
    counts = Counter(labels)
    top = max(counts.values()) if counts else 0
    bins = {}
    for c in classes:
        n = counts.get(c, 0)
        bins[c] = "head" if n * 2 >= top and n > 0 else ("tail" if n * 10 < top else "medium")
    return bins


def check_texts(texts) -> list[str]:
    """Validate texts to classify: a list (or other sequence) of non-empty strings; bytes must be UTF-8.

    Returns the texts as ``str``; ``ValueError`` names the first bad item by index.
    """
    if isinstance(texts, (str, bytes)):
        raise ValueError("expected a list of texts, got a single string; wrap it in a list")
    out = []
    for i, t in enumerate(texts):
        if isinstance(t, bytes):
            try:
                t = t.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"text {i}: not UTF-8 ({e.reason} at byte {e.start})") from None
        if not isinstance(t, str):
            raise ValueError(f"text {i}: expected a string, got {type(t).__name__}")
        if not t.strip():
            raise ValueError(f"text {i}: empty or whitespace-only text")
        out.append(t)
    if not out:
        raise ValueError("no texts given")
    return out


def stratified_holdout(labels: list[str], frac: float, *, seed: int = VALID_SEED) -> tuple[list[int], list[int]]:
    """``(keep, held_out)``: sorted indices of ``labels`` for training and for validation.

    Per class with ``n`` items: ``k = round(frac · n)`` items held out, clipped to ``[1, n − 1]`` so every class
    that can be split has a validation item and keeps a train item; a class with one item is not split. The
    items are drawn with ``random.Random(seed)`` class by class in sorted class order, so the split depends only
    on ``labels``, ``frac`` and ``seed``.

    Raises:
        ValueError: ``frac`` not in (0, 1).
    """
    import random

    if not 0.0 < frac < 1.0:
        raise ValueError(f"validation fraction must be in (0, 1), got {frac!r}")
    by_class: dict[str, list[int]] = {}
    for i, c in enumerate(labels):
        by_class.setdefault(c, []).append(i)
    rng = random.Random(seed)
    held: list[int] = []
    for c in sorted(by_class):
        idx = by_class[c]
        n = len(idx)
        if n < 2:
            continue
        k = min(max(int(math.floor(frac * n + 0.5)), 1), n - 1)
        held += rng.sample(idx, k)
    held_set = set(held)
    return [i for i in range(len(labels)) if i not in held_set], sorted(held)
