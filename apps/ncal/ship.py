"""Ship a trained run as a default model: ``python -m apps.ncal.ship --run runs/ncal_bench/tmwpl_tc_0 --name tmwpl``.

Copies the run's ``model.safetensors``, ``ncal.json``, ``tokenizer.json`` and ``metrics.jsonl`` into
``apps/ncal/weights/<name>/``, computes the test-set collapse measures and class-mean cosines
(``collapse.json``, shown by the demo) and the golden probabilities of the first test texts (``golden.json``,
checked by the tests). From the folder it then writes the provenance ``apps/ncal/weights/<name>.json`` and, with
``core.infra.model_card`` (the generator of every shipped card), the model card ``apps/ncal/weights/<name>.md``.
``--selection benchmarks/results/ncal/selection.json`` (written by ``python -m benchmarks.ncal_select``) says in
the card how the run was chosen (every loss's validation numbers) and is copied as ``<name>/selection.json``;
the run must be of the chosen loss.
``--encoder runs/ncal_mlm`` ships the MLM-pretrained encoder instead (``weights/mlm_encoder/`` + card).
``--provenance tmwpl pmtd mlm_encoder`` rewrites the provenance and card of shipped models from their folders.
``--out DIR`` writes into another weights folder.

Before anything is written the inputs are checked: the name is a safe file stem, the run folder holds every file
it ships and a finished run's ``ncal.json`` (with test metrics), and the model loads (strict keys) and gives finite
outputs on short texts and on the test split. The files are then written together (staged, then renamed into
place), so a refused or failed ship leaves the shipped files as they were. Errors: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from core.infra.cli import add_run_options, configure_run, nonempty_path, run_cli
from core.infra.guard import check_output, check_ship_run
from core.infra.ship import (Staging, check_finite, check_name, loading_check, read_json_file, read_jsonl_file,
                             require_files)

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "ship_run", "ship_encoder", "check_run", "check_model", "check_encoder_run",
           "run_record", "encoder_record", "provenance", "write_provenance", "selection_text", "GOLDEN_N",
           "ENCODER_NAME"]

WEIGHTS = Path(__file__).resolve().parent / "weights"
GOLDEN_N = 8  # test texts whose probabilities are stored
ENCODER_NAME = "mlm_encoder"  # the shipped encoder's folder; every other folder holds a classifier


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


LOSS_TEXT = {"ce": "cross-entropy", "tc": "cross-entropy + λ·text collapse, λ = {tc_lambda}, feature bank {bank_size}",
             "cb": "class-balanced cross-entropy, β = {cb_beta}", "la": "logit-adjusted cross-entropy, τ = {la_tau}",
             "focal": "focal loss, γ = {focal_gamma}", "etf": "fixed simplex-ETF classifier + dot-regression loss"}


def selection_text(meta: dict, sel: dict, entry: dict) -> str:
    """How the shipped run was chosen, in words, from a ``benchmarks.ncal_select`` file and its dataset entry."""
    vs = entry["valid_split"]
    chosen = entry["chosen"]
    s = meta["settings"]
    same = s["epochs"] == sel["epochs"] and s["encoder"] == sel["encoder"] and meta["context"] == sel["context"]
    recipe = ("the same recipe (epochs, encoder, context)" if same else
              f"NOT the same recipe: the selection runs used {sel['epochs']} epochs, encoder {sel['encoder']}, "
              f"context {sel['context']}; this run {s['epochs']} epochs, encoder {s['encoder']}, context {meta['context']}")
    miss = f"; classes without a validation item: {', '.join(vs['not_in_valid'])}" if vs["not_in_valid"] else ""
    f1 = sorted((r["valid"]["macro_f1"] for r in entry["losses"].values()), reverse=True)
    margin = 100 * (f1[0] - f1[1]) if len(f1) > 1 else None
    close = ("" if margin is None or margin >= 1.0 else
             f" The margin over the runner-up is {margin:.2f} macro-F1 points on {vs['n_valid']} validation items: "
             "the losses near the top are not told apart by this split, and the rule picked one of them.")
    per_class = ", ".join(f"{c} {n}" for c, n in vs["valid_counts"].items())
    t = meta["test"]
    test_counts = sorted({sum(row) for row in t.get("confusion", [])})
    if len(test_counts) == 1:  # a balanced test split against a hold-out with train's long tail
        per_class += (f". The hold-out keeps the train split's long tail while the test split has {test_counts[0]} items of "
                      "every class, so validation and test macro-F1 weigh the classes' precision differently and can "
                      "rank the losses differently")
    return f"""Without the test split. Each of the {len(entry['losses'])} losses ({', '.join(entry['losses'])}) was trained
