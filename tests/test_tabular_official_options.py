"""What the official package does beyond ten classes and one forward pass, against the official package itself (random
weights in its format): many classes (mixed-radix label views + class hierarchy), a train context built at ``fit`` and
reused (``kv_cache``), the inference options (``batch_size``, ``average_logits``, the ensemble's shuffles and
normalisations) and autocast. Published sizes: ``benchmarks/tabular_official_parity.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tabicl")

from tabicl import TabICLClassifier as OfficialClassifier  # noqa: E402
from tabicl._model.embedding import ColEmbedding  # noqa: E402
from tabicl._model.inference_config import InferenceConfig  # noqa: E402
from tabicl._model.learning import ICLearning  # noqa: E402

from tabular import TabICLClassifier  # noqa: E402
from tabular.many_class import group_sizes, mixed_radix_bases, mixed_radix_digit  # noqa: E402
from tabular.weights_io import load_model  # noqa: E402
from tests.test_tabular_official import official_ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fp32_config(device: str = "cpu") -> InferenceConfig:
    """The official inference settings with autocast off (every field set, as its many-class path reads them)."""
    cfg = InferenceConfig()
    cfg.update_from_dict({k: {"use_amp": False, "device": device} for k in ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")})
    return cfg


def many_class_table(C: int, seed: int = 0, B: int = 2, F: int = 7, n_test: int = 20):
    """``B`` tables of ``3C`` train rows holding every class; table ``b`` has the labels shifted by ``3b``."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * C
    X = torch.randn(B, n + n_test, F, generator=g)
    y0 = torch.randint(0, C, (n,), generator=g)
    y0[:C] = torch.randperm(C, generator=g)
    y = torch.stack([(y0 + 3 * b) % C for b in range(B)])
    return X, y


# --- many classes ------------------------------------------------------------------------------------------------


def test_mixed_radix_bases_and_class_groups_are_the_official_ones():
    """Bases and hierarchy groups for 11 to 400 classes (and other decoder sizes) equal the official model's."""
    for max_classes in (3, 7, 10):
        col = ColEmbedding(embed_dim=8, num_blocks=1, nhead=2, dim_feedforward=8, num_inds=4, max_classes=max_classes)
        icl = ICLearning(max_classes=max_classes, out_dim=max_classes, d_model=8, num_blocks=1, nhead=2, dim_feedforward=8)
        for C in range(max_classes + 1, 401):
            bases = mixed_radix_bases(C, max_classes)
            assert bases == col._compute_mixed_radix_bases(C), (max_classes, C)
            y = torch.arange(C)
            for i in range(len(bases)):
                assert torch.equal(mixed_radix_digit(y, i, bases), col._extract_mixed_radix_digit(y, i, bases))
            assignment, n_groups = icl._grouping(C)
            assert group_sizes(C, max_classes) == torch.bincount(assignment.long(), minlength=n_groups).tolist()
    assert mixed_radix_bases(25, 10) == [5, 5] and group_sizes(101, 10) == [11] + [10] * 9


@pytest.mark.parametrize("release", ["v1", "v2"])
@pytest.mark.parametrize("C", [12, 30, 100])
def test_many_classes_match_the_official_model(tmp_path, release, C):
    """The class hierarchy (and, for v2, the mixed-radix column stage) against the official forward pass."""
    official, path = official_ckpt(tmp_path, release)
    model = load_model(path)
    X, y = many_class_table(C)
    n = y.shape[1]
    with torch.no_grad():
        ref = official(X, y.float(), return_logits=False, inference_config=fp32_config())  # (B, n_test, C)
        ctx = model.build_context(X[:, :n], y, chunk=17)
        p = model.predict_proba(X[:, n:], ctx, chunk=7)
    assert ctx.tree is not None and ctx.kv == [] and len(ctx.summaries) == (2 if release == "v2" else 1)
    assert ref.shape == p.shape == (2, 20, C)
    assert ref.max() > 2 / C  # not a flat distribution
    assert (p - ref).abs().max().item() < 1e-5
    assert torch.allclose(p.sum(-1), torch.ones(2, 20), atol=1e-5)
    with pytest.raises(ValueError, match="predict_proba"):
        model.predict_logits(X[:, n:], ctx)
    with pytest.raises(ValueError, match="build_context and predict_proba"):
        model.predict_once(X[:, :n], y, X[:, n:])


