"""Ship a trained run as a default model: ``python -m apps.ncal.ship --run runs/ncal_bench/tmwpl_tc_0 --name tmwpl``.

Copies the run's ``model.safetensors``, ``ncal.json``, ``tokenizer.json`` and ``metrics.jsonl`` into
``apps/ncal/weights/<name>/``, computes the test-set collapse measures and class-mean cosines
(``collapse.json``, shown by the demo), the golden probabilities of the first test texts (``golden.json``,
checked by the tests), and writes the model card ``apps/ncal/weights/<name>.md`` from that JSON.
``--selection benchmarks/results/ncal/selection.json`` (written by ``python -m benchmarks.ncal_select``) says in
the card how the run was chosen (every loss's validation numbers) and is copied as ``<name>/selection.json``;
the run must be of the chosen loss.
``--encoder runs/ncal_mlm`` ships the MLM-pretrained encoder instead (``weights/mlm_encoder/`` + card).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "ship_run", "ship_encoder", "model_card", "selection_text", "GOLDEN_N"]

WEIGHTS = Path(__file__).resolve().parent / "weights"
GOLDEN_N = 8  # test texts whose probabilities are stored


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
    """The card's "How this model was chosen" section from a ``benchmarks.ncal_select`` file and its dataset entry."""
    vs = entry["valid_split"]
    chosen = entry["chosen"]
    rows = "\n".join(
        f"| {loss}{' (chosen)' if loss == chosen else ''} | {100 * r['valid']['accuracy']:.1f} | "
        f"{100 * r['valid']['macro_f1']:.1f} | {_pct(r['valid'].get('recall_tail'))} |"
        for loss, r in entry["losses"].items())
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
    return f"""## How this model was chosen
Without the test split. Each of the {len(entry['losses'])} losses ({', '.join(entry['losses'])}) was trained
with seed {sel['seed']} on the train split minus a stratified hold-out of {100 * vs['frac']:.0f}% ({vs['n_valid']} of
{vs['n_valid'] + vs['n_train']} items, split seed {vs['seed']}, the same items for every loss{miss}); rule: {sel['rule']}.
Chosen: **{chosen}**. This model is the `{chosen}` benchmark run with seed {s['seed']} (seed 0 was fixed before
any choice) trained on the full train split with {recipe}. It then got test accuracy {t['accuracy']:.4f} and
macro-F1 {t['macro_f1']:.4f} (Evaluation below): measured after the choice, they played no part in it.{close}
Command: `python -m benchmarks.ncal_select` (`benchmarks/results/ncal/selection.json`, copied here as
`{meta['dataset']}/selection.json`).

| loss | validation accuracy | validation macro-F1 | validation tail recall |
|---|---|---|---|
{rows}

Validation items per class: {per_class}.

"""


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def model_card(name: str, meta: dict, collapse: dict, size_mb: float, note: str = "", chosen: str = "") -> str:
    """Hugging Face-style card (YAML header, intended use, data, recipe, evaluation, limits) from the JSON."""
    loss_text = LOSS_TEXT[meta["loss"]["name"]].format(**meta["loss"])
    t = meta["test"]
    s = meta["settings"]
    weak = ", ".join(f"{c} ({t['recall'][c]:.2f})" for c in meta["classes"] if t["recall"][c] < 0.5) or "none"
    rec = "\n".join(f"| {c} | {meta['train_counts'][c]} | {meta['bins'][c]} | {t['recall'][c]:.3f} | {t['f1'][c]:.3f} |"
                    for c in meta["classes"])
    cmd = (f"python -m apps.ncal.train --dataset {meta['dataset']} --loss {s['loss']} --seed {s['seed']} "
           f"--epochs {s['epochs']} --out {s['out']}")
    return f"""---
license: mit
language: zh
library_name: longctx-suite
pipeline_tag: text-classification
tags: [ncal, neural-collapse, long-tail, education]
datasets: [{meta['dataset']}]
metrics: [accuracy, macro-f1]
---

# NCAL {name} — {meta['loss']['name']} loss, character transformer

A {size_mb:.1f} MB classifier of Chinese {'maths word problems into 7 TIMSS cognitive levels' if meta['dataset'] == 'tmwpl' else 'teacher–student dialogue turns into 8 dialogue acts'}:
the character transformer of `apps.ncal.encoder` (pretrained here by masked-language modelling on the train
text of TMWPL and PMTD, `apps/ncal/weights/mlm_encoder.md`) fine-tuned with the `{meta['loss']['name']}` loss
({loss_text}).{(' ' + note) if note else ''}

{chosen}## Intended use
Tagging problems or dialogue turns in personalised-learning tools, as a starting point to fine-tune on your own
labels (`NCALClassifier`), and as the demo's model. Not for grading or decisions about students without a person
checking: classes with test recall under 0.5 — {weak} — are mostly misclassified (table below).

## Training data
`apps/ncal/data/{meta['dataset'].upper()}_train.jsonl` ({sum(meta['train_counts'].values())} items; MIT licence,
copyright 2025 Hu Hanglei, released with "Advancing Personalized Learning with Neural Collapse for Long-Tail
Challenge", ICML 2025). PMTD context: `{meta['context']}` (the previous turn and the current one with speakers;
never the next turn).

## Recipe
`{cmd}` ({meta['steps']} steps, {meta['train_wall_s']:.0f} s of training on a shared CPU).

## Evaluation (official test split, {t['n']} items)
Accuracy {t['accuracy']:.4f}, macro-F1 {t['macro_f1']:.4f}; recall head {_f(t.get('recall_head'))},
medium {_f(t.get('recall_medium'))}, tail {_f(t.get('recall_tail'))};
test-feature NC1 {collapse['nc1']:.3f}, NC2 {collapse['nc2']:.3f}.

| class | train items | bin | test recall | test F1 |
|---|---|---|---|---|
{rec}

## Limitations
Trained on one source of Chinese primary-school material; a small model pretrained here on ~12K short texts,
far below the paper's 7B LLM in capacity. Long texts keep their last {meta['encoder']['config']['max_length'] - 2}
characters. The benchmark (`apps/ncal/README.md`) compares it with the other losses and a TF-IDF baseline.
"""


