"""``python -m apps``: serve the demo hub on 127.0.0.1:7860."""

from apps.hub import main
from core.infra.cli import run_cli

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
