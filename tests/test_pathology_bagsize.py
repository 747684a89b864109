"""benchmarks.pathology_bagsize: planted sites are tracked, the diagnostics measure what they say, records resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import pathology_bagsize as bs
from benchmarks.pathology_cohort import CohortConfig, directions, make_cohort
from core.infra.cli import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bags_know_their_planted_sites():
    cfg = CohortConfig(bag_size=600, strength=6.0, site_patches=12, decoys=2, negatives="single")
    bags = make_cohort(6, 7, cfg)
    d = directions(cfg)
    for b in bags:
        assert b.strong == (2 if b.label else len(b.sites) - 2) and len(b.sites) == b.strong + 2
        for letter, amp, idx in b.sites:
            assert len(idx) == 12 and amp == (6.0 if amp > 3 else 3.0)
        proj = b.features.numpy() @ d[:2].T  # (N, 2) along A and B
        for letter, amp, idx in b.sites[: b.strong]:  # the strong sites carry their pattern
            assert proj[idx, "AB".index(letter)].mean() > 4.5
        s = b.strong_patches()
        assert len(s) == 12 * b.strong and len(set(s.tolist())) == len(s)
    assert [b.sites[0][0] + b.sites[1][0] for b in bags if b.label] == ["AB"] * 3


class _Picks(torch.nn.Module):
    """A stand-in slide model that returns a fixed region choice: every region attends ``chosen`` (and itself)."""

    def __init__(self, chosen):
        super().__init__()
        self.chosen = chosen

    def forward(self, features, coords, *, patch_size_level0, return_index=False):
        from pathology.querent import MILOutput, build_regions

        layout = build_regions(coords, patch_size_level0, 4)
        nr = layout.num_regions
        idx = torch.full((1, nr, 2), -1, dtype=torch.long)
        idx[0, :, 0] = torch.arange(nr)
        idx[0, :, 1] = self.chosen(layout)
        n = features.shape[0]
        return MILOutput(torch.zeros(1, 2), torch.full((n,), 1.0 / n), torch.zeros(1, 4), [idx], layout)


def test_selection_recall_counts_the_other_sites_patches_in_the_chosen_regions():
    cfg = CohortConfig(bag_size=600, strength=6.0, site_patches=10, decoys=0, negatives="single")
    bag = next(b for b in make_cohort(4, 3, cfg) if b.label)
    a, b_ = bag.sites[0][2], bag.sites[1][2]
    from pathology.querent import build_regions

    reg = build_regions(bag.coords, 1.0, 4).region_of_patch()
    assert not set(reg[a].tolist()) & set(reg[b_].tolist())  # far apart: the sites share no region
    target = int(reg[b_][0])  # one of B's regions
    share_b = float(np.isin(reg[b_].numpy(), [target]).mean())
    to_b = _Picks(lambda layout: torch.full((layout.num_regions,), target))
    r = bs._selection_recall(to_b, bag)
    # A's regions pick one of B's regions (that share of B's patches); B's regions pick their own (none of A's)
    assert r["recall"] == pytest.approx((share_b + 0.0) / 2)
    selfish = _Picks(lambda layout: torch.arange(layout.num_regions))
    assert bs._selection_recall(selfish, bag)["recall"] == 0.0
    g = torch.Generator().manual_seed(0)
    half = bs._selection_recall(selfish, bag, g, max_patches=300)
    assert 0.2 < half["seen"] < 0.8  # about half of the planted patches survive a 300-of-600 step
    assert bs._selection_recall(to_b, next(b for b in make_cohort(4, 3, cfg) if not b.label)) is None


def test_planted_separation_before_and_after_the_layers():
    """The planted patches' offset from the others over the others' spread, on the embedded patches and on the
    pooled tokens; context that varies from patch to patch independently of the planting (here: noise 10x the
    tokens' spread) buries them."""
    from pathology.querent import Querent, QuerentConfig

    cfg = CohortConfig(bag_size=600, strength=6.0, site_patches=12, decoys=0, negatives="single")
    bags = make_cohort(4, 5, cfg)
    bag = next(b for b in bags if b.label)
    torch.manual_seed(0)
    m = Querent(QuerentConfig(in_dim=bag.features.shape[1], dim=16, depth=0, num_heads=2, dropout=0.0,
                              pos_encoding="none")).eval()
    with torch.no_grad():  # embed = identity onto the first 16 dims, then GELU
        m.embed[0].weight.zero_()
        m.embed[0].weight[:, :16].copy_(torch.eye(16))
        m.embed[0].bias.zero_()
    r = bs._planted_separation(m, bag)
    emb = torch.nn.functional.gelu(bag.features[:, :16]).numpy()
    s = np.zeros(len(emb), bool)
    s[bag.strong_patches()] = True
    rest = emb[~s]
    want = np.linalg.norm(emb[s].mean(0) - rest.mean(0)) / np.sqrt(((rest - rest.mean(0)) ** 2).sum(1).mean())
    assert r["embed"] == pytest.approx(want, rel=1e-4) and r["embed"] > 0.5
    assert r["tokens"] > 0.5  # a LayerNorm keeps them apart
    g = torch.Generator().manual_seed(0)
    m.norm.register_forward_hook(lambda mod, i, o: o + 10 * torch.randn(o.shape, generator=g))
    buried = bs._planted_separation(m, bag)
    assert buried["embed"] == pytest.approx(r["embed"]) and buried["tokens"] < 0.3  # (noise alone: ~(1/24 planted patches)^0.5)
    assert bs._planted_separation(m, next(b for b in bags if not b.strong)) is None if any(
        not b.strong for b in bags) else True


def test_variants_and_settings():
    auto = bs.settings("auto", 120, 2000)
    assert auto["max_patches"] == 512 and auto["region_size"] == 8 and auto["optimizer"] == "adamw"
    pub = bs.settings("transmil_published", 120, 500)
    assert (pub["optimizer"], pub["lr"], pub["weight_decay"], pub["dim"]) == ("radam_lookahead", 2e-4, 1e-5, 512)
    with pytest.raises(ValueError, match="unknown variant"):
        bs.settings("nope", 120, 500)
    base = bs.model_config(auto, 16)
    assert (base.pool_from, base.final_norm, base.pos_encoding, base.depth) == ("tokens", True, "sincos", 1)
    cfg = bs.model_config(bs.settings("embed_gate_nonorm_nopos", 120, 2000), 16)
    assert (cfg.pool_from, cfg.final_norm, cfg.pos_encoding) == ("embed_gate", False, "none")
    cfg = bs.model_config(bs.settings("selfonly", 120, 2000), 16)
    assert (cfg.region_size, cfg.neighbourhood, cfg.topk) == (1, 0, 0)
    staged = bs.settings("staged_nonorm_nopos", 120, 2000)
    assert staged["layers_from"] == 30 and "layers_from" not in auto  # earlier records' keys stay as they were
    cfg = bs.model_config(staged, 16)
    assert (cfg.final_norm, cfg.pos_encoding, cfg.depth) == (False, "none", 1)


def test_cli_runs_diagnoses_resumes_and_refuses_the_other_stages_seeds(tmp_path, monkeypatch, capsys):
    import benchmarks.pathology_cohort_bench as cb

    real = cb.recipe
    monkeypatch.setattr(cb, "recipe", lambda name, n: {**real(name, n), "epochs": 2, "min_epochs": 1, "smooth": 1})
    rec = tmp_path / "r.jsonl"
    args = ["--stage", "dev", "--seeds", "200", "--bags", "12", "--bag-sizes", "300", "--models", "querent", "abmil",
            "--folds", "2", "--records", str(rec), "--threads", "1"]
    assert run_cli(bs.main, args) == 0
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    assert [r["model"] for r in lines] == ["querent", "abmil"]
    q = lines[0]["diagnostics"]
    assert len(q) == 2 and {"train_auc", "strong_mass", "recall", "recall_step", "share"} <= set(q[0])
    assert "recall" not in lines[1]["diagnostics"][0]
    assert all(0 <= d["recall"] <= 1 and 0 < d["share"] <= 1 for d in q)
    assert len(lines[0]["probs"]) == 12
    assert run_cli(bs.main, args) == 0 and len(rec.read_text().splitlines()) == 2  # nothing redone
    assert run_cli(bs.main, args[:3] + ["10"] + args[4:]) == 2
    assert "report seeds" in capsys.readouterr().err
    out = tmp_path / "s.json"
    assert run_cli(bs.main, ["--stage", "summary", "--records", str(rec), "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    row = table["dev/n12/bag300/auto/querent/f2"]
    assert row["seeds"] == [200] and "minus_abmil" in row and "recall" in row


def test_a_units_training_gets_the_variants_staged_layers(monkeypatch):
    import pathology.training as training

    seen = []

    def fake_cv(name, mcfg, bags, tc, folds, on_fold):
        seen.append((name, mcfg.depth, tc.layers_from))
        raise RuntimeError("stop")

    monkeypatch.setattr(training, "cross_validate", fake_cv)
    for variant in ("staged", "auto"):
        with pytest.raises(RuntimeError, match="stop"):
            bs.run_unit("dev", 12, 300, 200, variant, "querent", folds=2)
    assert seen == [("querent", 1, 30), ("querent", 1, 0)]


def test_report_stage_runs_each_models_recipe_and_plots_the_curve(tmp_path, monkeypatch):
    import benchmarks.pathology_cohort_bench as cb

    real = cb.recipe
    monkeypatch.setattr(cb, "recipe", lambda name, n: {**real(name, n), "epochs": 2, "min_epochs": 1, "smooth": 1})
    monkeypatch.setattr(bs, "REPORT_VARIANTS", {("querent", 300): "nopos"})
    assert bs.report_variant("querent", 300) == "nopos" and bs.report_variant("abmil", 300) == "auto"
    rec = tmp_path / "r.jsonl"
    args = ["--stage", "report", "--seeds", "10", "--bags", "12", "--bag-sizes", "300", "--models", "querent", "abmil",
            "--folds", "2", "--records", str(rec), "--threads", "1"]
    assert run_cli(bs.main, args) == 0
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    assert [(r["model"], r["variant"]) for r in lines] == [("querent", "nopos"), ("abmil", "auto")]
    assert lines[0]["settings"]["pos_encoding"] == "none"
    out = tmp_path / "s.json"
    assert run_cli(bs.main, ["--stage", "summary", "--records", str(rec), "--out", str(out)]) == 0
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = json.loads(out.read_text())["report/n12/bag300/nopos/querent/f2"]
    assert "minus_abmil" in row  # paired with the peer's own recipe
