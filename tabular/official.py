"""The published TabICL checkpoints (``tabicl-classifier-*.ckpt``) as :class:`tabular.model.TabICL` models.

An official checkpoint is a ``torch.save`` of ``{"config": <TabICL keyword arguments>, "state_dict": ...}`` (plus
training state). :func:`read_official` checks it, detects the architecture version from the config (or, where the
config omits a switch, from the parameter names; sizes it omits take ``tabicl.TabICL``'s defaults, as the official
package would), builds the matching :class:`TabICLConfig` — the same model class, with the switches of
:mod:`tabular.model` set — and maps the weights:

- packed attention ``in_proj`` -> ``q_proj`` / ``k_proj`` / ``v_proj``; ``norm1`` also serves as the context
  LayerNorm of the induced blocks (the published blocks normalise queries and context with the same LayerNorm);
- interleaved rotary pairs (v1) -> this project's rotate-half layout: the query and key rows of each head are
  permuted ``(0, 2, 4, ..., 1, 3, 5, ...)``, which leaves every attention score unchanged;
- the stored ``rope.freqs`` must equal the frequencies of ``row_rope_base`` (checked, refused otherwise).

Versions: ``v1`` (``tabicl-classifier-v1-20250208.ckpt`` and ``v1.1-20250506``: the same architecture, trained on
different priors) and ``v2`` (``tabicl-classifier-v2-20260212.ckpt``: grouped, target-aware column embedding
without affine heads, query-aware scalable softmax, split-half rotary). Either architecture as a regression model
(``max_classes=0``: the label embeddings read the standardized target, the decoder emits ``num_quantiles``
quantiles; ``tabicl-regressor-v2-20260212.ckpt``) is built with ``TabICLConfig(max_classes=0)``; the card's
``task`` says which. Other variants are refused with the list of what is supported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tabular.model import TabICL, TabICLConfig

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED", "KNOWN_FILES", "detect_version", "official_config", "convert_state_dict", "read_official"]

#: The architecture versions this module builds, and what each one is.
SUPPORTED = {
    "v1": "TabICL v1 / v1.1 (affine column heads with LayerNorm after them, interleaved RoPE, no SSMax)",
    "v2": "TabICL v2 (feature groups of 3, target-aware column embedding, query-aware SSMax, split-half RoPE)",
}
#: Released file names -> the release each one is.
KNOWN_FILES = {
    "tabicl-classifier-v1-20250208.ckpt": "v1",
    "tabicl-classifier-v1.1-20250506.ckpt": "v1.1",
    "tabicl-classifier-v2-20260212.ckpt": "v2",
    "tabicl-regressor-v2-20260212.ckpt": "v2-regressor",
}
#: Sizes ``tabicl.TabICL`` (2.2.0) uses for keys a checkpoint's config omits.
CLASS_DEFAULTS = {"embed_dim": 128, "col_num_blocks": 3, "col_nhead": 8, "col_num_inds": 128, "row_num_blocks": 3,
                  "row_nhead": 8, "row_num_cls": 4, "row_rope_base": 100_000, "icl_num_blocks": 12, "icl_nhead": 8,
                  "ff_factor": 2}
_SUPPORTED_LINE = "; ".join(f"{k}: {v}" for k, v in SUPPORTED.items())
_V2_SSMAX = "qassmax-mlp-elementwise"


class UnsupportedCheckpoint(ValueError):
    """An official checkpoint this module cannot build (the message lists what is supported)."""


def _refuse(path, what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"{str(path)!r}: {what}; supported official TabICL checkpoints (classification or "
                                 f"regression): {_SUPPORTED_LINE}")


def _ssmax(value) -> str:
    if value is True:
        return _V2_SSMAX
    if value is False or value is None:
        return "none"
    return str(value)


def _resolved(config: dict, state: dict) -> dict:
    """The architecture switches of an official config; switches the config omits are read off the weights."""
    get = config.get
    in_dim = state["col_embedder.in_linear.weight"].shape[1] if "col_embedder.in_linear.weight" in state else 1
    group = get("col_feature_group", "same" if in_dim > 1 else False)
    has_ssmax = lambda prefix: any(k.startswith(prefix) and ".ssmax_layer." in k for k in state)  # noqa: E731
    icl_labels = state.get("icl_predictor.y_encoder.weight")  # (D, max_classes), or (D, 1) for regression
    from_weights = 10 if icl_labels is None else (0 if icl_labels.shape[1] == 1 else icl_labels.shape[1])
    return {
        "max_classes": get("max_classes", from_weights),
        "affine": get("col_affine", "col_embedder.out_w.weight" in state),
        "group": group,
        "group_size": get("col_feature_group_size", 3) if group else 1,
        "target_aware": get("col_target_aware", "col_embedder.y_encoder.weight" in state),
        "col_ssmax": _ssmax(get("col_ssmax", _V2_SSMAX if has_ssmax("col_embedder.") else False)),
        "icl_ssmax": _ssmax(get("icl_ssmax", _V2_SSMAX if has_ssmax("icl_predictor.") else False)),
        "interleaved": get("row_rope_interleaved", True),  # files from before the flag are v1: interleaved
        "norm_first": get("norm_first", True),
        "bias_free_ln": get("bias_free_ln", False),
        "activation": get("activation", "gelu"),
    }


def detect_version(config: dict, state: dict, path="checkpoint") -> str:
    """``"v1"`` or ``"v2"`` for an official config + state dict; :class:`UnsupportedCheckpoint` otherwise."""
    sw = _resolved(config, state)
    if not sw["norm_first"] or sw["bias_free_ln"] or sw["activation"] != "gelu":
        raise _refuse(path, "post-norm, bias-free LayerNorm or a non-GELU activation")
    v1 = (sw["affine"], bool(sw["group"]), sw["target_aware"], sw["col_ssmax"], sw["icl_ssmax"], sw["interleaved"])
    if v1 == (True, False, False, "none", "none", True):
        return "v1"
    if (not sw["affine"] and sw["group"] in ("same", True) and sw["group_size"] == 3 and sw["target_aware"]
            and sw["col_ssmax"] == _V2_SSMAX and sw["icl_ssmax"] == _V2_SSMAX and not sw["interleaved"]):
        return "v2"
    raise _refuse(path, "an architecture of no released version (col_affine={affine}, col_feature_group={group}, "
                        "col_target_aware={target_aware}, col_ssmax={col_ssmax}, icl_ssmax={icl_ssmax}, "
                        "row_rope_interleaved={interleaved})".format(**sw))


def official_config(config: dict, state: dict, path="checkpoint") -> tuple[TabICLConfig, str]:
    """The :class:`TabICLConfig` that builds an official checkpoint's architecture, and its version."""
    version = detect_version(config, state, path)
    sw = _resolved(config, state)
    get = lambda k: config.get(k, CLASS_DEFAULTS[k])  # noqa: E731 - what tabicl.TabICL(**config) would use
    embed, ff = get("embed_dim"), get("ff_factor")
    n_cls = get("row_num_cls")
    cfg = TabICLConfig(
        max_classes=sw["max_classes"], num_quantiles=config.get("num_quantiles", 999), embed_dim=embed, col_blocks=get("col_num_blocks"),
        col_heads=get("col_nhead"), col_inducing=get("col_num_inds"), row_blocks=get("row_num_blocks"),
        row_heads=get("row_nhead"), n_cls=n_cls, rope_base=float(get("row_rope_base")),
        icl_blocks=get("icl_num_blocks"), icl_heads=get("icl_nhead"), icl_ffn=embed * n_cls * ff,
        mlp_ratio=float(ff), input_standardize=False, row_standardize=False, row_pos_embed=False,
        col_output="affine_ln_after" if sw["affine"] else "direct", col_group_size=sw["group_size"],
        col_target_aware=sw["target_aware"], col_ssmax=sw["col_ssmax"], icl_ssmax=sw["icl_ssmax"],
    )
    return cfg, version


