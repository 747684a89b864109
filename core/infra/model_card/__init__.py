"""Model cards for the shipped weights, generated from their JSON provenance.

Every shipped weights file ``<package>/weights/<name>.safetensors`` (also ``apps/<app>/weights/``) has its provenance
in ``<name>.json`` beside it, written by the script that trained or shipped it. Weights shipped as a folder
(``weights/<name>/model.safetensors`` beside the files its app loads with them, as ``apps.ncal.ship`` writes them)
have their provenance and card at the folder's side: ``weights/<name>.json`` and ``weights/<name>.md``
(:func:`card_path`, :func:`provenance_path`). This module turns that JSON into a model card
``<name>.md`` in the Hugging Face convention: a YAML header (licence, library, tags, datasets, metrics) and sections
for the model, intended use, out-of-scope use, training data, training procedure, evaluation and limitations. The
card is a rendering of the JSON and of the weights file itself (size, tensor and parameter counts from its
header, SHA-256), so the two cannot disagree: every field of the JSON appears in the card, a field the card
needs and the JSON lacks reads "not recorded", and no number is added.

    python -m core.infra.model_card            # (re)write every card
    python -m core.infra.model_card --check    # exit 1 when a card is missing or differs from its JSON

Weights are found by globbing (``*/weights/**/*.safetensors`` and ``*/*/weights/**/*.safetensors`` inside Python
packages), so new shipped files need no registration here. Package-level text (intended use, out-of-scope use,
tags) comes from ``PACKAGE_TEXT``; a package missing there gets "not recorded" for the intended use, unless its
JSON carries a ``model_card`` object with ``intended_use``, ``out_of_scope``, ``tags``, ``datasets``,
``pipeline_tag``, ``language`` or ``limitations``.

A JSON object ``{"columns": [...], "rows": [[...], ...]}`` is rendered as a table; a ``selection`` field (prose) and a
``selection_candidates`` table make a section "How this model was chosen".
"""

from core.infra.model_card.cli import build_parser, main, write_cards
from core.infra.model_card.discovery import card_path, discover_weights, provenance_path, weights_summary
from core.infra.model_card.render import render_card
from core.infra.model_card.texts import GENERATOR, LICENSE, NOT_RECORDED, PACKAGE_TEXT, REPO, CardText

__all__ = [
    "GENERATOR",
    "LICENSE",
    "REPO",
    "NOT_RECORDED",
    "PACKAGE_TEXT",
    "CardText",
    "discover_weights",
    "card_path",
    "provenance_path",
    "weights_summary",
    "render_card",
    "write_cards",
    "build_parser",
    "main",
]
