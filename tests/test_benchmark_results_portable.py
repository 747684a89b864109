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
    listed = argparse.Namespace(checkpoints=["/elsewhere/a.safetensors", "training/b.safetensors"], noise=[0.4],
                                features=[5, 10])
    assert portable_args(listed) == {"checkpoints": ["a.safetensors", "training/b.safetensors"], "noise": [0.4],
                                     "features": [5, 10]}


def _absolute_paths(obj, where=""):
    """(location, value) of every string in a JSON value that is an absolute path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _absolute_paths(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _absolute_paths(v, f"{where}[{i}]")
    elif isinstance(obj, str) and obj.startswith("/"):
        yield where, obj


def test_committed_results_name_no_absolute_paths():
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results
    for path in results:
        found = list(_absolute_paths(json.loads(path.read_text())))
        assert not found, f"{path.name} names absolute paths: {found[:3]}"
