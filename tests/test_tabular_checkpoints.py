"""Release names ("v1", "v1.1", "v2", "v2-regressor") found in a local Hugging Face cache the test writes, as the
official package leaves it (``models--jingang--TabICL/{refs/main, snapshots/<rev>/<file>}``); the environment
variables that move it; the one-line refusal when a release is absent; nothing fetched."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

pytest.importorskip("tabicl")

from tabular import TabICLClassifier, TabICLRegressor  # noqa: E402
from tabular.checkpoints import RELEASES, CheckpointNotCached, find_cached, hub_cache_dir, resolve_checkpoint  # noqa: E402
from tabular.weights_io import load_model  # noqa: E402
from tests.test_tabular_official import official_ckpt  # noqa: E402
from tests.test_tabular_regressor import regression_ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = "models--jingang--TabICL"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """No cache variables from the machine; a home folder of the test's own; no network at all."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def no_network(*args, **kwargs):
        raise AssertionError("a checkpoint lookup tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)


def fake_cache(hub, files: dict, *, revision: str = "a" * 40, main: bool = True):
    """Write ``files`` (name -> source path) into a hub cache at ``hub`` as huggingface_hub does (blobs + links)."""
    snap = hub / REPO / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    (hub / REPO / "blobs").mkdir(exist_ok=True)
    for name, src in files.items():
        blob = hub / REPO / "blobs" / f"{abs(hash((revision, name))):x}"
        blob.write_bytes(src.read_bytes())
        (snap / name).symlink_to(blob)
    if main:
        (hub / REPO / "refs").mkdir(exist_ok=True)
        (hub / REPO / "refs" / "main").write_text(revision)
    return snap


def _table(seed=0, n=60):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5))
    return X, (X[:, 0] > 0).astype(int)


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", None])
def test_release_names_resolve_where_the_official_package_stores_them(tmp_path, monkeypatch, variable):
    _, ckpt = official_ckpt(tmp_path / "src", "v2")
    root = tmp_path / "cache"
    hub = {"HF_HUB_CACHE": root, "HUGGINGFACE_HUB_CACHE": root, "HF_HOME": root / "hub",
           "XDG_CACHE_HOME": root / "huggingface" / "hub", None: tmp_path / "home" / ".cache" / "huggingface" / "hub"}[variable]
    if variable is not None:
        monkeypatch.setenv(variable, str(root))
    snap = fake_cache(hub, {RELEASES["v2"]: ckpt})
    assert hub_cache_dir() == hub
    assert resolve_checkpoint("v2") == snap / RELEASES["v2"]
    assert resolve_checkpoint(RELEASES["v2"]) == snap / RELEASES["v2"]  # the released file name, not a path here
    assert load_model("v2").card["release"] == "v2"
    X, y = _table()
    p = TabICLClassifier(checkpoint="v2", official=True, device="cpu", n_estimators=2).fit(X[:40], y[:40])
    ref = TabICLClassifier(checkpoint=ckpt, official=True, device="cpu", n_estimators=2).fit(X[:40], y[:40])
    assert np.array_equal(p.predict_proba(X[40:]), ref.predict_proba(X[40:]))


def test_every_release_and_the_regressor_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    files = {RELEASES[r]: official_ckpt(tmp_path / r, r)[1] for r in ("v1", "v1.1", "v2")}
    files[RELEASES["v2-regressor"]] = regression_ckpt(tmp_path / "reg")
    fake_cache(tmp_path / "hub", files)
    for release in RELEASES:
        model = load_model(release)
        assert model.card["release"] == release and model.config.regression == (release == "v2-regressor")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 4))
    pred = TabICLRegressor(device="cpu", n_estimators=2).fit(X[:35], X[:35, 0]).predict(X[35:])  # "v2-regressor"
    assert pred.shape == (15,) and np.isfinite(pred).all()


def test_a_snapshot_other_than_main_and_explicit_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _, ckpt = official_ckpt(tmp_path / "src", "v1")
    fake_cache(tmp_path / "hub", {}, revision="b" * 40)  # refs/main names a snapshot without the file
    old = fake_cache(tmp_path / "hub", {RELEASES["v1"]: ckpt}, revision="c" * 40, main=False)
    assert find_cached(RELEASES["v1"]) == old / RELEASES["v1"]
    main = fake_cache(tmp_path / "hub", {RELEASES["v1"]: ckpt}, revision="d" * 40)  # refs/main now holds the file
    newer = fake_cache(tmp_path / "hub", {RELEASES["v1"]: ckpt}, revision="e" * 40, main=False)
    os.utime(newer / RELEASES["v1"], (2e9, 2e9), follow_symlinks=True)  # a newer snapshot: refs/main still wins
    assert find_cached(RELEASES["v1"]) == main / RELEASES["v1"]
    assert resolve_checkpoint(ckpt) == ckpt  # a path is a path
    assert resolve_checkpoint(None) is None


@pytest.mark.parametrize("release", ["v1", "v1.1", "v2", "v2-regressor"])
def test_an_absent_release_is_one_line_naming_the_file_and_the_download_command(tmp_path, monkeypatch, release):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointNotCached) as err:
        resolve_checkpoint(release)
    msg = str(err.value)
    assert "\n" not in msg and RELEASES[release] in msg and str(tmp_path / "hf" / "hub" / REPO) in msg
    assert f"hf download jingang/TabICL {RELEASES[release]}" in msg
    X, y = _table()
    est = TabICLRegressor(device="cpu") if release == "v2-regressor" else TabICLClassifier(checkpoint=release, official=True)
    with pytest.raises(FileNotFoundError, match="hf download"):
        est.fit(X, y)
    assert not (tmp_path / "hf").exists()  # nothing was written, let alone fetched
