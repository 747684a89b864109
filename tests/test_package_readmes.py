"""Package READMEs are user documentation that reads in a few minutes: at most MAX_LINES lines each, and every
relative link in them points to a file that exists. The history of experiments belongs in docs/experiments/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 250
# Packages whose README must exist; a package without one here (apps, some apps/*) is skipped by package_readmes.
EXPECTED = {"core", "kernels", "video", "pathology", "tabular", "rl"}

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def package_readmes(root: Path) -> dict[str, Path]:
    """README.md of each top-level package (a folder with ``__init__.py``) and of each app under ``apps/``."""
    found = {}
    for pkg in sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        if pkg.name == "tests":
            continue
        subs = [pkg, *sorted(p for p in pkg.iterdir() if p.is_dir())] if pkg.name == "apps" else [pkg]
        for folder in subs:
            if (folder / "README.md").is_file():
                found[folder.relative_to(root).as_posix()] = folder / "README.md"
    return found


def too_long(readmes: dict[str, Path], limit: int = MAX_LINES) -> dict[str, int]:
    """Package -> line count, for the READMEs longer than ``limit`` lines."""
    counts = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in readmes.items()}
    return {name: n for name, n in counts.items() if n > limit}


def broken_links(readme: Path) -> list[str]:
    """Relative link targets (outside code blocks) that name no existing file or folder, relative to the README."""
    text = _FENCE.sub("", readme.read_text(encoding="utf-8"))
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same file
        if not (readme.parent / target.split("#")[0]).exists():
            bad.append(target)
    return bad


def test_every_expected_package_readme_is_found():
    assert EXPECTED <= set(package_readmes(ROOT)), "a package README was not discovered"


def test_package_readmes_are_at_most_250_lines():
    over = too_long(package_readmes(ROOT))
    assert not over, (
        f"package READMEs over {MAX_LINES} lines: {over}; move experiment history, long per-run tables and "
        f"secondary results to docs/experiments/<package>.md"
    )


@pytest.mark.parametrize("name", sorted(package_readmes(ROOT)))
def test_relative_links_in_package_readmes_resolve(name):
    readme = package_readmes(ROOT)[name]
    assert not broken_links(readme), f"{readme.relative_to(ROOT)}: links to missing files {broken_links(readme)}"


def test_checks_catch_a_long_readme_and_a_broken_link(tmp_path):
    """The helpers above flag what they should, on a made-up tree (so the checks themselves can fail)."""
    for folder in ("alpha", "beta", "apps", "apps/gamma", "tests"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "notpkg").mkdir()
    (tmp_path / "notpkg" / "README.md").write_text("# not a package\n")
    (tmp_path / "tests" / "README.md").write_text("# tests\n")
    (tmp_path / "alpha" / "README.md").write_text("line\n" * MAX_LINES)
    (tmp_path / "beta" / "README.md").write_text("line\n" * (MAX_LINES + 1))
    (tmp_path / "apps" / "gamma" / "README.md").write_text(
        "[ok](../../alpha/README.md) ![img](missing.png) [web](https://example.org) [here](#top)\n"
        "```\n[in code](nowhere.md)\n```\n[gone](../../alpha/gone.md#part)\n")
    readmes = package_readmes(tmp_path)
    assert set(readmes) == {"alpha", "beta", "apps/gamma"}
    assert too_long(readmes) == {"beta": MAX_LINES + 1}
    assert broken_links(readmes["apps/gamma"]) == ["missing.png", "../../alpha/gone.md#part"]
    assert broken_links(readmes["alpha"]) == []
