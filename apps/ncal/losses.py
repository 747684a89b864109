"""The training losses NCAL compares, behind one module: ``ce``, ``tc`` and four long-tail peers.

| name | loss | prediction |
|---|---|---|
| ``ce`` | cross-entropy | argmax of the logits |
| ``tc`` | CE + λ·TC (:func:`core.collapse.tc_loss`, λ = 0.1, pairs also with a bank of recent features) | same |
| ``cb`` | class-balanced CE (Cui et al. 2019): weights ∝ (1 − β)/(1 − β^n_c), β = 0.999, mean weight 1 | same |
| ``la`` | logit-adjusted CE (Menon et al. 2021): CE of ``logits + τ log π``, τ = 1, π the train prior | same (unadjusted) |
| ``focal`` | focal loss (Lin et al. 2017), γ = 2 | same |
| ``etf`` | fixed simplex-ETF classifier + dot-regression loss (Yang et al. 2022) | nearest ETF vector |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.collapse import FeatureBank, dot_regression_loss, tc_loss

__all__ = ["LOSSES", "LossConfig", "LongTailLoss", "tc_on_at", "with_tc"]

LOSSES = ("ce", "tc", "cb", "la", "focal", "etf")


def tc_on_at(step: int, tc_from: int) -> bool:
    """Whether the TC term is in the loss of optimizer step ``step`` (0-based): from step ``tc_from`` on, inclusive.

    ``tc_from = round(tc_start · total)``; ``tc_start = 0`` puts the term in every step's loss, step 0 included.
    """
    return step >= tc_from


def with_tc(task: torch.Tensor, reg: torch.Tensor | None, tc_lambda: float, tc_on: bool) -> torch.Tensor:
    """The training loss: ``task + tc_lambda · reg`` while the term is on (:func:`tc_on_at`), else ``task``."""
    return task + tc_lambda * reg if reg is not None and tc_on else task


@dataclass(kw_only=True)
class LossConfig:
    """Which loss and its hyper-parameters (defaults are the published ones)."""

    name: str = "tc"  # one of LOSSES
    tc_lambda: float = 0.1  # weight of the TC term (NCAL: 0.1)
    bank_size: int = 256  # recent features the TC term also pairs with (0: batch only, as the published code)
    cb_beta: float = 0.999  # class-balanced loss: effective-number β
    la_tau: float = 1.0  # logit adjustment: τ
    focal_gamma: float = 2.0  # focal loss: γ

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.name!r}")
        if self.tc_lambda < 0 or self.bank_size < 0:
            raise ValueError(f"tc_lambda ({self.tc_lambda}) and bank_size ({self.bank_size}) must be >= 0")
        if not 0 <= self.cb_beta < 1:
            raise ValueError(f"cb_beta must be in [0, 1), got {self.cb_beta}")

    def to_dict(self) -> dict:
        return asdict(self)


class LongTailLoss(nn.Module):
    """``forward(feats_ND, logits_NK, y_N, etf_W_KD=None) -> (loss, {"task": ..., "tc": ...})``.

    Args:
        cfg: the loss.
        class_counts: train examples per class ``(K,)`` (class-balanced weights, logit-adjustment prior).
        feature_dim: width of the features (the TC bank).
    """

    def __init__(self, cfg: LossConfig, class_counts: torch.Tensor, feature_dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        counts_K = torch.as_tensor(class_counts, dtype=torch.float64).clamp_min(1.0)
        self.num_classes = int(counts_K.numel())
        eff_K = (1 - cfg.cb_beta ** counts_K) / (1 - cfg.cb_beta) if cfg.cb_beta > 0 else torch.ones_like(counts_K)
        w_K = 1.0 / eff_K
        self.register_buffer("cb_weight_K", (w_K / w_K.mean()).float())
        self.register_buffer("log_prior_K", torch.log(counts_K / counts_K.sum()).float())
        self.bank = FeatureBank(cfg.bank_size if cfg.name == "tc" else 0, feature_dim)

    def terms(self, feats_ND: torch.Tensor, logits_NK: torch.Tensor, y_N: torch.Tensor,
              etf_W_KD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(task loss, TC term before λ or None)`` as tensors (the TC term only for ``tc``; no bank push)."""
        name = self.cfg.name
        if name in ("ce", "tc"):
            task = F.cross_entropy(logits_NK, y_N)
        elif name == "cb":
            task = F.cross_entropy(logits_NK, y_N, weight=self.cb_weight_K.to(logits_NK.dtype))
        elif name == "la":
            task = F.cross_entropy(logits_NK + self.cfg.la_tau * self.log_prior_K.to(logits_NK.dtype), y_N)
        elif name == "focal":
            logp_N = F.log_softmax(logits_NK, dim=-1).gather(1, y_N[:, None]).squeeze(1)
            task = (-(1 - logp_N.exp()) ** self.cfg.focal_gamma * logp_N).mean()
        else:  # etf
            if etf_W_KD is None:
                raise ValueError("the etf loss needs the ETF classifier's vectors (etf_W_KD)")
            task = dot_regression_loss(feats_ND, y_N, etf_W_KD)
        if name != "tc":
            return task, None
        bank_h, bank_y = self.bank.get()
        return task, tc_loss(feats_ND, y_N, self.num_classes, bank_h_MD=bank_h, bank_y_M=bank_y)

    def forward(self, feats_ND: torch.Tensor, logits_NK: torch.Tensor, y_N: torch.Tensor,
                etf_W_KD: torch.Tensor | None = None, *, tc_on: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """``tc_on=False`` leaves the TC term out of the loss (still measured and logged; a TC schedule)."""
        task, reg = self.terms(feats_ND, logits_NK, y_N, etf_W_KD)
        parts: dict[str, float] = {"task": float(task.detach())}
        loss = task
        if reg is not None:
            parts["tc"] = float(reg.detach())
            loss = with_tc(task, reg, self.cfg.tc_lambda, tc_on)
            if self.training:
                self.bank.push(feats_ND, y_N)
        return loss, parts
