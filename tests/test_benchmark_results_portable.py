"""Committed benchmark results record their arguments without this machine's directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import portable_args

ROOT = Path(__file__).resolve().parents[1]


def test_portable_args_strips_machine_directories():
    args = argparse.Namespace(out=ROOT / "benchmarks" / "results" / "x.json", checkpoint=Path("/elsewhere/w.safetensors"),
                              merge="/scratch/a.json,/scratch/b.json", data_dir="data/rl", n=3, name="iris")
    assert portable_args(args) == {"out": "benchmarks/results/x.json", "checkpoint": "w.safetensors",
                                   "merge": "a.json,b.json", "data_dir": "data/rl", "n": 3, "name": "iris"}


def test_committed_results_name_no_absolute_paths():
    home = str(ROOT)
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        text = path.read_text()
        assert home not in text, f"{path.name} names the checkout directory {home}"
        json.loads(text)
