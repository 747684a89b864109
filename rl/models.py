"""Decision Transformer and Decision Mixer: GPT-style policies over (return-to-go, state, action) tokens.

Token layout: for timesteps ``t = 0..T-1`` the sequence is ``R_0, s_0, a_0, R_1, s_1, a_1, ...`` (``3T`` tokens),
each token embedding plus a learned embedding of its episode timestep. The action ``a_t`` is predicted from the
output at ``s_t``, which (causal attention) sees ``R_<=t, s_<=t, a_<t`` only.

``DecisionMixer`` replaces some blocks (by default layers 1, 3, 5 of 6, zero-based) with
``core.routing.RoutedBlock``: a router scores the tokens, a capacity predictor chooses how many run the block
(exactly ``k``), the others skip it; an auxiliary predictor learns the selection and makes the decision at
evaluation time, token by token, so the policy stays causal. Top-k over the whole segment lets later tokens
(including the action a state token must predict) decide whether that state token is routed;
``train_selection="prefix"`` trains with a causal prefix top-k instead. Nothing is hard-wired: context length, widths and
the routed layers come from the config.

Inputs are normalized inside the model (state mean/std, return scale are buffers/config saved with it), so a
checkpoint is self-contained.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from core.layers import SelfAttentionBlock
from core.routing import RoutedBlock, RoutingConfig, RoutingInfo

logger = logging.getLogger(__name__)

__all__ = ["DTConfig", "DMConfig", "DecisionTransformer", "DecisionMixer", "build_model", "config_from_dict",
           "config_to_dict"]


@dataclass(kw_only=True)
class DTConfig:
    """Decision Transformer shape and input scaling."""

    state_dim: int  # observation size
    act_dim: int  # action size (actions in [-1, 1] after `action_scale`)
    context: int = 20  # K: timesteps per input segment (3K tokens)
    embed_dim: int = 128  # token width
    num_layers: int = 3  # transformer blocks
    num_heads: int = 1  # attention heads (must divide embed_dim)
    dropout: float = 0.1  # dropout on embeddings, attention output and MLP
    max_ep_len: int = 1000  # timestep embedding table size (longer episodes reuse the last entry)
    return_scale: float = 1000.0  # returns-to-go are divided by this before embedding
    action_tanh: bool = True  # squash predicted actions with tanh (continuous actions in [-1, 1])
    action_scale: float = 1.0  # environment action bound (predictions are multiplied by it)

    def __post_init__(self) -> None:
        for name in ("state_dim", "act_dim", "context", "embed_dim", "num_layers", "num_heads", "max_ep_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide embed_dim ({self.embed_dim})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.return_scale <= 0 or self.action_scale <= 0:
            raise ValueError(f"return_scale ({self.return_scale}) and action_scale ({self.action_scale}) must be > 0")


_ROUTED_UPDATES = ("gated_residual", "scaled_block")


@dataclass(kw_only=True)
class DMConfig(DTConfig):
    """Decision Mixer: a Decision Transformer whose `routed_layers` run only on routed tokens."""

    num_layers: int = 6  # transformer blocks
    routed_layers: tuple[int, ...] = (1, 3, 5)  # zero-based indices of routed blocks
    capacity: float = 0.5  # initial (or fixed, if not learned) fraction of tokens routed
    learn_capacity: bool = True  # per-sample capacity predictor (trained through a straight-through soft mask)
    min_capacity: float = 0.1  # bounds of the predicted capacity
    max_capacity: float = 1.0
    soft_rank_temperature: float = 2.0  # straight-through soft-mask temperature, in ranks
    # unselected tokens past the cut that run a routed block for the capacity gradient only (core.routing); 0: the
    # gradient reaches capacity through selected tokens only and cannot learn that adding a token helps
    probe_tokens: int = 4
    # routing in training: "topk" over the whole segment (later tokens, the predicted action among them, decide
    # whether a state token is routed) or "prefix" (causal prefix top-k: what acting can see)
    train_selection: str = "topk"
    # control arm: routed tokens drawn at random at the fixed `capacity` (core.routing); needs learn_capacity False
    random_routing: bool = False
    router_hidden: int = 64  # width of the capacity and auxiliary predictors
    aux_loss_weight: float = 0.1  # weight of the auxiliary predictor's BCE in the training loss
    capacity_cost_weight: float = 0.0  # weight of the mean predicted capacity (compute cost) in the loss; 0 chosen by `python -m rl.tune` on hopper-medium (rl/README.md)
    # The released code's routed layer (`rl.release.reference_config` sets all; core.routing.RoutingConfig says what
    # each does): the defaults are this project's fixes.
    capacity_input: str = "mean"  # "flatten": capacity from all 3 K tokens flattened (input length fixed)
    capacity_rounding: str = "round"  # "floor": the release's clamp(c n, 1, n).long()
    capacity_gradient: bool = True  # False: no gradient reaches the capacity predictor (the release's .long())
    strict_threshold: bool = False  # True: scores strictly above the k-th, k - 1 tokens (the release)
    routed_update: str = "gated_residual"  # "scaled_block": s f(x) with the raw router score (the release)
    aux_activation: str = "gelu"  # "silu": the release's auxiliary predictor
    capacity_hidden: int = 0  # capacity predictor width (0: router_hidden; the release: 512)
    aux_hidden: int = 0  # auxiliary predictor width (0: router_hidden; the release: embed_dim // 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.routed_layers = tuple(int(i) for i in self.routed_layers)
        bad = [i for i in self.routed_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"routed_layers {bad} out of range for num_layers={self.num_layers}")
        if len(set(self.routed_layers)) != len(self.routed_layers):
            raise ValueError(f"routed_layers has duplicates: {self.routed_layers}")
        if self.capacity_hidden < 0 or self.aux_hidden < 0:
            raise ValueError(f"capacity_hidden ({self.capacity_hidden}) and aux_hidden ({self.aux_hidden}) must be >= 0")
        if self.aux_loss_weight < 0 or self.capacity_cost_weight < 0:
            raise ValueError(f"loss weights must be >= 0, got aux={self.aux_loss_weight}, "
                             f"capacity={self.capacity_cost_weight}")
        if self.routed_update not in _ROUTED_UPDATES:  # named here: RoutingConfig calls it `update`
            raise ValueError(f"routed_update must be one of {_ROUTED_UPDATES}, got {self.routed_update!r}")
        self.routing_config()  # validates the capacity fields

    def routing_config(self) -> RoutingConfig:
        return RoutingConfig(dim=self.embed_dim, capacity=self.capacity, learn_capacity=self.learn_capacity,
                             min_capacity=self.min_capacity, max_capacity=self.max_capacity,
                             capacity_hidden=self.capacity_hidden or self.router_hidden,
                             aux_hidden=self.aux_hidden or self.router_hidden,
                             soft_rank_temperature=self.soft_rank_temperature, probe_tokens=self.probe_tokens,
                             train_selection=self.train_selection, random_selection=self.random_routing,
                             capacity_input=self.capacity_input, seq_len=3 * self.context,
                             capacity_rounding=self.capacity_rounding, capacity_gradient=self.capacity_gradient,
                             strict_threshold=self.strict_threshold, update=self.routed_update,
                             aux_activation=self.aux_activation)


class _CausalBlock(nn.Module):
    """A causal ``SelfAttentionBlock`` (the interface `RoutedBlock` expects): ``causal=True``, or the
    block-diagonal causal ``attn_bias`` of `RoutedBlock`'s packed call, which already holds causality."""

    accepts_attn_bias = True

    def __init__(self, block: SelfAttentionBlock):
        super().__init__()
        self.inner = block

    def forward(self, x_BSD: torch.Tensor, *, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
        if attn_bias is not None:
            return self.inner(x_BSD, attn_bias=attn_bias)
        return self.inner(x_BSD, causal=True)


class DecisionTransformer(nn.Module):
    """GPT over (R, s, a) tokens; ``forward`` returns predicted actions ``(B, T, act_dim)`` and routing infos."""

    config_class = DTConfig

    def __init__(self, config: DTConfig):
        super().__init__()
        self.config = config
        d = config.embed_dim
        self.embed_timestep = nn.Embedding(config.max_ep_len, d)
        self.embed_return = nn.Linear(1, d)
        self.embed_state = nn.Linear(config.state_dim, d)
        self.embed_action = nn.Linear(config.act_dim, d)
        self.embed_ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([self._make_block(i) for i in range(config.num_layers)])
        self.final_ln = nn.LayerNorm(d)
        self.predict_action = nn.Linear(d, config.act_dim)
        self.register_buffer("state_mean", torch.zeros(config.state_dim))
        self.register_buffer("state_std", torch.ones(config.state_dim))

    def _attn_block(self) -> SelfAttentionBlock:
        c = self.config
        return SelfAttentionBlock(c.embed_dim, c.num_heads, dropout=c.dropout, activation="gelu")

    def _make_block(self, i: int) -> nn.Module:
        return _CausalBlock(self._attn_block())

    def set_state_normalization(self, mean, std) -> None:
        """Store the dataset's observation mean/std (used to normalize states inside the model)."""
        mean = torch.as_tensor(mean, dtype=torch.float32)
        std = torch.as_tensor(std, dtype=torch.float32).clamp_min(1e-6)
        if mean.shape != self.state_mean.shape or std.shape != self.state_std.shape:
            raise ValueError(f"state mean/std must have shape ({self.config.state_dim},), got "
                             f"{tuple(mean.shape)} and {tuple(std.shape)}")
        self.state_mean.copy_(mean)
        self.state_std.copy_(std)

    def embed(self, states_BTS, actions_BTA, returns_BT1, timesteps_BT) -> torch.Tensor:
        """Interleaved token embeddings ``(B, 3T, D)``."""
        B, T, _ = states_BTS.shape
        c = self.config
        time_BTD = self.embed_timestep(timesteps_BT.clamp(0, c.max_ep_len - 1))
        s = self.embed_state((states_BTS - self.state_mean) / self.state_std) + time_BTD
        a = self.embed_action(actions_BTA / c.action_scale) + time_BTD
        r = self.embed_return(returns_BT1 / c.return_scale) + time_BTD
        tokens_BT3D = torch.stack([r, s, a], dim=2)
        return self.drop(self.embed_ln(tokens_BT3D.reshape(B, 3 * T, -1)))  # (B, 3T, D)

    def forward(self, states_BTS: torch.Tensor, actions_BTA: torch.Tensor, returns_BT1: torch.Tensor,
                timesteps_BT: torch.Tensor, *, valid_BT: torch.Tensor | None = None,
                mode: str = "auto") -> tuple[torch.Tensor, list[RoutingInfo]]:
        """Args:
            states_BTS, actions_BTA, returns_BT1 (returns-to-go), timesteps_BT (int episode steps).
            valid_BT: optional bool, False marks right-padding (never attended by real tokens because of
                causality; never routed).
            mode: routing mode for routed layers ("auto", "topk", "prefix", "aux"); "auto" is the config's
                ``train_selection`` in ``train()`` and "aux" in ``eval()``; ignored by plain layers.
        Returns:
            actions ``(B, T, act_dim)`` predicted at the state tokens, and one ``RoutingInfo`` per routed layer.
        """
        B, T, _ = states_BTS.shape
        x_BSD = self.embed(states_BTS, actions_BTA, returns_BT1, timesteps_BT)
        pad_BS = None if valid_BT is None else (~valid_BT.bool()).repeat_interleave(3, dim=1)
        infos: list[RoutingInfo] = []
        for block in self.blocks:
            if isinstance(block, RoutedBlock):
                x_BSD, info = block(x_BSD, mode=mode, key_padding_mask=pad_BS)
                infos.append(info)
            else:
                x_BSD = block(x_BSD)
        h_BT3D = self.final_ln(x_BSD).reshape(B, T, 3, -1)
        pred_BTA = self.predict_action(h_BT3D[:, :, 1])
        if self.config.action_tanh:
            pred_BTA = torch.tanh(pred_BTA)
        return pred_BTA * self.config.action_scale, infos

    def routing_losses(self, infos: list[RoutingInfo]) -> dict[str, torch.Tensor]:
        """Extra loss terms (none for the plain DT)."""
        return {}

    @torch.no_grad()
    def act(self, states_BTS, actions_BTA, returns_BT1, timesteps_BT) -> torch.Tensor:
        """Action for the last timestep of each history (the last ``context`` steps are used): ``(B, act_dim)``."""
        K = self.config.context
        pred, _ = self(states_BTS[:, -K:], actions_BTA[:, -K:], returns_BT1[:, -K:], timesteps_BT[:, -K:])
        return pred[:, -1]


class DecisionMixer(DecisionTransformer):
    """Decision Transformer with routed layers (see module docstring)."""

    config_class = DMConfig

    def _make_block(self, i: int) -> nn.Module:
        block = _CausalBlock(self._attn_block())
        if i in self.config.routed_layers:
            return RoutedBlock(block, self.config.routing_config())
        return block

    def routing_losses(self, infos: list[RoutingInfo]) -> dict[str, torch.Tensor]:
        if not infos:
            return {}
        c = self.config
        aux = torch.stack([i.aux_loss for i in infos]).mean()
        cost = torch.stack([i.capacity_cost for i in infos]).mean()
        return {"aux_loss": c.aux_loss_weight * aux, "capacity_cost": c.capacity_cost_weight * cost}


def config_from_dict(algo: str, d: dict) -> DTConfig:
    """Rebuild a config saved with ``dataclasses.asdict``."""
    cls = {"dt": DTConfig, "dm": DMConfig}.get(algo)
    if cls is None:
        raise ValueError(f"unknown algo {algo!r}; accepted: 'dt', 'dm'")
    d = dict(d)
    if "routed_layers" in d:
        d["routed_layers"] = tuple(d["routed_layers"])
    if cls is DMConfig:
        d.setdefault("probe_tokens", 0)  # saved before the option: trained with the one-sided capacity gradient
    return cls(**d)


def build_model(algo: str, config: DTConfig) -> DecisionTransformer:
    """``"dt"`` -> DecisionTransformer, ``"dm"`` -> DecisionMixer."""
    if algo == "dt":
        return DecisionTransformer(config)
    if algo == "dm":
        if not isinstance(config, DMConfig):
            raise ValueError(f"algo 'dm' needs a DMConfig, got {type(config).__name__}")
        return DecisionMixer(config)
    raise ValueError(f"unknown algo {algo!r}; accepted: 'dt', 'dm'")


def config_to_dict(config: DTConfig) -> dict:
    d = asdict(config)
    if "routed_layers" in d:
        d["routed_layers"] = list(d["routed_layers"])
    return d

