"""What every ``ship`` command shares: checks of its inputs before anything is written, and a staging area that
writes all the shipped files first and then renames them into place together, so a refused or failed ship leaves
the shipped files byte-identical.

    check_name(args.name, flag="--name", example="dm_hopper")          # a bare, safe file stem
    require_files(run, ["model.safetensors", "config.json"], flag="--run", holds="a training run folder holds ...")
    with loading_check(run / "model.safetensors", flag="--run", what="policy"):
        model = load(run)                       # any failure becomes one ValueError naming the file
        check_finite("the policy's actions", model(x))
    with Staging(out_dir) as stage:             # renamed into place on leaving the block; nothing on an error
        stage.copy(run / "model.safetensors", out_dir / "x.safetensors")
        stage.write_json(out_dir / "x.json", record)
        stage.write_card(out_dir / "x.safetensors")  # the model card, rendered from the staged files

The errors these raise are ``ValueError`` and ``FileNotFoundError`` naming the flag, the value and what is
accepted: an entry point run through ``core.infra.cli.run_cli`` prints them as one line and exits with code 2.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core.infra.fileio import set_file_mode

logger = logging.getLogger(__name__)

__all__ = ["NAME_RULE", "check_name", "check_weights_path", "require_files", "read_json_file", "read_jsonl_file",
           "loading_check", "check_finite", "Staging"]

NAME_RULE = "letters, digits, '_', '-' and '.', not starting with '.', at most 100 characters"
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")


def check_name(name: str, *, flag: str = "--name", example: str = "default") -> str:
    """``name`` when it is a safe file stem (:data:`NAME_RULE`: no path separator, never empty, ``.`` or ``..``);
    otherwise ``ValueError`` naming the flag, the value and what is accepted."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{flag} {name!r}: a shipped name is a file stem of {NAME_RULE} (e.g. {example!r})")
    return name


def check_weights_path(path: str | os.PathLike, *, flag: str = "--dest", example: str = "model.safetensors") -> Path:
    """``path`` when it names a file ``NAME.safetensors`` (not a folder) with ``NAME`` a safe file stem
    (:data:`NAME_RULE`); otherwise ``ValueError`` naming the flag, the value and what is accepted."""
    p = Path(path)
    stem = p.name.removesuffix(".safetensors")
    if (str(path).endswith(("/", os.sep)) or not p.name.endswith(".safetensors") or not _NAME_RE.fullmatch(stem)
            or p.is_dir()):
        raise ValueError(f"{flag} {str(path)!r}: the shipped weights are a file NAME.safetensors, NAME of {NAME_RULE} "
                         f"(e.g. {example!r})")
    return p


