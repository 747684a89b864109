"""Dynamic token selection (mixture-of-depths style routing) for causal sequence models.

A routed layer lets only some tokens of a sequence run a transformer block; the others skip it (identity).

Pieces:
    ``TokenRouter``: linear score per token, ``(B, S, D) -> (B, S)``.
    ``CapacityPredictor``: per-sample fraction of tokens to keep, in ``[min_capacity, max_capacity]`` (per
        position, from the running mean of the tokens so far, for prefix top-k).
    ``topk_mask``: exactly ``k_b`` tokens per sample (ranks from a stable sort, so ties never add or drop
        a token: the published code's strict ``score > kth_score`` kept ``k - 1``).
    ``AuxSelectionPredictor``: per-token MLP trained (binary cross-entropy, on detached inputs) to predict the
        top-k decision; at evaluation it replaces top-k, which looks at the whole sequence, by a per-token
        decision that depends on token ``i`` only, so it is causal whenever the layer's input is.
    ``RoutedBlock``: wraps a causal block ``f``; selected tokens (kept in time order) run ``f`` and get
        ``x + w * (f(x_sel) - x_sel)`` with ``w = sigmoid(score)``, the others pass through unchanged.
    The predictors live in ``core.routing_predictors``.

The released code (ruthless-man/Decision-Mixer, ``DM/DM.py``) is reproduced by ``RoutingConfig.reference()``; each of
this project's departures from it is its own field (``capacity_input``, ``capacity_rounding``,
``capacity_gradient``, ``strict_threshold``, ``update``, ``aux_activation``), so each can be tested alone.

Selections (``mode``):
    ``"topk"``: exactly ``k = round(c * S)`` tokens per sample by score over the whole sequence. Whether token
        ``i`` is routed then depends on later tokens (in a Decision Mixer, on the action the state token must
        predict), which no policy can see when acting.
    ``"prefix"``: causal prefix top-k: token ``i`` is routed when its rank among the scores of tokens ``0..i``
        (ties to the earlier token) is below ``c_i * n_i - 0.5``, ``n_i`` the valid tokens up to ``i`` and ``c_i``
        the capacity predicted from them: the top ``c_i`` fraction of every prefix. The decision depends on
        tokens ``<= i`` only, so training can use the selection that acting can
        (``RoutingConfig.train_selection = "prefix"``); the count per sample varies.
    ``"aux"``: the auxiliary predictor's per-token decision (evaluation).
    ``"auto"``: ``train_selection`` in ``train()``, ``"aux"`` in ``eval()``.
    ``RoutingConfig.random_selection`` (a control, not the method): the router's scores choose nothing;
        ``"topk"`` keeps ``k = round(c * S)`` uniformly random tokens, ``"prefix"`` and ``"aux"`` keep each token
        independently with probability ``c`` (causal), ``c`` the fixed ``capacity``; the router still weighs
        the selected tokens' updates, and the auxiliary predictor is not trained.

How the capacity predictor gets gradient (the published code cast ``k`` with ``.long()``, which cuts it): the
forward pass uses the hard mask ``M``, and the backward pass a straight-through soft mask
``m = sigmoid((c * n - rank - 0.5) / T)`` (``n``, ``rank``: per sample for top-k, per prefix for prefix top-k):
the applied gate is ``M + m - m.detach()``, equal to ``M`` in value. Its gradient with respect to ``c`` is
``sum_i dL/dgate_i * dm_i/dc`` with ``dL/dgate_i = <dL/dy_i, w_i (f(x_i) - x_i)>``, which needs the block's
output at token ``i``. With ``probe_tokens = 0`` only selected tokens have one, so the gradient can say that
dropping a selected token hurts but never that adding one helps, and capacity drifts down even at zero cost.
With ``probe_tokens = P > 0`` (the default) the gradient is two-sided: the first ``P`` unselected tokens past the
cut of each sample (prefix: those within ``P`` ranks of their prefix's cut) also run the block, each seeing
the selected tokens before it and itself (the output it would get if it alone were added; its effect on later
tokens is left out), with gate value 0, so the forward output is unchanged and the block, router and later
layers get no gradient from them; and the soft mask's gradient is kept to the ``P`` ranks on each side of the
cut, so both sides weigh alike. The probes cost ``P`` extra block tokens per sample in training only (none
under ``torch.no_grad()`` or in ``"aux"`` mode). A compute cost ``mean(c)`` is also returned; a trainer adds it
with a weight to trade accuracy for fewer routed tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.routing_predictors import AuxSelectionPredictor, CapacityPredictor, FlatCapacityPredictor, TokenRouter

logger = logging.getLogger(__name__)

__all__ = [
    "RoutingConfig",
    "RoutingInfo",
    "TokenRouter",
    "CapacityPredictor",
    "FlatCapacityPredictor",
    "AuxSelectionPredictor",
    "RoutedBlock",
    "topk_mask",
    "token_ranks",
    "prefix_ranks",
    "prefix_topk_mask",
    "soft_capacity_mask",
]

_MODES = ("auto", "topk", "prefix", "aux")
_TRAIN_SELECTIONS = ("topk", "prefix")
_CHOICES = {"capacity_input": ("mean", "flatten"), "capacity_rounding": ("round", "floor"),
            "update": ("gated_residual", "scaled_block"), "aux_activation": ("gelu", "silu")}

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
    # unselected tokens past the cut that run the block for the capacity gradient only (0: one-sided, through
    # selected tokens only, which cannot learn that adding a token helps); 4 = 2 T covers the soft mask's slope
    probe_tokens: int = 4
    train_selection: str = "topk"  # mode "auto" in train(): "topk" (whole sequence) or "prefix" (causal prefix top-k)
    random_selection: bool = False  # control: random tokens at the fixed `capacity` (module docstring); needs learn_capacity False
    # Departures from the released code (DM/DM.py): each default is this project's fix, the other value the
    # release's; `reference()` sets them all the release's way.
    capacity_input: str = "mean"  # "mean": from the mean token, any length; "flatten": all S*D values (S = seq_len fixed)
    seq_len: int = 0  # tokens per sequence, needed by capacity_input="flatten" (the release wires it to 3 K)
    capacity_rounding: str = "round"  # k = round(c n) >= 1; "floor": clamp(c n, 1, n) cast down (the release's .long())
    capacity_gradient: bool = True  # straight-through soft mask; False: the predictor gets no gradient (the release)
    strict_threshold: bool = False  # True: keep scores strictly above the k-th one, k - 1 tokens (the release)
    update: str = "gated_residual"  # x + sigmoid(s) (f(x) - x); "scaled_block": s f(x), raw score s (the release)
    aux_activation: str = "gelu"  # hidden activation of the auxiliary predictor ("silu": the release)

    @classmethod
    def reference(cls, *, dim: int, seq_len: int, **overrides) -> "RoutingConfig":
        """The released layer (``DM/DM.py``): capacity ``clamp(sigmoid(MLP(flatten x)) S, 1, S).long()`` with no
        gradient, hidden 512 and LeakyReLU, strict threshold, update ``s f(x)``, auxiliary MLP of width ``D // 2``
        with SiLU. ``overrides`` flip single fields (one fix at a time)."""
        base = dict(dim=dim, seq_len=seq_len, capacity=0.5, min_capacity=0.0, max_capacity=1.0, capacity_hidden=512,
                    aux_hidden=max(dim // 2, 1), probe_tokens=0, train_selection="topk", capacity_input="flatten",
                    capacity_rounding="floor", capacity_gradient=False, strict_threshold=True,
                    update="scaled_block", aux_activation="silu")
        return cls(**{**base, **overrides})

    def __post_init__(self) -> None:
        if self.random_selection and self.learn_capacity:
            raise ValueError("random_selection=True routes at the fixed capacity: set learn_capacity=False")
        if self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        if not 0.0 <= self.min_capacity <= self.max_capacity <= 1.0 or self.max_capacity == 0.0:
            raise ValueError(
                f"need 0 <= min_capacity ({self.min_capacity}) <= max_capacity ({self.max_capacity}) <= 1, "
                f"max_capacity > 0"
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
        if self.probe_tokens < 0:
            raise ValueError(f"probe_tokens must be >= 0, got {self.probe_tokens}")
        if self.train_selection not in _TRAIN_SELECTIONS:
            raise ValueError(f"train_selection must be one of {_TRAIN_SELECTIONS}, got {self.train_selection!r}")
        for name, accepted in _CHOICES.items():
            if getattr(self, name) not in accepted:
                raise ValueError(f"{name} must be one of {accepted}, got {getattr(self, name)!r}")
        if self.capacity_input == "flatten":
            if self.seq_len <= 0:
                raise ValueError(f"capacity_input='flatten' needs seq_len > 0 (tokens per sequence), got {self.seq_len}")
            if self.train_selection != "topk":
                raise ValueError("capacity_input='flatten' has no causal form: it needs train_selection='topk'")


@dataclass
class RoutingInfo:
    """What one routed layer decided, for losses and visualisation."""

    mask: torch.Tensor  # (B, S) bool: token ran the block
    scores: torch.Tensor  # (B, S) router logits
    capacity: torch.Tensor  # (B,) fraction used (predicted, or the fixed one; prefix: mean over positions); kept/S in aux mode
    aux_logits: torch.Tensor  # (B, S) auxiliary predictor logits
    aux_loss: torch.Tensor  # scalar BCE of the auxiliary predictor against the top-k mask (0 in aux mode)
    capacity_cost: torch.Tensor  # scalar mean predicted capacity (compute cost to penalize)
    mode: str  # "topk", "prefix" or "aux"


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


def prefix_ranks(scores_BS: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal ranks: ``(rank_BS, n_BS)``, ``rank[b, i]`` = number of valid tokens ``j < i`` with ``score_j >= score_i``
    (0-based rank of token ``i`` among tokens ``0..i``, ties to the earlier token), ``n[b, i]`` = valid tokens in
    ``0..i``. Both depend on tokens ``<= i`` only. Padded tokens get rank ``S`` (never selected)."""
    s = scores_BS.detach()
    S = s.shape[-1]
    earlier_SS = torch.ones(S, S, dtype=torch.bool, device=s.device).tril(-1)  # [i, j]: j < i
    beats_BSS = (s[:, None, :] >= s[:, :, None]) & earlier_SS  # [b, i, j]: earlier token j ranks above i
    valid_BS = torch.ones_like(s, dtype=torch.bool) if key_padding_mask is None else ~key_padding_mask
    beats_BSS = beats_BSS & valid_BS[:, None, :]
    rank_BS = beats_BSS.sum(-1)
    n_BS = valid_BS.long().cumsum(-1)
    return rank_BS.masked_fill(~valid_BS, S), n_BS


