"""Querent's per-query selection, the sparse-regime bag generator and the benchmark's record/summary code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from benchmarks.pathology_sparse import (GridBagConfig, append_record, auc, chebyshev, folds_for, main, make_bag,
                                         make_cohort, pooled_auc_ci, read_records, record_key, render_bag,
                                         spatial_label, summarize, t_interval)
from core.attention import attention
from core.blocksparse import block_summaries, block_upper_bound
from pathology.querent import Querent, QuerentConfig, build_regions, per_query_region_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _grid(w: int, h: int, keep: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    gy, gx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    grid = torch.stack([gx, gy], -1).reshape(-1, 2)
    m = torch.rand(len(grid), generator=g) < keep
    m[0] = True
    return grid[m] * 256 + 512


def _qkv(coords: torch.Tensor, R: int, H: int = 2, hd: int = 8, seed: int = 0):
    lay = build_regions(coords, 256, R)
    pad = torch.ones(1, lay.padded_len, dtype=torch.bool)
    pad[0, lay.slot] = False
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, lay.padded_len, hd, generator=g) for _ in range(3))
    return lay, pad, q, k, v


# ------------------------------------------------------------------------------------ per-query selection


def test_per_query_with_every_region_is_dense_attention():
    coords = _grid(13, 11, 0.7)
    lay, pad, q, k, v = _qkv(coords, 4)
    o, idx = per_query_region_attention(q, k, v, lay, topk=lay.num_regions, key_padding_mask=pad)
    real = lay.slot
    ref = attention(q[:, :, real], k[:, :, real], v[:, :, real])
    torch.testing.assert_close(o[:, :, real], ref, atol=1e-5, rtol=1e-5)
    assert bool((idx[0][:, real] >= 0).sum(-1).eq(lay.num_regions).all())  # every query saw every region


@pytest.mark.parametrize("selection", ["query", "region"])
def test_model_with_every_region_equals_dense_model(selection):
    coords = _grid(12, 10, 0.8)
    torch.manual_seed(0)
    feats = torch.randn(len(coords), 8)
    outs = {}
    for sel in (selection, "dense"):
        torch.manual_seed(1)  # same weights for both
        m = Querent(QuerentConfig(in_dim=8, dim=16, num_heads=2, depth=2, region_size=4, topk=100, selection=sel,
                                  dropout=0.0)).eval()
        with torch.no_grad():
            outs[sel] = m(feats, coords, patch_size_level0=256)
    torch.testing.assert_close(outs[selection].logits, outs["dense"].logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[selection].attention, outs["dense"].attention, atol=1e-6, rtol=1e-5)


def test_per_query_selects_per_query_by_its_own_bound():
    coords = _grid(17, 15, 0.75, seed=3)
    lay, pad, q, k, v = _qkv(coords, 4, seed=5)
    topk = 2
    o, idx = per_query_region_attention(q, k, v, lay, topk=topk, key_padding_mask=pad)
    bs, nr = 16, lay.num_regions
    kmin, kmax, _ = block_summaries(k, bs, key_padding_mask=pad)
    bound = block_upper_bound(q, kmin, kmax)[0]  # (H, S, NR)
    region_of = lay.slot // bs
    distinct = 0
    for h in range(q.shape[1]):
        per_region: dict[int, set] = {}
        for j, s in enumerate(lay.slot.tolist()):
            r = int(region_of[j])
            chosen = {int(c) for c in idx[0, h, s] if c >= 0}
            neigh = {int(c) for c in lay.neighbours[r] if c >= 0}
            assert neigh <= chosen  # the neighbourhood is always attended
            extra = chosen - neigh
            assert len(extra) == min(topk, nr - len(neigh))
            others = [n for n in range(nr) if n not in neigh]
            # the extras are this query's own best regions by its bound
            worst_chosen = min(float(bound[h, s, n]) for n in extra)
            best_left = max((float(bound[h, s, n]) for n in others if n not in extra), default=-math.inf)
            assert worst_chosen >= best_left
            per_region.setdefault(r, set()).add(frozenset(chosen))
            # the output is exact attention over this query's own regions
            keys = torch.isin(torch.arange(lay.padded_len) // bs, torch.tensor(sorted(chosen))) & ~pad[0]
            w = torch.softmax(q[0, h, s] @ k[0, h, keys].T / math.sqrt(q.shape[-1]), 0)
            torch.testing.assert_close(o[0, h, s], w @ v[0, h, keys], atol=1e-5, rtol=1e-4)
        distinct += sum(len(c) > 1 for c in per_region.values())
    assert distinct > 0  # queries of one region chose differently: the choice really is per query


@pytest.mark.parametrize("group", [1, 4, 32])
def test_per_query_attention_and_its_gradients_match_masked_dense_attention(group):
    """Every tile size and batch size (a 1-byte budget: one query per batch) gives the same output and the
    same gradients as dense attention masked to each query's own regions."""
    coords = _grid(14, 13, 0.7, seed=2)
    lay, pad, q, k, v = _qkv(coords, 4, seed=7)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    bs = 16
    outs = {}
    w = torch.randn_like(q)
    for budget in (1, 32 * 2**20):
        o, idx = per_query_region_attention(q, k, v, lay, topk=3, key_padding_mask=pad, budget_bytes=budget,
                                            query_group=group)
        grads = torch.autograd.grad((o[:, :, lay.slot] * w[:, :, lay.slot]).sum(), (q, k, v))
        outs[budget] = (o, idx, grads)
    torch.testing.assert_close(outs[1][0], outs[32 * 2**20][0])
    assert torch.equal(outs[1][1], outs[32 * 2**20][1])
    for a, b in zip(outs[1][2], outs[32 * 2**20][2]):
        torch.testing.assert_close(a, b)
    # reference: dense attention, each query allowed the keys of exactly the regions it reports
    region_of_key = torch.arange(lay.padded_len) // bs
    allowed = (idx[0][..., None] == region_of_key).any(-2) & ~pad[0]  # (H, S, S)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    s = (qr @ kr.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    ref = torch.softmax(s.masked_fill(~allowed[None], float("-inf")), -1) @ vr
    ref_grads = torch.autograd.grad((ref[:, :, lay.slot] * w[:, :, lay.slot]).sum(), (qr, kr, vr))
    torch.testing.assert_close(o[:, :, lay.slot], ref[:, :, lay.slot], atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got[:, :, lay.slot], want[:, :, lay.slot], atol=1e-5, rtol=1e-4)