def require_files(folder: str | os.PathLike, names: Sequence[str], *, flag: str, holds: str) -> Path:
    """``folder`` as a path when it is a folder holding every file of ``names``; otherwise ``FileNotFoundError``
    naming the flag, the folder, what is missing and ``holds`` (what such a folder holds)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag} {folder}: no such folder ({holds})")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{flag} {folder}: missing {', '.join(missing)} ({holds})")
    return folder


def read_json_file(path: str | os.PathLike, *, flag: str, kind: type = dict) -> Any:
    """The JSON value in ``path`` (of type ``kind``); ``FileNotFoundError`` / ``ValueError`` naming the flag."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: not a JSON file ({e})") from e
    if not isinstance(value, kind):
        raise ValueError(f"{flag} {path}: expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def read_jsonl_file(path: str | os.PathLike, *, flag: str) -> list[dict]:
    """The JSON objects of a JSON-lines file (blank lines skipped); ``ValueError`` names the first bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not a JSON-lines file ({e})") from e
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{flag} {path}: line {i} is not JSON ({e})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{flag} {path}: line {i} is not a JSON object")
        out.append(rec)
    return out


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def loading_check(path: str | os.PathLike, *, flag: str, what: str) -> Iterator[None]:
    """Run the block that loads and runs a candidate model; any exception becomes a ``ValueError`` that says
    ``path`` is not a loadable ``what`` and why (first line of the cause), so a corrupt or foreign file is refused
    with a message instead of a traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure to load or run the candidate is a refusal of the file
        raise ValueError(f"{flag} {path}: not a loadable {what} ({type(e).__name__}: {_one_line(e)})") from e


def check_finite(what: str, *tensors) -> None:
    """``ValueError`` when a tensor holds NaN or infinity (``what`` names the output)."""
    import torch

    for t in tensors:
        t = torch.as_tensor(t)
        if t.numel() == 0 or not bool(torch.isfinite(t.float()).all()):
            raise ValueError(f"{what} is empty or not finite (NaN or infinity)")


class Staging:
    """Files written beside their targets, renamed into place together.

    Every target must lie under ``folder``. New contents go to a hidden temp folder ``folder/.ship-*`` (same file
    system, so the renames are atomic), laid out like the targets' absolute paths so that a model card can be
    rendered from the staged weights and provenance exactly as it will read in place (:meth:`write_card`).
    :meth:`commit` renames them over the targets (creating folders); when a rename fails, the targets already
    replaced get their old files back. As a context manager it commits on a normal exit and discards everything
    on an exception.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder).resolve()
        self._dir: Path | None = None
        self._targets: dict[Path, Path] = {}  # target -> staged file, in staging order
        self._removals: list[Path] = []  # targets to delete at commit

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    # ------------------------------------------------------------------ staging
    def _target(self, target: str | os.PathLike) -> Path:
        t = Path(target)
        t = t.parent.resolve() / t.name  # the folder's real path; a target that is a link is replaced, not followed
        if not t.is_relative_to(self.folder) or t == self.folder:
            raise ValueError(f"{t} is not inside the staging folder {self.folder}")
        return t

    def _mirror(self, path: Path) -> Path:
        if self._dir is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(dir=self.folder, prefix=".ship-"))
        return self._dir.joinpath(*path.parts[1:])

    def path(self, target: str | os.PathLike) -> Path:
        """Where to write the new content of ``target`` (its folder exists); the file is renamed onto ``target``
        at :meth:`commit`."""
        t = self._target(target)
        if t in self._removals:
            self._removals.remove(t)
        staged = self._mirror(t)
        staged.parent.mkdir(parents=True, exist_ok=True)
        self._targets[t] = staged
        return staged

    def staged(self, target: str | os.PathLike) -> Path:
        """The staged file or folder of ``target`` (in the staging layout; may not exist)."""
        return self._mirror(self._target(target))

    def copy(self, src: str | os.PathLike, target: str | os.PathLike) -> Path:
        """Stage a byte copy of ``src`` as ``target``."""
        staged = self.path(target)
        shutil.copyfile(src, staged)
        set_file_mode(staged)  # the user's umask (mkstemp and safetensors make 0600)
        return staged

    def write_text(self, target: str | os.PathLike, text: str) -> Path:
        staged = self.path(target)
        staged.write_text(text, encoding="utf-8")
        set_file_mode(staged)  # the user's umask (mkstemp and safetensors make 0600)
        return staged

    def write_json(self, target: str | os.PathLike, obj: Any, *, indent: int = 2) -> Path:
        """``obj`` as indented JSON with a trailing newline (the format of ``write_json_atomic``)."""
        return self.write_text(target, json.dumps(obj, indent=indent, sort_keys=False) + "\n")

    def remove(self, target: str | os.PathLike) -> None:
        """Delete ``target`` (when it exists) at :meth:`commit`."""
        t = self._target(target)
        staged = self._targets.pop(t, None)
        if staged is not None and staged.exists():
            staged.unlink()
        if t not in self._removals:
            self._removals.append(t)

    def _reference(self, f: Path) -> None:
        """Copy ``f`` (in place, not staged) into the staging layout so a renderer can read it; never committed."""
        ref = self._mirror(f)
        ref.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, ref)

    def write_card(self, weights: str | os.PathLike, *, root: str | os.PathLike | None = None) -> Path | None:
        """Stage the model card of the weights file ``weights`` (``core.infra.model_card.render_card`` with
        ``root``, default the repository), rendered from the staged weights and provenance (or the files in place
        where nothing is staged) and the ``README.md`` files of the folders above them, so the card committed with
        them is the one the generator would render in place. Returns the card's target, or ``None`` when
        ``weights`` is not inside a ``weights/`` folder (such files have no card)."""
        from core.infra.model_card import card_path, provenance_path, render_card
        from core.infra.model_card.texts import REPO

        root = Path(REPO if root is None else root).resolve()
        w = self._target(weights)
        try:
            card = card_path(w)
        except ValueError:
            return None
        for f in (w, self._target(provenance_path(w))):
            if f not in self._targets:  # not staged: render from the file in place
                if not f.is_file():
                    raise FileNotFoundError(f"cannot render the card of {w}: {f} is neither staged nor in place")
                self._reference(f)
        if w.is_relative_to(root):  # the card links its package's README when there is one
            for folder in w.parents:
                if (folder / "README.md").is_file() and not self._mirror(folder / "README.md").exists():
                    self._reference(folder / "README.md")
                if folder == root:
                    break
        self.write_text(card, render_card(self._mirror(w), root=self._mirror(root)))  # as it will read in place
        return card

    # ------------------------------------------------------------------ commit
    def commit(self) -> list[Path]:
        """Rename every staged file onto its target and delete the targets marked for removal; returns the
        targets written. When a step fails, the targets changed so far are restored and the error re-raised."""
        if self._dir is None:
            return []
        backups = self._dir / ".previous"
        done: list[tuple[Path, Path | None]] = []  # (target, backup of its old file or None when it was new)
        try:
            for i, target in enumerate([*self._targets, *self._removals]):
                old = None
                if target.exists():
                    old = backups / str(i)
                    old.parent.mkdir(parents=True, exist_ok=True)
                    if target in self._removals:
                        os.replace(target, old)
                    else:
                        try:
                            os.link(target, old)
                        except OSError:
                            shutil.copy2(target, old)
                target.parent.mkdir(parents=True, exist_ok=True)
                if target in self._targets:
                    os.replace(self._targets[target], target)
                done.append((target, old))
        except BaseException:
            for target, old in reversed(done):
                try:
                    if old is not None:
                        os.replace(old, target)
                    elif target.exists():
                        target.unlink()
                except OSError:  # pragma: no cover - nothing more can be done; the error below is the real one
                    logger.exception("could not restore %s", target)
            self.discard()
            raise
        written = list(self._targets)
        self.discard()
        logger.debug("committed %s", [str(t) for t in written])
        return written

    def discard(self) -> None:
        """Remove the staging folder and forget everything staged."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._targets = {}
        self._removals = []
