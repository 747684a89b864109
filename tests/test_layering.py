"""The package layers hold: every import in every package points down or stays inside the package.

    kernels  <-  core  <-  {video, pathology, tabular, rl}  <-  apps

``core`` may import ``kernels``; a domain package imports ``core``, ``kernels`` and itself, never another domain
package, ``apps``, ``benchmarks``, ``tests`` or ``training``; ``apps`` may import everything below it.
``benchmarks`` and ``tests`` may import anything. Every ``.py`` file is parsed with ``ast``: module-level and
function-local imports, relative imports (resolved against the file's package) and
``importlib.import_module("literal")`` calls all count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Rank of each layered package; a package may import packages of lower rank and itself.
LAYERS = {"kernels": 0, "core": 1, "video": 2, "pathology": 2, "tabular": 2, "rl": 2, "apps": 3}
# Top-level folders of the repository that no layered package may import.
NEVER_IMPORTED = ("benchmarks", "tests", "training")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the file (relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return found


def layer_violations(root: Path = ROOT) -> list[str]:
    """``"file:line: package imports target"`` for every import that points up or sideways."""
    bad = []
    for pkg, rank in LAYERS.items():
        for path in sorted((root / pkg).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            try:
                found = _imports(path, root)
            except SyntaxError as e:
                bad.append(f"{path.relative_to(root)}:{e.lineno}: cannot be parsed ({e.msg})")
                continue
            for line, name in found:
                top = name.split(".")[0]
                if top in NEVER_IMPORTED or (top in LAYERS and top != pkg and LAYERS[top] >= rank):
                    bad.append(f"{path.relative_to(root)}:{line}: {pkg} imports {name}")
    return bad


def test_every_layered_package_exists():
    missing = [p for p in LAYERS if not (ROOT / p / "__init__.py").exists()]
    assert not missing, f"packages named in LAYERS are missing: {missing}"


def test_imports_point_only_down():
    bad = layer_violations()
    assert not bad, "imports against the layers (kernels <- core <- domain packages <- apps):\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("import apps.hub\n", "rl/x.py:1: rl imports apps.hub"),
    ("def f():\n    from benchmarks.common import read_json\n", "rl/x.py:2: rl imports benchmarks.common"),
    ("from tabular import model\n", "rl/x.py:1: rl imports tabular"),
    ("from ..tabular.model import TabICL\n", "rl/x.py:1: rl imports tabular.model"),
    ("import importlib\nm = importlib.import_module('video.io')\n", "rl/x.py:2: rl imports video.io"),
])
def test_the_check_catches_upward_sideways_local_relative_and_dynamic_imports(tmp_path, source, expected):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "rl" / "x.py").write_text(source)
    (tmp_path / "rl" / "ok.py").write_text("import core.routing\nfrom kernels import flash_attention\nfrom . import x\n"
                                           "import numpy\n")
    (tmp_path / "core" / "ok.py").write_text("from kernels.block_sparse import f\n")
    assert layer_violations(tmp_path) == [expected]
