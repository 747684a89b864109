"""``python -m core.infra.model_card [--check]``."""

from core.infra.cli import run_cli
from core.infra.model_card.cli import main

raise SystemExit(run_cli(main))
