"""What a command writes follows the user's umask; loaders refuse non-finite weights naming the file; every count
is bounded when parsed; a run out of memory or stopped inside a progress bar ends in one ``error:`` line; the
degenerate inputs of the batch and comparison commands get a message and, for a batch, a manifest row."""

from __future__ import annotations

import argparse
import csv
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from core.infra import cli
from core.infra.cli import DEBUG_ENV, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- file modes --------------------------------------------------------------------------------------------------


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o640  # the mode a new file gets under umask 027
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_follow_the_umask(tmp_path, umask_027):
    from safetensors.torch import save_file

    from core.infra.fileio import atomic_path, file_mode, torch_save_atomic, write_text_atomic
    from core.infra.jobs import atomic_write
    from core.infra.ship import Staging
    from core.kv_cache import KVCache, LayerKV

    assert file_mode() == umask_027
    made = [write_text_atomic(tmp_path / "a.json", "{}"), torch_save_atomic({"x": torch.ones(2)}, tmp_path / "b.pt")]
    with atomic_path(tmp_path / "c.safetensors") as tmp:  # the safetensors writer itself creates 0600
        save_file({"x": torch.ones(2)}, tmp)
    made.append(tmp_path / "c.safetensors")
    with atomic_write(tmp_path / "d.png") as tmp:
        Path(tmp).write_bytes(b"x")
    made.append(tmp_path / "d.png")
    layer = LayerKV(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.arange(3)[None])
    made.append(KVCache([layer], torch.tensor([3])).save(tmp_path / "e.safetensors"))  # an EMLoC memory's writer
    dest = tmp_path / "ship"
    dest.mkdir()
    with Staging(dest) as stage:
        stage.copy(made[0], dest / "f.json")
    made.append(dest / "f.json")
    assert {str(p): oct(_mode(p)) for p in made} == {str(p): oct(umask_027) for p in made}


def test_rl_and_pathology_model_files_follow_the_umask(tmp_path, umask_027):
    from pathology.querent import QuerentConfig
    from pathology.training import TrainConfig, cross_validate
    from tests.test_pathology_train import planted_cohort

    bags = planted_cohort(8, lo=20, hi=30, d=8)
    cross_validate("mean", QuerentConfig(in_dim=8, dim=8, num_classes=2), bags,
                   TrainConfig(epochs=1, val_fraction=0.0, min_epochs=0), folds=2, save_dir=str(tmp_path))
    folds = sorted(tmp_path.glob("mean_fold*.safetensors"))
    assert folds and all(_mode(p) == umask_027 for p in folds), [oct(_mode(p)) for p in folds]

    from rl.train import _atomic

    _atomic(tmp_path / "model.safetensors", lambda p: __import__("safetensors.torch").torch.save_file(
        {"w": torch.ones(1)}, str(p)))
    assert _mode(tmp_path / "model.safetensors") == umask_027


# -- the reference attention with no keys -------------------------------------------------------------------------


def test_reference_attention_with_zero_keys_gives_zeros_like_the_others():
    from core.attention import attention

    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 0, 4), torch.randn(2, 3, 0, 6)
    outs = {b: attention(q, k, v, backend=b) for b in ("reference", "chunked", "sdpa")}
    for b, out in outs.items():
        assert out.shape == (2, 3, 5, 6) and not out.any(), b
    assert not attention(q, k[:, :1], v[:, :1], backend="reference", causal=True).isnan().any()


# -- loaders refuse non-finite weights ---------------------------------------------------------------------------


def test_every_loader_refuses_non_finite_weights_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    from core.infra.fileio import (load_safetensors, load_safetensors_model, load_state_dict_checked,
                                   open_safetensors, torch_load)

    model = torch.nn.Linear(3, 2)
    bad = {"weight": model.weight.detach().clone(), "bias": torch.tensor([0.0, float("inf")])}
    path = tmp_path / "m.safetensors"
    save_file(bad, str(path))
    torch.save({"model": bad, "step": 3}, tmp_path / "s.pt")
    checks = [
        lambda: load_safetensors(path, what="x"),
        lambda: load_safetensors_model(model, path, what="x"),
        lambda: load_state_dict_checked(model, bad, path, what="x"),
        lambda: torch_load(tmp_path / "s.pt", what="x"),
    ]
    for check in checks:
        with pytest.raises(ValueError, match=r"holds values that are not finite .*bias"):
            check()
    with open_safetensors(path, what="x") as f:
        assert f.get_tensor("weight").shape == (2, 3)  # finite tensors read as before
        with pytest.raises(ValueError, match=str(path.name)):
            f.get_tensor("bias")
    save_file({"weight": model.weight.detach(), "bias": torch.zeros(2)}, str(tmp_path / "ok.safetensors"))
    load_safetensors_model(model, tmp_path / "ok.safetensors", what="x")  # finite weights load


# -- bounds ------------------------------------------------------------------------------------------------------


