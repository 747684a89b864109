"""``python -m apps.emloc.predict``: answer query images against a memory file (see
:func:`apps.emloc.cli.predict_main`; ``--help`` for the options)."""

if __name__ == "__main__":
    from apps.emloc.cli import predict_main
    from core.infra.cli import run_cli

    raise SystemExit(run_cli(predict_main))