def _interleaved_to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight ``(dim, in)`` or bias ``(dim,)``) from interleaved rotary pairs to the
    rotate-half layout, per head."""
    hd = w.shape[0] // heads
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    idx = (torch.arange(heads)[:, None] * hd + perm[None]).reshape(-1)
    return w[idx]


def _block(out: dict, src: dict, s: str, d: str, *, rope_heads: int = 0, norm_context: bool = False,
           ssmax_to: str | None = None) -> None:
    """One official attention block (``MultiheadAttentionBlock``) under prefix ``s`` -> ours under ``d``."""
    w, b = src.pop(f"{s}.attn.in_proj_weight"), src.pop(f"{s}.attn.in_proj_bias")
    for name, wi, bi in zip("qkv", w.chunk(3), b.chunk(3)):
        if rope_heads and name in "qk":
            wi, bi = _interleaved_to_half(wi, rope_heads), _interleaved_to_half(bi, rope_heads)
        out[f"{d}.attn.{name}_proj.weight"], out[f"{d}.attn.{name}_proj.bias"] = wi, bi
    pairs = {"attn.out_proj": "attn.out_proj", "norm1": "norm1", "norm2": "norm2", "linear1": "mlp.fc1",
             "linear2": "mlp.fc2"}
    for a, c in pairs.items():
        for p in ("weight", "bias"):
            out[f"{d}.{c}.{p}"] = src.pop(f"{s}.{a}.{p}")
    if norm_context:
        for p in ("weight", "bias"):
            out[f"{d}.norm_context.{p}"] = out[f"{d}.norm1.{p}"].clone()
    for k in [k for k in src if k.startswith(f"{s}.attn.ssmax_layer.")]:
        if ssmax_to is None:
            raise KeyError(k)
        out[ssmax_to + k[len(f"{s}.attn.ssmax_layer"):]] = src.pop(k)


def convert_state_dict(state: dict, cfg: TabICLConfig, *, interleaved: bool, path="checkpoint") -> dict:
    """Official parameter names and layouts -> this project's (see the module docstring)."""
    src = {k: v.detach().float().cpu() for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    mv = lambda a, b: out.__setitem__(b, src.pop(a))  # noqa: E731
    for p in ("weight", "bias"):
        mv(f"col_embedder.in_linear.{p}", f"col.lift.{p}")
    for i in range(cfg.col_blocks):
        s, d = f"col_embedder.tf_col.blocks.{i}", f"col.blocks.{i}"
        mv(f"{s}.ind_vectors", f"{d}.inducing")
        _block(out, src, f"{s}.multihead_attn1", f"{d}.induce_block", norm_context=True, ssmax_to=f"col.ssmax.{i}")
        _block(out, src, f"{s}.multihead_attn2", f"{d}.broadcast_block", norm_context=True)
    heads = {"out_w": "weight_head", "out_b": "bias_head", "ln_w": "ln_w", "ln_b": "ln_b", "y_encoder": "label_embed"}
    for a, c in heads.items():
        for p in ("weight", "bias"):
            if f"col_embedder.{a}.{p}" in src:
                mv(f"col_embedder.{a}.{p}", f"col.{c}.{p}")
    for i in range(cfg.row_blocks):
        _block(out, src, f"row_interactor.tf_row.blocks.{i}", f"row.blocks.{i}",
               rope_heads=cfg.row_heads if interleaved else 0)
    freqs = src.pop("row_interactor.tf_row.rope.freqs", None)
    hd = cfg.embed_dim // cfg.row_heads
    expected = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    if freqs is not None and not torch.allclose(freqs, expected, rtol=1e-5, atol=0):
        raise _refuse(path, f"stored RoPE frequencies differ from those of base {cfg.rope_base:g} (learned frequencies)")
    mv("row_interactor.cls_tokens", "row.cls")
    for p in ("weight", "bias"):
        mv(f"row_interactor.out_ln.{p}", f"row.norm.{p}")
    for i in range(cfg.icl_blocks):
        _block(out, src, f"icl_predictor.tf_icl.blocks.{i}", f"icl.blocks.{i}", ssmax_to=f"icl.ssmax.{i}")
    for a, c in {"ln": "norm", "y_encoder": "label_embed", "decoder.0": "decoder.fc1", "decoder.2": "decoder.fc2"}.items():
        for p in ("weight", "bias"):
            mv(f"icl_predictor.{a}.{p}", f"icl.{c}.{p}")
    if src:
        raise _refuse(path, f"unrecognised parameters {sorted(src)[:4]}")
    return out


def read_official(path: str | os.PathLike, ckpt: dict) -> tuple[TabICL, dict]:
    """A :class:`TabICL` (eval mode, CPU) and its card from a loaded official checkpoint dict."""
    path = Path(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise _refuse(path, "not an official TabICL checkpoint (a dict with 'config' and 'state_dict' expected)")
    config, state = ckpt["config"], ckpt["state_dict"]
    cfg, version = official_config(config, state, path)
    try:
        mapped = convert_state_dict(state, cfg, interleaved=_resolved(config, state)["interleaved"], path=path)
        model = TabICL(cfg)
        model.load_state_dict(mapped)
    except (KeyError, RuntimeError) as e:
        raise _refuse(path, f"weights do not match the {version} architecture ({str(e).splitlines()[0][:200]})") from None
    release = KNOWN_FILES.get(path.name, version)
    task = "regression" if cfg.regression else "classification"
    if path.name not in KNOWN_FILES and cfg.regression:
        release = f"{version}-regressor"
    card = {"source": "official TabICL checkpoint", "file": path.name, "version": version, "release": release,
            "task": task,
            "official_config": {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool, type(None)))},
            # v1's pretraining tables had up to 100 features (TabICL paper); v2's width is not recorded here
            "pretrained_max_features": 100 if version == "v1" else None}
    logger.info("loaded official TabICL %s checkpoint %s", release, path.name)
    return model.eval(), card
