"""``python -m core.infra.model_card [--check]``."""

import sys

from core.infra.model_card.cli import main

sys.exit(main())
