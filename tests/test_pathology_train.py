"""pathology.training / pathology.train: a schedule that trains small cohorts, patient-level folds, CLAM splits,
CLAM and TRIDENT feature files, string labels, out-of-fold predictions, curves."""

from __future__ import annotations

import csv
import json
import logging
import math

import numpy as np
import pytest
import torch

from pathology.mil import build_model
from pathology.querent import QuerentConfig
from pathology.training import (Bag, TrainConfig, _class_weight, cross_validate, evaluate, feature_stats,
                                fold_standardization, load_bags, patient_folds, read_splits, train_model,
                                validation_split)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LN2 = math.log(2)


def planted_cohort(n: int, *, lo: int = 150, hi: int = 400, d: int = 32, seed: int = 0, frac: float = 0.03,
                   scale: float = 0.05, patients: int | None = None) -> list[Bag]:
    """Bags of ``lo..hi`` patches of ``d``-dim features; odd slides carry one strong planted cluster (label 1).

    Background patches come from four "tissue" clusters; the planted cluster is as far from them as they
    are from each other, in ``frac`` of a positive slide's patches. Features are scaled by ``scale`` (raw
    encoder features are often small and off-centre), which is what the old default schedule could not handle.
    """
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2, (4, d)) + 3.0
    planted = rng.normal(0, 2, d) + 3.0
    bags = []
    for i in range(n):
        N, y = int(rng.integers(lo, hi + 1)), i % 2
        f = centers[rng.integers(0, 4, N)] + rng.normal(0, 1.5, (N, d))
        if y:
            idx = rng.choice(N, max(1, int(frac * N)), replace=False)
            f[idx] = planted + rng.normal(0, 1.5, (len(idx), d))
        side = math.ceil(math.sqrt(N))
        g = np.arange(N)
        coords = np.stack([g % side, g // side], 1) * 256 + 512
        pid = f"p{i // 2 if patients is None else i % patients}"
        bags.append(Bag(f"s{i}", torch.tensor(f * scale, dtype=torch.float32), torch.tensor(coords), 256.0,
                        label=y, patient_id=pid if patients else "", label_name=["normal", "tumor"][y]))
    return bags


def test_old_schedule_undertrains_and_the_new_defaults_train():
    bags = planted_cohort(18)
    train, test = bags[:10], bags[10:]
    cfg = QuerentConfig(in_dim=32, dim=64, num_classes=2)
    # the schedule before: lr 2e-4, one slide per step, 20 epochs, cosine, raw features -> stuck at ln 2
    _, old = train_model("abmil", cfg, train, TrainConfig(epochs=20, lr=2e-4, standardize=False, class_weights=False))
    assert abs(old["final_loss"] - LN2) < 0.02, old["final_loss"]
    # the same 20 epochs with the new defaults (standardised features, lr 1e-3, class weights)
    model, new = train_model("abmil", cfg, train, TrainConfig(epochs=20))
    assert new["final_loss"] < 0.2 * LN2, new["final_loss"]
    assert evaluate(model, test, "cls")["auc"] >= 0.95
    assert [r["epoch"] for r in new["history"]] == list(range(1, 21))
    assert new["history"][-1]["train_loss"] < new["history"][0]["train_loss"]


def test_default_schedule_with_early_stopping_trains_the_planted_cluster():
    bags = planted_cohort(20)
    cfg = QuerentConfig(in_dim=32, dim=64, num_classes=2)
    tr, va = validation_split(bags, list(range(14)), TrainConfig().val_fraction)
    assert va and not {bags[i].slide_id for i in tr} & {bags[i].slide_id for i in va}
    model, info = train_model("abmil", cfg, [bags[i] for i in tr], TrainConfig(), val_bags=[bags[i] for i in va])
    assert info["final_loss"] < 0.1 * LN2 and info["best_val_loss"] < 0.1 * LN2
    assert info["epochs_run"] < TrainConfig().epochs and info["stopped_early"]  # early stopping ended it
    # the default watches the validation AUC over `smooth` epochs, ties broken by the validation loss over the same
    # epochs; an epoch is a candidate once its window is full
    h, w = info["history"], TrainConfig().smooth
    keys = {e: (np.mean([r["val_auc"] for r in h[e - w + 1: e + 1]]), -np.mean([r["val_loss"] for r in h[e - w + 1: e + 1]]))
            for e in range(w - 1, len(h))}
    assert info["best_epoch"] == 1 + max(keys, key=lambda e: (keys[e], -e)) >= w
    assert evaluate(model, bags[14:], "cls")["auc"] >= 0.95


def test_early_stopping_keeps_the_best_epoch():
    bags = planted_cohort(10, lo=40, hi=60, seed=3)
    cfg = QuerentConfig(in_dim=32, dim=16, num_classes=2)
    # a learning rate so large that the validation loss gets worse: stop after `patience` epochs, keep the best
    tc = TrainConfig(epochs=60, lr=0.5, patience=3, min_epochs=1, min_delta=0.0, seed=1, monitor="loss", smooth=1)
    model, info = train_model("mean", cfg, bags[:6], tc, val_bags=bags[6:])
    losses = [r["val_loss"] for r in info["history"]]
    best = int(np.argmin(losses))
    assert info["best_epoch"] == best + 1 and info["epochs_run"] <= 60
    if info["stopped_early"]:
        assert info["epochs_run"] - info["best_epoch"] >= 3
    # the returned weights are the best epoch's: their validation loss is the best one
    with torch.no_grad():
        logits = torch.cat([model(b.features, b.coords, patch_size_level0=256.0).logits for b in bags[6:]])
    w = _class_weight(bags[:6], 2)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([b.label for b in bags[6:]]), weight=w)
    assert float(loss) == pytest.approx(losses[best], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("name", ["abmil", "transmil", "querent"])
def test_standardisation_folds_into_the_first_layer(name):
    bags = planted_cohort(2, lo=30, hi=50, d=8)
    mean, std = feature_stats(bags)
    cat = torch.cat([b.features for b in bags]).double()
    torch.testing.assert_close(mean.double(), cat.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std.double(), cat.std(0, unbiased=False), rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    m = build_model(name, QuerentConfig(in_dim=8, dim=16, num_heads=2, region_size=2, topk=2, dropout=0.0)).eval()
    b = bags[0]
    with torch.no_grad():
        ref = m((b.features - mean) / std, b.coords, patch_size_level0=256.0).logits
        fold_standardization(m, mean, std)
        out = m(b.features, b.coords, patch_size_level0=256.0).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_class_weights_balance_the_classes():
    bags = [Bag(f"s{i}", torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long), 1.0, label=int(i < 2))
            for i in range(8)]
    w = _class_weight(bags, 3)  # 6 of class 0, 2 of class 1, none of class 2
    torch.testing.assert_close(w, torch.tensor([8 / (2 * 6), 8 / (2 * 2), 1.0]))


def test_patient_level_folds_and_validation_split():
    bags = planted_cohort(30, lo=10, hi=12, patients=10)  # 3 slides per patient
    folds = patient_folds(bags, 3, seed=0)
    seen = []
    for tr, te in folds:
        assert not {bags[i].patient_id for i in tr} & {bags[i].patient_id for i in te}
        seen += te
        sub, va = validation_split(bags, tr, 0.25, seed=1)
        assert va and not {bags[i].patient_id for i in sub} & {bags[i].patient_id for i in va}
        assert sorted(sub + va) == sorted(tr) and {bags[i].label for i in va} == {0, 1}
    assert sorted(seen) == list(range(30))
    with pytest.raises(ValueError, match="smallest class"):
        patient_folds(bags[:4], 3)
    assert validation_split(bags, list(range(4)), 0.2) == (list(range(4)), [])  # too few patients: no split


def _write_h5(path, feats, coords, attrs=None):
    import h5py

    with h5py.File(path, "w") as f:
        dc = f.create_dataset("coords", data=coords)
        for k, v in (attrs or {}).items():
            dc.attrs[k] = v
        f.create_dataset("features", data=feats)


def test_clam_and_trident_feature_layouts(tmp_path, caplog):
    from pathology.features import infer_grid_step, read_feature_file

    bags = planted_cohort(6, lo=20, hi=30, d=8)
    clam, trident = tmp_path / "clam", tmp_path / "trident"
    (clam / "h5_files").mkdir(parents=True)
    trident.mkdir()
    rows = ["slide_id,label"]
    for b in bags:
        c = (b.coords.numpy() - 512) * 2  # a 512-px grid, some cells empty (not every gap is one step)
        c = c[np.r_[0, 2:len(c)]]
        f = b.features.numpy()[np.r_[0, 2:len(c) + 1]]
        _write_h5(clam / "h5_files" / f"{b.slide_id}.h5", f, c)  # CLAM: coords without attributes
        _write_h5(trident / f"{b.slide_id}.h5", f, c, {"patch_size": 256, "patch_size_level0": 512, "overlap": 0,
                                                          "level0_magnification": 40, "target_magnification": 20})
        rows.append(f"{b.slide_id},{b.label_name}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="pathology.training"):
        got = load_bags(str(clam), str(tmp_path / "labels.csv"))
    assert [b.patch_size_level0 for b in got] == [512.0] * 6
    assert "6 of 6 feature files have no 'patch_size_level0'" in caplog.text and "--patch-size-level0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pathology.training"):
        tri = load_bags(str(trident), str(tmp_path / "labels.csv"))
    assert [b.patch_size_level0 for b in tri] == [512.0] * 6 and "patch_size_level0" not in caplog.text
    assert all(torch.equal(a.features, b.features) and torch.equal(a.coords, b.coords) for a, b in zip(got, tri))
    # string labels mapped in sorted order
    assert [b.label for b in got] == [0, 1] * 3 and [b.label_name for b in got] == ["normal", "tumor"] * 3
    flagged = load_bags(str(clam), str(tmp_path / "labels.csv"), patch_size_level0=300)
    assert [b.patch_size_level0 for b in flagged] == [300.0] * 6
    # an overlapping TRIDENT grid: the attribute is the patch size, not the step, so the step is inferred
    _write_h5(tmp_path / "ov.h5", np.zeros((4, 8), np.float32), np.array([[0, 0], [384, 0], [0, 384], [768, 768]]),
              {"patch_size_level0": 512, "overlap": 64})
    assert read_feature_file(tmp_path / "ov.h5").patch_size_level0 == 384
    _write_h5(tmp_path / "one.h5", np.zeros((1, 8), np.float32), np.array([[0, 0]]))
    with pytest.raises(ValueError, match="--patch-size-level0"):
        read_feature_file(tmp_path / "one.h5")
    assert infer_grid_step(np.array([[0, 0], [768, 256], [1280, 512]])) == 256
    _write_h5(tmp_path / "bad.h5", np.zeros((3, 8), np.float32), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="3 feature rows but 2 coords"):
        read_feature_file(tmp_path / "bad.h5")


def test_clam_splits_files(tmp_path):
    bags = planted_cohort(12, lo=10, hi=14, d=8)
    ids = [b.slide_id for b in bags]

    def write(path, train, val, test):
        n = max(len(train), len(val), len(test))
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["", "train", "val", "test"])
            for i in range(n):
                w.writerow([i] + [c[i] if i < len(c) else "" for c in (train, val, test)])

    write(tmp_path / "splits_0.csv", ids[:8], ids[8:10], ids[10:])
    write(tmp_path / "splits_1.csv", ids[4:], [], ids[:4] + ["missing_slide"])
    (tmp_path / "splits_0_bool.csv").write_text("junk\n")
    sp = read_splits(str(tmp_path))
    assert len(sp) == 2 and sp[0]["val"] == ids[8:10] and sp[1]["val"] == [] and len(sp[1]["test"]) == 5
    cfg = QuerentConfig(in_dim=8, dim=16, num_classes=2, dropout=0.0)
    res = cross_validate("mean", cfg, bags, TrainConfig(epochs=3, min_epochs=1), splits=sp)
    # split 1 has no val column: one training patient per class is held out for early stopping
    assert [(f["n_train"], f["n_val"], f["n_test"]) for f in res["folds"]] == [(8, 2, 2), (6, 2, 4)]
    assert sorted(r["slide_id"] for r in res["oof"] if r["fold"] == 1) == ids[:4]
    leak = [b for b in bags]
    for b in leak[:2]:
        b.patient_id = "same"  # s0 (train of split 0) and s1 ... and s10 (test of split 0) share a patient
    bags[10].patient_id = "same"
    with pytest.raises(ValueError, match="patient.*'same'.*both train and test"):
        cross_validate("mean", cfg, bags, TrainConfig(epochs=1), splits=sp)
    with pytest.raises(ValueError, match="columns 'train' and 'test'"):
        (tmp_path / "x.csv").write_text("a,b\n1,2\n")
        read_splits(str(tmp_path / "x.csv"))


def test_train_cli_on_clam_files_with_string_labels(tmp_path):
    from pathology.train import main

    bags = planted_cohort(16, lo=30, hi=60, d=16, patients=8)  # 2 slides per patient
    (tmp_path / "feats" / "h5_files").mkdir(parents=True)
    rows = ["slide_id,patient_id,diagnosis"]
    for b in bags:
        _write_h5(tmp_path / "feats" / "h5_files" / f"{b.slide_id}.h5", b.features.numpy(), b.coords.numpy())
        rows.append(f"{b.slide_id},{b.patient_id},{b.label_name}")
    rows.append("s_nofeat,p99,tumor")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc = main(["--features", str(tmp_path / "feats"), "--labels", str(tmp_path / "labels.csv"), "--target", "diagnosis",
               "--model", "querent", "--folds", "2", "--epochs", "4", "--min-epochs", "1", "--dim", "16",
               "--heads", "2", "--region-size", "2", "--topk", "2", "--out", str(out), "--no-progress",
               "--device", "cpu"])
    assert rc == 0
    res = json.loads((out / "metrics_querent_diagnosis.json").read_text())
    assert res["classes"] == ["normal", "tumor"] and res["n_patients"] == 8 and res["n_slides"] == 16
    for k in ("auc", "balanced_accuracy"):
        s = res["summary"][k]
        assert s["n"] == 2 and s["min"] <= s["mean"] <= s["max"] and s["std"] >= 0
    assert set(res["summary"]) == {"auc", "balanced_accuracy"} and set(res["pooled"]) == {"auc", "balanced_accuracy"}
    for f in res["folds"]:
        assert 1 <= len(f["history"]) <= 4
        assert all(set(r) == {"epoch", "train_loss", "val_loss", "lr"} for r in f["history"])
    with open(out / "oof_querent_diagnosis.csv") as fh:
        oof = list(csv.DictReader(fh))
    assert sorted(r["slide_id"] for r in oof) == sorted(b.slide_id for b in bags)  # every slide once
    pats = {}
    for r in oof:
        pats.setdefault(r["patient_id"], set()).add(r["fold"])
        assert abs(float(r["prob_normal"]) + float(r["prob_tumor"]) - 1) < 1e-5
        assert r["label_name"] in ("normal", "tumor")
    assert all(len(v) == 1 for v in pats.values())  # a patient's slides in one fold
    assert (out / "curves_querent_diagnosis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "querent_config.json").read_text())["classes"] == ["normal", "tumor"]


def test_survival_cross_validation_reports_c_index_spread(tmp_path):
    rng = np.random.default_rng(0)
    bags = planted_cohort(16, lo=10, hi=20, d=8)
    for b in bags:
        b.time, b.event = float(rng.exponential(5 if b.label else 20)), int(rng.random() < 0.8)
    cfg = QuerentConfig(in_dim=8, dim=16, num_classes=1, task="survival", dropout=0.0)
    res = cross_validate("abmil", cfg, bags, TrainConfig(epochs=3, min_epochs=1), folds=2)
    assert set(res["summary"]) == {"c_index"} and res["summary"]["c_index"]["n"] == 2 and "c_index" in res["pooled"]
    assert len(res["oof"]) == 16 and all("risk" in r and "time" in r for r in res["oof"])


# ------------------------------------------------------------------------ warnings and the validation threshold


def test_fit_warnings_name_a_first_best_epoch_and_a_single_predicted_class():
    from pathology.training import fit_warnings

    good = {"best_epoch": 7, "epochs_run": 17, "predicted_counts": [5, 4]}
    assert fit_warnings("abmil", good, 0) == []
    first = fit_warnings("querent", {**good, "best_epoch": 1}, 2)
    assert len(first) == 1 and "querent fold 2" in first[0] and "first" in first[0] and "Try" in first[0]
    # with a smoothed score the first epoch that can be kept is the window's length
    assert fit_warnings("querent", {**good, "best_epoch": 1, "first_candidate": 5}, 2) == []
    assert len(fit_warnings("querent", {**good, "best_epoch": 5, "first_candidate": 5}, 2)) == 1
    one = fit_warnings("dense", {**good, "predicted_counts": [0, 9]}, 1)
    assert len(one) == 1 and "one class" in one[0] and "Try" in one[0]
    assert len(fit_warnings("dense", {"best_epoch": 1, "epochs_run": 11, "predicted_counts": [9, 0]}, 0)) == 2
    assert fit_warnings("mean", {"best_epoch": 1, "epochs_run": 1, "predicted_counts": [1, 0]}, 0) == []  # nothing to tell


class _Constant(torch.nn.Module):
    """A model that gives every slide the same logits (what a fit that learnt nothing returns)."""

    def forward(self, features, coords, *, patch_size_level0=None):
        from pathology.querent import MILOutput

        n = features.shape[0]
        return MILOutput(torch.tensor([[0.3, -0.3]]), torch.full((n,), 1.0 / n), torch.zeros(1, 4))


def test_cross_validate_warns_when_the_best_epoch_is_the_first_and_one_class_is_predicted(monkeypatch, caplog):
    import pathology.training as tr

    bags = planted_cohort(12, lo=10, hi=14, d=8)
    fake = {"steps": 1, "epochs_run": 11, "best_epoch": 1, "stopped_early": True, "train_seconds": 0.0,
            "final_loss": 0.1, "best_val_loss": 0.7, "monitor": "auc", "threshold": None, "history": []}
    monkeypatch.setattr(tr, "train_model", lambda *a, **k: (_Constant(), dict(fake)))
    cfg = QuerentConfig(in_dim=8, dim=8, num_heads=2, num_classes=2)
    with caplog.at_level(logging.WARNING, logger="pathology.training"):
        res = cross_validate("abmil", cfg, bags, TrainConfig(epochs=2), folds=2)
    for k, f in enumerate(res["folds"]):
        assert f["predicted_counts"] == [f["n_test"], 0]
        assert len(f["warnings"]) == 2
        assert any(f"abmil fold {k}: the best validation epoch is the first" in r.message for r in caplog.records)
        assert any(f"abmil fold {k}: every test slide is predicted as one class" in r.message for r in caplog.records)
    # a fit that improves after its first epoch and predicts both classes raises neither warning
    caplog.clear()
    monkeypatch.undo()
    res = cross_validate("abmil", cfg, planted_cohort(20, lo=20, hi=30, d=8), TrainConfig(epochs=15, min_epochs=15), folds=2)
    for f in res["folds"]:
        if f["best_epoch"] > 1 and min(f["predicted_counts"]) > 0:
            assert f["warnings"] == []


def test_threshold_chosen_on_validation_gives_balanced_accuracy():
    from pathology.training import choose_threshold, predicted_classes

    # every probability under 0.5 (a model whose bias drifted): the 0.5 rule predicts one class, the chosen
    # threshold separates the classes
    prob = np.array([0.1, 0.12, 0.2, 0.3, 0.31, 0.4])
    y = np.array([0, 0, 0, 1, 1, 1])
    t = choose_threshold(prob, y)
    assert 0.2 < t < 0.3
    logits = torch.log(torch.tensor(np.stack([1 - prob, prob], 1), dtype=torch.float32))
    assert predicted_classes(logits).tolist() == [0] * 6
    assert predicted_classes(logits, t).tolist() == y.tolist()
    assert choose_threshold(prob, np.zeros(6)) == 0.5  # one class: nothing to choose from


def test_early_stopping_on_validation_auc_keeps_the_epoch_that_ranks_best():
    bags = planted_cohort(20, lo=30, hi=60, d=16)
    cfg = QuerentConfig(in_dim=16, dim=16, num_classes=2)
    tc = TrainConfig(epochs=12, min_epochs=12, monitor="auc", smooth=1, seed=2)
    model, info = train_model("abmil", cfg, bags[:12], tc, val_bags=bags[12:])
    h = info["history"]
    aucs = [r["val_auc"] for r in h]
    best = info["best_epoch"]
    assert aucs[best - 1] == max(aucs)  # the best AUC, the lowest validation loss among epochs with that AUC
    assert h[best - 1]["val_loss"] == min(r["val_loss"] for r in h if r["val_auc"] == max(aucs))
    assert info["threshold"] is not None and 0 <= info["threshold"] <= 1
    with pytest.raises(ValueError, match="monitor"):
        TrainConfig(monitor="accuracy")


def _count_layer_calls(monkeypatch):
    """Patch the model builder of pathology.training so that the built Querent counts, per call of its first layer,
    whether the model was training (True) or evaluating (False)."""
    import pathology.training as training

    calls: list[bool] = []
    built: list = []

    def build(name, cfg):
        m = build_model(name, cfg)
        if name == "querent":
            m.layers[0].register_forward_hook(lambda mod, i, o: calls.append(mod.training))
        built.append(m)
        return m

    monkeypatch.setattr(training, "build_model", build)
    return calls, built


def test_layers_from_trains_the_depth_0_form_first_then_the_layers(monkeypatch):
    bags = planted_cohort(12, lo=30, hi=50, d=8)
    cfg = QuerentConfig(in_dim=8, dim=16, depth=1, num_heads=2, region_size=4, num_classes=2)
    calls, built = _count_layer_calls(monkeypatch)
    tc = TrainConfig(epochs=5, layers_from=3, batch_slides=4, max_patches=None, seed=0)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in build_model("querent", cfg).state_dict().items() if k.startswith("layers.")}
    calls.clear()
    model, info = train_model("querent", cfg, bags, tc)
    # 12 bags, 4 per step: the layer runs for each bag of epochs 4 and 5 only
    assert calls.count(True) == 2 * 12 and info["epochs_run"] == 5
    assert model.skip_layers is False and built[-1] is model
    x = model(bags[0].features, bags[0].coords, patch_size_level0=bags[0].patch_size_level0)
    assert calls[-1] is False and torch.isfinite(x.logits).all()  # the returned model uses its layers
    # the layer trained in the last two epochs
    moved = [k for k, v in model.state_dict().items() if k in init and not torch.equal(v, init[k])]
    assert any(k.startswith("layers.0.attn") for k in moved) and any(k.startswith("layers.0.mlp") for k in moved)
    # depth-0 models and the other models ignore it; 0 = the layers from the first step
    calls.clear()
    train_model("querent", cfg, bags, TrainConfig(epochs=2, layers_from=0, batch_slides=4, max_patches=None))
    assert calls.count(True) == 2 * 12
    train_model("abmil", cfg, bags, TrainConfig(epochs=2, layers_from=1, batch_slides=4))
    with pytest.raises(ValueError, match="layers_from"):
        TrainConfig(epochs=5, layers_from=5)
    with pytest.raises(ValueError, match="layers_from"):
        TrainConfig(layers_from=-1)


def test_layers_from_keeps_only_epochs_trained_with_the_layers(monkeypatch):
    """Validation AUC made to fall epoch by epoch: without staged layers early stopping keeps the first candidate;
    with them the first epoch whose smoothing window ran with the layers, and patience counts from there."""
    import pathology.training as training

    bags = planted_cohort(16, lo=30, hi=50, d=8)
    cfg = QuerentConfig(in_dim=8, dim=16, depth=1, num_heads=2, region_size=4, num_classes=2)
    real = training._metrics
    seen = {"n": 0}

    def falling(outs, bs, task, pred=None):
        m = real(outs, bs, task, pred)
        if len(bs) == 4:  # the validation bags
            seen["n"] += 1
            m["auc"] = 1.0 - 0.01 * seen["n"]
        return m

    monkeypatch.setattr(training, "_metrics", falling)
    tc = dict(epochs=20, batch_slides=4, max_patches=None, min_epochs=0, patience=3, smooth=2, seed=0)
    _, plain = train_model("querent", cfg, bags[:12], TrainConfig(**tc), val_bags=bags[12:])
    assert plain["best_epoch"] == 2 and plain["epochs_run"] == 4  # patience from epoch 1
    seen["n"] = 0
    model, staged = train_model("querent", cfg, bags[:12], TrainConfig(**tc, layers_from=6), val_bags=bags[12:])
    assert staged["best_epoch"] == 8 and staged["epochs_run"] == 11 and model.skip_layers is False


@pytest.mark.parametrize("freeze", [True, False])
def test_a_first_stage_ended_by_early_stopping_hands_its_best_weights_to_the_layers(monkeypatch, freeze):
    """stage_end="early_stop": the depth-0 stage stops by its own early stopping, its best epoch's weights are what
    the layers start from, the second stage has its own floor and patience; freeze_pooling keeps the pooling's
    weights from then on (the head still trains)."""
    import pathology.training as training

    bags = planted_cohort(16, lo=30, hi=50, d=8)
    cfg = QuerentConfig(in_dim=8, dim=16, depth=1, num_heads=2, region_size=4, num_classes=2, pool_from="embed_gate",
                        final_norm=False, pos_encoding="none")
    calls, built = _count_layer_calls(monkeypatch)
    real, snaps, at_switch = training._metrics, [], {}

    def falling(outs, bs, task, pred=None):
        m = real(outs, bs, task, pred)
        if len(bs) == 4:  # the validation bags: AUC falls epoch by epoch; the pooling's weights of every epoch
            snaps.append({k: v.clone() for k, v in built[-1].pool.state_dict().items()})
            m["auc"] = 1.0 - 0.01 * len(snaps)
        return m

    monkeypatch.setattr(training, "_metrics", falling)
    tc = TrainConfig(epochs=20, layers_from=10, stage_end="early_stop", freeze_pooling=freeze, batch_slides=4,
                     max_patches=None, min_epochs=0, patience=3, smooth=2, seed=0)
    model, info = train_model("querent", cfg, bags[:12], tc, val_bags=bags[12:])
    h = info["history"]
    # stage 1: patience from epoch 1, stops at epoch 4, keeps epoch 2 (first full window); stage 2 from epoch 5:
    # candidates from epoch 6, patience from there, stops at epoch 9
    assert info["layers_from_epoch"] == 4 and h[3]["stage_best_epoch"] == 2
    assert [r["layers"] for r in h] == [False] * 4 + [True] * 5
    assert info["best_epoch"] == 6 and info["epochs_run"] == 9
    assert calls.count(True) == 5 * 12  # the layer trained in epochs 5-9 only
    assert h[4]["lr"] > h[3]["lr"]  # the layers' stage starts its own schedule
    # the pooling the layers started from is stage 1's best (epoch 2), not its last (epoch 4)
    first = snaps[4]  # validated after epoch 5: with freezing still epoch 2's
    same = all(torch.equal(first[k], snaps[1][k]) for k in first)
    assert same is freeze
    assert any(not torch.equal(snaps[1][k], snaps[3][k]) for k in first)  # epochs 2 and 4 differ
    final = model.pool.state_dict()
    assert all(torch.equal(final[k], snaps[1][k]) for k in final) is freeze
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="stage_end"):
        TrainConfig(stage_end="later")


