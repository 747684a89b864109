"""The authors' released CoMemo checkpoints (CoMemo-2B, CoMemo-9B) in the layout ``CoMemo.from_hf`` loads.

A released folder holds ``config.json`` (``model_type`` ``comemo_chat``: ``vision_config`` of InternViT,
``llm_config`` of InternLM2, ``mixin_config`` of the memory blocks), safetensors weights (one file or shards with an
index) and a tokenizer. Its language model is InternLM2 with a packed ``wqkv``, each decoder layer wrapped with an
optional gated cross-attention block (``language_model.model.layers.N.decoder_layer.*`` and
``...layers.N.gated_cross_attn_layer.*``).

Converted, it becomes a transformers InternVL folder (``InternVLForConditionalGeneration``; the language model in
the Llama layout that transformers' own InternVL conversion uses for InternLM2: ``wqkv`` split per KV group into
``q_proj``/``k_proj``/``v_proj``, ``w1``/``w3``/``w2`` -> ``gate_proj``/``up_proj``/``down_proj``) plus
``comemo_memory.safetensors`` with the memory blocks and their architecture (:meth:`MemoryConfig.release`), a
processor (InternVL tiling at the release's tile size and tile range, ImageNet normalisation), and a chat template
that renders the release's conversation template (``internlm2-chat``: its system message, ``<|im_start|>`` turns
closed by ``<|im_end|>`` with no newline between turns).

:func:`convert_tensors` and :func:`release_tensors_from` are exact inverses (the converter checks the round trip on
every tensor).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from apps.comemo.hf_config import MemoryConfig

__all__ = ["ACCEPTED", "read_release_config", "read_release_tensors", "internvl_config", "memory_config",
           "convert_tensors", "release_tensors_from", "chat_template", "TEMPLATES"]

ACCEPTED = ("a released CoMemo checkpoint folder: config.json with model_type 'comemo_chat', an InternLM2ForCausalLM "
            "llm_config (packed wqkv), ps_version 'v2', safetensors weights")

# the release's conversation templates of its InternLM2 models (comemo/conversation.py): MPT separators
_INTERNLM2_SYSTEM = ("你是由上海人工智能实验室联合商汤科技开发的书生多模态大模型，英文名叫InternVL, "
                     "是一个有用无害的人工智能助手。")
TEMPLATES = {"internlm2-chat": _INTERNLM2_SYSTEM, "internlm2-flamingo-chat": _INTERNLM2_SYSTEM}


def chat_template(name: str) -> str:
    """A Jinja chat template rendering the release's conversation template ``name``: ``<|im_start|>system\\n`` +
    system message + ``<|im_end|>``, then each turn as ``<|im_start|>{role}\\n{text}<|im_end|>``; the generation
    prompt is ``<|im_start|>assistant\\n``. Image content items render as ``<image>\\n``."""
    if name not in TEMPLATES:
        raise ValueError(f"conversation template {name!r} is not supported; accepted: {', '.join(TEMPLATES)}")
    system = json.dumps(TEMPLATES[name], ensure_ascii=False)
    return (
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}{%- set system = " + system + " -%}{%- set loop_messages = messages -%}{%- endif -%}"
        "{{- '<|im_start|>system\\n' + system + '<|im_end|>' -}}"
        "{%- for message in loop_messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for c in message['content'] -%}"
        "{%- if c['type'] == 'image' -%}{{- '<image>\\n' -}}{%- elif c['type'] == 'text' -%}{{- c['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def read_release_config(folder: Path) -> dict:
    """``config.json`` of a released checkpoint, checked (a ``ValueError`` names what was found and what is
    accepted)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json; accepted: {ACCEPTED}")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    kind = cfg.get("model_type")
    if kind != "comemo_chat":
        archs = ", ".join(cfg.get("architectures") or []) or "no architectures"
        raise ValueError(f"{folder}: found model_type {kind!r} ({archs}); accepted: {ACCEPTED}")
    llm = cfg.get("llm_config") or {}
    arch = (llm.get("architectures") or ["?"])[0]
    if arch != "InternLM2ForCausalLM":
        raise ValueError(f"{folder}: found a {arch} language model; accepted: {ACCEPTED}")
    if cfg.get("ps_version", "v1") != "v2":
        raise ValueError(f"{folder}: found ps_version {cfg.get('ps_version', 'v1')!r} (transposed pixel shuffle); "
                         f"accepted: {ACCEPTED}")
    for key in ("vision_config", "mixin_config"):
        if not isinstance(cfg.get(key), dict):
            raise ValueError(f"{folder}: config.json has no {key}; accepted: {ACCEPTED}")
    return cfg