def test_per_query_model_trains_and_reports_its_index():
    coords = _grid(12, 12, 0.9)
    m = Querent(QuerentConfig(in_dim=8, dim=16, num_heads=2, region_size=4, topk=1, selection="query"))
    out = m(torch.randn(len(coords), 8), coords, patch_size_level0=256, return_index=True)
    out.logits.sum().backward()
    assert all(p.grad is not None for p in m.layers[0].attn.parameters())
    assert out.block_index[0].shape[:2] == (2, out.layout.padded_len)
    ids = m.regions_for_patch(out, 5)
    assert 1 <= len(ids) <= 9 + 1
    with pytest.raises(ValueError, match="selection"):
        QuerentConfig(in_dim=8, selection="per-query")
    assert QuerentConfig(in_dim=8).selection == "region"  # the default is unchanged


# ------------------------------------------------------------------------------------------- generator


def test_spatial_label_follows_the_distance_of_the_same_two_sites():
    cfg = GridBagConfig(side=40, keep=0.8, in_dim=8, radius=2.0, near=(6, 8), far_min=20)
    rng = np.random.default_rng(0)
    near = render_bag(rng, "AB", [(10, 10), (17, 12)], cfg, label=spatial_label((10, 10), (17, 12), cfg))
    far = render_bag(rng, "AB", [(10, 10), (33, 30)], cfg, label=spatial_label((10, 10), (33, 30), cfg))
    assert (near.label, far.label) == (1, 0)  # moving B away flips the label
    with pytest.raises(ValueError, match="neither near"):
        spatial_label((10, 10), (22, 10), cfg)
    # the same pattern content in both: as many A and B patches (sites are whole disks), so counts cannot tell
    from benchmarks.pathology_sparse import pattern_directions

    d = torch.from_numpy(pattern_directions(cfg))
    for bag in (near, far):
        assert len(bag.features) > 0.75 * 40 * 40
    def site_sizes(bag):
        pos = bag.coords
        return [int(((pos - torch.tensor(c)).pow(2).sum(1) <= cfg.radius**2).sum()) for c in bag.centres]
    assert site_sizes(near) == site_sizes(far)
    # patches of site A carry μ_A: their mean projection on μ_A is about the amplitude, elsewhere about 0
    a = ((near.coords - torch.tensor(near.centres[0])).pow(2).sum(1) <= cfg.radius**2)
    proj = near.features @ d[0]
    assert float(proj[a].mean()) > 1.0 > float(proj[~a].mean().abs())


