import functools

from apps.hub import main
from core.infra.cli import run_cli

if __name__ == "__main__":
    raise SystemExit(run_cli(functools.partial(main, app="decision_mixer")))
