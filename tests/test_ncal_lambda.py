"""The TC schedule and its logging (apps.ncal.train --tc-start, gradient share), the raw class-mean cosine, and
benchmarks.ncal_lambda's choice rule and summary."""

from __future__ import annotations

import json

import pytest
import torch

from core.collapse import mean_offdiag_cosine, simplex_etf
from tests._ncal_toy import CLASSES, toy_examples, write_tiny_encoder


def test_mean_offdiag_cosine_is_minus_one_over_k_minus_one_at_the_etf():
    K = 5
    W = simplex_etf(K, 8, generator=torch.Generator().manual_seed(0))
    h = W.repeat_interleave(3, 0) * 2.0
    y = torch.arange(K).repeat_interleave(3)
    assert mean_offdiag_cosine(h, y, K) == pytest.approx(-1 / (K - 1), abs=1e-6)
    same = torch.ones(10, 4)  # every class at the same point: cosine 1
    assert mean_offdiag_cosine(same + 0.0, torch.arange(10) % 2, 2) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def enc_dir(tmp_path_factory):
    return write_tiny_encoder(tmp_path_factory.mktemp("enc"), [e.text for e in toy_examples()])


def _run(tmp, enc, **kw):
    from apps.ncal.train import TrainConfig, train

    cfg = TrainConfig(dataset="toy", out=str(tmp), encoder=str(enc), epochs=2, batch_size=8, lr=3e-3, ckpt_every=50,
                      nc_train_sample=32, device="cpu", seed=2, valid_frac=0.2, **kw)
    train(cfg, progress=False, examples=(toy_examples(), None, CLASSES))
    return [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_tc_start_keeps_the_term_out_until_then_and_the_share_is_logged(tmp_path, enc_dir):
    ce = _run(tmp_path / "ce", enc_dir, loss="ce")
    late = _run(tmp_path / "late", enc_dir, loss="tc", tc_lambda=10.0, tc_start=0.5, grad_share_every=1)
    now = _run(tmp_path / "now", enc_dir, loss="tc", tc_lambda=10.0, grad_share_every=1)
    # first epoch of "late": cross-entropy only, so the same training as ce
    assert late[0]["train_loss"] == pytest.approx(ce[0]["train_loss"], abs=1e-3)
    assert late[0]["valid_macro_f1"] == pytest.approx(ce[0]["valid_macro_f1"])
    assert late[0]["tc_active"] is False and late[1]["tc_active"] is True
    # tc_start 0.5 of 2 epochs: from the first step of epoch 2 on, exactly (tc_on_at: step >= tc_from)
    assert late[0]["tc_steps"] == 0 and late[1]["tc_steps"] == late[1]["step"] - late[0]["step"]
    assert now[0]["tc_steps"] == now[0]["step"]
    assert late[1]["train_loss"] > ce[1]["train_loss"] + 0.05  # the TC term (λ = 10) is now in the loss
    assert now[0]["train_loss"] > ce[0]["train_loss"] + 0.05
    assert all(r["tc_grad_share"] > 0 and "valid_nc_cos_mean" in r for r in late + now)
    with pytest.raises(ValueError, match="tc_start"):
        from apps.ncal.train import TrainConfig

        TrainConfig(dataset="x", out="y", tc_start=1.0)


def test_lambda_choice_rule_and_summary(tmp_path):
    from benchmarks.ncal_lambda import choose, config_name, summary_markdown

    assert config_name("ce") == "ce" and config_name("tc", 3.0, 0.33) == "tc_l3_s0.33"
    recs = [{"loss": "ce", "config": "ce", "valid": {"macro_f1": 0.9}},
            {"loss": "tc", "config": "tc_l3_s0", "tc_lambda": 3.0, "tc_start": 0.0, "valid": {"macro_f1": 0.5}},
            {"loss": "tc", "config": "tc_l1_s0", "tc_lambda": 1.0, "tc_start": 0.0, "valid": {"macro_f1": 0.5}},
            {"loss": "tc", "config": "tc_l10_s0", "tc_lambda": 10.0, "tc_start": 0.0, "valid": {"macro_f1": 0.4}}]
    assert choose(recs)["config"] == "tc_l1_s0"  # ties: the smaller λ; ce is never chosen
    assert choose(recs[:1]) is None
    for r in recs:
        r.update(valid_cos_raw=-0.1, per_epoch=[{"tc_grad_share": 0.5}], valid={**r["valid"], "accuracy": 0.7, "nc_nc1": 1.0,
                                                            "nc_nc2": 0.5, "nc_cos_mean": -0.1})
    md = summary_markdown({"datasets": {"toy": {"sweep": recs, "chosen": "tc_l1_s0",
                                                "test": {"mean": 1.0, "ci95": [0.5, 1.5], "method": "tc_l1_s0",
                                                         "seeds": [0, 1], "tc_macro_f1": [60.0, 61.0],
                                                         "ce_macro_f1": [59.0, 60.0],
                                                         "tfidf_balanced_macro_f1": 70.0}}}})
    assert "| toy | tc_l1_s0 | 50.0 |" in md and "**yes**" in md and "+1.00 [+0.50, +1.50]" in md