def test_cohorts_are_balanced_and_labels_mean_what_they_say():
    cfg = GridBagConfig(side=40, keep=0.9, in_dim=8, radius=2.0, near=(6, 8), far_min=20)
    sp = make_cohort("spatial", 12, 0, cfg)
    assert [b.label for b in sp].count(1) == 6
    for b in sp:
        assert b.sites == "AB" and spatial_label(*b.centres, cfg) == b.label
        assert chebyshev(*b.centres) <= 8 if b.label else chebyshev(*b.centres) >= 20
    co = make_cohort("cooccur", 12, 0, cfg)
    assert all((b.sites == "AB") == bool(b.label) for b in co)
    assert {b.sites for b in co if not b.label} <= {"AA", "BB", "CC"}
    again = make_cohort("spatial", 12, 0, cfg)
    assert all(torch.equal(x.features, y.features) for x, y in zip(sp, again))  # seeded
    with pytest.raises(ValueError, match="kind"):
        make_bag(np.random.default_rng(0), "nearby", 1, cfg)


def test_several_pairs_per_bag_all_near_or_all_far():
    from benchmarks.pathology_sparse import pattern_directions

    cfg = GridBagConfig(side=64, keep=0.9, in_dim=8, radius=2.0, near=(6, 8), far_min=16, pairs=3)
    bags = make_cohort("spatial", 10, 0, cfg)
    gap = int(2 * cfg.radius) + 2
    for b in bags:
        assert b.sites == "ABABAB" and len(b.centres) == 6
        a, bb = b.centres[0::2], b.centres[1::2]
        if b.label:
            assert all(6 <= chebyshev(p, q) <= 8 for p, q in zip(a, bb))  # each A next to its B
        else:
            assert all(chebyshev(p, q) >= 16 for p in a for q in bb)  # every A far from every B
        assert all(chebyshev(p, q) >= gap for i, p in enumerate(b.centres) for q in b.centres[i + 1:])  # apart
        # every A site painted with μ_A (mean projection about the amplitude there, about 0 elsewhere)
        in_a = torch.zeros(len(b.coords), dtype=torch.bool)
        for c in a:
            in_a |= (b.coords - torch.tensor(c)).pow(2).sum(1) <= cfg.radius**2
        proj = b.features @ torch.from_numpy(pattern_directions(cfg))[0]
        assert int(in_a.sum()) == 3 * 13 and float(proj[in_a].mean()) > 2.0 > 0.5 > float(proj[~in_a].mean().abs())
    assert [b.label for b in bags].count(1) == 5
    with pytest.raises(ValueError, match="pairs"):
        GridBagConfig(pairs=0)
    with pytest.raises(ValueError, match="could not place 4"):
        make_bag(np.random.default_rng(0), "spatial", 0, GridBagConfig(side=30, radius=2.0, near=(6, 8), far_min=25,
                                                                        pairs=4))


# ----------------------------------------------------------------------------------- records, summary


def test_auc_folds_and_interval():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50)
    s = rng.random(50).round(1)  # ties
    assert auc(y, s) == pytest.approx(roc_auc_score(y, s))
    folds = folds_for(list(y), 5, seed=1)
    assert sorted(i for f in folds for i in f) == list(range(50))
    assert max(abs(sum(y[f]) - sum(y) / 5) for f in folds) <= 1
    m, lo, hi = t_interval([0.8, 0.9, 1.0])
    assert m == pytest.approx(0.9) and lo < 0.9 < hi and hi - 0.9 == pytest.approx(0.9 - lo)