with seed {sel['seed']} on the train split minus a stratified hold-out of {100 * vs['frac']:.0f}% ({vs['n_valid']} of
{vs['n_valid'] + vs['n_train']} items, split seed {vs['seed']}, the same items for every loss{miss}); rule: {sel['rule']}.
Chosen: **{chosen}**. This model is the `{chosen}` benchmark run with seed {s['seed']} (seed 0 was fixed before
any choice) trained on the full train split with {recipe}. It then got test accuracy {t['accuracy']:.4f} and
macro-F1 {t['macro_f1']:.4f} (Evaluation below): measured after the choice, they played no part in it.{close}
Command: `python -m benchmarks.ncal_select` (`benchmarks/results/ncal/selection.json`, copied here as
`{meta['dataset']}/selection.json`; the table below is in %).

Validation items per class: {per_class}."""


def _selection_candidates(entry: dict) -> dict:
    """Every loss's validation numbers (%) as a card table."""
    return {"columns": ["loss", "validation accuracy", "validation macro-F1", "validation tail recall"],
            "rows": [[f"{loss}{' (chosen)' if loss == entry['chosen'] else ''}", round(100 * r["valid"]["accuracy"], 1),
                      round(100 * r["valid"]["macro_f1"], 1), _pct(r["valid"].get("recall_tail"))]
                     for loss, r in entry["losses"].items()]}


def _pct(x) -> float | str:
    return "n/a" if x is None else round(100 * x, 1)


_LANGUAGE = "zh"  # both shipped sets are Chinese
_LIMITS = ("Trained on one source of Chinese primary-school material; a small model pretrained here on ~12K short "
           "texts, far below the paper's 7B LLM in capacity.")


