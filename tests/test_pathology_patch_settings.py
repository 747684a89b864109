"""pathology.train records how its feature files' patches were made, and a train folder patches new slides so."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from core.infra.cli import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _settings(mpp=1.0, patch_size=64, min_tissue=0.4, encoder="default", kwargs=None):
    """A feature file's settings as pathology.batch stores them (BatchRunner.settings' "feat" entry)."""
    from pathology.tissue import TissueConfig

    tissue = dataclasses.asdict(TissueConfig(close_um=32.0))
    return {"output": "features", "slide_mpp": 0.25, "tissue": tissue, "mpp": mpp, "patch_size": patch_size,
            "min_tissue": min_tissue, "encoder": {"name": encoder, "kind": "default", "preset": None,
                                                  "encoder_kwargs": kwargs or {}, "weights": None}}


def _feature_folder(path, n=8, settings=None, odd=None):
    """``n`` feature files (16-d, a 6 x 6 grid) with pathology.batch's root attributes (``settings``: one dict for
    all, ``odd``: another for the last file, None: no settings at all) and a labels CSV."""
    from pathology.batch import _settings_attrs
    from pathology.patching import PatchGrid, write_h5

    path.mkdir()
    rng = np.random.default_rng(0)
    g = np.arange(36)
    coords = np.stack([g % 6, g // 6], 1) * 128
    rows = ["slide_id,label"]
    for i in range(n):
        grid = PatchGrid(coords.astype(np.int64), 64, 128, 0, 1.0, 0.5, np.ones(36, np.float32))
        f = rng.standard_normal((36, 16)).astype(np.float32) + (i % 2)
        s = odd if (odd is not None and i == n - 1) else settings
        write_h5(path / f"s{i}.h5", grid, f, slide_id=f"s{i}", **(_settings_attrs(s) if s else {}))
        rows.append(f"s{i},{i % 2}")
    (path.parent / "labels.csv").write_text("\n".join(rows) + "\n")


def _train(tmp_path, out="run"):
    from pathology.train import main

    return run_cli(main, ["--features", str(tmp_path / "feats"), "--labels", str(tmp_path / "labels.csv"),
                          "--model", "mean", "--folds", "2", "--epochs", "2", "--min-epochs", "1", "--out",
                          str(tmp_path / out), "--no-progress", "--device", "cpu"])


def test_train_records_the_patch_settings_and_the_loader_uses_them(tmp_path, monkeypatch):
    from pathology.inference import load_slide_model, slide_encoder

    _feature_folder(tmp_path / "feats", settings=_settings(kwargs={"depth": 3}))
    assert _train(tmp_path) == 0
    cfg = json.loads((tmp_path / "run" / "mean_config.json").read_text())
    assert (cfg["patch_mpp"], cfg["patch_size"], cfg["min_tissue"], cfg["encoder"]) == (1.0, 64, 0.4, "default")
    assert cfg["encoder_kwargs"] == {"depth": 3} and cfg["tissue"]["close_um"] == 32.0
    metrics = json.loads((tmp_path / "run" / "metrics_mean_label.json").read_text())
    assert metrics["patch_settings"]["patch_size"] == 64
    _, meta = load_slide_model(str(tmp_path / "run"))
    assert (meta["patch_mpp"], meta["patch_size"], meta["min_tissue"]) == (1.0, 64, 0.4)
    assert meta["tissue"]["close_um"] == 32.0 and meta["encoder_kwargs"] == {"depth": 3}
    built = []

    class FakeEncoder:
        dim = 16
        name = "default"

    def fake_build(name, *, weights=None, device=None, encoder_kwargs=None, strict=True):
        built.append((name, encoder_kwargs))
        return FakeEncoder()

    import pathology.encoders
    import pathology.inference as inf

    monkeypatch.setattr(pathology.encoders, "build_encoder", fake_build)
    inf._encoder.cache_clear()
    slide_encoder(meta)
    assert built == [("default", {"depth": 3})]  # the encoder as the features were made
    slide_encoder(meta, name="timm:resnet18")
    assert built[-1] == ("timm:resnet18", None)  # another encoder keeps its own defaults
    inf._encoder.cache_clear()


def test_analyze_slide_segments_with_the_recorded_tissue_settings(tmp_path, monkeypatch):
    """The tissue settings of the config reach segment_tissue (the slide itself is not needed to see that)."""
    import pathology.inference as inf
    import pathology.tissue

    seen = []

    class Stop(Exception):
        pass

    def fake_segment(slide, config=None):
        seen.append(config)
        raise Stop

    class FakeSlide:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    _feature_folder(tmp_path / "feats", settings=_settings())
    assert _train(tmp_path) == 0
    monkeypatch.setattr(pathology.tissue, "segment_tissue", fake_segment)
    monkeypatch.setattr("pathology.slide.Slide", FakeSlide)
    with pytest.raises(Stop):
        inf.analyze_slide("any.tiff", model_path=str(tmp_path / "run"))
    assert seen[0] is not None and seen[0].close_um == 32.0
    inf._load_slide_model.cache_clear()


def test_mixed_or_missing_patch_settings(tmp_path, capsys, caplog):
    from pathology.inference import load_slide_model

    _feature_folder(tmp_path / "feats", settings=_settings(), odd=_settings(patch_size=128))
    assert _train(tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: feature files made with different settings") and "patch_size: 64 vs 128" in err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()  # refused before any training
    (tmp_path / "feats").rename(tmp_path / "mixed")
    _feature_folder(tmp_path / "feats", settings=None)  # features from elsewhere (CLAM, TRIDENT): nothing stored
    assert _train(tmp_path, "plain") == 0
    assert "will assume pathology.batch's defaults" in caplog.text
    cfg = json.loads((tmp_path / "plain" / "mean_config.json").read_text())
    assert "patch_mpp" not in cfg
    _, meta = load_slide_model(str(tmp_path / "plain"))
    assert (meta["patch_mpp"], meta["patch_size"]) == (0.5, 256)  # pathology.batch's defaults