def _cv(label, model, seed, fold, ids, labels, probs, a=None):
    return {"stage": "cv", "label": label, "model": model, "seed": seed, "fold": fold, "test_ids": ids,
            "test_labels": labels, "test_probs": probs, "auc": auc(labels, probs) if a is None else a,
            "epochs_run": 3, "train_cpu_s": 6.0, "steps": 30, "regions_kept": 0.15 if "querent" in model else None}


def test_records_resume_and_summary(tmp_path):
    path = tmp_path / "r.jsonl"
    ids = [f"b{i}" for i in range(8)]
    y = [1, 0] * 4
    good = [0.9, 0.1] * 4  # perfect
    bad = [0.4, 0.6, 0.6, 0.4, 0.5, 0.5, 0.7, 0.2]
    for seed in (0, 1):
        for fold in (0, 1):
            sl = slice(4 * fold, 4 * fold + 4)
            append_record(path, _cv("spatial", "dense", seed, fold, ids[sl], y[sl], good[sl]))
            append_record(path, _cv("spatial", "querent_region", seed, fold, ids[sl], y[sl], good[sl]))
            append_record(path, _cv("spatial", "abmil", seed, fold, ids[sl], y[sl], bad[sl]))
    with open(path, "a") as f:
        f.write('{"stage": "cv", "label": "spa')  # a killed run's torn last line
    recs = read_records(path)
    assert len(recs) == 12
    assert record_key(recs["cv|spatial|0|1|abmil"]) == "cv|spatial|0|1|abmil"
    with pytest.raises(ValueError, match="stage"):
        record_key({"stage": "train"})
    s = summarize(recs, labels=["spatial"], models=["dense", "querent_region", "abmil"], n_boot=200)
    rows = {r["model"]: r for r in s["rows"]}
    assert rows["dense"]["pooled_auc"] == 1.0 and rows["querent_region"]["minus_dense"] == 0.0
    assert rows["abmil"]["pooled_auc"] == pytest.approx(auc(y, bad))
    assert rows["abmil"]["minus_dense"] < 0 and rows["abmil"]["minus_dense_lo"] <= rows["abmil"]["minus_dense"]
    assert rows["querent_region"]["runs"] == 4 and rows["querent_region"]["seeds"] == [0, 1]
    t = s["targets"]
    assert t["querent_region_spatial_within_1pt_of_dense"]["point_met"]
    assert t["querent_region_above_abmil_on_spatial"]["point_met"]
    # a seed missing a fold is left out of the pooled AUC, not mixed in
    partial = [r for k, r in recs.items() if r["model"] == "abmil" and not (r["seed"] == 1 and r["fold"] == 1)]
    assert pooled_auc_ci(partial, n_boot=10)["seeds"] == 1
    # while dense has only part of its folds there is no paired difference (not a NaN in the table)
    early = {k: r for k, r in recs.items() if r["model"] != "dense" or r["fold"] == 0}
    rows = {r["model"]: r for r in summarize(early, labels=["spatial"], models=["dense", "abmil"], n_boot=20)["rows"]}
    assert "minus_dense" not in rows["abmil"] and rows["dense"]["runs"] == 2


def test_quick_run_writes_json_and_curve(tmp_path):
    out = tmp_path / "res.json"
    argv = ["--quick", "--models", "mean,dense", "--records", str(tmp_path / "r.jsonl"), "--out", str(out),
            "--work", str(tmp_path / "w"), "--approx-grid", "region:4:0,query:4:4", "--labels", "spatial",
            "--bags", "10", "--no-progress", "--n-boot", "50"]
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert {r["model"] for r in d["rows"]} == {"mean", "dense"}
    assert {(a["selection"], a["topk"]) for a in d["approx"]} == {("region", 0), ("query", 4)}
    assert all(0 < a["regions_kept"] < 1 and a["rel_error"] >= 0 for a in d["approx"])
    assert d["speed"] and d["speed"][0]["dense_cpu_s"] > 0
    assert (tmp_path / "res_curves.png").exists()
    n = len(read_records(tmp_path / "r.jsonl"))
    assert main(argv) == 0  # resumed: nothing is redone
    assert len(read_records(tmp_path / "r.jsonl")) == n
    # other settings never reuse the records of the old ones: every unit runs again, tagged with its settings
    lines = lambda: [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]  # noqa: E731
    assert main(argv + ["--lr", "0.01"]) == 0
    recs = lines()
    assert len(recs) == 2 * n and len({r["settings_id"] for r in recs}) == 2
    d2 = json.loads(out.read_text())
    assert d2["settings"]["lr"] == 0.01 and {r["model"] for r in d2["rows"]} == {"mean", "dense"}
    assert main(argv) == 0  # and back: the first settings' records are still there, nothing runs
    assert len(lines()) == 2 * n
    with pytest.raises(SystemExit, match="legacy-records"):
        main(argv + ["--legacy-records"])


