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
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "ship_run", "ship_encoder", "run_record", "encoder_record", "provenance",
           "write_provenance", "selection_text", "GOLDEN_N", "ENCODER_NAME"]

WEIGHTS = Path(__file__).resolve().parent / "weights"
GOLDEN_N = 8  # test texts whose probabilities are stored
ENCODER_NAME = "mlm_encoder"  # the shipped encoder's folder; every other folder holds a classifier


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


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


def provenance(name: str, *, note: str | None = None) -> dict:
    """The provenance record of the shipped model ``name`` (``mlm_encoder`` or a classifier), from its folder.

    ``note`` (a sentence recorded as ``ship_note``): ``None`` keeps the note of the current record.
    """
    folder = WEIGHTS / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no shipped model {name!r}: {folder} is not a folder")
    if name == ENCODER_NAME:
        return encoder_record(folder)
    if note is None:
        old = WEIGHTS / f"{name}.json"
        note = json.loads(old.read_text(encoding="utf-8")).get("ship_note", "") if old.is_file() else ""
    return run_record(name, folder, note=note)


def write_provenance(name: str, *, note: str | None = None) -> Path:
    """Write ``weights/<name>.json`` from the folder and render its card ``weights/<name>.md`` with
    ``core.infra.model_card``; returns the card's path."""
    from core.infra.fileio import write_json_atomic, write_text_atomic
    from core.infra.model_card import card_path, render_card

    write_json_atomic(WEIGHTS / f"{name}.json", provenance(name, note=note))
    weights = WEIGHTS / name / ("encoder.safetensors" if name == ENCODER_NAME else "model.safetensors")
    card = card_path(weights)
    write_text_atomic(card, render_card(weights))
    return card


def ship_run(run: Path, name: str, note: str = "", selection: Path | None = None) -> Path:
    import torch

    from apps.ncal.data import load_split
    from apps.ncal.metrics import collapse_metrics
    from apps.ncal.model import infer, load_checkpoint
    from core.infra.fileio import write_json_atomic

    from apps.ncal.weights_io import read_json

    sel = entry = None
    if selection is not None:
        sel = read_json(selection)
        run_meta = read_json(run / "ncal.json")
        entry = sel.get("datasets", {}).get(run_meta["dataset"])
        if entry is None or not entry.get("complete"):
            raise ValueError(f"{selection} has no complete selection for dataset {run_meta['dataset']!r}")
        if run_meta["loss"]["name"] != entry["chosen"] or run_meta["settings"]["seed"] != sel["seed"]:
            raise ValueError(f"{run} is loss {run_meta['loss']['name']!r} seed {run_meta['settings']['seed']}; "
                             f"{selection} chose loss {entry['chosen']!r} seed {sel['seed']}")
        if run_meta.get("valid_split"):
            raise ValueError(f"{run} was trained with a validation hold-out; ship the full-train benchmark run")
    dst = WEIGHTS / name
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("model.safetensors", "ncal.json", "tokenizer.json", "metrics.jsonl"):
        _copy(run / f, dst / f)
    ckpt = load_checkpoint(dst)
    meta = ckpt.meta
    test, classes = load_split(meta["dataset"], "test", context=meta["context"])
    probs, feats = infer(ckpt.model, ckpt.tokenizer, [e.text for e in test])
    idx = {c: k for k, c in enumerate(classes)}
    col = collapse_metrics(feats, [idx[e.label] for e in test], len(classes))
    write_json_atomic(dst / "collapse.json", {"classes": list(classes), **col})
    write_json_atomic(dst / "golden.json", {
        "command": f"python -m apps.ncal.ship --run {run} --name {name}"
                   + (f" --selection {selection}" if selection is not None else ""),
        "texts": [e.text for e in test[:GOLDEN_N]],
        "probs": [[round(float(p), 6) for p in row] for row in probs[:GOLDEN_N].tolist()],
        "torch": torch.__version__,
    })
    if sel is not None:
        keep = {k: sel[k] for k in ("rule", "seed", "valid_frac", "valid_seed", "epochs", "encoder", "context")}
        write_json_atomic(dst / "selection.json", {**keep, "dataset": meta["dataset"], **entry})
    elif (dst / "selection.json").exists():
        (dst / "selection.json").unlink()  # a stale choice of an earlier shipped run
    card = write_provenance(name, note=note)
    logger.info("shipped %s to %s (%.1f MB), card %s", run, dst, (dst / "model.safetensors").stat().st_size / 2**20, card)
    return dst


def ship_encoder(run: Path) -> Path:
    dst = WEIGHTS / ENCODER_NAME
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("encoder.safetensors", "encoder.json", "tokenizer.json", "metrics.jsonl"):
        _copy(run / f, dst / f)
    card = write_provenance(ENCODER_NAME)
    logger.info("shipped the encoder of %s to %s, card %s", run, dst, card)
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a finished apps.ncal.train run folder")
    p.add_argument("--name", default=None, help="shipped name (tmwpl, pmtd)")
    p.add_argument("--encoder", default=None, help="an apps.ncal.pretrain run folder to ship as the default encoder")
    p.add_argument("--selection", default=None,
                   help="benchmarks.ncal_select output: the card says how the run was chosen (validation numbers)")
    p.add_argument("--note", default="", help="a sentence for the model card (recorded as ship_note)")
    p.add_argument("--provenance", nargs="+", default=None, metavar="NAME",
                   help=f"rewrite weights/NAME.json and the card NAME.md of shipped models from their folders "
                        f"(tmwpl, pmtd, {ENCODER_NAME})")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.encoder:
        ship_encoder(Path(args.encoder))
    for name in args.provenance or ():
        logger.info("wrote %s", write_provenance(name, note=args.note or None))
    if args.run:
        if not args.name:
            raise ValueError("--run needs --name (tmwpl or pmtd)")
        ship_run(Path(args.run), args.name, args.note, Path(args.selection) if args.selection else None)


if __name__ == "__main__":
    main()