def run_record(name: str, folder: Path, *, note: str = "") -> dict:
    """The provenance of a shipped classifier (``weights/<name>.json``), from the files of its ``folder``.

    ``ncal.json`` (settings, test metrics), ``collapse.json`` (test-feature NC1/NC2), ``selection.json`` when the
    run was chosen by ``benchmarks.ncal_select``, ``golden.json`` (the ship command) and the weights file's size.
    """
    from apps.ncal.weights_io import read_json

    meta = read_json(folder / "ncal.json")
    collapse = read_json(folder / "collapse.json")
    loss = meta["loss"]
    t = meta["test"]
    s = meta["settings"]
    size_mb = (folder / "model.safetensors").stat().st_size / 2**20
    task = ("maths word problems into 7 TIMSS cognitive levels" if meta["dataset"] == "tmwpl"
            else "teacher–student dialogue turns into 8 dialogue acts")
    weak = ", ".join(f"{c} ({t['recall'][c]:.2f})" for c in meta["classes"] if t["recall"][c] < 0.5) or "none"
    record = {
        "name": f"NCAL {name} — {loss['name']} loss, character transformer",
        "what_it_is": (
            f"A {size_mb:.1f} MB classifier of Chinese {task}: the character transformer of `apps.ncal.encoder` "
            "(pretrained here by masked-language modelling on the train text of TMWPL and PMTD, "
            f"[`{ENCODER_NAME}.md`]({ENCODER_NAME}.md)) fine-tuned with the `{loss['name']}` loss "
            f"({LOSS_TEXT[loss['name']].format(**loss)}). Folder `{name}/`: weights, `ncal.json` (settings and "
            "metrics), `tokenizer.json`, `metrics.jsonl`, `collapse.json`, `golden.json`."),
        "command": (f"python -m apps.ncal.train --dataset {meta['dataset']} --loss {s['loss']} --seed {s['seed']} "
                    f"--epochs {s['epochs']} --out {s['out']}"),
        "data": (
            f"`apps/ncal/data/{meta['dataset'].upper()}_train.jsonl` ({sum(meta['train_counts'].values())} items; MIT "
            "licence, copyright 2025 Hu Hanglei, released with \"Advancing Personalized Learning with Neural Collapse "
            f"for Long-Tail Challenge\", ICML 2025). PMTD context: `{meta['context']}` (the previous turn and the current "
            "one with speakers; never the next turn)."),
        "model_config": {"encoder": meta["encoder"], "loss": loss, "classes": meta["classes"]},
        "train_config": s,
        "steps": meta["steps"],
        "train_wall_s": meta["train_wall_s"],
    }
    if (folder / "selection.json").is_file():
        sel = read_json(folder / "selection.json")  # the ncal_select settings with this dataset's entry merged in
        record["selection"] = selection_text(meta, sel, sel)
        record["selection_candidates"] = _selection_candidates(sel)
    record["held_out_metrics"] = {
        "evaluation": (f"official test split ({t['n']} items), evaluated by the training command at its end; recall "
                       "per long-tail bin of the train counts (head, medium, tail); NC1/NC2 of the test features "
                       "(`collapse.json`)"),
        "accuracy": t["accuracy"], "macro_f1": t["macro_f1"], "recall_head": t.get("recall_head"),
        "recall_medium": t.get("recall_medium"), "recall_tail": t.get("recall_tail"),
        "test_feature_nc1": collapse["nc1"], "test_feature_nc2": collapse["nc2"],
    }
    record["per_class"] = {
        "columns": ["class", "train items", "bin", "test recall", "test F1"],
        "rows": [[c, meta["train_counts"][c], meta["bins"][c], t["recall"][c], t["f1"][c]] for c in meta["classes"]]}
    golden = folder / "golden.json"
    if golden.is_file():
        record["ship_command"] = read_json(golden)["command"]
    if note:
        record["ship_note"] = note
    record["model_card"] = {
        "intended_use": ("Tagging problems or dialogue turns in personalised-learning tools, as a starting point to "
                         "fine-tune on your own labels (`NCALClassifier`), and as the demo's model."),
        "out_of_scope": ("Grading or decisions about students without a person checking: classes with test recall "
                         f"under 0.5 — {weak} — are mostly misclassified (per-class table under Evaluation)."),
        "tags": ["neural-collapse", "long-tail", "education", "text-classification"],
        "datasets": [meta["dataset"]],
        "pipeline_tag": "text-classification",
        "language": _LANGUAGE,
        "limitations": [
            _LIMITS + f" Long texts keep their last {meta['encoder']['config']['max_length'] - 2} characters.",
            "The benchmark (`apps/ncal/README.md`) compares it with the other losses and a TF-IDF baseline.",
        ],
    }
    return record