def prefix_topk_mask(scores_BS: torch.Tensor, capacity_B: torch.Tensor | float,
                     key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``(B, S)`` causal prefix top-k: token ``i`` is kept when ``prefix rank < c * n_i - 0.5`` (see
    :func:`prefix_ranks`), i.e. it lies in the top ``c`` fraction of the valid tokens ``0..i``."""
    rank_BS, n_BS = prefix_ranks(scores_BS, key_padding_mask)
    c_B = torch.as_tensor(capacity_B, dtype=torch.float32, device=scores_BS.device).detach().expand(scores_BS.shape[0])
    return rank_BS.float() < c_B[:, None] * n_BS.float() - 0.5


def soft_capacity_mask(ranks_BS: torch.Tensor, capacity_B: torch.Tensor, n_B: torch.Tensor | int,
                       temperature: float) -> torch.Tensor:
    """Differentiable (in ``capacity_B``) relaxation of ``rank < capacity * n``: values in (0, 1).

    ``capacity_B`` is ``(B,)`` or, per position, ``(B, S)``; ``n_B`` an int, a ``(B,)`` tensor (top-k: valid
    tokens per sample) or a ``(B, S)`` tensor (prefix top-k: valid tokens up to each position)."""
    n = torch.as_tensor(n_B, device=capacity_B.device, dtype=capacity_B.dtype)
    c = capacity_B[:, None] if capacity_B.ndim == 1 else capacity_B
    k_cont = c * (n[:, None] if n.ndim == 1 else n)
    return torch.sigmoid((k_cont - ranks_BS.to(capacity_B.dtype) - 0.5) / temperature)


def _capacity_to_k(cap_B: torch.Tensor, n_B: torch.Tensor, rounding: str) -> torch.Tensor:
    """Tokens to keep per sample ``(B,)`` in ``[1, n]``: ``round(c n)``, or ``floor(clamp(c n, 1, n))``."""
    if rounding == "floor":
        kf_B = cap_B * n_B
        return torch.minimum(torch.maximum(kf_B, torch.ones_like(kf_B)), n_B.to(kf_B.dtype)).long()
    return torch.minimum(torch.round(cap_B * n_B).long().clamp(min=1), n_B)


def _strict_topk_mask(scores_BS: torch.Tensor, k_B: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens whose score is strictly above the ``k``-th highest (``k - 1`` of them without ties, none for
    ``k = 1``): the released selection, kept for ``RoutingConfig.strict_threshold``."""
    s = scores_BS.detach()
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask, float("-inf"))
    sorted_BS = torch.sort(s, dim=-1, descending=True).values
    kth_B = sorted_BS.gather(-1, (k_B - 1).clamp(min=0)[:, None])
    return s > kth_B


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