def read_release_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (one safetensors file, or shards listed in ``model.safetensors.index.json``)."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json (found: "
                         f"{', '.join(found) or 'no weight files'}); accepted: {ACCEPTED}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return out


def _image_size(cfg: dict) -> int:
    return int(cfg.get("force_image_size") or cfg["vision_config"]["image_size"])


def num_image_tokens(cfg: dict) -> int:
    """Tokens per tile after pixel shuffle: ``(image_size / patch_size)^2 * downsample_ratio^2``."""
    v = cfg["vision_config"]
    return int((_image_size(cfg) // int(v["patch_size"])) ** 2 * float(cfg.get("downsample_ratio", 0.5)) ** 2)


def internvl_config(cfg: dict, *, image_token_id: int):
    """The transformers ``InternVLConfig`` of the converted model."""
    from transformers import InternVLConfig

    v, t = cfg["vision_config"], cfg["llm_config"]
    size, patch = _image_size(cfg), int(v["patch_size"])
    vision = dict(hidden_size=v["hidden_size"], num_hidden_layers=v["num_hidden_layers"],
                  num_attention_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"],
                  image_size=[size, size], patch_size=[patch, patch], attention_bias=bool(v.get("qkv_bias", False)),
                  use_qk_norm=bool(v.get("qk_normalization", False)), norm_type=v.get("norm_type", "rms_norm"),
                  layer_norm_eps=v.get("layer_norm_eps", 1e-6), hidden_act=v.get("hidden_act", "gelu"),
                  attention_dropout=0.0, projection_dropout=0.0, hidden_dropout_prob=0.0,
                  use_absolute_position_embeddings=True, use_mean_pooling=True,
                  layer_scale_init_value=v.get("initializer_factor", 0.1))
    rope = {"rope_type": "default", "rope_theta": float(t.get("rope_theta", 10000.0))}
    scaling = t.get("rope_scaling")
    if scaling:  # InternLM2's {"type": "dynamic"|"linear", "factor": f}
        kind = scaling.get("type") or scaling.get("rope_type")
        if kind not in ("dynamic", "linear"):
            raise ValueError(f"llm_config rope_scaling {scaling!r} is not supported; accepted: dynamic, linear, none")
        rope = {**rope, "rope_type": kind, "factor": float(scaling["factor"])}
    heads = t["num_attention_heads"]
    text = dict(model_type="llama", vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                intermediate_size=t["intermediate_size"], num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads") or heads,
                head_dim=t["hidden_size"] // heads, hidden_act=t.get("hidden_act", "silu"),
                max_position_embeddings=t.get("max_position_embeddings", 2048), rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                rope_parameters=rope, attention_bias=bool(t.get("bias", False)), mlp_bias=False,
                tie_word_embeddings=bool(t.get("tie_word_embeddings", False)), bos_token_id=t.get("bos_token_id"),
                eos_token_id=t.get("eos_token_id"), pad_token_id=t.get("pad_token_id"))
    return InternVLConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                          image_seq_length=num_image_tokens(cfg), downsample_ratio=float(cfg.get("downsample_ratio", 0.5)),
                          projector_hidden_act="gelu", vision_feature_layer=int(cfg.get("select_layer", -1)),
                          vision_feature_select_strategy="default", architectures=["InternVLForConditionalGeneration"],
                          tie_word_embeddings=bool(t.get("tie_word_embeddings", False)))


def memory_config(cfg: dict, *, reference: bool = False) -> MemoryConfig:
    """The memory blocks' architecture from ``mixin_config`` (see :meth:`MemoryConfig.release`)."""
    m, t = cfg["mixin_config"], cfg["llm_config"]
    if int(m.get("language_dim", t["hidden_size"])) != t["hidden_size"] or \
            int(m.get("vision_dim", t["hidden_size"])) != t["hidden_size"]:
        raise ValueError(f"mixin_config language_dim/vision_dim {m.get('language_dim')}/{m.get('vision_dim')} differ from "
                         f"the language model's hidden size {t['hidden_size']}; accepted: {ACCEPTED}")
    return MemoryConfig.release(every=int(m.get("mixin_every_n_layers", 4)), num_heads=int(m["num_heads"]),
                                head_dim=int(m["head_dim"]), ffn_hidden=int(m["intermediate_size"]), reference=reference)


# -- tensors ------------------------------------------------------------------------------------------------------
_VISION = [  # (release pattern, converted replacement), applied in order to keys under vision_model.
    (r"^vision_model\.", "model.vision_tower."),
    (r"\.embeddings\.class_embedding$", ".embeddings.cls_token"),
    (r"\.embeddings\.position_embedding$", ".embeddings.position_embeddings"),
    (r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
    (r"\.encoder\.layers\.", ".encoder.layer."),
    (r"\.ls(\d)$", r".lambda_\1"),
    (r"\.attn\.proj\.", ".attention.projection_layer."),
    (r"\.attn\.", ".attention."),
    (r"\.norm1\.", ".layernorm_before."),
    (r"\.norm2\.", ".layernorm_after."),
]
_PROJECTOR = {"mlp1.0.": "model.multi_modal_projector.layer_norm.", "mlp1.1.": "model.multi_modal_projector.linear_1.",
              "mlp1.3.": "model.multi_modal_projector.linear_2."}
_LM = {"attention.wo.": "self_attn.o_proj.", "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.",
       "feed_forward.w2.": "mlp.down_proj.", "attention_norm.": "input_layernorm.", "ffn_norm.": "post_attention_layernorm."}
_MEM = {"cross_attention_norm.weight": "norm1.weight", "ffn_norm_2.weight": "norm2.weight",
        "cross_attn.to_q.weight": "attn.q_proj.weight", "cross_attn.to_out.weight": "attn.out_proj.weight",
        "ffn_2.w2.weight": "mlp.fc2.weight"}
_LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.(decoder_layer\.|gated_cross_attn_layer\.)(.+)$")


def _split_wqkv(w: torch.Tensor, kv_heads: int, groups: int, head_dim: int) -> tuple:
    """InternLM2's packed ``wqkv`` rows ``(kv_head, [q_0 .. q_{groups-1}, k, v], head_dim)`` -> q, k, v rows."""
    rest = w.shape[1:]
    x = w.reshape(kv_heads, groups + 2, head_dim, *rest)
    return (x[:, :groups].reshape(kv_heads * groups * head_dim, *rest).contiguous(),
            x[:, -2].reshape(kv_heads * head_dim, *rest).contiguous(), x[:, -1].reshape(kv_heads * head_dim, *rest).contiguous())


def _pack_wqkv(q, k, v, kv_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    rest = q.shape[1:]
    parts = [q.reshape(kv_heads, groups, head_dim, *rest), k.reshape(kv_heads, 1, head_dim, *rest),
             v.reshape(kv_heads, 1, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(kv_heads * (groups + 2) * head_dim, *rest).contiguous()


def _lm_shape(cfg: dict) -> tuple[int, int, int]:
    t = cfg["llm_config"]
    heads = t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    return kv, heads // kv, t["hidden_size"] // heads


def convert_tensors(tensors: dict[str, torch.Tensor], cfg: dict) -> tuple[dict, dict]:
    """Release keys -> ``(base, memory)``: the InternVL state dict and the memory file's tensors (``"{layer}.{name}"``).

    Every key must be claimed: an unknown one is a ``ValueError`` naming it (another layout than the release's)."""
    kv, groups, hd = _lm_shape(cfg)
    base: dict[str, torch.Tensor] = {}
    memory: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, w in tensors.items():
        if key.startswith("vision_model."):
            new = key
            for pat, rep in _VISION:
                new = re.sub(pat, rep, new)
            if ".attention.qkv." in new:
                q, k, v = w.chunk(3, dim=0)
                for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    base[new.replace(".attention.qkv.", f".attention.{name}.")] = part.contiguous()
            else:
                base[new] = w
        elif key[:7] in _PROJECTOR:
            base[_PROJECTOR[key[:7]] + key[7:]] = w
        elif key == "language_model.model.tok_embeddings.weight":
            base["model.language_model.embed_tokens.weight"] = w
        elif key == "language_model.model.norm.weight":
            base["model.language_model.norm.weight"] = w
        elif key == "language_model.output.weight":
            base["lm_head.weight"] = w
        elif (m := _LAYER.match(key)) is not None:
            layer, part, rest = m.groups()
            if part == "gated_cross_attn_layer.":
                memory.setdefault(layer, {})[rest] = w
                continue
            prefix = f"model.language_model.layers.{layer}."
            if rest.startswith("attention.wqkv."):
                q, k, v = _split_wqkv(w, kv, groups, hd)
                suffix = rest[len("attention.wqkv."):]
                for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    base[f"{prefix}self_attn.{name}.{suffix}"] = t
            elif (hit := next((r for r in _LM if rest.startswith(r)), None)) is not None:
                base[prefix + _LM[hit] + rest[len(hit):]] = w
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    mem = {}
    for layer, parts in memory.items():
        need = {"attn_gate", "ff_gate", "cross_attn.to_kv.weight", "ffn_2.w1.weight", "ffn_2.w3.weight", *_MEM}
        if set(parts) != need:
            unknown += [f"language_model.model.layers.{layer}.gated_cross_attn_layer.{k}" for k in set(parts) - need]
            missing = need - set(parts)
            if missing:
                raise ValueError(f"memory block {layer} lacks {sorted(missing)}; accepted: {ACCEPTED}")
        for old, new in _MEM.items():
            mem[f"{layer}.{new}"] = parts[old]
        k, v = parts["cross_attn.to_kv.weight"].chunk(2, dim=0)
        mem[f"{layer}.attn.k_proj.weight"], mem[f"{layer}.attn.v_proj.weight"] = k.contiguous(), v.contiguous()
        mem[f"{layer}.mlp.fc1.weight"] = torch.cat([parts["ffn_2.w1.weight"], parts["ffn_2.w3.weight"]], dim=0)
        mem[f"{layer}.attn_gate"] = parts["attn_gate"].reshape(())
        mem[f"{layer}.ff_gate"] = parts["ff_gate"].reshape(())
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"unexpected tensors {shown}; accepted: {ACCEPTED}")
    return base, mem


def release_tensors_from(base: dict, memory: dict, cfg: dict) -> dict[str, torch.Tensor]:
    """The inverse of :func:`convert_tensors` (the round-trip check)."""
    kv, groups, hd = _lm_shape(cfg)
    out: dict[str, torch.Tensor] = {}
    vis_back = {"cls_token": "class_embedding", "position_embeddings": "position_embedding"}
    for key, w in base.items():
        if key.startswith("model.vision_tower."):
            if ".attention.k_proj." in key or ".attention.v_proj." in key:
                continue
            new = "vision_model." + key[len("model.vision_tower."):]
            new = new.replace(".patch_embeddings.projection.", ".patch_embedding.").replace(".encoder.layer.", ".encoder.layers.")
            new = re.sub(r"\.lambda_(\d)$", r".ls\1", new)
            new = new.replace(".attention.projection_layer.", ".attn.proj.").replace(".layernorm_before.", ".norm1.")
            new = new.replace(".layernorm_after.", ".norm2.").replace(".attention.", ".attn.")
            last = new.rsplit(".", 1)[-1]
            if last in vis_back:
                new = new[: -len(last)] + vis_back[last]
            if ".attn.q_proj." in new:
                k, v = base[key.replace(".q_proj.", ".k_proj.")], base[key.replace(".q_proj.", ".v_proj.")]
                out[new.replace(".attn.q_proj.", ".attn.qkv.")] = torch.cat([w, k, v], dim=0)
            else:
                out[new] = w
        elif key.startswith("model.multi_modal_projector."):
            back = {v: k for k, v in _PROJECTOR.items()}
            hit = next(p for p in back if key.startswith(p))
            out[back[hit] + key[len(hit):]] = w
        elif key == "model.language_model.embed_tokens.weight":
            out["language_model.model.tok_embeddings.weight"] = w
        elif key == "model.language_model.norm.weight":
            out["language_model.model.norm.weight"] = w
        elif key == "lm_head.weight":
            out["language_model.output.weight"] = w
        else:
            m = re.match(r"^model\.language_model\.layers\.(\d+)\.(.+)$", key)
            layer, rest = m.groups()
            prefix = f"language_model.model.layers.{layer}.decoder_layer."
            if rest.startswith("self_attn.q_proj."):
                suffix = rest[len("self_attn.q_proj."):]
                k = base[f"model.language_model.layers.{layer}.self_attn.k_proj.{suffix}"]
                v = base[f"model.language_model.layers.{layer}.self_attn.v_proj.{suffix}"]
                out[f"{prefix}attention.wqkv.{suffix}"] = _pack_wqkv(w, k, v, kv, groups, hd)
            elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            else:
                hit = next(v for v in _LM.values() if rest.startswith(v))
                old = next(k for k, v in _LM.items() if v == hit)
                out[prefix + old + rest[len(hit):]] = w
    for key, w in memory.items():
        layer, name = key.split(".", 1)
        prefix = f"language_model.model.layers.{layer}.gated_cross_attn_layer."
        back = {v: k for k, v in _MEM.items()}
        if name in back:
            out[prefix + back[name]] = w
        elif name == "attn.k_proj.weight":
            out[prefix + "cross_attn.to_kv.weight"] = torch.cat([w, memory[f"{layer}.attn.v_proj.weight"]], dim=0)
        elif name == "mlp.fc1.weight":
            w1, w3 = w.chunk(2, dim=0)
            out[prefix + "ffn_2.w1.weight"], out[prefix + "ffn_2.w3.weight"] = w1, w3
        elif name in ("attn_gate", "ff_gate"):
            out[prefix + name] = w.reshape(1)
    return out
