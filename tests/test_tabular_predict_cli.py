"""``python -m tabular.predict`` on a user's CSV files: classification with the shipped checkpoint and with an official
release from a Hugging Face cache, regression with quantiles, and the one-line refusals (exit 2, nothing written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core.infra.cli import run_cli
from tabular.predict import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def csvs(tmp_path):
    rng = np.random.default_rng(0)
    n = 110
    df = pd.DataFrame({"a": rng.normal(size=n), "kind": rng.choice(["x", "y", "z"], n), "c": rng.normal(size=n)})
    df.loc[::9, "c"] = np.nan
    df["label"] = np.where(df.a + (df.kind == "x") > 0.5, "pos", "neg")
    df["price"] = 100 + 10 * df.a + rng.normal(size=n)
    paths = {}
    for name, part, drop in (("train", df.iloc[:80], ["price"]), ("test", df.iloc[80:], ["label", "price"]),
                             ("train_reg", df.iloc[:80], ["label"])):
        paths[name] = tmp_path / f"{name}.csv"
        part.drop(columns=drop).to_csv(paths[name], index=False)
    test_reordered = df.iloc[80:][["c", "price", "a", "kind"]]  # other order, an extra column
    paths["test_reg"] = tmp_path / "test_reg.csv"
    test_reordered.to_csv(paths["test_reg"], index=False)
    return paths


def _run(*argv):
    return run_cli(main, [str(a) for a in argv])


def test_classification_with_the_shipped_checkpoint(csvs, tmp_path, capsys):
    out = tmp_path / "out" / "preds.csv"
    assert _run("--train", csvs["train"], "--test", csvs["test"], "--target", "label", "--out", out,
                "--n-estimators", "2", "--threads", "1") == 0
    pred = pd.read_csv(out)
    assert list(pred.columns) == ["row", "prediction", "proba_neg", "proba_pos"] and len(pred) == 30
    assert np.allclose(pred[["proba_neg", "proba_pos"]].sum(axis=1), 1) and set(pred.prediction) <= {"neg", "pos"}
    test = pd.read_csv(csvs["test"])
    truth = np.where(test.a + (test.kind == "x") > 0.5, "pos", "neg")  # an easy rule: most rows right
    assert (pred.prediction == truth).mean() > 0.8 and "wrote" in capsys.readouterr().out


def test_official_release_and_regression_with_quantiles(csvs, tmp_path, monkeypatch):
    pytest.importorskip("tabicl")
    from tests.test_tabular_checkpoints import fake_cache
    from tests.test_tabular_official import official_ckpt
    from tests.test_tabular_regressor import regression_ckpt

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    fake_cache(tmp_path / "hub", {"tabicl-classifier-v2-20260212.ckpt": official_ckpt(tmp_path / "v2", "v2")[1]})
    out = tmp_path / "official.csv"
    assert _run("--checkpoint", "v2", "--official", "--train", csvs["train"], "--test", csvs["test"], "--target",
                "label", "--out", out, "--n-estimators", "2", "--device", "cpu") == 0
    assert len(pd.read_csv(out)) == 30
    reg = regression_ckpt(tmp_path / "reg")
    out = tmp_path / "reg.csv"
    assert _run("--checkpoint", reg, "--train", csvs["train_reg"], "--test", csvs["test_reg"], "--target", "price",
                "--out", out, "--n-estimators", "2", "--quantiles", "0.1,0.9") == 0
    pred = pd.read_csv(out)
    assert list(pred.columns) == ["row", "prediction", "q0.1", "q0.9"] and len(pred) == 30
    assert (pred["q0.1"] <= pred["q0.9"] + 1e-6).all() and pred.prediction.between(50, 150).all()  # in price units


@pytest.mark.parametrize("change, words", [
    (dict(target="nope"), "--target 'nope' is not a column of --train"),
    (dict(drop_test="c"), "lacks the train feature column(s) c"),
    (dict(nan_target=True), "empty value(s)"),
    (dict(one_class=True), "single class"),
    (dict(quantiles="0.1,0.9"), "--quantiles: only a regression checkpoint"),
    (dict(quantiles="0.5,1.5"), "levels in (0, 1)"),
    (dict(out="train"), "also an input"),
    (dict(out="weights"), "inside the shipped weights"),
    (dict(train="missing.csv"), "no such file"),
    (dict(train="empty.csv"), "not a readable CSV"),
    (dict(checkpoint="v1.1"), "hf download jingang/TabICL tabicl-classifier-v1.1-20250506.ckpt"),
])
def test_bad_inputs_are_one_line_exit_2_and_write_nothing(csvs, tmp_path, capsys, monkeypatch, change, words):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    train, test = csvs["train"], csvs["test"]
    if "drop_test" in change:
        test = tmp_path / "test_short.csv"
        pd.read_csv(csvs["test"]).drop(columns=[change["drop_test"]]).to_csv(test, index=False)
    if change.get("nan_target") or change.get("one_class"):
        df = pd.read_csv(train)
        if change.get("nan_target"):
            df.loc[3, "label"] = None
        else:
            df["label"] = "pos"
        train = tmp_path / "train_bad.csv"
        df.to_csv(train, index=False)
    if "train" in change:
        train = tmp_path / change["train"]
        if change["train"] == "empty.csv":
            train.write_text("")
    out = {"train": train, "weights": ROOT / "tabular" / "weights" / "preds.csv"}.get(change.get("out"), tmp_path / "p.csv")
    argv = ["--train", train, "--test", test, "--target", change.get("target", "label"), "--out", out]
    argv += ["--quantiles", change["quantiles"]] if "quantiles" in change else []
    argv += ["--checkpoint", change["checkpoint"]] if "checkpoint" in change else []
    if "0.5,1.5" in argv:
        with pytest.raises(SystemExit) as exit_:
            _run(*argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
        return
    assert _run(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
    assert not (tmp_path / "p.csv").exists() and not (ROOT / "tabular" / "weights" / "preds.csv").exists()


def test_a_missing_gpu_is_one_line_from_the_command_line(csvs, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "-m", "tabular.predict", "--train", str(csvs["train"]), "--test",
                        str(csvs["test"]), "--target", "label", "--out", str(tmp_path / "p.csv"), "--device", "cuda"],
                       capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2 and p.stderr.strip().startswith("error: --device cuda") and "Traceback" not in p.stderr
