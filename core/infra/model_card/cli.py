"""``python -m core.infra.model_card``: write every card, or check them (``--check``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from core.infra.cli import nonempty_path_obj
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)


from core.infra.model_card.discovery import card_path, discover_weights
from core.infra.model_card.render import render_card
from core.infra.model_card.texts import GENERATOR, REPO


def write_cards(root: Path = REPO, *, check: bool = False) -> dict[Path, str]:
    """Render every shipped file's card; write the ones that differ unless ``check``.

    Returns ``{card path: "ok" | "written" | "missing" | "differs"}`` ("missing"/"differs" only with ``check``).
    """
    status: dict[Path, str] = {}
    owner: dict[Path, Path] = {}
    for weights in discover_weights(root):
        card = card_path(weights)
        if card in owner:
            raise ValueError(f"{weights} and {owner[card]} would share the card {card}: ship one weights file per "
                             "weights/<name>/ folder, and no weights/<name>.safetensors beside a weights/<name>/ folder")
        owner[card] = weights
        text = render_card(weights, root=root)
        old = card.read_text(encoding="utf-8") if card.is_file() else None
        if old == text:
            status[card] = "ok"
        elif check:
            status[card] = "missing" if old is None else "differs"
        else:
            write_text_atomic(card, text)
            status[card] = "written"
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=GENERATOR,
        description="Write the model card <name>.md of every shipped weights file from its <name>.json provenance.",
    )
    p.add_argument("--root", type=nonempty_path_obj, default=REPO,
                   help="repository root to search (default: this checkout)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a card is missing or stale")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.root.is_dir():  # a wrong root finds no weights: that must not pass as "every card is fine"
        raise FileNotFoundError(f"--root {str(args.root)!r} is not a folder; give the repository root")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    status = write_cards(args.root, check=args.check)
    if not status:
        logger.warning("no shipped weights found under %s", args.root)
    for card, s in status.items():
        logger.info("%s: %s", card.relative_to(args.root) if card.is_relative_to(args.root) else card, s)
    bad = [c for c, s in status.items() if s in ("missing", "differs")]
    if bad:
        logger.error("%d card(s) missing or stale: run `%s`", len(bad), GENERATOR)
        return 1
    return 0