def encoder_record(folder: Path) -> dict:
    """The provenance of the shipped MLM encoder (``weights/mlm_encoder.json``), from ``encoder.json`` and
    ``metrics.jsonl`` in its ``folder``."""
    from apps.ncal.weights_io import read_json

    info = read_json(folder / "encoder.json")
    recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    c = info["config"]
    size_mb = (folder / "encoder.safetensors").stat().st_size / 2**20
    record = {
        "name": "NCAL MLM encoder (character transformer)",
        "what_it_is": (
            f"The default text encoder of `apps.ncal` ({size_mb:.1f} MB): {c['num_layers']} pre-norm transformer "
            f"blocks of width {c['dim']} ({c['num_heads']} heads, MLP ×{c['mlp_ratio']}) on "
            f"`core.layers.SelfAttentionBlock`, learned positions up to {c['max_length']} tokens, a character "
            f"vocabulary of {c['vocab_size']} tokens (`{ENCODER_NAME}/tokenizer.json`)."),
        "command": info.get("command"),
        "data": (
            "Masked-language modelling (15% of characters; 80/10/10 mask/random/keep) on the train text only of "
            f"TMWPL and PMTD ({info.get('texts')} texts after holding out 2% for validation; PMTD turns with the "
            "previous turn and speakers)."),
        "model_config": c,
        "steps": info.get("step"),
        "train_wall_s": info.get("wall_s"),
        "held_out_metrics": {
            "evaluation": "validation MLM loss on the held-out 2% of the train texts, by step (`metrics.jsonl`)",
            "val_loss_by_step": {str(r["step"]): r["val_loss"] for r in recs if "val_loss" in r},
        },
    }
    if info.get("note"):
        record["notes"] = info["note"][:1].upper() + info["note"][1:] + "."
    record["model_card"] = {
        "intended_use": "Initialising NCAL classifiers (`python -m apps.ncal.train --encoder default`).",
        "out_of_scope": "Use as a general Chinese language model.",
        "tags": ["character-transformer", "mlm"],
        "datasets": ["tmwpl", "pmtd"],
        "pipeline_tag": "fill-mask",
        "language": _LANGUAGE,
        "limitations": ["Seen ~12K short texts of one domain; characters outside its vocabulary become `[UNK]`."],
    }
    return record


def provenance(name: str, *, note: str | None = None, weights_dir: Path | None = None) -> dict:
    """The provenance record of the shipped model ``name`` (``mlm_encoder`` or a classifier), from its folder in
    ``weights_dir`` (default :data:`WEIGHTS`).

    ``note`` (a sentence recorded as ``ship_note``): ``None`` keeps the note of the current record.
    """
    weights_dir = Path(WEIGHTS if weights_dir is None else weights_dir)
    folder = weights_dir / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no shipped model {name!r}: {folder} is not a folder")
    if name == ENCODER_NAME:
        return encoder_record(folder)
    if note is None:
        old = weights_dir / f"{name}.json"
        note = json.loads(old.read_text(encoding="utf-8")).get("ship_note", "") if old.is_file() else ""
    return run_record(name, folder, note=note)


def _weights_file(folder: Path, name: str) -> Path:
    return folder / name / ("encoder.safetensors" if name == ENCODER_NAME else "model.safetensors")


def write_provenance(name: str, *, note: str | None = None, weights_dir: Path | None = None) -> Path:
    """Write ``weights/<name>.json`` from the folder and the card ``weights/<name>.md`` rendered from it by
    ``core.infra.model_card``, together (staged, then renamed into place); returns the card's path."""
    weights_dir = Path(WEIGHTS if weights_dir is None else weights_dir)
    check_name(name, flag="--provenance", example="tmwpl")
    record = provenance(name, note=note, weights_dir=weights_dir)
    with Staging(weights_dir) as stage:
        stage.write_json(weights_dir / f"{name}.json", record)
        card = stage.write_card(_weights_file(weights_dir, name))
    return card


RUN_FILES = ("model.safetensors", "ncal.json", "tokenizer.json", "metrics.jsonl")
RUN_HOLDS = ("a finished apps.ncal.train run folder holds model.safetensors, ncal.json, tokenizer.json and "
             "metrics.jsonl; ncal.json is written when the run ends")
META_KEYS = ("dataset", "classes", "bins", "train_counts", "context", "loss", "encoder", "settings", "steps",
             "train_wall_s", "test")
ENCODER_FILES = ("encoder.safetensors", "encoder.json", "tokenizer.json", "metrics.jsonl")
ENCODER_HOLDS = ("an apps.ncal.pretrain run folder holds encoder.safetensors, encoder.json, tokenizer.json and "
                 "metrics.jsonl")


