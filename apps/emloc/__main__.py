"""EMLoC demo alone: ``python -m apps.emloc`` serves the EMLoC tab on 127.0.0.1:7860."""
import functools

from apps.hub import main
from core.infra.cli import run_cli

if __name__ == "__main__":
    raise SystemExit(run_cli(functools.partial(main, app="emloc")))
