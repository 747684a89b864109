"""benchmarks.pathology_ensemble: fold models read back as pathology.train writes them, ensemble metrics, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import pathology_ensemble as ens
from core.infra.cli import run_cli


def test_ensemble_metrics_average_the_fold_probabilities():
    y = np.array([0, 0, 1, 1])
    prob = np.array([[0.1, 0.6, 0.4, 0.9],   # fold 0 ranks one negative over one positive: AUC 0.75
                     [0.3, 0.2, 0.8, 0.25]])  # fold 1 likewise, another pair
    res = ens.ensemble_metrics(prob, [0.5, 0.22], y)
    assert [s["auc"] for s in res["single"]] == [0.75, 0.75]
    assert [s["bacc"] for s in res["single"]] == [0.5, 0.75]  # each at its own threshold
    e = res["ensemble"]  # mean probabilities 0.2, 0.4, 0.6, 0.575: ranked perfectly
    assert e["auc"] == 1.0 and e["threshold"] == pytest.approx(0.36)
    assert e["bacc"] == 0.75 and e["bacc_05"] == 1.0  # 0.4 > 0.36: one negative called positive at the mean threshold


def test_fold_models_read_back_give_the_out_of_fold_predictions():
    from benchmarks.pathology_cohort import CohortConfig, make_cohort
    from pathology.querent import QuerentConfig
    from pathology.training import TrainConfig, predict_outputs

    torch.set_num_threads(1)
    bags = make_cohort(16, 100, CohortConfig(bag_size=64, site_patches=4, strength=4.0, decoys=0, negatives="single"))
    mcfg = QuerentConfig(in_dim=16, dim=8, depth=1, num_heads=2, pool_hidden=8, num_classes=2)
    tc = TrainConfig(epochs=2, min_epochs=0, smooth=1, seed=0)
    res, models = ens.fold_models("abmil", mcfg, bags, tc, folds=2)
    assert len(models) == 2
    by_id = {b.slide_id: b for b in bags}
    for k, m in enumerate(models):
        rows = [r for r in res["oof"] if r["fold"] == k]
        got = torch.softmax(predict_outputs(m, [by_id[r["slide_id"]] for r in rows]), -1)[:, 1].numpy()
        np.testing.assert_allclose(got, [r["prob_1"] for r in rows], atol=1e-5)
    # the two folds' models differ (each its own training slides), so an average is not one model twice
    assert not torch.equal(models[0].head.weight, models[1].head.weight)


def _argv(tmp_path, *extra):
    return ["--models", "mean", "--seeds", "100", "--bags", "12", "--test-bags", "10", "--folds", "2",
            "--epochs-cap", "2", "--bag-size", "64", "--records", str(tmp_path / "r.jsonl"),
            "--out", str(tmp_path / "o.json"), *extra]


def test_cli_records_resume_and_summary(tmp_path, capsys):
    assert run_cli(ens.main, _argv(tmp_path)) == 0
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["cohort_seed"] == 100 and rec["test_seed"] == 1100 and len(rec["single"]) == 2
    assert np.array(rec["test_probs"]).shape == (2, 10) and rec["test_labels"] == [1, 0] * 5
    out = json.loads((tmp_path / "o.json").read_text())
    row = out["models"]["mean"]["per_seed"][0]
    assert row["gain_auc"] == pytest.approx(rec["ensemble"]["auc"] - np.mean([s["auc"] for s in rec["single"]]))
    assert "gain AUC" in capsys.readouterr().out
    assert run_cli(ens.main, _argv(tmp_path)) == 0  # a rerun skips the recorded unit
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 1
    assert run_cli(ens.main, _argv(tmp_path, "--test-bags", "12")) == 0  # other settings: a new unit
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("extra", [["--seeds", "3"], ["--seeds", "100", "101", "--test-offset", "1"],
                                   ["--folds", "1"], ["--test-bags", "2"], ["--seeds", "0"], ["--bags", "abc"],
                                   ["--models", "nope"], ["--out", ""]])
def test_cli_refuses_bad_input(tmp_path, capsys, extra):
    try:
        code = run_cli(ens.main, _argv(tmp_path, *extra))
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "error:" in err.strip().splitlines()[-1], err
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------ the fold ensemble as a slide model (pathology)


def _train_folder(folder, name="abmil", k=3, **extra):
    """Fold models and config as pathology.train writes them (fresh random tiny models)."""
    import dataclasses

    from safetensors.torch import save_file

    from pathology.mil import build_model
    from pathology.querent import QuerentConfig

    cfg = QuerentConfig(in_dim=16, dim=8, depth=1, num_heads=2, pool_hidden=8, num_classes=2, region_size=2, topk=1)
    models = []
    for i in range(k):
        torch.manual_seed(i)
        models.append(build_model(name, cfg).eval())
        state = {a: b.contiguous() for a, b in models[-1].state_dict().items()}
        save_file(state, str(folder / f"{name}_fold{i}.safetensors"))
    config = {**dataclasses.asdict(cfg), "classes": ["neg", "pos"], **extra}
    (folder / f"{name}_config.json").write_text(json.dumps(config))
    return models


@pytest.mark.parametrize("name", ["abmil", "querent"])
def test_a_train_folder_loads_as_the_average_of_its_fold_models(tmp_path, name):
    from pathology.inference import FoldEnsemble, load_slide_model

    models = _train_folder(tmp_path, name)
    model, meta = load_slide_model(str(tmp_path))
    assert isinstance(model, FoldEnsemble) and len(model.members) == 3 and not model.training
    assert meta["class_names"] == ["neg", "pos"] and meta["model"] == name and meta["model_config"]["in_dim"] == 16
    assert (meta["patch_mpp"], meta["patch_size"], meta["encoder"]) == (0.5, 256, "default")  # pathology.batch's
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(64, 16, generator=g)
    coords = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).reshape(-1, 2)
    with torch.no_grad():
        out = model(feats, coords, patch_size_level0=1, return_index=True)
        outs = [m(feats, coords, patch_size_level0=1, return_index=True) for m in models]
    probs = torch.stack([torch.softmax(o.logits, -1) for o in outs])
    torch.testing.assert_close(torch.softmax(out.logits, -1), probs.mean(0))
    torch.testing.assert_close(out.attention, torch.stack([o.attention for o in outs]).mean(0))
    assert not torch.allclose(probs[0], probs[1])  # the members differ: the average is not one of them
    assert (out.block_index is None) == (name != "querent")
    same, _ = load_slide_model(str(tmp_path / f"{name}_config.json"))  # the config file names the same models
    with torch.no_grad():
        torch.testing.assert_close(same(feats, coords, patch_size_level0=1).logits, out.logits)


def test_a_train_folder_without_fold_models_or_with_several_models_is_refused(tmp_path):
    from pathology.inference import load_slide_model

    with pytest.raises(FileNotFoundError, match="no fold models"):
        load_slide_model(str(tmp_path))
    _train_folder(tmp_path, "abmil")
    _train_folder(tmp_path, "mean", k=2)
    with pytest.raises(ValueError, match="several models"):
        load_slide_model(str(tmp_path))
    model, meta = load_slide_model(str(tmp_path / "mean_config.json"))
    assert meta["model"] == "mean" and len(model.members) == 2
    (tmp_path / "abmil_fold1.safetensors").write_text("not weights")
    with pytest.raises(ValueError, match="abmil_fold1.safetensors"):
        load_slide_model(str(tmp_path / "abmil_config.json"))


def test_predict_with_a_train_folder(tmp_path):
    """pathology.predict --model <pathology.train output>: an ABMIL fold ensemble (no regions) on a synthetic slide."""
    pytest.importorskip("openslide")
    pytest.importorskip("tifffile")
    from safetensors.torch import save_file

    from pathology.encoders import SmallPatchCNN
    from pathology.predict import main
    from pathology.synthetic import generate_dataset

    w = tmp_path / "enc.safetensors"
    torch.manual_seed(0)
    enc = SmallPatchCNN(dim=16, widths=(8, 8, 8, 16, 16))
    save_file({k: v.contiguous() for k, v in enc.state_dict().items()}, str(w),
              metadata={"dim": "16", "input_size": "32", "widths": "8,8,8,16,16"})
    specs = generate_dataset(tmp_path / "slides", n=1, seed=3, size=1024, mpp=0.5)
    (tmp_path / "run").mkdir()
    _train_folder(tmp_path / "run", "abmil", patch_mpp=1.0, patch_size=64)
    slide = str(tmp_path / "slides" / f"{specs[0].name}.tiff")
    assert run_cli(main, [slide, "--out", str(tmp_path / "pred"), "--model", str(tmp_path / "run"),
                          "--encoder-weights", str(w)]) == 0
    res = json.loads((tmp_path / "pred" / f"{specs[0].name}.json").read_text())
    assert res["n_patches"] > 0 and set(res["probabilities"]) == {"neg", "pos"}
    assert abs(sum(res["probabilities"].values()) - 1) < 1e-5
    assert (tmp_path / "pred" / f"{specs[0].name}_heatmap.png").exists()