def _probe_texts(tokenizer) -> list[str]:
    """Two short texts for a forward pass; the second holds the tokenizer's last characters (its largest ids)."""
    vocab = getattr(tokenizer, "vocab", None)
    return ["1+1=2", "".join(vocab[-16:]) if vocab else "3x5=15"]


def check_run(run: Path) -> dict:
    """``ncal.json`` of a finished training run (its files present, its metadata complete).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file at fault. The model itself is checked by
    :func:`check_model`.
    """
    run = require_files(run, RUN_FILES, flag="--run", holds=RUN_HOLDS)
    meta = read_json_file(run / "ncal.json", flag="--run")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"--run {run / 'ncal.json'}: missing {', '.join(missing)} ({RUN_HOLDS})")
    for k, kind in (("classes", list), ("loss", dict), ("encoder", dict), ("settings", dict)):
        if not isinstance(meta[k], kind):
            raise ValueError(f"--run {run / 'ncal.json'}: {k} must be a JSON {kind.__name__}")
    if "name" not in meta["loss"] or "seed" not in meta["settings"]:
        raise ValueError(f"--run {run / 'ncal.json'}: needs loss.name and settings.seed")
    read_jsonl_file(run / "metrics.jsonl", flag="--run")
    return meta


def check_model(run: Path, meta: dict):
    """The checkpoint of ``run`` (``apps.ncal.model.load_checkpoint``: strict keys for the character encoder) after
    one forward pass on two short texts gave finite probabilities; ``ValueError`` names the file otherwise."""
    from apps.ncal.model import infer, load_checkpoint

    what = "NCAL classifier with ncal.json and tokenizer.json"
    with loading_check(run / "model.safetensors", flag="--run", what=what):
        ckpt = load_checkpoint(run)
        tok, enc = ckpt.tokenizer, ckpt.model.encoder
        cfg = getattr(enc, "cfg", None)
        if tok is not None and cfg is not None and len(tok) > cfg.vocab_size:
            raise ValueError(f"tokenizer.json has {len(tok)} tokens, the encoder embeds {cfg.vocab_size}")
        probs, feats = infer(ckpt.model, tok, _probe_texts(tok))
        check_finite("the classifier's probabilities on two short texts", probs, feats)
        if probs.shape[1] != len(meta["classes"]):
            raise ValueError(f"{probs.shape[1]} outputs for {len(meta['classes'])} classes")
    return ckpt


def _check_selection(selection: Path, run: Path, meta: dict) -> tuple[dict, dict]:
    sel = read_json_file(selection, flag="--selection")
    need = ("rule", "seed", "valid_frac", "valid_seed", "epochs", "encoder", "context", "datasets")
    if any(k not in sel for k in need) or not isinstance(sel["datasets"], dict):
        raise ValueError(f"--selection {selection}: not a benchmarks.ncal_select result (needs {', '.join(need)})")
    entry = sel["datasets"].get(meta["dataset"])
    if entry is None or not entry.get("complete"):
        raise ValueError(f"{selection} has no complete selection for dataset {meta['dataset']!r}")
    if meta["loss"]["name"] != entry["chosen"] or meta["settings"]["seed"] != sel["seed"]:
        raise ValueError(f"{run} is loss {meta['loss']['name']!r} seed {meta['settings']['seed']}; "
                         f"{selection} chose loss {entry['chosen']!r} seed {sel['seed']}")
    if meta.get("valid_split"):
        raise ValueError(f"{run} was trained with a validation hold-out; ship the full-train benchmark run")
    return sel, entry


