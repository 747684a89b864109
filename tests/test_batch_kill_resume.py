"""Exact resume of the batch CLIs: ``pathology.batch`` and ``video.batch`` run in a subprocess that is killed with
SIGKILL (``kill -9``) at chosen points of its work, then rerun to the end; every output array must equal a clean
run's. The subprocess stops at a point (the N-th file renamed into place, just before or just after the rename),
says so on stdout and waits; the test kills it there from outside.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# The child: run a CLI with os.replace wrapped so that the N-th rename pauses (before or after it) for the kill.
CHILD = r"""
import importlib, os, sys, time
n, when = int(sys.argv[1]), sys.argv[2]
real, count = os.replace, [0]

def stop_here():
    print("at-point", flush=True)
    time.sleep(120)  # the parent kills this process with SIGKILL here

def replace(a, b):
    count[0] += 1
    if count[0] == n and when == "before":
        stop_here()
    real(a, b)
    if count[0] == n and when == "after":
        stop_here()

os.replace = replace
from core.infra.cli import run_cli
raise SystemExit(run_cli(importlib.import_module(sys.argv[3]).main, sys.argv[4:]))
"""


def _killed_run(module: str, argv: list[str], n: int, when: str, cwd: Path) -> None:
    """Run ``module`` in a subprocess, wait until its ``n``-th rename (``when`` = before/after it), kill -9 it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(n), when, module, *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the child reaches the point (or ends without reaching it)
        assert line.strip() == "at-point", f"{module} ended before rename {n} ({when}); exit {proc.wait()}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _manifest_status(path: Path) -> dict[str, str]:
    with open(path, newline="") as f:
        return {r[next(iter(r))]: r["status"] for r in csv.DictReader(f)}


# -- pathology.batch ---------------------------------------------------------------------------------------------


def _h5_arrays(path: Path) -> dict[str, np.ndarray]:
    import h5py

    with h5py.File(path, "r") as f:
        return {k: f[k][:] for k in f.keys()}


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im)


def _pathology_outputs(out: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if p.suffix == ".h5":
            arrays.update({f"{rel}:{k}": v for k, v in _h5_arrays(p).items()})
        elif p.suffix == ".png":
            arrays[rel] = _png(p)
    return arrays


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    from pathology.synthetic import generate_dataset

    d = tmp_path_factory.mktemp("slides")
    generate_dataset(d, n=2, seed=0, size=1024)  # two tiny slides: 32 and 36 patches of 64 px at 1 µm/px
    (d / "labels.csv").unlink()
    return d


PATHOLOGY_ARGS = ["--mpp", "1.0", "--patch-size", "64", "--no-progress"]


@pytest.fixture(scope="module")
def pathology_clean(slides, tmp_path_factory):
    from pathology.batch import main

    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(["--slides", str(slides), "--out", str(out), *PATHOLOGY_ARGS]) == 0
    return _pathology_outputs(out)


# renames of a clean run of two slides: 1 mask, 2 overview, 3 patches, 4 features, 5 manifest, 6-9 the second
# slide's, 10-11 manifest
@pytest.mark.parametrize("n,when", [(3, "after"), (4, "before"), (7, "after")])
def test_pathology_batch_killed_and_resumed_matches_a_clean_run(n, when, slides, pathology_clean, tmp_path):
    from pathology.batch import main

    out = tmp_path / "out"
    argv = ["--slides", str(slides), "--out", str(out), *PATHOLOGY_ARGS]
    _killed_run("pathology.batch", argv, n, when, tmp_path)
    assert main(argv) == 0  # the rerun finishes the job
    got = _pathology_outputs(out)
    assert sorted(got) == sorted(pathology_clean)
    for key, want in pathology_clean.items():
        np.testing.assert_array_equal(got[key], want, err_msg=f"{key} after a kill at rename {n} ({when})")
    assert set(_manifest_status(out / "manifest.csv").values()) <= {"done", "exists"}


# -- video.batch -------------------------------------------------------------------------------------------------


def _safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if k != "timings"}  # wall times differ
        return {k: f.get_tensor(k) for k in f.keys()}, meta


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    from video.synthetic import write_dataset

    d = tmp_path_factory.mktemp("videos")
    write_dataset(d, n=2, frames=[64], seed=0, size=32)
    return d


@pytest.fixture(scope="module")
def video_clean(videos, tmp_path_factory):
    from video.batch import main

    out = tmp_path_factory.mktemp("vclean") / "out"
    assert main(["--videos", str(videos), "--out", str(out)]) == 0
    return {p.name: _safetensors(p) for p in sorted(out.glob("*.safetensors"))}


# renames of a clean run of two videos: 1 first memory file, 2 manifest, 3 second memory file, 4-5 manifest
@pytest.mark.parametrize("n,when", [(1, "before"), (1, "after"), (3, "after")])
def test_video_batch_killed_and_resumed_matches_a_clean_run(n, when, videos, video_clean, tmp_path):
    from video.batch import main

    out = tmp_path / "out"
    argv = ["--videos", str(videos), "--out", str(out)]
    _killed_run("video.batch", argv, n, when, tmp_path)
    assert main(argv) == 0
    got = {p.name: _safetensors(p) for p in sorted(out.glob("*.safetensors"))}
    assert sorted(got) == sorted(video_clean)
    for name, (tensors, meta) in video_clean.items():
        assert got[name][1] == meta, name
        assert sorted(got[name][0]) == sorted(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(got[name][0][k], v, err_msg=f"{name}:{k} after a kill at rename {n} ({when})")
    assert not list(out.glob(".*tmp*")), "a temp file of the killed run was left behind"
    assert set(_manifest_status(out / "manifest.csv").values()) <= {"done", "exists"}
