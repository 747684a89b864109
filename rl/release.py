"""The released Decision Mixer (ruthless-man/Decision-Mixer): its configuration and its checkpoint layout.

``reference_config`` builds a ``DMConfig`` whose routed layers compute what the release's ``DM/DM.py`` computes
(``core.routing.RoutingConfig.reference``): capacity ``k = clamp(sigmoid(MLP(flatten x)) * 3K, 1, 3K).long()``
(no gradient), tokens strictly above the k-th router score (k - 1 of them), routed update ``s * f(x)`` with the raw
score ``s``, a two-class auxiliary predictor (SiLU, width ``D // 2``) deciding at evaluation; the odd layers routed
(``trajectory_gpt2.py``). Each of this project's fixes is a single field of ``DMConfig`` that ``overrides`` can
flip (rl/README.md, "Reference preset").

``load_release_state_dict`` maps a state dict in the release's layout (GPT-2 ``Conv1D`` blocks under
``transformer.h.<i>``, routed ones under ``transformer.h.<i>.block`` with a ``router``) onto a ``DecisionMixer``
built from ``reference_config``. The release's two-class auxiliary head ``(l0, l1)`` becomes the project's
single logit ``l1 - l0``: ``argmax`` is ``l1 - l0 > 0`` and its two-class cross-entropy is the binary one on
``l1 - l0``, so both decide and learn alike.

What stays this project's even under the preset: states and returns are scaled inside the model
(``state_mean``/``state_std``, ``return_scale``; the release scales them in its data pipeline), routing never
selects padding (the release's left padding takes part in top-k), and the auxiliary predictor's loss is added to
the training loss with ``aux_loss_weight`` (the release steps its own Adam, lr 1e-4, inside the forward pass).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rl.models import DecisionMixer, DMConfig

__all__ = ["RELEASE_SHAPE", "PRESETS", "REFERENCE_ROUTING", "reference_config", "preset_overrides",
           "load_release_state_dict"]

# The release's defaults (main.py): K = 120 timesteps, width 256, 6 layers, 4 heads, dropout 0.1.
RELEASE_SHAPE = dict(context=120, embed_dim=256, num_layers=6, num_heads=4, dropout=0.1)


def reference_config(*, state_dim: int, act_dim: int, **overrides) -> DMConfig:
    """``DMConfig`` of the released routed model; ``overrides`` set the shape (default ``RELEASE_SHAPE``) or flip
    single fixes (``capacity_gradient=True``, ``strict_threshold=False``, ``capacity_input="mean"``, ...)."""
    shape = {**RELEASE_SHAPE, **{k: v for k, v in overrides.items() if k in RELEASE_SHAPE}}
    d = shape["embed_dim"]
    base = dict(state_dim=state_dim, act_dim=act_dim, **shape,
                routed_layers=tuple(range(1, shape["num_layers"], 2)), capacity=0.5, learn_capacity=True,
                min_capacity=0.0, max_capacity=1.0, probe_tokens=0, train_selection="topk",
                capacity_input="flatten", capacity_rounding="floor", capacity_gradient=False, strict_threshold=True,
                routed_update="scaled_block", aux_activation="silu", capacity_hidden=512, aux_hidden=max(d // 2, 1),
                capacity_cost_weight=0.0)
    base.update({k: v for k, v in overrides.items() if k not in RELEASE_SHAPE})
    return DMConfig(**base)


#: ``rl.train --preset``: ``project`` (``DMConfig``'s defaults, this project's fixes) or ``reference`` (the release's
#: routed layer, :data:`REFERENCE_ROUTING`; shape, routed layers and everything else stay the run's own).
PRESETS = ("project", "reference")
#: the ``DMConfig`` fields the ``reference`` preset sets to the release's values (:func:`reference_config`)
REFERENCE_ROUTING = ("capacity", "learn_capacity", "min_capacity", "max_capacity", "probe_tokens", "train_selection",
                     "capacity_input", "capacity_rounding", "capacity_gradient", "strict_threshold", "routed_update",
                     "aux_activation", "capacity_hidden", "aux_hidden", "capacity_cost_weight")
_WHY = {"train_selection": " (its capacity reads all 3 K tokens flattened: it has no causal prefix form)",
        "probe_tokens": " (no gradient reaches its capacity predictor, so probes have nothing to train)",
        "capacity_cost_weight": " (no gradient reaches its capacity predictor, so a cost has no effect)"}


def preset_overrides(preset: str, overrides: dict, *, embed_dim: int) -> dict:
    """``overrides`` (``DMConfig`` fields of a run, ``None`` = not given) under ``preset``.

    ``project`` returns them unchanged; ``reference`` adds the release's routing fields (:data:`REFERENCE_ROUTING`,
    the auxiliary width from ``embed_dim``) and keeps the shape, the routed layers and the rest as given.

    Raises:
        ValueError: unknown preset, or under ``reference`` a given routing field that differs from the release's
            (named, with the value the preset accepts).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    if preset == "project":
        return dict(overrides)
    ref = reference_config(state_dim=1, act_dim=1, embed_dim=embed_dim, num_heads=1)
    routing = {k: getattr(ref, k) for k in REFERENCE_ROUTING}
    for k, v in overrides.items():
        if v is not None and k in routing and v != routing[k]:
            raise ValueError(f"preset 'reference' sets {k}={routing[k]!r}, the release's{_WHY.get(k, '')}; "
                             f"{k}={v!r} does not apply: leave it out or use preset 'project'")
    return {**overrides, **routing}