def ship_run(run: Path, name: str, note: str = "", selection: Path | None = None, *,
             weights_dir: Path | None = None) -> Path:
    """Check the run, its model and ``name``, then write ``weights_dir/<name>/`` (the run's files, ``collapse.json``,
    ``golden.json``, ``selection.json``), the provenance ``<name>.json`` and the card ``<name>.md`` together;
    returns the folder. ``weights_dir`` defaults to :data:`WEIGHTS`."""
    import torch

    from apps.ncal.data import load_split
    from apps.ncal.metrics import collapse_metrics
    from apps.ncal.model import infer

    weights_dir = Path(WEIGHTS if weights_dir is None else weights_dir)
    check_name(name, flag="--name", example="tmwpl")
    if name == ENCODER_NAME:
        raise ValueError(f"--name {name!r} is the shipped encoder's folder; a classifier needs another name "
                         "(tmwpl, pmtd)")
    run = Path(run)
    meta = check_run(run)
    sel = entry = None
    if selection is not None:
        sel, entry = _check_selection(Path(selection), run, meta)
    t = meta["test"]
    if not isinstance(t, dict) or any(k not in t for k in ("n", "accuracy", "macro_f1", "recall", "f1")):
        raise ValueError(f"--run {run / 'ncal.json'}: no test metrics (n, accuracy, macro_f1, recall, f1); ship a run "
                         "trained with its test split")
    ckpt = check_model(run, meta)
    test, classes = load_split(meta["dataset"], "test", context=meta["context"])
    if list(classes) != list(meta["classes"]):
        raise ValueError(f"--run {run / 'ncal.json'}: classes {meta['classes']} are not those of the "
                         f"{meta['dataset']!r} test split {list(classes)}")
    probs, feats = infer(ckpt.model, ckpt.tokenizer, [e.text for e in test])
    check_finite(f"the classifier's outputs on the {meta['dataset']!r} test split", probs, feats)
    idx = {c: k for k, c in enumerate(classes)}
    col = collapse_metrics(feats, [idx[e.label] for e in test], len(classes))
    golden = {
        "command": f"python -m apps.ncal.ship --run {run} --name {name}"
                   + (f" --selection {selection}" if selection is not None else ""),
        "texts": [e.text for e in test[:GOLDEN_N]],
        "probs": [[round(float(p), 6) for p in row] for row in probs[:GOLDEN_N].tolist()],
        "torch": torch.__version__,
    }
    dst = weights_dir / name
    with Staging(weights_dir) as stage:
        for f in RUN_FILES:
            stage.copy(run / f, dst / f)
        stage.write_json(dst / "collapse.json", {"classes": list(classes), **col})
        stage.write_json(dst / "golden.json", golden)
        if sel is not None:
            keep = {k: sel[k] for k in ("rule", "seed", "valid_frac", "valid_seed", "epochs", "encoder", "context")}
            stage.write_json(dst / "selection.json", {**keep, "dataset": meta["dataset"], **entry})
        else:
            stage.remove(dst / "selection.json")  # a stale choice of an earlier shipped run
        stage.write_json(weights_dir / f"{name}.json", run_record(name, stage.staged(dst), note=note))
        card = stage.write_card(dst / "model.safetensors")
    logger.info("shipped %s to %s (%.1f MB), card %s", run, dst, (dst / "model.safetensors").stat().st_size / 2**20,
                card)
    return dst


def check_encoder_run(run: Path) -> None:
    """A finished ``apps.ncal.pretrain`` run whose encoder loads strictly (``apps.ncal.pretrain.load_encoder``)
    and gives finite features on two short texts; ``FileNotFoundError`` / ``ValueError`` name the file otherwise."""
    import torch

    from apps.ncal.pretrain import load_encoder

    run = require_files(run, ENCODER_FILES, flag="--encoder", holds=ENCODER_HOLDS)
    info = read_json_file(run / "encoder.json", flag="--encoder")
    if not isinstance(info.get("config"), dict):
        raise ValueError(f"--encoder {run / 'encoder.json'}: no encoder config ({ENCODER_HOLDS})")
    read_jsonl_file(run / "metrics.jsonl", flag="--encoder")
    what = "NCAL encoder with encoder.json and tokenizer.json"
    with loading_check(run / "encoder.safetensors", flag="--encoder", what=what):
        enc, tok = load_encoder(run)
        if len(tok) > enc.cfg.vocab_size:
            raise ValueError(f"tokenizer.json has {len(tok)} tokens, the encoder embeds {enc.cfg.vocab_size}")
        b = tok.batch(_probe_texts(tok))
        with torch.no_grad():
            feats = enc.eval()(b["input_ids"], b["attention_mask"])
        check_finite("the encoder's features on two short texts", feats)