def _bias_from_keep(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


class RoutedBlock(nn.Module):
    """Run ``block`` on the routed tokens only; the others skip it.

    ``block`` maps ``(B, K, D) -> (B, K, D)`` (a residual transformer block) and must be causal: the selected
    tokens are packed in time order with padding at the end, so a causal block never lets a real token see a
    padded one, and no padding mask is needed. A block with ``accepts_attn_bias = True`` is also called as
    ``block(x, attn_bias=bias)``: on the selected tokens of all samples laid end to end, the bias keeping
    each token to earlier-or-equal tokens of its own sample, when that saves at least a fifth of the tokens
    (samples keep different numbers of tokens, and padding follows the largest) and the bias stays small; and,
    in training with capacity probes (module docstring), with a bias that lets a probe token see the selected
    tokens before it and itself, and no token see a probe. Every call computes the same function.

    Modes: ``"topk"``, ``"prefix"``, ``"aux"`` and ``"auto"`` (module docstring).
    """

    def __init__(self, block: nn.Module, config: RoutingConfig):
        super().__init__()
        self.block = block
        self.config = config
        self.router = TokenRouter(config.dim)
        lo, hi = config.min_capacity, config.max_capacity
        if not config.learn_capacity:
            self.capacity_predictor = None
        elif config.capacity_input == "flatten":
            self.capacity_predictor = FlatCapacityPredictor(config.dim, config.seq_len, config.capacity_hidden,
                                                            lo=lo, hi=hi)
        else:
            self.capacity_predictor = CapacityPredictor(config.dim, config.capacity_hidden, lo=lo, hi=hi,
                                                        init=config.capacity)
        self.aux = AuxSelectionPredictor(config.dim, config.aux_hidden, config.aux_activation)

    def forward(self, x_BSD: torch.Tensor, *, mode: str = "auto",
                key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, RoutingInfo]:
        """Args:
            x_BSD: tokens.
            mode: "auto", "topk", "prefix" or "aux".
            key_padding_mask: optional bool ``(B, S)``, True = padded (never routed, not counted in ``S``).
        Returns:
            ``(y_BSD, RoutingInfo)``.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if mode == "auto":
            mode = self.config.train_selection if self.training else "aux"
        B, S, _ = x_BSD.shape
        cfg = self.config
        scores_BS = self.router(x_BSD)
        aux_logits_BS = self.aux(x_BSD.detach())
        n_B = torch.full((B,), S, device=x_BSD.device) if key_padding_mask is None else (~key_padding_mask).sum(-1)
        valid_BS = torch.ones(B, S, dtype=torch.bool, device=x_BSD.device) if key_padding_mask is None \
            else ~key_padding_mask
        zero = x_BSD.new_zeros(())
        probe_BS = torch.zeros_like(valid_BS)
        if cfg.random_selection:
            cap_B = torch.full((B,), cfg.capacity, device=x_BSD.device, dtype=x_BSD.dtype)
            if mode == "topk":
                k_B = torch.minimum(torch.round(cap_B * n_B).long().clamp(min=1), n_B)
                mask_BS = token_ranks(torch.rand_like(scores_BS), key_padding_mask) < k_B[:, None]
            else:
                mask_BS = (torch.rand_like(scores_BS) < cfg.capacity) & valid_BS
            gate_BS = mask_BS.to(x_BSD.dtype)
            aux_loss, cost = zero, cap_B.mean()
        elif mode in ("topk", "prefix"):
            if self.capacity_predictor is None:
                cap_B = torch.full((B,), cfg.capacity, device=x_BSD.device, dtype=x_BSD.dtype)
                cap_soft = cap_B
            elif mode == "topk":
                cap_B = cap_soft = self.capacity_predictor(x_BSD, key_padding_mask)
            else:  # causal: position i's capacity pools tokens 0..i
                cap_soft = self.capacity_predictor.prefix(x_BSD, key_padding_mask)  # (B, S)
                vf_BS = valid_BS.to(x_BSD.dtype)
                cap_B = (cap_soft * vf_BS).sum(-1) / vf_BS.sum(-1).clamp_min(1.0)
            if mode == "topk":
                k_B = _capacity_to_k(cap_B.detach(), n_B, cfg.capacity_rounding)
                ranks_BS = token_ranks(scores_BS, key_padding_mask)
                mask_BS = (_strict_topk_mask(scores_BS, k_B, key_padding_mask) if cfg.strict_threshold
                           else ranks_BS < k_B[:, None])
                n_soft = n_B
                past_cut_BS = ranks_BS - k_B[:, None]  # integer ranks past the cut: < 0 selected
            else:
                ranks_BS, n_soft = prefix_ranks(scores_BS, key_padding_mask)
                c_BS = cap_soft.detach() if cap_soft.ndim == 2 else cap_soft.detach()[:, None]
                cut_BS = c_BS * n_soft - 0.5
                mask_BS = (ranks_BS < cut_BS) & valid_BS
                past_cut_BS = ranks_BS - cut_BS  # ranks past the prefix's cut: < 0 selected
            gate_BS = mask_BS.to(x_BSD.dtype)
            if self.capacity_predictor is not None and cfg.capacity_gradient and cap_soft.requires_grad:
                soft_BS = soft_capacity_mask(ranks_BS, cap_soft, n_soft, cfg.soft_rank_temperature)
                st_BS = soft_BS - soft_BS.detach()  # value 0; gradient: the soft mask's
                P = cfg.probe_tokens
                if P > 0:
                    probe_BS = (past_cut_BS >= 0) & (past_cut_BS < P) & valid_BS
                    st_BS = st_BS * ((past_cut_BS >= -P) & (past_cut_BS < P)).to(x_BSD.dtype)
                gate_BS = gate_BS + st_BS  # value: hard mask; gradient: the soft one
            target_BS = mask_BS.to(x_BSD.dtype)
            vf_BS = valid_BS.to(x_BSD.dtype)
            aux_loss = (F.binary_cross_entropy_with_logits(aux_logits_BS, target_BS, reduction="none") * vf_BS
                        ).sum() / vf_BS.sum().clamp_min(1.0)
            cost = cap_B.mean()
        else:
            mask_BS = (torch.sigmoid(aux_logits_BS) > cfg.aux_threshold) & valid_BS
            gate_BS = mask_BS.to(x_BSD.dtype)
            cap_B = mask_BS.sum(-1).to(x_BSD.dtype) / n_B.clamp_min(1).to(x_BSD.dtype)
            aux_loss, cost = zero, cap_B.mean()

        if cfg.update == "scaled_block":  # s f(x) = x + s (f(x) - x) + (s - 1) x on routed tokens
            y_BSD = (x_BSD + self._update(x_BSD, mask_BS, probe_BS, scores_BS * gate_BS)
                     + ((scores_BS - 1.0) * gate_BS).unsqueeze(-1) * x_BSD)
        else:
            y_BSD = x_BSD + self._update(x_BSD, mask_BS, probe_BS, torch.sigmoid(scores_BS) * gate_BS)
        info = RoutingInfo(mask=mask_BS, scores=scores_BS, capacity=cap_B, aux_logits=aux_logits_BS,
                           aux_loss=aux_loss, capacity_cost=cost, mode=mode)
        return y_BSD, info

    def _update(self, x_BSD: torch.Tensor, mask_BS: torch.Tensor, probe_BS: torch.Tensor,
                weight_BS: torch.Tensor) -> torch.Tensor:
        """``w * (f(x_run) - x_run)`` for the selected and probe tokens, scattered back to ``(B, S, D)``."""
        B = x_BSD.shape[0]
        run_BS = mask_BS | probe_BS
        k_B = run_BS.sum(-1)
        total, kmax = int(k_B.sum()), (int(k_B.max()) if B else 0)
        if total == 0:
            return torch.zeros_like(x_BSD)
        has_probes = bool(probe_BS.any())
        if getattr(self.block, "accepts_attn_bias", False):
            if total <= _PACK_MAX_TOKENS and total <= (1.0 - _PACK_MIN_SAVING) * B * kmax:
                return self._packed_update(x_BSD, run_BS, mask_BS, weight_BS)
            if has_probes:
                return self._padded_bias_update(x_BSD, run_BS, mask_BS, weight_BS, k_B, kmax)
        if not has_probes:
            return self._padded_update(x_BSD, mask_BS, weight_BS, k_B, kmax)
        k_sel_B = mask_BS.sum(-1)
        update = self._padded_update(x_BSD, mask_BS, weight_BS, k_sel_B, int(k_sel_B.max()))
        return update + self._probe_prefix_update(x_BSD, mask_BS, probe_BS, weight_BS)

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

    def _padded_bias_update(self, x_BSD: torch.Tensor, run_BS: torch.Tensor, live_BS: torch.Tensor,
                            weight_BS: torch.Tensor, k_B: torch.Tensor, kmax: int) -> torch.Tensor:
        """As :meth:`_padded_update` for the run tokens (selected and probes), with a per-row bias: a token sees
        the earlier-or-equal selected tokens of its row and itself (so a probe is seen by no other token)."""
        x_run_BKD, index_BK, valid_BK = _gather_selected(x_BSD, run_BS, k_B, kmax)
        live_BK = torch.gather(live_BS, 1, index_BK) & valid_BK
        eye_KK = torch.eye(kmax, dtype=torch.bool, device=x_BSD.device)
        keep_BKK = eye_KK[None] | (torch.ones_like(eye_KK).tril()[None] & live_BK[:, None, :])  # [b, query, key]
        delta_BKD = self.block(x_run_BKD, attn_bias=_bias_from_keep(keep_BKK, x_BSD.dtype)[:, None]) - x_run_BKD
        w_BK = torch.gather(weight_BS, 1, index_BK) * valid_BK.to(x_BSD.dtype)
        return torch.zeros_like(x_BSD).scatter_add(1, index_BK[..., None].expand_as(delta_BKD), delta_BKD * w_BK[..., None])

    def _packed_update(self, x_BSD: torch.Tensor, run_BS: torch.Tensor, live_BS: torch.Tensor,
                       weight_BS: torch.Tensor) -> torch.Tensor:
        """``w * (f(x_run) - x_run)`` scattered back to ``(B, S, D)``, with the run tokens of all samples in one
        sequence and a block-diagonal causal bias in which only selected (live) tokens are seen by others."""
        B, S, D = x_BSD.shape
        flat_T = run_BS.reshape(-1).nonzero().squeeze(1)  # sample-major, time order within each sample
        x_run_1TD = x_BSD.reshape(B * S, D).index_select(0, flat_T)[None]
        seg_T, pos_T = flat_T // S, flat_T % S
        live_T = live_BS.reshape(-1).index_select(0, flat_T)
        keep_TT = (seg_T[:, None] == seg_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])  # [query, key]
        keep_TT = keep_TT & (live_T[None, :] | torch.eye(len(flat_T), dtype=torch.bool, device=x_BSD.device))
        bias = _bias_from_keep(keep_TT, x_BSD.dtype)
        delta_TD = (self.block(x_run_1TD, attn_bias=bias[None, None]) - x_run_1TD)[0]
        w_T = weight_BS.reshape(-1).index_select(0, flat_T)
        update = torch.zeros(B * S, D, dtype=x_BSD.dtype, device=x_BSD.device).index_add(0, flat_T, delta_TD * w_T[:, None])
        return update.view(B, S, D)

    def _probe_prefix_update(self, x_BSD: torch.Tensor, live_BS: torch.Tensor, probe_BS: torch.Tensor,
                             weight_BS: torch.Tensor) -> torch.Tensor:
        """Probe updates for a block without an attention bias: one row per probe token, holding the selected
        tokens before it then the probe itself; the causal block's output at the probe is read (what follows it
        in the row does not reach it)."""
        B, S, D = x_BSD.shape
        b_P, pos_P = probe_BS.nonzero(as_tuple=True)
        k_sel_B = live_BS.sum(-1)
        kmax = int(k_sel_B.max())
        x_live_BKD, _, _ = _gather_selected(x_BSD, live_BS, k_sel_B, kmax)
        before_BS = live_BS.long().cumsum(-1) - live_BS.long()  # selected tokens strictly before each position
        m_P = before_BS[b_P, pos_P]
        rows_PLD = torch.cat([x_live_BKD[b_P], x_BSD.new_zeros(len(b_P), 1, D)], dim=1)  # (P, kmax + 1, D)
        ar_P = torch.arange(len(b_P), device=x_BSD.device)
        x_probe_PD = x_BSD[b_P, pos_P]
        rows_PLD = rows_PLD.index_put((ar_P, m_P), x_probe_PD)
        delta_PD = self.block(rows_PLD)[ar_P, m_P] - x_probe_PD
        update = torch.zeros(B * S, D, dtype=x_BSD.dtype, device=x_BSD.device)
        flat_P = b_P * S + pos_P
        return update.index_add(0, flat_P, delta_PD * weight_BS[b_P, pos_P][:, None]).view(B, S, D)
