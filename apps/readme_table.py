"""The root README's apps table, generated from ``apps.REGISTRY`` so the README and the hub say the same thing.

``python -m apps.readme_table`` rewrites the table between the README's ``<!-- apps-table:start -->`` and
``<!-- apps-table:end -->`` markers; ``--check`` only compares and exits 1 when the README differs. The test
suite runs the comparison, so a status changed in the registry and not in the README fails a test.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path

from apps import REGISTRY, AppSpec
from core.infra.cli import run_cli
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)

__all__ = ["START", "END", "README", "apps_table", "render_readme", "write_readme", "build_parser", "main"]

START = "<!-- apps-table:start -->"
END = "<!-- apps-table:end -->"
REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell (no pipes, no line breaks)."""
    return " ".join(text.replace("|", "\\|").split())


def _package_dirs(spec: AppSpec) -> list[str]:
    """The folders of ``spec.package`` (``"core/, kernels/"`` -> ``["core/", "kernels/"]``)."""
    return [p.strip() for p in spec.package.split(",") if p.strip()]


def _git_files(root: Path) -> set[str] | None:
    """Paths git tracks under ``root`` (relative, POSIX), or None when ``root`` is not a git checkout."""
    try:
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return {p for p in r.stdout.decode("utf-8", "replace").split("\0") if p}


def _readme_link(folder: str, root: Path, tracked: set[str] | None) -> str | None:
    """Relative link to ``<folder>/README.md`` when that file exists (and, in a git checkout, is committed),
    else None: a README still being written in a shared checkout does not change the table."""
    path = folder.rstrip("/") + "/README.md"
    if not (root / path).is_file():
        return None
    return path if tracked is None or path in tracked else None


def apps_table(specs: Sequence[AppSpec] = REGISTRY, *, root: Path = REPO) -> str:
    """The Markdown table of the apps: title (linked to its README), summary, code folders, status.

    A folder links to its README when ``<root>/<folder>/README.md`` exists and, if ``root`` is a git checkout,
    is committed; so committing an app's README changes the table (regenerate it then).
    """
    tracked = _git_files(root)
    lines = ["| app | what it does | code and docs | status |", "|---|---|---|---|"]
    for s in specs:
        folders = _package_dirs(s)
        links = [_readme_link(f, root, tracked) for f in folders]
        title = f"[{_cell(s.title)}]({links[0]})" if links and links[0] else _cell(s.title)
        code = ", ".join(f"[`{f}`]({link})" if link else f"`{f}`" for f, link in zip(folders, links))
        lines.append(f"| {title} | {_cell(s.summary)} | {code} | {_cell(s.status)} |")
    return "\n".join(lines)


def render_readme(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``; ``ValueError`` without both markers."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"the README needs the markers {START!r} and then {END!r} around its apps table")
    return text[: i + len(START)] + "\n" + table + "\n" + text[j:]


def write_readme(path: Path = README, *, check: bool = False, specs: Sequence[AppSpec] = REGISTRY) -> bool:
    """Bring the apps table of ``path`` in line with the registry; True when it already was.

    With ``check`` nothing is written. The write is atomic (temporary file in the same folder, then rename).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no README at {path}")
    text = path.read_text(encoding="utf-8")
    new = render_readme(text, apps_table(specs, root=path.parent))
    if new == text:
        return True
    if not check:
        write_text_atomic(path, new)
        logger.info("rewrote the apps table of %s", path)
    return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m apps.readme_table",
        description="Write the root README's apps table from apps.REGISTRY (the one source of the apps' status).",
    )
    p.add_argument("--readme", type=Path, default=README, help="the README to update (default: the root README.md)")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when the README's table differs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    same = write_readme(args.readme, check=args.check)
    if args.check and not same:
        logger.error("the apps table of %s differs from apps.REGISTRY: run `python -m apps.readme_table`", args.readme)
        return 1
    if same:
        logger.info("the apps table of %s matches apps.REGISTRY", args.readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