def ship_encoder(run: Path, *, weights_dir: Path | None = None) -> Path:
    """Check the pretraining run (:func:`check_encoder_run`), then write ``weights_dir/mlm_encoder/`` (its files),
    the provenance ``mlm_encoder.json`` and the card ``mlm_encoder.md`` together; returns the folder."""
    weights_dir = Path(WEIGHTS if weights_dir is None else weights_dir)
    run = Path(run)
    check_encoder_run(run)
    dst = weights_dir / ENCODER_NAME
    with Staging(weights_dir) as stage:
        for f in ENCODER_FILES:
            stage.copy(run / f, dst / f)
        stage.write_json(weights_dir / f"{ENCODER_NAME}.json", encoder_record(stage.staged(dst)))
        card = stage.write_card(dst / "encoder.safetensors")
    logger.info("shipped the encoder of %s to %s, card %s", run, dst, card)
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a finished apps.ncal.train run folder")
    p.add_argument("--name", default=None, help="shipped name (tmwpl, pmtd): letters, digits, _, -, .")
    p.add_argument("--encoder", default=None, help="an apps.ncal.pretrain run folder to ship as the default encoder")
    p.add_argument("--selection", default=None,
                   help="benchmarks.ncal_select output: the card says how the run was chosen (validation numbers)")
    p.add_argument("--note", default="", help="a sentence for the model card (recorded as ship_note)")
    p.add_argument("--provenance", nargs="+", default=None, metavar="NAME",
                   help=f"rewrite weights/NAME.json and the card NAME.md of shipped models from their folders "
                        f"(tmwpl, pmtd, {ENCODER_NAME})")
    p.add_argument("--out", type=nonempty_path, default=None,
                   help="the weights folder to write into (default: apps/ncal/weights)")
    add_run_options(p, threads=False)
    return p


def _check_args(args) -> None:
    """Refuse a bad combination or name before any action writes anything."""
    if not (args.run or args.encoder or args.provenance):
        raise ValueError("nothing to do: give --run DIR --name NAME, --encoder DIR or --provenance NAME ...")
    if args.run is not None and args.name is None:
        raise ValueError("--run needs --name (tmwpl or pmtd)")
    if args.name is not None and not args.run:
        raise ValueError(f"--name {args.name!r} needs --run (a finished apps.ncal.train run folder)")
    if args.selection is not None and not args.run:
        raise ValueError("--selection needs --run")
    if args.run:
        check_name(args.name, flag="--name", example="tmwpl")
        require_files(args.run, RUN_FILES, flag="--run", holds=RUN_HOLDS)
    if args.encoder:
        require_files(args.encoder, ENCODER_FILES, flag="--encoder", holds=ENCODER_HOLDS)
    for name in args.provenance or ():
        check_name(name, flag="--provenance", example="tmwpl")


def _main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_run(args)
    out = Path(args.out) if args.out else None
    dest = Path(WEIGHTS if out is None else out)
    # NCAL's ship writes NCAL's weights (no other package's), never onto what it reads
    check_output(dest, inputs=[args.selection, args.run, args.encoder], ship="apps.ncal")
    _check_args(args)
    if args.run:  # shipping replaces the destination folder's files: never ship from inside it
        check_ship_run(args.run, dest / args.name)
    if args.encoder:
        check_ship_run(args.encoder, dest / ENCODER_NAME, flag="--encoder")
    if args.encoder:
        ship_encoder(Path(args.encoder), weights_dir=out)
    for name in args.provenance or ():
        logger.info("wrote %s", write_provenance(name, note=args.note or None, weights_dir=out))
    if args.run:
        ship_run(Path(args.run), args.name, args.note, Path(args.selection) if args.selection else None,
                 weights_dir=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code 0, or 2 with one line on stderr for a bad input (``core.infra.cli.run_cli``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