def _linear_from_conv1d(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()  # GPT-2 Conv1D stores (in, out); nn.Linear (out, in)


def _block_entries(src: str, dst: str, sd: Mapping[str, torch.Tensor], d: int) -> dict[str, torch.Tensor]:
    out = {}
    for a, b in (("ln_1", "norm1"), ("ln_2", "norm2")):
        out[f"{dst}.{b}.weight"], out[f"{dst}.{b}.bias"] = sd[f"{src}.{a}.weight"], sd[f"{src}.{a}.bias"]
    w_qkv = _linear_from_conv1d(sd[f"{src}.attn.c_attn.weight"])  # (3D, D): q, k, v rows
    b_qkv = sd[f"{src}.attn.c_attn.bias"]
    for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
        out[f"{dst}.attn.{name}.weight"] = w_qkv[j * d:(j + 1) * d]
        out[f"{dst}.attn.{name}.bias"] = b_qkv[j * d:(j + 1) * d]
    for a, b in (("attn.c_proj", "attn.out_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
        out[f"{dst}.{b}.weight"] = _linear_from_conv1d(sd[f"{src}.{a}.weight"])
        out[f"{dst}.{b}.bias"] = sd[f"{src}.{a}.bias"]
    return out


class _Reads(dict):
    """A state dict that remembers which keys were read, and names a missing one."""

    def __init__(self, sd: Mapping[str, torch.Tensor]):
        super().__init__(sd)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self:
            raise ValueError(f"the release's state dict has no {key!r}")
        self.read.add(key)
        return super().__getitem__(key)


_IGNORED = ("transformer.wte.weight",)  # GPT-2's token table: unused (the inputs are embeddings)
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the release's causal-mask buffers, not weights


def load_release_state_dict(model: DecisionMixer, sd: Mapping[str, torch.Tensor]) -> DecisionMixer:
    """Load the release's weights into ``model`` (built from :func:`reference_config`); strict on both sides.

    Raises:
        ValueError: the routed layers differ, or a key is missing, left over or of another shape (named).
    """
    c = model.config
    sd = _Reads(sd)
    release_routed = tuple(i for i in range(c.num_layers) if f"transformer.h.{i}.router.weight_predictor.weight" in sd)
    if release_routed != tuple(c.routed_layers):
        raise ValueError(f"the release's state dict routes layers {list(release_routed)}, the model "
                         f"{list(c.routed_layers)}")
    out = {k: sd[k] for k in ("embed_timestep.weight", "embed_ln.weight", "embed_ln.bias")}
    for name in ("embed_return", "embed_state", "embed_action"):
        out[f"{name}.weight"], out[f"{name}.bias"] = sd[f"{name}.weight"], sd[f"{name}.bias"]
    out["predict_action.weight"], out["predict_action.bias"] = sd["predict_action.0.weight"], sd["predict_action.0.bias"]
    out["final_ln.weight"], out["final_ln.bias"] = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
    for i in range(c.num_layers):
        routed = i in c.routed_layers
        src, dst = (f"transformer.h.{i}.block", f"blocks.{i}.block.inner") if routed else \
            (f"transformer.h.{i}", f"blocks.{i}.inner")
        out.update(_block_entries(src, dst, sd, c.embed_dim))
        if routed:
            r = f"transformer.h.{i}.router"
            out[f"blocks.{i}.router.proj.weight"] = sd[f"{r}.weight_predictor.weight"]
            out[f"blocks.{i}.router.proj.bias"] = sd[f"{r}.weight_predictor.bias"]
            for j in (0, 2):
                out[f"blocks.{i}.capacity_predictor.net.{j}.weight"] = sd[f"{r}.k_predictor.{j}.weight"]
                out[f"blocks.{i}.capacity_predictor.net.{j}.bias"] = sd[f"{r}.k_predictor.{j}.bias"]
            out[f"blocks.{i}.aux.net.0.weight"] = sd[f"{r}.aux_predictor.0.weight"]
            out[f"blocks.{i}.aux.net.0.bias"] = sd[f"{r}.aux_predictor.0.bias"]
            w2, b2 = sd[f"{r}.aux_predictor.2.weight"], sd[f"{r}.aux_predictor.2.bias"]  # (2, H), (2,)
            out[f"blocks.{i}.aux.net.2.weight"] = (w2[1] - w2[0])[None]
            out[f"blocks.{i}.aux.net.2.bias"] = (b2[1] - b2[0])[None]
    left = sorted(k for k in set(sd) - sd.read if k not in _IGNORED and not k.endswith(_BUFFERS))
    if left:
        raise ValueError(f"keys of the release's state dict with no place in the model: {left[:8]}")
    target = model.state_dict()
    missing = sorted(set(target) - set(out) - {"state_mean", "state_std"})
    if missing:
        raise ValueError(f"model keys the release's state dict does not fill: {missing[:8]}")
    bad = [f"{k}: {tuple(v.shape)} vs {tuple(target[k].shape)}" for k, v in out.items() if v.shape != target[k].shape]
    if bad:
        raise ValueError(f"shapes differ between the release and the model: {bad[:4]}")
    model.load_state_dict({**target, **{k: v.to(target[k].dtype) for k, v in out.items()}})
    return model
