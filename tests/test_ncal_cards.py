"""apps.ncal's shipped cards: the provenance ``weights/<name>.json`` is what ``apps.ncal.ship`` makes of the shipped
folder (so an edited ``ncal.json``, ``collapse.json`` or ``selection.json`` makes it stale), and the card the
generator renders from it keeps the evaluation numbers and how the model was chosen.
``tests/test_model_cards.py`` checks that each card is the generator's rendering of that JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = REPO / "apps" / "ncal" / "weights"
NAMES = ("tmwpl", "pmtd", "mlm_encoder")


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", NAMES)
def test_provenance_is_what_ship_makes_of_the_folder(name):
    from apps.ncal.ship import provenance

    assert _json(WEIGHTS / f"{name}.json") == provenance(name), (
        f"apps/ncal/weights/{name}.json is stale: run `python -m apps.ncal.ship --provenance {name}`")


@pytest.mark.parametrize("name", ("tmwpl", "pmtd"))
def test_classifier_cards_keep_evaluation_and_selection(name):
    meta = _json(WEIGHTS / name / "ncal.json")
    sel = _json(WEIGHTS / name / "selection.json")
    card = (WEIGHTS / f"{name}.md").read_text(encoding="utf-8")
    t = meta["test"]
    choice = card.split("## How this model was chosen", 1)[1].split("## Evaluation", 1)[0]
    assert f"Chosen: **{sel['chosen']}**" in choice and f"seed {meta['settings']['seed']}" in choice
    assert f"test accuracy {t['accuracy']:.4f} and\nmacro-F1 {t['macro_f1']:.4f}" in choice
    for loss, r in sel["losses"].items():
        row = f"| {loss}{' (chosen)' if loss == sel['chosen'] else ''} | {100 * r['valid']['accuracy']:.1f} | "
        assert row + f"{100 * r['valid']['macro_f1']:.1f} |" in choice
    evaluation = card.split("## Evaluation", 1)[1].split("## Limitations", 1)[0]
    assert f"| accuracy | {round(t['accuracy'], 4)} |" in evaluation
    assert f"| macro_f1 | {round(t['macro_f1'], 4)} |" in evaluation
    assert f"official test split ({t['n']} items)" in evaluation
    for c in meta["classes"]:
        assert f"| {c} | {meta['train_counts'][c]} | {meta['bins'][c]} | {round(t['recall'][c], 4)} |" in evaluation
    header = card.split("\n---\n", 1)[0]
    assert '\nlanguage: "zh"' in header and '- "text-classification"' in header and f'- "{name}"' in header


def test_encoder_card_keeps_its_validation_losses():
    info = _json(WEIGHTS / "mlm_encoder" / "encoder.json")
    card = (WEIGHTS / "mlm_encoder.md").read_text(encoding="utf-8")
    vals = [json.loads(x) for x in (WEIGHTS / "mlm_encoder" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert len(vals) >= 2 and info["command"] in card and f"- **steps**: {info['step']}" in card
    for r in vals:
        assert f"- {r['step']}: {round(r['val_loss'], 4)}" in card
    assert "step-800 checkpoint" in card.split("## Limitations", 1)[1]


def test_provenance_refuses_an_unknown_name():
    from apps.ncal.ship import provenance

    with pytest.raises(FileNotFoundError, match="no shipped model 'nope'"):
        provenance("nope")
