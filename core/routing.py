"""Dynamic token selection (mixture-of-depths style routing) for causal sequence models.

A routed layer lets only some tokens of a sequence run a transformer block; the others skip it (identity).

Pieces:
    ``TokenRouter``: linear score per token, ``(B, S, D) -> (B, S)``.
    ``CapacityPredictor``: per-sample fraction of tokens to keep, in ``[min_capacity, max_capacity]``.
    ``topk_mask``: exactly ``k_b`` tokens per sample (ranks from a stable sort, so ties never add or drop
        a token: the published code's strict ``score > kth_score`` kept ``k - 1``).
    ``AuxSelectionPredictor``: per-token MLP trained (binary cross-entropy, on detached inputs) to predict the
        top-k decision; at evaluation it replaces top-k, which looks at the whole sequence, by a per-token
        decision that depends on token ``i`` only, so it is causal whenever the layer's input is.
    ``RoutedBlock``: wraps a causal block ``f``; selected tokens (kept in time order) run ``f`` and get
        ``x + w * (f(x_sel) - x_sel)`` with ``w = sigmoid(score)``, the others pass through unchanged.

How the capacity predictor gets gradient (the published code cast ``k`` with ``.long()``, which cuts it):
the forward pass uses the hard top-k mask ``M`` (exactly ``k = round(c * S)`` tokens), and the backward pass
uses a straight-through soft mask ``m = sigmoid((c * S - rank - 0.5) / T)``: the applied mask is
``M + m - m.detach()``, equal to ``M`` in value, whose gradient with respect to ``c`` says whether keeping
more or fewer of the marginal tokens would lower the loss. Tokens that skipped the block contribute no gradient
(their block output was never computed). A compute cost ``mean(c)`` is also returned; a trainer adds it with a
weight to trade accuracy for fewer routed tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = [
    "RoutingConfig",
    "RoutingInfo",
    "TokenRouter",
    "CapacityPredictor",
    "AuxSelectionPredictor",
    "RoutedBlock",
    "topk_mask",
    "token_ranks",
    "soft_capacity_mask",
]

_MODES = ("auto", "topk", "aux")

# Packed routing runs the block on the selected tokens of all samples laid end to end, with a block-diagonal
# causal bias: compute follows the number of selected tokens rather than batch x the largest sample's count.
# Used while the bias stays small (tokens^2 floats) and packing saves at least this fraction of the tokens.
_PACK_MAX_TOKENS = 2048
_PACK_MIN_SAVING = 0.2


@dataclass(kw_only=True)
class RoutingConfig:
    """Settings of one routed layer."""

    dim: int  # token width D
    capacity: float = 0.5  # fraction of tokens kept when `learn_capacity` is False (and the predictor's start)
    learn_capacity: bool = True  # predict a per-sample capacity with `CapacityPredictor`
    min_capacity: float = 0.1  # lower bound of the predicted fraction (at least one token is always kept)
    max_capacity: float = 1.0  # upper bound of the predicted fraction
    capacity_hidden: int = 64  # width of the capacity predictor's hidden layer
    soft_rank_temperature: float = 2.0  # T of the straight-through soft mask, in ranks (larger: more tokens get gradient)
    aux_hidden: int = 64  # width of the auxiliary selection predictor's hidden layer
    aux_threshold: float = 0.5  # probability above which the auxiliary predictor selects a token at evaluation

    def __post_init__(self) -> None:
        if self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        if not 0.0 < self.min_capacity <= self.max_capacity <= 1.0:
            raise ValueError(
                f"need 0 < min_capacity ({self.min_capacity}) <= max_capacity ({self.max_capacity}) <= 1"
            )
        if not self.min_capacity <= self.capacity <= self.max_capacity:
            raise ValueError(
                f"capacity ({self.capacity}) must lie in [min_capacity ({self.min_capacity}), "
                f"max_capacity ({self.max_capacity})]"
            )
        if self.soft_rank_temperature <= 0:
            raise ValueError(f"soft_rank_temperature must be positive, got {self.soft_rank_temperature}")
        if self.capacity_hidden <= 0 or self.aux_hidden <= 0:
            raise ValueError(f"hidden widths must be positive, got {self.capacity_hidden}, {self.aux_hidden}")
        if not 0.0 < self.aux_threshold < 1.0:
            raise ValueError(f"aux_threshold must be in (0, 1), got {self.aux_threshold}")


@dataclass
class RoutingInfo:
    """What one routed layer decided, for losses and visualisation."""

    mask: torch.Tensor  # (B, S) bool: token ran the block
    scores: torch.Tensor  # (B, S) router logits
    capacity: torch.Tensor  # (B,) fraction used (predicted, or the fixed one); (B,) of kept/S in aux mode
    aux_logits: torch.Tensor  # (B, S) auxiliary predictor logits
    aux_loss: torch.Tensor  # scalar BCE of the auxiliary predictor against the top-k mask (0 in aux mode)
    capacity_cost: torch.Tensor  # scalar mean predicted capacity (compute cost to penalize)
    mode: str  # "topk" or "aux"


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


class AuxSelectionPredictor(nn.Module):
    """Per-token MLP predicting whether top-k would select the token: ``(B, S, D) -> (B, S)`` logits.

    Token ``i``'s logit depends on ``x[:, i]`` only, which makes the decision causal.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.net(x_BSD).squeeze(-1)