@pytest.mark.parametrize("release", ["v1", "v2"])
def test_many_class_predict_proba_matches_the_official_classifier(tmp_path, release):
    _, path = official_ckpt(tmp_path, release)
    rng = np.random.default_rng(1)
    for C in (12, 30, 100):
        n = 3 * C + 25
        X = rng.normal(size=(n, 6))
        y = rng.integers(0, C, n)
        y[:C] = np.arange(C)
        for avg in (True, False):
            kw = dict(n_estimators=3, random_state=5, average_logits=avg)
            ref = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw)
            p_ref = ref.fit(X[:-25], y[:-25]).predict_proba(X[-25:])
            p = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw).fit(X[:-25], y[:-25]).predict_proba(X[-25:])
            assert p.shape == (25, C) and np.abs(p - p_ref).max() < 1e-5, (C, avg)


# --- a train context reused (kv_cache) --------------------------------------------------------------------------


def _xy(seed=0, n=90, F=9):
    """A table of ``n`` rows, ``F`` features and four classes (two from the first feature, two at random)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, F))
    return X, (X[:, 0] + rng.normal(size=n) > 0).astype(int) + 2 * (rng.random(n) < 0.3)


@pytest.mark.parametrize("release", ["v1", "v2"])
def test_kv_cache_matches_the_official_kv_cache(tmp_path, release):
    _, path = official_ckpt(tmp_path, release)
    X, y = _xy()
    kw = dict(n_estimators=6, random_state=3)
    ref = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, kv_cache=True,
                             **kw).fit(X[:60], y[:60])
    ours = TabICLClassifier(checkpoint=path, official=True, device="cpu", kv_cache=True, **kw).fit(X[:60], y[:60])
    assert ours.context_nbytes_ > 0
    for part in (slice(60, 90), slice(60, 70), slice(75, 90)):  # repeated predictions from the one context
        assert np.abs(ours.predict_proba(X[part]) - ref.predict_proba(X[part])).max() < 1e-5


@pytest.mark.parametrize("release", ["v1", "v2"])
def test_a_reused_context_equals_a_fresh_computation(tmp_path, release):
    """Built once at fit, read by many predictions: the same numbers as running the train rows again."""
    _, path = official_ckpt(tmp_path, release)
    model = load_model(path)
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(3, 70, 9, generator=g), torch.randint(0, 4, (3, 50), generator=g)
    with torch.no_grad():
        ctx = model.build_context(X[:, :50], y, chunk=11)
        for lo, hi in ((50, 70), (50, 55), (61, 70)):
            fresh = model(torch.cat([X[:, :50], X[:, lo:hi]], 1), y)
            assert (model.predict_logits(X[:, lo:hi], ctx, chunk=4) - fresh).abs().max() < 1e-5
    # The estimator: v1's official batches embed a batch's first member once (no kv_cache only), so compare with
    # one member per batch, where both paths run every member.
    Xn, yn = _xy(1)
    kw = dict(checkpoint=path, official=True, device="cpu", n_estimators=4, random_state=0, batch_size=1)
    cached = TabICLClassifier(kv_cache=True, **kw).fit(Xn[:60], yn[:60])
    fresh = TabICLClassifier(**kw).fit(Xn[:60], yn[:60])
    assert np.abs(cached.predict_proba(Xn[60:]) - fresh.predict_proba(Xn[60:])).max() < 1e-6


def test_refit_on_other_data_replaces_the_cached_context(tmp_path):
    _, path = official_ckpt(tmp_path, "v2")
    Xa, ya = _xy(2)
    Xb, yb = _xy(3)
    yb = 3 - yb  # other labels too
    kw = dict(checkpoint=path, official=True, device="cpu", n_estimators=4, kv_cache=True)
    est = TabICLClassifier(**kw).fit(Xa[:60], ya[:60])
    p_a = est.predict_proba(Xb[60:])
    est.fit(Xb[:60], yb[:60])
    p_b = est.predict_proba(Xb[60:])
    assert np.abs(p_b - TabICLClassifier(**kw).fit(Xb[:60], yb[:60]).predict_proba(Xb[60:])).max() < 1e-7
    assert np.abs(p_b - p_a).max() > 1e-3  # the refit changed the predictions


# --- inference options -------------------------------------------------------------------------------------------

OPTIONS = [
    ("v1", dict(batch_size=1)),  # every member embedded on its own (no shared first-member embedding)
    ("v1", dict(batch_size=2)),
    ("v1", dict(average_logits=False)),
    ("v2", dict(average_logits=False)),
    ("v2", dict(feat_shuffle_method="random")),
    ("v1", dict(feat_shuffle_method="shift")),
    ("v2", dict(feat_shuffle_method="none")),
    ("v2", dict(class_shuffle_method="latin")),
    ("v1", dict(class_shuffle_method="random")),
    ("v2", dict(class_shuffle_method="none")),
    ("v2", dict(norm_methods=["robust", "quantile_rtdl"])),
]


@pytest.mark.parametrize("release, option", OPTIONS, ids=[f"{r}-{next(iter(o))}={next(iter(o.values()))}" for r, o in OPTIONS])
def test_inference_options_change_results_as_in_the_official_package(tmp_path, release, option):
    _, path = official_ckpt(tmp_path, release)
    X, y = _xy(4)
    kw = dict(n_estimators=6, random_state=3)

    def official(**extra):
        est = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw, **extra)
        return est.fit(X[:60], y[:60]).predict_proba(X[60:])

    p_ref, p_default = official(**option), official()
    assert np.abs(p_ref - p_default).max() > 1e-4  # the option changes the official result
    p = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw, **option).fit(X[:60], y[:60]).predict_proba(X[60:])
    assert np.abs(p - p_ref).max() < 1e-5


def test_bf16_autocast_on_the_cpu_follows_the_official_amp(tmp_path):
    """``dtype="bfloat16"`` runs the model under CPU autocast, as the official ``use_amp=True`` does there."""
    _, path = official_ckpt(tmp_path, "v2")
    X, y = _xy(5)
    kw = dict(n_estimators=4, random_state=3)
    ref = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=True, **kw)
    p_ref = ref.fit(X[:60], y[:60]).predict_proba(X[60:])
    bf16 = TabICLClassifier(checkpoint=path, official=True, device="cpu", dtype="bfloat16", **kw).fit(X[:60], y[:60])
    fp32 = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw).fit(X[:60], y[:60])
    assert bf16.compute_dtype_ == torch.bfloat16 and fp32.compute_dtype_ == torch.float32  # auto on the CPU: fp32
    p16, p32 = bf16.predict_proba(X[60:]), fp32.predict_proba(X[60:])
    assert 1e-5 < np.abs(p16 - p32).max() < 1e-2  # autocast really ran, and stayed close
    assert np.abs(p16 - p_ref).max() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", [False, True])
def test_bf16_autocast_on_cuda(tmp_path, kv_cache):
    """On CUDA the default dtype is bf16 autocast: close to fp32 on the CPU and to the official package's AMP."""
    _, path = official_ckpt(tmp_path, "v2")
    X, y = _xy(6, n=600)
    kw = dict(n_estimators=4, random_state=3)
    gpu = TabICLClassifier(checkpoint=path, official=True, device="cuda", kv_cache=kv_cache, **kw).fit(X[:400], y[:400])
    assert gpu.compute_dtype_ in (torch.bfloat16, torch.float16)
    cpu = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw).fit(X[:400], y[:400])
    ref = OfficialClassifier(model_path=path, allow_auto_download=False, device="cuda", use_amp=True, kv_cache=kv_cache,
                             **kw).fit(X[:400], y[:400])
    p_gpu, p_cpu, p_ref = gpu.predict_proba(X[400:]), cpu.predict_proba(X[400:]), ref.predict_proba(X[400:])
    assert np.abs(p_gpu - p_cpu).max() < 2e-2 and np.abs(p_gpu - p_ref).max() < 2e-2
    assert (p_gpu.argmax(1) == p_cpu.argmax(1)).mean() >= 0.95


# --- refusals ----------------------------------------------------------------------------------------------------


def test_official_options_are_refused_outside_the_official_pipeline(tmp_path):
    X, y = _xy(7)
    for bad in (dict(kv_cache=True), dict(average_logits=False), dict(class_shuffle_method="none"), dict(dtype="bf16")):
        with pytest.raises(ValueError, match="official=True"):
            TabICLClassifier(n_estimators=1, **bad).fit(X, y)
    _, path = official_ckpt(tmp_path, "v1")
    for bad, words in ((dict(kv_cache="yes"), "kv_cache"), (dict(feat_shuffle_method="sorted"), "feat_shuffle_method"),
                       (dict(norm_methods=["zscore"]), "norm_methods"), (dict(dtype="float8"), "dtype")):
        with pytest.raises(ValueError, match=words):
            TabICLClassifier(checkpoint=path, official=True, device="cpu", **bad).fit(X, y)
