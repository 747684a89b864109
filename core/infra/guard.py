"""The output guard every command that writes calls on its outputs before any work.

- An output that resolves (symlinks followed) inside a package's shipped ``weights/`` folder is refused, unless the
  command is that package's ``ship`` (``ship="rl"`` lets ``rl.ship`` write into ``rl/weights``).
- An output equal to one of the command's inputs (same file after resolving links) is refused: no command
  overwrites what the user gave it.
- :func:`check_ship_run` refuses a run folder that is, or lies inside, the shipping destination (shipping would
  delete the files it reads).

Each refusal is a :class:`~core.infra.cli.UsageError` (one line, exit 2 under ``run_cli``) naming the option, the
path and what is accepted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PROJECT_ROOT", "shipped_weights_dirs", "shipped_owner", "check_output", "check_outputs", "check_ship_run"]

#: the folder that holds the project's packages (``core``, ``video``, ``apps``, ...)
PROJECT_ROOT = Path(__file__).resolve().parents[2]

_PACKAGES = ("video", "pathology", "tabular", "rl", "core", "kernels", "apps")


def shipped_weights_dirs(root: str | os.PathLike | None = None) -> dict[str, Path]:
    """Each package's shipped ``weights/`` folder (resolved), by the package's dotted name: ``{"rl": .../rl/weights,
    "apps.ncal": .../apps/ncal/weights, ...}``."""
    root = Path(root).resolve() if root is not None else PROJECT_ROOT
    out: dict[str, Path] = {}
    for top in _PACKAGES:
        pkg = root / top
        if not (pkg / "__init__.py").is_file():
            continue
        candidates = [(top, pkg)] + [(f"{top}.{sub.name}", sub) for sub in sorted(pkg.iterdir())
                                     if sub.is_dir() and (sub / "__init__.py").is_file()]
        for name, folder in candidates:
            w = folder / "weights"
            if w.is_dir():
                out[name] = w.resolve()
    return out


def _resolved(path: str | os.PathLike) -> Path:
    # strict=False: the output may not exist yet; links in the part that exists are followed
    return Path(path).expanduser().resolve()


def shipped_owner(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> str | None:
    """The package whose shipped ``weights/`` folder holds ``path`` (or is ``path``), else None."""
    p = _resolved(path)
    for name, w in shipped_weights_dirs(root).items():
        if p == w or w in p.parents:
            return name
    return None


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (), flag: str = "--out",
                 ship: str | None = None, root: str | os.PathLike | None = None) -> Path:
    """Refuse ``path`` as an output when it lies inside a shipped ``weights/`` folder (unless ``ship`` names that
    folder's package) or resolves to one of ``inputs``; returns ``path`` as a ``Path``.

    Args:
        path: an output file or folder of the command.
        inputs: the command's input files and folders (None entries are skipped). An output *file* equal to an
            input file, or an output folder equal to an input folder, is refused.
        flag: the option that named ``path``, for the message.
        ship: the package allowed to write into its own shipped folder (``"rl"``, ``"apps.ncal"``): only its
            ``ship`` command passes it.
        root: the project root to look for shipped folders in (default: this installation's).
    """
    from core.infra.cli import UsageError

    p = _resolved(path)
    owner = shipped_owner(p, root=root)
    if owner is not None and owner != ship:
        raise UsageError(
            f"{flag} {path}: that is inside the shipped weights of {owner} ({shipped_weights_dirs(root)[owner]}); "
            f"only `python -m {owner}.ship` writes there. Write to a folder of your own (e.g. runs/...)"
        )
    for inp in inputs:
        if inp is None:
            continue
        q = _resolved(inp)
        if p == q:
            raise UsageError(f"{flag} {path}: that is also an input of this command ({inp}); "
                             "write to another path so the input is kept")
    return Path(path)


def check_outputs(paths: Iterable[tuple[str, str | os.PathLike | None]], *,
                  inputs: Iterable[str | os.PathLike | None] = (), ship: str | None = None) -> None:
    """:func:`check_output` on each ``(flag, path)`` pair (None paths skipped) against the same inputs."""
    inputs = list(inputs)
    for flag, path in paths:
        if path is not None:
            check_output(path, inputs=inputs, flag=flag, ship=ship)


def check_ship_run(run: str | os.PathLike, dest: str | os.PathLike, *, flag: str = "--run") -> Path:
    """Refuse a run folder that is, or lies inside, the ship destination ``dest`` (shipping replaces ``dest``'s
    files, so it would delete what it reads); returns ``run`` as a ``Path``."""
    from core.infra.cli import UsageError

    r, d = _resolved(run), _resolved(dest)
    if r == d or d in r.parents:
        raise UsageError(f"{flag} {run}: the run folder is (or is inside) the shipping destination {dest}; "
                         "ship from the run's own folder (e.g. runs/NAME)")
    return Path(run)
