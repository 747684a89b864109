"""The EMLoC host's image summary must let it learn in context (random label mapping per episode).

At ``summary_scale`` 1.0 the whole-image projection drowned the patch features and training stayed at
ln(num_labels); at the default 0.1 a 2-way host reads labels from its demonstrations within a few hundred
small steps. The label ids are drawn anew for every episode, so accuracy above 1/2 after a few shots can only
come from the context."""

from __future__ import annotations

import pytest
import torch

from apps.emloc.data import EpisodeConfig
from apps.emloc.model import EMLoCHost, HostConfig
from apps.emloc.train import episode_batch, episode_loss


def _train(scale: float, steps: int = 120) -> float:
    torch.manual_seed(0)
    m = EMLoCHost(HostConfig(image_summary=True, summary_scale=scale, dim=64, depth=2, num_heads=2, num_kv_heads=1))
    ec = EpisodeConfig(n_way=2)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.98))
    for step in range(steps):
        imgs, labs = episode_batch(list(range(step * 16, step * 16 + 16)), num_demos=12, split="train", config=ec)
        loss, _ = episode_loss(m, imgs, labs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    m.eval()
    with torch.no_grad():  # fresh episodes of held-out classes
        imgs, labs = episode_batch(list(range(10_000, 10_064)), num_demos=12, split="eval", config=ec)
        _, correct = episode_loss(m, imgs, labs)
    return float(correct[:, 4:].float().mean())  # positions with at least four demonstrations before them


def test_scaled_image_summary_learns_in_context():
    acc = _train(0.1)
    assert acc > 0.8, f"2-way in-context accuracy after 4+ shots on held-out classes: {acc:.3f}"


def test_summary_scale_must_be_positive():
    with pytest.raises(ValueError, match="summary_scale"):
        HostConfig(image_summary=True, summary_scale=0.0)
