"""``python -m apps.emloc.compress``: compress labelled demonstrations into a memory file (see
:func:`apps.emloc.cli.compress_main`; ``--help`` for the options).

This module shares its name with the package's ``compress`` function; if it is ever imported, the module
object stays callable as that function, so ``apps.emloc.compress(model, demos)`` keeps working.
"""

from __future__ import annotations

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from apps.emloc.api import compress

        return compress(*args, **kwargs)


if __name__ == "__main__":
    from apps.emloc.cli import compress_main
    from core.infra.cli import run_cli

    raise SystemExit(run_cli(compress_main))
else:
    sys.modules[__name__].__class__ = _CallableModule