def token_ranks(scores_BS: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """0-based rank of each token by descending score (ties broken by position); padded tokens rank last."""
    s = scores_BS.detach()
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask, float("-inf"))
    order_BS = torch.sort(s, dim=-1, descending=True, stable=True).indices
    ranks_BS = torch.empty_like(order_BS)
    ar = torch.arange(s.shape[-1], device=s.device).expand_as(order_BS)
    ranks_BS.scatter_(-1, order_BS, ar)
    return ranks_BS


def topk_mask(scores_BS: torch.Tensor, k_B: torch.Tensor | int,
              key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``(B, S)`` mask with exactly ``k_b`` True per row (the highest scores; ties by position).

    Args:
        scores_BS: router scores.
        k_B: int or int tensor ``(B,)``, tokens to keep per row; must lie in ``[0, S]`` (or in
            ``[0, valid tokens]`` when ``key_padding_mask`` marks padded tokens, which are never kept).
    """
    B, S = scores_BS.shape
    k_B = torch.as_tensor(k_B, device=scores_BS.device).expand(B)
    n_valid = S if key_padding_mask is None else (~key_padding_mask).sum(-1)
    if (k_B < 0).any() or (k_B > n_valid).any():
        raise ValueError(f"k must lie in [0, number of valid tokens]; got k={k_B.tolist()}, valid={n_valid}")
    return token_ranks(scores_BS, key_padding_mask) < k_B[:, None]


def soft_capacity_mask(ranks_BS: torch.Tensor, capacity_B: torch.Tensor, n_B: torch.Tensor | int,
                       temperature: float) -> torch.Tensor:
    """Differentiable (in ``capacity_B``) relaxation of ``rank < round(capacity * n)``: values in (0, 1)."""
    k_cont_B = capacity_B * torch.as_tensor(n_B, device=capacity_B.device, dtype=capacity_B.dtype)
    return torch.sigmoid((k_cont_B[:, None] - ranks_BS.to(capacity_B.dtype) - 0.5) / temperature)


def _gather_selected(x_BSD: torch.Tensor, mask_BS: torch.Tensor, k_B: torch.Tensor,
                     kmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected tokens first, in time order, padded at the end: (x_sel (B, K, D), index (B, K), valid (B, K)).

    ``k_B`` = ``mask_BS.sum(-1)`` and ``kmax`` its maximum (0 for an empty batch)."""
    # Stable sort of "not selected" puts selected positions first, each group in ascending time order.
    order_BS = torch.sort((~mask_BS).to(torch.int8), dim=-1, stable=True).indices
    index_BK = order_BS[:, :kmax]
    valid_BK = torch.arange(kmax, device=x_BSD.device)[None, :] < k_B[:, None]
    x_sel_BKD = torch.gather(x_BSD, 1, index_BK[..., None].expand(-1, -1, x_BSD.shape[-1]))
    return x_sel_BKD, index_BK, valid_BK


class RoutedBlock(nn.Module):
    """Run ``block`` on the routed tokens only; the others skip it.

    ``block`` maps ``(B, K, D) -> (B, K, D)`` (a residual transformer block) and must be causal: the selected
    tokens are packed in time order with padding at the end, so a causal block never lets a real token see a
    padded one, and no padding mask is needed. A block with ``accepts_attn_bias = True`` is also called as
    ``block(x_1TD, attn_bias=bias)`` on the selected tokens of all samples laid end to end, the bias keeping
    each token to earlier-or-equal tokens of its own sample; that packed call is used when it saves at least
    a fifth of the tokens (samples keep different numbers of tokens, and padding follows the largest) and
    the bias stays small. Both calls compute the same function.

    Modes: ``"topk"`` (exactly ``k`` per sample, used in training), ``"aux"`` (causal per-token decisions of the
    auxiliary predictor, used at evaluation), ``"auto"`` = topk in ``train()`` and aux in ``eval()``.
    """

    def __init__(self, block: nn.Module, config: RoutingConfig):
        super().__init__()
        self.block = block
        self.config = config
        self.router = TokenRouter(config.dim)
        self.capacity_predictor = (
            CapacityPredictor(config.dim, config.capacity_hidden, lo=config.min_capacity, hi=config.max_capacity,
                              init=config.capacity)
            if config.learn_capacity else None
        )
        self.aux = AuxSelectionPredictor(config.dim, config.aux_hidden)

    def forward(self, x_BSD: torch.Tensor, *, mode: str = "auto",
                key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingInfo]:
        """Args:
            x_BSD: tokens.
            mode: "auto", "topk" or "aux".
            key_padding_mask: optional bool ``(B, S)``, True = padded (never routed, not counted in ``S``).
        Returns:
            ``(y_BSD, RoutingInfo)``.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if mode == "auto":
            mode = "topk" if self.training else "aux"
        B, S, _ = x_BSD.shape
        cfg = self.config
        scores_BS = self.router(x_BSD)
        aux_logits_BS = self.aux(x_BSD.detach())
        n_B = torch.full((B,), S, device=x_BSD.device) if key_padding_mask is None else (~key_padding_mask).sum(-1)
        zero = x_BSD.new_zeros(())
        if mode == "topk":
            if self.capacity_predictor is not None:
                cap_B = self.capacity_predictor(x_BSD, key_padding_mask)
            else:
                cap_B = torch.full((B,), cfg.capacity, device=x_BSD.device, dtype=x_BSD.dtype)
            k_B = torch.round(cap_B.detach() * n_B).long().clamp(min=1)
            k_B = torch.minimum(k_B, n_B)
            ranks_BS = token_ranks(scores_BS, key_padding_mask)
            mask_BS = ranks_BS < k_B[:, None]
            gate_BS = mask_BS.to(x_BSD.dtype)
            if self.capacity_predictor is not None:
                soft_BS = soft_capacity_mask(ranks_BS, cap_B, n_B, cfg.soft_rank_temperature)
                gate_BS = gate_BS + soft_BS - soft_BS.detach()  # value: hard mask; gradient: soft one
            target_BS = mask_BS.to(x_BSD.dtype)
            valid_BS = torch.ones_like(target_BS) if key_padding_mask is None else (~key_padding_mask).to(x_BSD.dtype)
            aux_loss = (F.binary_cross_entropy_with_logits(aux_logits_BS, target_BS, reduction="none") * valid_BS
                        ).sum() / valid_BS.sum().clamp_min(1.0)
            cost = cap_B.mean()
        else:
            mask_BS = torch.sigmoid(aux_logits_BS) > cfg.aux_threshold
            if key_padding_mask is not None:
                mask_BS = mask_BS & ~key_padding_mask
            gate_BS = mask_BS.to(x_BSD.dtype)
            cap_B = mask_BS.sum(-1).to(x_BSD.dtype) / n_B.clamp_min(1).to(x_BSD.dtype)
            aux_loss, cost = zero, cap_B.mean()

        weight_BS = torch.sigmoid(scores_BS) * gate_BS
        k_B = mask_BS.sum(-1)
        total, kmax = int(k_B.sum()), int(k_B.max()) if B else 0
        if (getattr(self.block, "accepts_attn_bias", False) and 0 < total <= _PACK_MAX_TOKENS
                and total <= (1.0 - _PACK_MIN_SAVING) * B * kmax):
            y_BSD = x_BSD + self._packed_update(x_BSD, mask_BS, weight_BS)
        else:
            y_BSD = x_BSD + self._padded_update(x_BSD, mask_BS, weight_BS, k_B, kmax)
        info = RoutingInfo(mask=mask_BS, scores=scores_BS, capacity=cap_B, aux_logits=aux_logits_BS,
                           aux_loss=aux_loss, capacity_cost=cost, mode=mode)
        return y_BSD, info

    def _padded_update(self, x_BSD: torch.Tensor, mask_BS: torch.Tensor, weight_BS: torch.Tensor,
                       k_B: torch.Tensor, kmax: int) -> torch.Tensor:
        """``w * (f(x_sel) - x_sel)`` scattered back to ``(B, S, D)``, each sample's selected tokens in its own
        row, padded at the end to the largest count ``kmax``."""
        x_sel_BKD, index_BK, valid_BK = _gather_selected(x_BSD, mask_BS, k_B, kmax)
        if x_sel_BKD.shape[1] == 0:
            return torch.zeros_like(x_BSD)
        delta_BKD = self.block(x_sel_BKD) - x_sel_BKD
        w_BK = torch.gather(weight_BS, 1, index_BK) * valid_BK.to(x_BSD.dtype)
        return torch.zeros_like(x_BSD).scatter_add(1, index_BK[..., None].expand_as(delta_BKD), delta_BKD * w_BK[..., None])

    def _packed_update(self, x_BSD: torch.Tensor, mask_BS: torch.Tensor, weight_BS: torch.Tensor) -> torch.Tensor:
        """``w * (f(x_sel) - x_sel)`` scattered back to ``(B, S, D)``, with the selected tokens of all samples
        in one sequence and a block-diagonal causal bias (see the class docstring)."""
        B, S, D = x_BSD.shape
        flat_T = mask_BS.reshape(-1).nonzero().squeeze(1)  # sample-major, time order within each sample
        x_sel_1TD = x_BSD.reshape(B * S, D).index_select(0, flat_T)[None]
        seg_T, pos_T = flat_T // S, flat_T % S
        keep_TT = (seg_T[:, None] == seg_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
        bias = torch.zeros(keep_TT.shape, dtype=x_BSD.dtype, device=x_BSD.device).masked_fill(~keep_TT, float("-inf"))
        delta_TD = (self.block(x_sel_1TD, attn_bias=bias[None, None]) - x_sel_1TD)[0]
        w_T = weight_BS.reshape(-1).index_select(0, flat_T)
        update = torch.zeros(B * S, D, dtype=x_BSD.dtype, device=x_BSD.device).index_add(0, flat_T, delta_TD * w_T[:, None])
        return update.view(B, S, D)