def test_dev_probe_cli_records_per_epoch_history(tmp_path):
    import json

    from benchmarks.pathology_sparse_dev import main

    out = tmp_path / "dev.jsonl"
    assert main(["--side", "16", "--radius", "2", "--near", "4,5", "--far-min", "10", "--bags", "6", "--val", "4",
                 "--epochs", "2", "--region-size", "4", "--topk", "2", "--dim", "8", "--heads", "1",
                 "--models", "dense,abmil", "--batch-bags", "4", "--out", str(out)]) == 0
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["model"] for r in recs] == ["dense", "abmil"]
    assert all(len(r["history"]) == 2 and r["settings"]["bags"] == 6 for r in recs)


def test_batch_bags_takes_one_step_on_several_bags():
    """With two bags per step, one epoch of two bags is one step on the mean of their losses (not two steps)."""
    from benchmarks.pathology_sparse import build_peer, train_peer
    from pathology.querent import QuerentConfig

    cfg = GridBagConfig(side=16, radius=2, near=(4, 5), far_min=10)
    bags = make_cohort("spatial", 2, 5, cfg)
    mc = QuerentConfig(in_dim=cfg.in_dim, dim=8, depth=1, num_heads=1, region_size=4, topk=2, dropout=0.0,
                       num_classes=2, pool_hidden=8)
    model, _ = train_peer("abmil", mc, bags, bags, epochs=1, lr=1e-2, patience=5, min_epochs=1, seed=0, batch_bags=2)
    torch.manual_seed(0)
    ref = build_peer("abmil", mc)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-2)
    loss = sum(torch.nn.functional.cross_entropy(ref(b.features, b.coords, patch_size_level0=1).logits,
                                                 torch.tensor([b.label])) for b in bags) / 2
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=n)
    with pytest.raises(ValueError, match="batch_bags"):
        train_peer("abmil", mc, bags, bags, epochs=1, lr=1e-2, patience=5, min_epochs=1, seed=0, batch_bags=0)


def test_a_stopped_fit_resumes_from_its_epoch_checkpoint_to_the_same_model(tmp_path, monkeypatch):
    """A fit stopped during epoch 3 resumes after epoch 2 and ends with the weights and history of an
    uninterrupted fit; the checkpoint is removed when the fit ends."""
    import benchmarks.pathology_sparse as ps
    from pathology.querent import QuerentConfig

    cfg = GridBagConfig(side=16, radius=2, near=(4, 5), far_min=10)
    bags = make_cohort("spatial", 6, 5, cfg)
    mc = QuerentConfig(in_dim=cfg.in_dim, dim=8, depth=1, num_heads=1, region_size=4, topk=2, dropout=0.1,
                       num_classes=2, pool_hidden=8)
    kw = dict(epochs=4, lr=1e-2, patience=9, min_epochs=1, seed=3, batch_bags=2)
    ref, ref_info = ps.train_peer("dense", mc, bags[:4], bags[4:], **kw)
    ckpt = tmp_path / "fit.pt"
    real, calls = ps._probs, []

    def stop_in_epoch_3(model, val):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, val)

    monkeypatch.setattr(ps, "_probs", stop_in_epoch_3)
    with pytest.raises(KeyboardInterrupt):
        ps.train_peer("dense", mc, bags[:4], bags[4:], checkpoint=str(ckpt), **kw)
    assert len(torch.load(ckpt, weights_only=False)["history"]) == 2
    monkeypatch.setattr(ps, "_probs", real)
    model, info = ps.train_peer("dense", mc, bags[:4], bags[4:], checkpoint=str(ckpt), **kw)
    assert info["history"] == ref_info["history"] and info["best_epoch"] == ref_info["best_epoch"]
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=n)
    assert not ckpt.exists()