def test_every_count_is_bounded_when_parsed():
    for parse in (cli.positive_int, cli.nonnegative_int):
        assert parse(str(cli.MAX_COUNT)) == cli.MAX_COUNT
        with pytest.raises(argparse.ArgumentTypeError, match="<= 1000000000"):
            parse(str(cli.MAX_COUNT + 1))
    ctx = cli.capped_int(1000, why="the longest episode")
    assert ctx("1000") == 1000 and ctx.cap == 1000 and ctx.kind == "positive_int"
    with pytest.raises(argparse.ArgumentTypeError, match="the longest episode"):
        ctx("1001")
    side = cli.memory_capped_int(3.0, power=2, what="an RGB image")
    assert side.cap == int((cli.total_memory_bytes() / 2 / 3.0) ** 0.5)
    with pytest.raises(argparse.ArgumentTypeError, match="an RGB image"):
        side(str(side.cap + 1))
    cores = os.cpu_count() or 1
    assert cli.worker_count(str(4 * cores)) == 4 * cores and cli.worker_count("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="per CPU core"):
        cli.worker_count(str(4 * cores + 1))
    with pytest.raises(argparse.ArgumentTypeError):
        cli.thread_count("0")
    with pytest.raises(cli.UsageError, match="--batch-size: the batch would take"):
        cli.check_memory(cli.total_memory_bytes(), what="the batch", options="--batch-size")
    cli.check_memory(1e6, what="the batch", options="--batch-size")


def test_out_of_memory_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def main(argv):
        raise MemoryError("Unable to allocate 702. PiB")

    assert run_cli(main, []) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory") and "Traceback" not in err and len(err.strip().splitlines()) == 1

    def bug(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):  # other runtime errors keep their traceback
        run_cli(bug, [])


def test_the_error_line_is_never_drawn_onto_a_progress_bar(capsys, monkeypatch):
    from tqdm import tqdm

    monkeypatch.delenv(DEBUG_ENV, raising=False)

    bars = []

    def main(argv):  # a bar updated by hand (as rl.generate's and apps.emloc.compress's) stays open on an error
        bars.append(tqdm(total=10, desc="rows"))
        bars[0].update(3)
        raise ValueError("row 3 is bad")

    assert run_cli(main, []) == 2
    err = capsys.readouterr().err
    assert "error: row 3 is bad" in err.splitlines(), err


# -- batch inputs that fail per item: a real message, a manifest row ----------------------------------------------


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_one_pixel_image_is_named_too_small(tmp_path, caplog):
    from PIL import Image

    from pathology.batch import main

    (tmp_path / "slides").mkdir()
    Image.new("RGB", (1, 1), (200, 100, 150)).save(tmp_path / "slides" / "one.png")
    out = tmp_path / "out"
    assert main(["--slides", str(tmp_path / "slides"), "--out", str(out), "--slide-mpp", "0.5", "--skip-errors",
                 "--no-progress", "--task", "seg"]) == 1
    row = _rows(out / "manifest.csv")[0]
    assert row["status"] == "failed" and "1x1 pixels: too small to hold tissue" in row["error"], row


def test_a_dangling_link_gets_a_manifest_row_and_its_error_a_line_of_its_own(tmp_path):
    import subprocess
    import sys

    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "gone.mp4").symlink_to(tmp_path / "nowhere.mp4")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "video.batch", "--videos", str(tmp_path / "videos"), "--out", str(out),
                        "--skip-errors"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    row = _rows(out / "manifest.csv")[0]
    assert row["video"] == "gone.mp4" and row["status"] == "failed" and "not found" in row["error"], row
    # the progress bar is cleared before the line that names the failure (not drawn onto it)
    assert "ERROR core.infra.jobs.runner: failed on" in p.stderr and "item/s]ERROR" not in p.stderr, p.stderr


# -- tabular.compare: labels keep their text, unlabelled rows are counted --------------------------------------------


def test_compare_keeps_label_text_and_counts_unlabelled_rows(tmp_path):
    from tabular.compare import compare_on_table, read_table

    rng = np.random.default_rng(0)
    rows = ["a,b,target"] + [f"{x:.3f},{y:.3f},{k}" for k, (x, y) in
                             ((i % 3, rng.normal(i % 3, 0.3, 2)) for i in range(45))]
    rows[7] = rows[7].rsplit(",", 1)[0] + ","  # one row without a label
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    df = read_table(tmp_path / "t.csv", "target")
    out = compare_on_table(df, "target", n_estimators=1, baselines=False)
    assert out["classes"] == ["0", "1", "2"]  # not "2.0": the missing label does not turn the column into floats
    assert out["n_unlabelled_dropped"] == 1 and out["n_train"] + out["n_test"] == 44


# -- a run whose metrics are not finite fails ---------------------------------------------------------------------


def test_pathology_train_with_non_finite_metrics_exits_1(tmp_path, monkeypatch, capsys):
    import pathology.train as train_cli
    from tests.test_cli_bad_inputs import LABELS, _cohort

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    argv = _cohort(tmp_path, LABELS)
    real = train_cli.cross_validate

    def nan_metrics(*a, **k):
        res = real(*a, **k)
        res["summary"]["auc"] = {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan")}
        return res

    monkeypatch.setattr(train_cli, "cross_validate", nan_metrics)
    assert run_cli(train_cli.main, argv) == 1
    assert "error: the cross-validated auc came out non-finite" in capsys.readouterr().err
