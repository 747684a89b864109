"""Classify texts or data rows: ``python -m apps.ncal.predict --checkpoint tmwpl --text "..."``.

``--checkpoint`` is a shipped model name (``tmwpl``, ``pmtd``) or a folder written by ``apps.ncal.train``.
``--text`` is a model input as it is; for a dialogue turn give its speaker and, optionally, the previous turn
(``--speaker teacher --previous "..." --previous-speaker student``), as the PMTD model was trained.
``--rows FILE.jsonl`` classifies the rows of a file in the layout of the model's training data (PMTD:
``dialog_content`` + ``dialog_history``; TMWPL: ``question``; ``class`` is optional and not used), each
formatted as training formatted it. Prints each class's probability, highest first (``--json`` for JSON, one
``{class: probability}`` per input, ``null`` for an input that could not be read). The demo calls the same
:func:`classify`.

A row that cannot be read (not JSON, a missing field) or an empty ``--text`` is named on stderr (its line) and the
others are still classified; the exit code is then 1 (2 when no input could be read).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from core.infra.cli import InputTally, add_run_options, configure_run, run_cli
from core.infra.device import add_device_options, device_from_args

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "classify", "cached_checkpoint", "read_rows", "read_row_inputs"]


def cached_checkpoint(name_or_path: str, base_model: str | None = None, *, device=None, dtype=None):
    """Load (once per process) a checkpoint by shipped name or folder (``base_model``: an adapter's base model
    folder, when not where its ``ncal.json`` says; ``device``/``dtype``: None = auto, :mod:`core.infra.device`)."""
    from core.infra.device import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return _load(name_or_path, base_model, str(dev), str(resolve_dtype(dtype, dev)).removeprefix("torch."))


@lru_cache(maxsize=4)
def _load(name_or_path: str, base_model: str | None, device: str, dtype: str):
    from apps.ncal.estimator import resolve_checkpoint
    from apps.ncal.model import load_checkpoint

    return load_checkpoint(resolve_checkpoint(name_or_path), base_model=base_model, device=device, dtype=dtype)


def classify(checkpoint: str, inputs, *, base_model: str | None = None, device=None,
             dtype=None) -> list[dict[str, float]]:
    """``[{class: probability}, ...]`` per input (classes in the checkpoint's order).

    ``inputs``: strings (model inputs, used as they are) and/or rows of the model's training layout as dicts (or a
    DataFrame), formatted as training formatted them (:func:`apps.ncal.inputs.model_inputs`, which validates them).
    """
    from apps.ncal.inputs import model_inputs, row_layout
    from apps.ncal.model import infer

    ckpt = cached_checkpoint(str(checkpoint), base_model, device=device, dtype=dtype)
    texts = model_inputs(inputs, layout=row_layout(ckpt.meta), context=ckpt.meta.get("context", "past"))
    probs, _ = infer(ckpt.model, ckpt.tokenizer, texts)
    return [{c: float(p) for c, p in zip(ckpt.classes, row)} for row in probs.tolist()]


def read_rows(checkpoint: str, path: str, *, base_model: str | None = None) -> list[str]:
    """The model inputs of a JSONL file of rows, formatted as the checkpoint's training data (errors name the line)."""
    out = []
    for where, text, err in read_row_inputs(checkpoint, path, base_model=base_model):
        if err is not None:
            raise err
        out.append(text)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def read_row_inputs(checkpoint: str, path: str, *, base_model: str | None = None, device=None, dtype=None,
                    ) -> list[tuple[str, str | None, ValueError | None]]:
    """``(where, model input, None)`` per row of a JSONL file, or ``(where, None, error)`` for a row that cannot be
    read (not UTF-8, not a JSON object, a missing field); ``where`` is ``"<file> line <n>"``, blank lines are
    skipped. Raises for the file as a whole: missing, or a checkpoint without a row layout."""
    from apps.ncal.data import format_record
    from apps.ncal.inputs import accepted, row_layout

    meta = cached_checkpoint(str(checkpoint), base_model, device=device, dtype=dtype).meta
    layout = row_layout(meta)
    if layout is None:
        raise ValueError(f"checkpoint {checkpoint!r} was fitted on texts and records no row layout; give --text "
                         f"(accepted: {accepted(layout)})")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no rows file at {path} (accepted: a JSONL file, {accepted(layout)})")
    context = meta.get("context", "past")
    out: list[tuple[str, str | None, ValueError | None]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path.name} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((where, None, ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})")))
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                out.append((where, None, ValueError(f"{where}: not valid JSON ({e.msg})")))
                continue
            if not isinstance(rec, dict):
                out.append((where, None, ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")))
                continue
            try:
                out.append((where, format_record(rec, layout=layout, context=context, where=where), None))
            except ValueError as e:
                out.append((where, None, e))
    return out


def _accepted_rows(layout: str | None) -> str:
    """What a line of a ``--rows`` file may be, in words (for error messages)."""
    from apps.ncal.data import DATASETS

    if layout in DATASETS:
        return f"one JSON object per line with the fields {list(DATASETS[layout].fields)}"
    return "one JSON object per line with 'question' (TMWPL) or 'dialog_content' and 'dialog_history' (PMTD)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="shipped name (tmwpl, pmtd) or checkpoint folder")
    p.add_argument("--base-model", default=None, metavar="DIR",
                   help="an adapter's base model folder, when not where its ncal.json says (it was moved)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", help="text to classify, used as it is (repeat for several)")
    src.add_argument("--rows", default=None, help="JSONL file of rows in the layout of the model's training data")
    p.add_argument("--speaker", default=None, choices=("teacher", "student"), help="speaker of a dialogue turn")
    p.add_argument("--previous", default=None, help="the previous dialogue turn (PMTD context)")
    p.add_argument("--previous-speaker", default=None, choices=("teacher", "student"))
    p.add_argument("--json", action="store_true", help="print JSON")
    add_device_options(p)
    add_run_options(p, threads=False, log_level="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device, dtype = device_from_args(args)  # a missing GPU is one line before any work
    configure_run(args)
    from apps.ncal.data import format_turn
    from apps.ncal.inputs import row_layout

    base = str(args.base_model) if args.base_model else None
    layout = row_layout(cached_checkpoint(str(args.checkpoint), base, device=device, dtype=dtype).meta)  # an unknown checkpoint is refused first
    if args.rows is not None:
        if args.speaker or args.previous or args.previous_speaker:
            parser.error("--speaker/--previous/--previous-speaker apply to --text; a row carries its own context")
        tally = InputTally("row")
        items = read_row_inputs(args.checkpoint, args.rows, base_model=base, device=device, dtype=dtype)
    else:
        tally = InputTally("text")
        items = []
        for i, t in enumerate(args.text, start=1):
            where = f"--text {i}"
            if not t.strip():
                items.append((where, None, ValueError(f"{where}: empty or whitespace-only text")))
            elif args.speaker or args.previous:
                items.append((where, format_turn(t, speaker=args.speaker, previous=args.previous,
                                                 previous_speaker=args.previous_speaker), None))
            else:
                items.append((where, t, None))
    what = _accepted_rows(layout) if args.rows is not None else "a non-empty text"
    for where, _, err in items:
        if err is not None:
            tally.fail(where, err, accepted=what)
    texts = [t for _, t, err in items if err is None]
    probs = iter(classify(args.checkpoint, texts, base_model=base, device=device, dtype=dtype) if texts else [])
    out = [next(probs) if err is None else None for _, _, err in items]
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        for (_, t, _), p in zip(items, out):
            if p is None:
                continue
            print(t.replace("\n", " | "))
            for c, v in sorted(p.items(), key=lambda kv: -kv[1]):
                print(f"  {c:<10} {v:.4f}")
    tally.ok(len(texts))
    return tally.finish()


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
