"""The small networks of a routed layer (``core.routing``): router, capacity predictors, auxiliary predictor.

    ``TokenRouter``: linear score per token, ``(B, S, D) -> (B, S)``.
    ``CapacityPredictor``: per-sample fraction of tokens to keep, from the mean token (any sequence length; per
        position from the running mean, for prefix top-k).
    ``FlatCapacityPredictor``: the released Decision Mixer's form (``DM/DM.py``): an MLP on all ``S * D`` values
        of the sequence, so ``S`` is fixed when the layer is built (``RoutingConfig.capacity_input="flatten"``).
    ``AuxSelectionPredictor``: per-token MLP predicting the top-k decision (one logit; the release's two-class head
        is the same function with the difference of its two rows, see ``rl.release``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["TokenRouter", "CapacityPredictor", "FlatCapacityPredictor", "AuxSelectionPredictor"]

_ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


class TokenRouter(nn.Module):
    """Linear router: one logit per token. ``(B, S, D) -> (B, S)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.proj(x_BSD).squeeze(-1)


class CapacityPredictor(nn.Module):
    """Per-sample fraction of tokens to keep, from the mean token: ``(B, S, D) -> (B,)`` in ``[lo, hi]``.

    The output layer starts at zero with a bias that puts the initial fraction at ``init``.
    """

    def __init__(self, dim: int, hidden: int, *, lo: float, hi: float, init: float):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.net[2].weight)
        with torch.no_grad():
            if hi > lo:
                p = min(max((init - lo) / (hi - lo), 1e-3), 1 - 1e-3)
                self.net[2].bias.fill_(float(torch.logit(torch.tensor(p))))

    def forward(self, x_BSD: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if key_padding_mask is None:
            pooled_BD = x_BSD.mean(1)
        else:
            keep_BS1 = (~key_padding_mask).unsqueeze(-1).to(x_BSD.dtype)
            pooled_BD = (x_BSD * keep_BS1).sum(1) / keep_BS1.sum(1).clamp_min(1.0)
        return self.lo + (self.hi - self.lo) * torch.sigmoid(self.net(pooled_BD).squeeze(-1))

    def prefix(self, x_BSD: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal capacity ``(B, S)``: position ``i`` pools the valid tokens ``0..i`` (running mean)."""
        keep_BS1 = (torch.ones_like(x_BSD[..., :1]) if key_padding_mask is None
                    else (~key_padding_mask).unsqueeze(-1).to(x_BSD.dtype))
        pooled_BSD = (x_BSD * keep_BS1).cumsum(1) / keep_BS1.cumsum(1).clamp_min(1.0)
        return self.lo + (self.hi - self.lo) * torch.sigmoid(self.net(pooled_BSD).squeeze(-1))


class FlatCapacityPredictor(nn.Module):
    """Per-sample fraction from the whole sequence flattened: ``(B, S, D) -> (B,)`` in ``[lo, hi]``.

    ``Linear(S * D, hidden) -> LeakyReLU -> Linear(hidden, 1) -> sigmoid``, PyTorch's default initialisation (the
    released code's ``k_predictor``). It accepts sequences of exactly ``seq_len`` tokens (padded tokens included,
    as in the release); it has no causal (prefix) form.
    """

    def __init__(self, dim: int, seq_len: int, hidden: int, *, lo: float, hi: float):
        super().__init__()
        self.lo, self.hi, self.seq_len = lo, hi, seq_len
        self.net = nn.Sequential(nn.Linear(seq_len * dim, hidden), nn.LeakyReLU(), nn.Linear(hidden, 1))

    def forward(self, x_BSD: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x_BSD.shape[1] != self.seq_len:
            raise ValueError(f"capacity_input='flatten' was built for {self.seq_len} tokens, got a sequence of "
                             f"{x_BSD.shape[1]}; use capacity_input='mean' for other lengths")
        flat_BX = x_BSD.reshape(x_BSD.shape[0], -1)  # (B, S * D)
        return self.lo + (self.hi - self.lo) * torch.sigmoid(self.net(flat_BX).squeeze(-1))


class AuxSelectionPredictor(nn.Module):
    """Per-token MLP predicting whether top-k would select the token: ``(B, S, D) -> (B, S)`` logits.

    Token ``i``'s logit depends on ``x[:, i]`` only, which makes the decision causal. ``activation``: ``"gelu"``
    or ``"silu"`` (the release's).
    """

    def __init__(self, dim: int, hidden: int, activation: str = "gelu"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.net = nn.Sequential(nn.Linear(dim, hidden), _ACTIVATIONS[activation](), nn.Linear(hidden, 1))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.net(x_BSD).squeeze(-1)
