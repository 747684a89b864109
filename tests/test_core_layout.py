"""core/ keeps a shape that shows its two halves: the attention math directly in core/, the plumbing in core/infra/
(which imports none of the math), the transformers bridge in core/hf/; no file grows past ~550 lines; the old
entry points still import."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
MAX_LINES = 550


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_infra_imports_none_of_the_attention_math():
    math_modules = {f"core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__"}
    assert {"core.attention", "core.decoder", "core.kv_compress"} <= math_modules
    for path in sorted((CORE / "infra").rglob("*.py")):
        bad = sorted(m for m in _imported_modules(path) if m in math_modules or m.split(".")[:2] == ["core", "hf"])
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: core.infra must not depend on the math"


def test_no_core_file_is_past_the_size_limit():
    long = {str(p.relative_to(ROOT)): n for p in sorted(CORE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these along a natural seam (limit {MAX_LINES} lines): {long}"


def test_entry_points_and_reexports_import():
    from core import attention

    assert callable(attention.attention) and callable(attention.auto_rule)
    for module, names in {
        "core.kv_compress": ["observe", "compress", "emloc_compress", "chunk_demonstrations", "POLICIES"],
        "core.continuous": ["ridge_fit", "make_basis", "ContinuousMemory"],
        "core.blocksparse": ["select_blocks", "block_sparse_attention", "block_summaries"],
        "core.infra.jobs": ["run_job", "FileLock", "add_job_arguments", "settings_fingerprint"],
        "core.infra.model_card": ["render_card", "write_cards", "discover_weights", "main"],
    }.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module} lacks {missing}"