def ship_run(run: Path, name: str, note: str = "", selection: Path | None = None) -> Path:
    import torch

    from apps.ncal.data import load_split
    from apps.ncal.metrics import collapse_metrics
    from apps.ncal.model import infer, load_checkpoint
    from core.fileio import write_json_atomic, write_text_atomic

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
    size = (dst / "model.safetensors").stat().st_size / 2**20
    chosen = ""
    if sel is not None:
        keep = {k: sel[k] for k in ("rule", "seed", "valid_frac", "valid_seed", "epochs", "encoder", "context")}
        write_json_atomic(dst / "selection.json", {**keep, "dataset": meta["dataset"], **entry})
        chosen = selection_text(meta, sel, entry)
    elif (dst / "selection.json").exists():
        (dst / "selection.json").unlink()  # a stale choice of an earlier shipped run
    write_text_atomic(WEIGHTS / f"{name}.md", model_card(name, meta, col, size, note, chosen))
    logger.info("shipped %s to %s (%.1f MB)", run, dst, size)
    return dst


def ship_encoder(run: Path) -> Path:
    from apps.ncal.weights_io import read_json
    from core.fileio import write_text_atomic

    dst = WEIGHTS / "mlm_encoder"
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("encoder.safetensors", "encoder.json", "tokenizer.json", "metrics.jsonl"):
        _copy(run / f, dst / f)
    info = read_json(dst / "encoder.json")
    recs = [json.loads(x) for x in (dst / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r for r in recs if "val_loss" in r]
    c = info["config"]
    size = (dst / "encoder.safetensors").stat().st_size / 2**20
    card = f"""---
license: mit
language: zh
library_name: longctx-suite
pipeline_tag: fill-mask
tags: [ncal, character-transformer, mlm]
datasets: [tmwpl, pmtd]
---

# NCAL MLM encoder (character transformer, {size:.1f} MB)

The default text encoder of `apps.ncal`: {c['num_layers']} pre-norm transformer blocks of width {c['dim']}
({c['num_heads']} heads, MLP ×{c['mlp_ratio']}) on `core.layers.SelfAttentionBlock`, learned positions up to
{c['max_length']} tokens, a character vocabulary of {c['vocab_size']} tokens (`tokenizer.json`).

## Intended use
Initialising NCAL classifiers (`python -m apps.ncal.train --encoder default`). Not a general Chinese language model.

## Training data and recipe
Masked-language modelling (15% of characters; 80/10/10 mask/random/keep) on the train text only of TMWPL and
PMTD ({info.get('texts')} texts after holding out 2% for validation; PMTD turns with the previous turn and
speakers). `{info.get('command')}` — {info.get('step')} steps, {info.get('wall_s')} s of training on a shared CPU.
{('Note: ' + info['note'] + '.') if info.get('note') else ''}

## Evaluation
Validation MLM loss (held-out 2% of the train texts): {vals[0]['val_loss'] if vals else 'n/a'} at step
{vals[0]['step'] if vals else 'n/a'}, {vals[-1]['val_loss'] if vals else 'n/a'} at step {vals[-1]['step'] if vals else 'n/a'}.

## Limitations
Seen ~12K short texts of one domain; characters outside its vocabulary become `[UNK]`.
"""
    write_text_atomic(WEIGHTS / "mlm_encoder.md", card)
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a finished apps.ncal.train run folder")
    p.add_argument("--name", default=None, help="shipped name (tmwpl, pmtd)")
    p.add_argument("--encoder", default=None, help="an apps.ncal.pretrain run folder to ship as the default encoder")
    p.add_argument("--selection", default=None,
                   help="benchmarks.ncal_select output: the card says how the run was chosen (validation numbers)")
    p.add_argument("--note", default="", help="a sentence for the model card (e.g. how the run was chosen)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.encoder:
        ship_encoder(Path(args.encoder))
    if args.run:
        if not args.name:
            raise ValueError("--run needs --name (tmwpl or pmtd)")
        ship_run(Path(args.run), args.name, args.note, Path(args.selection) if args.selection else None)


if __name__ == "__main__":
    main()
