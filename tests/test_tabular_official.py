"""The official TabICL checkpoints: every released architecture built by the official package (``tabicl``, the dev
extra) with random weights, saved in its format, loaded here — logits, the cached and one-shot paths, the estimator
against the official estimator, detection and refusals, and the conversion CLI."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("tabicl")

from tabicl import TabICLClassifier as OfficialClassifier  # noqa: E402
from tabicl._model.inference_config import InferenceConfig  # noqa: E402
from tabicl._model.tabicl import TabICL as OfficialTabICL  # noqa: E402

from tabular import TabICLClassifier  # noqa: E402
from tabular.convert import main as convert_main  # noqa: E402
from tabular.weights_io import load_model  # noqa: E402

SWITCHES = {
    "v1": dict(col_affine=True, col_feature_group=False, col_target_aware=False, col_ssmax=False, icl_ssmax=False,
               row_rope_interleaved=True),
    "v2": dict(col_affine=False, col_feature_group="same", col_feature_group_size=3, col_target_aware=True,
               col_ssmax="qassmax-mlp-elementwise", icl_ssmax="qassmax-mlp-elementwise", row_rope_interleaved=False),
}
FILES = {"v1": "tabicl-classifier-v1-20250208.ckpt", "v1.1": "tabicl-classifier-v1.1-20250506.ckpt",
         "v2": "tabicl-classifier-v2-20260212.ckpt"}
TINY = dict(max_classes=10, embed_dim=32, col_num_blocks=2, col_nhead=4, col_num_inds=16, row_num_blocks=2,
            row_nhead=4, row_num_cls=2, icl_num_blocks=2, icl_nhead=4, ff_factor=2, zero_init=False)
FP32 = InferenceConfig(COL_CONFIG={"use_amp": False}, ROW_CONFIG={"use_amp": False}, ICL_CONFIG={"use_amp": False})


def official_ckpt(tmp_path, release: str, *, config: dict | None = None, seed: int = 0, drop: tuple = ()) -> tuple:
    """An official model with random weights (every tensor perturbed, so no zero-initialised branch hides a mapping
    error), saved as the official trainer does: ``torch.save({"config", "state_dict", ...})``."""
    torch.manual_seed(seed)
    cfg = config or {**TINY, **SWITCHES["v2" if release == "v2" else "v1"]}
    model = OfficialTabICL(**cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("rope.freqs"):
                p.add_(torch.randn_like(p) * 0.1)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / FILES.get(release, f"{release}.ckpt")
    saved = {k: v for k, v in cfg.items() if k not in drop}
    torch.save({"config": saved, "state_dict": model.state_dict(), "curr_step": 0}, path)
    return model, path


def table(seed: int = 0, B: int = 2, n_train: int = 40, n_test: int = 20, F: int = 7, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, n_train + n_test, F, generator=g)
    y = torch.randint(0, classes, (B, n_train), generator=g)
    y[:, :classes] = torch.arange(classes)
    return X, y


@pytest.mark.parametrize("release", ["v1", "v1.1", "v2"])
def test_logits_match_the_official_model(tmp_path, release):
    official, path = official_ckpt(tmp_path, release)
    model = load_model(path)
    assert model.card["release"] == release and model.card["version"] == ("v2" if release == "v2" else "v1")
    X, y = table()
    n = y.shape[1]
    with torch.no_grad():
        ref = official(X, y, return_logits=True, inference_config=FP32)  # (B, n_test, classes in y)
        C = ref.shape[-1]
        outs = {
            "forward": model(X, y),
            "cached": model.predict_logits(X[:, n:], model.build_context(X[:, :n], y, chunk=7), chunk=5),
            "once": model.predict_once(X[:, :n], y, X[:, n:], chunk=6),
            "once_streamed": model.predict_once(X[:, :n], y, X[:, n:], chunk=6, memory_budget_mb=1e-4),
        }
    assert ref.abs().max() > 0.1  # a model whose logits are all near zero would prove nothing
    for name, out in outs.items():
        got = out[..., :C]
        assert (got - ref).abs().max().item() < 1e-5, name
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), name


def test_a_config_without_the_switches_is_read_off_the_weights(tmp_path):
    """Files written before the switches were in the config: the architecture comes from the parameter names."""
    official, path = official_ckpt(tmp_path, "v1", drop=tuple(SWITCHES["v1"]))
    model = load_model(path)
    assert model.card["version"] == "v1" and model.config.col_output == "affine_ln_after"
    X, y = table(1)
    with torch.no_grad():
        ref = official(X, y, return_logits=True, inference_config=FP32)
        assert (model(X, y)[..., : ref.shape[-1]] - ref).abs().max() < 1e-5


@pytest.mark.parametrize("change, words", [
    (dict(col_feature_group="valid"), "no released version"),
    (dict(col_ssmax="ssmax", icl_ssmax="ssmax"), "no released version"),
])
def test_unsupported_versions_are_refused_with_what_is_supported(tmp_path, change, words):
    _, path = official_ckpt(tmp_path, "custom", config={**TINY, **SWITCHES["v2"], **change})
    with pytest.raises(ValueError, match=words) as err:
        load_model(path)
    assert "v1:" in str(err.value) and "v2:" in str(err.value) and "\n" not in str(err.value)


def test_learned_rope_frequencies_are_refused(tmp_path):
    official, _ = official_ckpt(tmp_path, "v1")
    state = official.state_dict()
    state["row_interactor.tf_row.rope.freqs"] = state["row_interactor.tf_row.rope.freqs"] * 1.5
    path = tmp_path / "learned.ckpt"
    torch.save({"config": {**TINY, **SWITCHES["v1"]}, "state_dict": state}, path)
    with pytest.raises(ValueError, match="RoPE frequencies"):
        load_model(path)


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(ValueError, match="broken.ckpt") as err:
        load_model(bad)
    assert "v1.1" in str(err.value)  # names what would be accepted
    other = tmp_path / "other.ckpt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="'config' and 'state_dict'"):
        load_model(other)


def _tables():
    rng = np.random.default_rng(0)
    n = 70
    num = pd.DataFrame(rng.normal(size=(n, 5)), columns=list("abcde"))
    y_num = (num["a"] + num["b"] ** 2 > 1).astype(int).to_numpy()
    cat = pd.DataFrame({"a": rng.normal(size=n), "c": rng.choice(["x", "y", "z"], size=n),
                        "e": rng.exponential(size=n)})
    cat.loc[rng.random(n) < 0.15, "a"] = np.nan  # missing values
    y_cat = np.where(cat["c"] == "x", "yes", "no")
    many = pd.DataFrame(rng.normal(size=(n, 4)))
    y_many = rng.integers(0, 10, n)  # ten classes: the checkpoint's max_classes
    y_many[:10] = np.arange(10)
    wide = pd.DataFrame(rng.normal(size=(n, 110)))  # wider than the v1 pretraining tables (100 features)
    y_wide = (wide[0] > 0).astype(int).to_numpy()
    return {"numeric": (num, y_num), "categorical_missing": (cat, y_cat), "ten_classes": (many, y_many),
            "wide": (wide, y_wide)}


@pytest.mark.parametrize("release", ["v1", "v2"])
def test_predict_proba_matches_the_official_classifier(tmp_path, release):
    _, path = official_ckpt(tmp_path, release)
    for name, (X, y) in _tables().items():
        kw = dict(n_estimators=4, random_state=3)
        ref = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw)
        p_ref = ref.fit(X[:50], y[:50]).predict_proba(X[50:])
        ours = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw).fit(X[:50], y[:50])
        p = ours.predict_proba(X[50:])
        assert list(ours.classes_) == list(ref.classes_)
        assert np.abs(p - p_ref).max() < 1e-4, name
        assert np.array_equal(p.argmax(1), p_ref.argmax(1)), name


def test_official_mode_refuses_what_it_does_not_cover(tmp_path):
    X = np.random.default_rng(0).normal(size=(40, 3))
    with pytest.raises(ValueError, match="official TabICL checkpoint"):
        TabICLClassifier(official=True, device="cpu").fit(X, np.arange(40) % 2)  # the project's own default
    _, path = official_ckpt(tmp_path, "custom", config={**TINY, **SWITCHES["v2"], "max_classes": 0, "num_quantiles": 9})
    for official in (True, False):
        with pytest.raises(ValueError, match="regression checkpoint: use tabular.TabICLRegressor"):
            TabICLClassifier(checkpoint=path, official=official, device="cpu").fit(X, np.arange(40) % 2)


def test_the_project_pipeline_runs_official_weights(tmp_path):
    """Without ``official``: this project's preprocessing, ensemble and hierarchy feed the official weights."""
    _, path = official_ckpt(tmp_path, "v1")
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(80, 4)), rng.integers(0, 12, 80)  # 12 classes: the class hierarchy
    p = TabICLClassifier(checkpoint=path, device="cpu", n_estimators=2).fit(X[:60], y[:60]).predict_proba(X[60:])
    assert p.shape == (20, len(np.unique(y[:60]))) and np.allclose(p.sum(1), 1) and np.isfinite(p).all()


def test_convert_writes_weights_card_and_provenance(tmp_path, capsys):
    official, path = official_ckpt(tmp_path, "v1.1")
    out = tmp_path / "conv" / "tabicl_v11.safetensors"
    assert convert_main([str(path), str(out)]) == 0
    assert "v1.1" in capsys.readouterr().out
    model = load_model(out)
    assert model.card["release"] == "v1.1" and len(model.card["source_sha256"]) == 64
    X, y = table(2)
    with torch.no_grad():
        ref = official(X, y, return_logits=True, inference_config=FP32)
        assert (model(X, y)[..., : ref.shape[-1]] - ref).abs().max() < 1e-5
    prov = json.loads(out.with_suffix(".json").read_text())
    assert prov["file"] == path.name and prov["version"] == "v1"
    assert "tabicl-classifier-v1.1-20250506.ckpt" in out.with_suffix(".md").read_text()
    assert sorted(p.name for p in out.parent.iterdir()) == ["tabicl_v11.json", "tabicl_v11.md", "tabicl_v11.safetensors"]