def test_train_cli_trains_querent_in_stages_and_refuses_what_cannot_be_staged(tmp_path, capsys):
    from core.infra.cli import run_cli
    from pathology.train import main

    bags = planted_cohort(12, lo=30, hi=50, d=8)
    (tmp_path / "feats" / "h5_files").mkdir(parents=True)
    rows = ["slide_id,label"]
    for b in bags:
        _write_h5(tmp_path / "feats" / "h5_files" / f"{b.slide_id}.h5", b.features.numpy(), b.coords.numpy())
        rows.append(f"{b.slide_id},{b.label}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    base = ["--features", str(tmp_path / "feats"), "--labels", str(tmp_path / "labels.csv"), "--folds", "2",
            "--epochs", "3", "--min-epochs", "1", "--dim", "16", "--heads", "2", "--region-size", "2", "--topk", "2",
            "--no-progress", "--device", "cpu"]
    staged = ["--layers-from", "2", "--stage-end", "early_stop", "--freeze-pooling", "on", "--final-norm", "off",
              "--pool-from", "embed_gate", "--pos-encoding", "none"]
    assert main(base + staged + ["--out", str(tmp_path / "q")]) == 0
    res = json.loads((tmp_path / "q" / "metrics_querent_label.json").read_text())
    tc, mc = res["train_config"], res["model_config"]
    assert (tc["layers_from"], tc["stage_end"], tc["freeze_pooling"]) == (2, "early_stop", True)
    assert (mc["final_norm"], mc["pool_from"], mc["pos_encoding"]) == (False, "embed_gate", "none")
    for f in res["folds"]:
        layers = [r["layers"] for r in f["history"]]
        assert layers[0] is False and layers[-1] is True and f["history"][-1]["epoch"] <= 5
    cfg = json.loads((tmp_path / "q" / "querent_config.json").read_text())
    assert (cfg["final_norm"], cfg["pool_from"]) == (False, "embed_gate")  # what the ensemble loader rebuilds
    assert run_cli(main, base + ["--model", "abmil", "--layers-from", "2", "--out", str(tmp_path / "a")]) == 2
    assert "--model querent" in capsys.readouterr().err
    assert run_cli(main, base + ["--layers-from", "3", "--out", str(tmp_path / "b")]) == 2  # fixed: below --epochs
    assert "layers_from (3)" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_querent_on_large_bags_takes_the_large_bag_recipe_unless_told_otherwise():
    from pathology.train import LARGE_BAG, LARGE_BAG_QUERENT, SMALL_BAG_QUERENT, _staging, build_parser, querent_recipe

    assert querent_recipe(LARGE_BAG) == LARGE_BAG_QUERENT and querent_recipe(LARGE_BAG - 1) == SMALL_BAG_QUERENT
    assert LARGE_BAG_QUERENT["layers_from"] > 0 and LARGE_BAG_QUERENT["freeze_pooling"] is True
    req = ["--features", "f", "--labels", "l", "--out", "o"]
    p = build_parser()
    assert _staging(p.parse_args(req), 8000) == LARGE_BAG_QUERENT
    assert _staging(p.parse_args(req), 500) == SMALL_BAG_QUERENT
    assert _staging(p.parse_args(req + ["--model", "dense"]), 8000) == SMALL_BAG_QUERENT  # Querent only
    st = _staging(p.parse_args(req + ["--freeze-pooling", "off", "--pos-encoding", "sincos", "--final-norm", "on"]),
                  8000)
    assert st == {**LARGE_BAG_QUERENT, "freeze_pooling": False, "pos_encoding": "sincos", "final_norm": True}
    assert _staging(p.parse_args(req + ["--layers-from", "0"]), 8000)["layers_from"] == 0


def test_the_bag_size_benchmark_reports_querent_with_the_recipe_pathology_train_picks():
    import benchmarks.pathology_bagsize as bs
    from pathology.train import LARGE_BAG, querent_recipe

    for size in (500, 2000, 8000):
        s = bs.settings(bs.report_variant("querent", size), 120, size)
        want = querent_recipe(size)
        got = {k: s.get(k, d) for k, d in dict(pos_encoding="sincos", final_norm=True, pool_from="tokens",
                                                 layers_from=0, stage_end="fixed", freeze_pooling=False).items()}
        assert got == want, size
    assert bs.LARGE_BAG == LARGE_BAG
