"""Run CoMemo's released modeling code on a tiny random model and write the numbers it produces as test fixtures.

Usage (in an environment with the transformers version the release names, 4.37.2; see README.md here)::

    python tools/reference/comemo/make_fixtures.py RELEASE_DIR tests/fixtures/comemo

``RELEASE_DIR`` is a checkout of LALBJ/CoMemo; its ``comemo`` package is imported from there (nothing of it is
copied). The script

1. builds a tiny ``CoMemoChatConfig`` in the release's format (InternViT with 64-pixel tiles and 256 tokens per tile
   after pixel shuffle, an 8-layer InternLM2 with grouped KV heads and packed ``wqkv``, a memory block before
   layers 3 and 7), draws random weights with non-zero gates, saves it as a release checkpoint folder
   (``config.json``, ``model.safetensors``, a byte-level BPE ``tokenizer.json``) and loads it back with the
   release's ``CoMemoChatModel.from_pretrained``;
2. tiles three random images 1x2, 2x2 and 2x3 (+ thumbnail) as the release's README does (row-major crops);
3. runs the release's ``CoMemoChatModel.chat`` (16 greedy tokens) for each image alone and for a three-image prompt,
   with RoPE-DHR on (``target_aspect_ratio`` given) and off, and records what the release computed: the prompt ids,
   its position ids (language model and memory), the prompt logits at chosen positions, the logits of every decode
   step and the generated ids.

Work-arounds, all here and none in the project (the release does not run on a CPU-only machine as shipped):

- ``comemo/model/comemo_chat/helpers.py`` line 16 imports ``flash_attn.flash_attn_interface`` unconditionally
  (``ModuleNotFoundError: No module named 'flash_attn'``): a stub module is put in ``sys.modules`` (the release
  only calls it when ``cu_seqlens`` are set, which inference never does).
- ``CoMemoChatModel.chat`` (``modeling_comemo_chat.py`` lines 397-398) moves the prompt with ``.cuda()``
  (``RuntimeError: Found no NVIDIA driver on your system``): ``torch.Tensor.cuda`` is replaced by the
  identity while ``chat`` runs.
- ``CoMemoChatModel.__init__`` (``modeling_comemo_chat.py`` line 102) reads ``config.use_temporal``, which
  ``CoMemoChatConfig`` does not define (``AttributeError``): the config is given ``use_temporal=False``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch

TILE = 64  # pixels per tile side (patch 2 -> 32x32 patches -> 16x16 = 256 tokens after pixel shuffle)
GRIDS = {"1x2": (1, 2), "2x2": (2, 2), "2x3": (2, 3)}  # (rows, cols)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NEW_TOKENS = 16
SEED = 0

SYSTEM = ("你是由上海人工智能实验室联合商汤科技开发的书生多模态大模型，英文名叫InternVL, "
          "是一个有用无害的人工智能助手。")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
TRAIN_TEXT = [SYSTEM, "user\n", "assistant\n", "Describe the image in detail.", "Image-1: Image-2: Image-3:",
              "What is the same and what differs in these three images?", "a red square, a blue circle, a digit",
              "left right top bottom one two three yes no the and of is it"]


def stub_flash_attn() -> None:
    """helpers.py line 16 imports flash_attn unconditionally; inference never calls it."""
    import importlib.machinery

    pkg = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # transformers probes find_spec()
    iface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)

    def _absent(*args, **kwargs):
        raise RuntimeError("flash_attn is stubbed out in this harness")

    iface.flash_attn_varlen_func = _absent
    pkg.flash_attn_interface = iface
    sys.modules.setdefault("flash_attn", pkg)
    sys.modules.setdefault("flash_attn.flash_attn_interface", iface)


def build_tokenizer(folder: Path):
    """A byte-level BPE (every string encodes) with InternLM2's special tokens and a BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(TRAIN_TEXT, trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>", additional_special_tokens=SPECIALS[3:])
    tok.save_pretrained(str(folder))
    return tok


def build_config(vocab: int):
    from comemo.model.comemo_chat.configuration_comemo_chat import CoMemoChatConfig

    vision = dict(architectures=["InternVisionModel"], num_channels=3, patch_size=2, image_size=TILE, qkv_bias=True,
                  hidden_size=16, num_attention_heads=2, intermediate_size=32, qk_normalization=False,
                  num_hidden_layers=2, use_flash_attn=False, hidden_act="gelu", norm_type="layer_norm",
                  layer_norm_eps=1e-6, dropout=0.0, drop_path_rate=0.0, attention_dropout=0.0,
                  initializer_range=0.02, initializer_factor=0.1)
    # rope_theta and rms_norm_eps of the LM differ from the memory block's hard-coded 1e6 / 1e-5 on purpose: a port
    # that takes the memory's RoPE base or norm eps from the LM fails the fixtures
    llm = dict(architectures=["InternLM2ForCausalLM"], vocab_size=vocab, hidden_size=64, intermediate_size=128,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=50000.0, rope_scaling=None, bias=False,
               tie_word_embeddings=False, attn_implementation="eager", pad_token_id=2, bos_token_id=1,
               eos_token_id=2)
    mixin = dict(mixin_every_n_layers=4, language_dim=64, vision_dim=64, head_dim=16, num_heads=4,
                 intermediate_size=96)
    return CoMemoChatConfig(vision_config=vision, llm_config=llm, mixin_config=mixin, select_layer=-1,
                            force_image_size=TILE, downsample_ratio=0.5, template="internlm2-chat",
                            dynamic_image_size=True, use_thumbnail=True, ps_version="v2", min_dynamic_patch=1,
                            max_dynamic_patch=12, use_temporal=False, architectures=["CoMemoChatModel"])


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Weights with O(1) logits (well-separated greedy choices) and non-zero gates of both signs."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith(("attn_gate", "ff_gate")):
            continue
        if p.dim() == 1:  # norms, biases, layer scales
            base = 1.0 if name.endswith("weight") or ".ls" in name else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        else:
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    gates = [(0.9, 0.6), (-0.7, 0.8)]  # (attn, ff) of the blocks before layers 3 and 7
    blocks = [layer.gated_cross_attn_layer for layer in model.language_model.model.layers
              if layer.gated_cross_attn_layer is not None]
    for blk, (a, f) in zip(blocks, gates, strict=True):
        blk.attn_gate.fill_(a)
        blk.ff_gate.fill_(f)


def make_images(seed: int) -> dict:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = {}
    for name, (rows, cols) in GRIDS.items():
        small = rng.integers(0, 256, (rows * 4, cols * 4, 3), dtype=np.uint8)  # blocky: resizing is gentle
        out[name] = Image.fromarray(small).resize((cols * TILE + 8, rows * TILE + 8), Image.NEAREST)
    return out


def tile(image, grid) -> torch.Tensor:
    """The README's ``dynamic_preprocess`` at a known grid: row-major crops, then the thumbnail; normalised."""
    rows, cols = grid
    resized = image.resize((cols * TILE, rows * TILE))
    views = [resized.crop((c * TILE, r * TILE, (c + 1) * TILE, (r + 1) * TILE)) for r in range(rows) for c in range(cols)]
    views.append(image.resize((TILE, TILE)))
    arr = np.stack([np.asarray(v, dtype=np.float32) / 255.0 for v in views])
    arr = (arr - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous().half().float()  # fp16-exact inputs


class Recorder:
    """Captures what the release computes inside ``chat``: generate's inputs, prefill and step logits, ids."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls: list[dict] = []
        self.logits: list[torch.Tensor] = []
        orig = model.generate

        def generate(**kw):
            self.calls.append({k: v for k, v in kw.items() if isinstance(v, torch.Tensor)})
            out = orig(**kw)
            self.calls[-1]["output"] = out
            return out

        model.generate = generate
        model.language_model.register_forward_hook(lambda m, a, kw_out: self.logits.append(kw_out.logits[0].clone()))

    def reset(self) -> None:
        self.calls.clear()
        self.logits.clear()


def chosen_positions(ids: torch.Tensor, img_token: int) -> list[int]:
    """Every text position, every 61st image position, and the last position."""
    S = ids.shape[0]
    is_img = (ids == img_token).tolist()
    img_seen = 0
    keep = []
    for i in range(S):
        if not is_img[i]:
            keep.append(i)
        else:
            if img_seen % 61 == 0:
                keep.append(i)
            img_seen += 1
    if keep[-1] != S - 1:
        keep.append(S - 1)
    return keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", type=Path, help="checkout of LALBJ/CoMemo")
    ap.add_argument("out", type=Path, help="fixture folder (tests/fixtures/comemo)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(args.release.resolve()))
    stub_flash_attn()
    import transformers
    from safetensors.torch import save_file

    from comemo.model.comemo_chat.modeling_comemo_chat import CoMemoChatModel

    release_dir = args.out / "release"
    release_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(release_dir)
    config = build_config(len(tok))
    torch.manual_seed(SEED)
    model = CoMemoChatModel(config)
    randomize(model, SEED)
    with torch.no_grad():  # the end token's logit is 0, far below the best of 400 O(1) logits: 16 tokens always come
        model.language_model.output.weight[tok.convert_tokens_to_ids("<|im_end|>")] = 0.0
    model.save_pretrained(str(release_dir), safe_serialization=True)
    model = CoMemoChatModel.from_pretrained(str(release_dir), torch_dtype=torch.float32, local_files_only=True).eval()
    rec = Recorder(model)

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>", "<|im_end|>")}
    images = make_images(SEED)
    pixels = {name: tile(img, GRIDS[name]) for name, img in images.items()}
    cases = [(f"{n}_{mode}", [n], "Describe the image in detail.", mode) for n in GRIDS for mode in ("dhr", "1d")]
    multi_q = "Image-1: <image>\nImage-2: <image>\nImage-3: <image>\nWhat is the same and what differs in these three images?"
    cases += [(f"multi_{mode}", list(GRIDS), multi_q, mode) for mode in ("dhr", "1d")]

    tensors = {f"pixels.{n}": p.half().contiguous() for n, p in pixels.items()}  # fp16-exact values
    meta = {"release_format": "CoMemoChatModel (InternViT + InternLM2, packed wqkv), release folder: release/",
            "tokens": ids, "grids": {n: list(g) for n, g in GRIDS.items()}, "tile": TILE, "mean": MEAN, "std": STD,
            "new_tokens": NEW_TOKENS, "transformers": transformers.__version__, "torch": torch.__version__,
            "cases": {}}
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # chat() moves its prompt with .cuda() (lines 397-398)
    try:
        for name, imgs, question, mode in cases:
            rec.reset()
            pv = torch.cat([pixels[n] for n in imgs])
            grid_wh = [(GRIDS[n][1], GRIDS[n][0]) for n in imgs]  # target_aspect_ratio is (cols, rows)
            gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
            model.chat(tok, pv, question, gen, target_aspect_ratio=grid_wh if mode == "dhr" else None,
                       num_patches_list=[pixels[n].shape[0] for n in imgs], IMAGE_START_TOKEN_ID=ids["<img>"],
                       IMAGE_END_TOKEN_ID=ids["</img>"])
            call = rec.calls[-1]
            prompt = call["input_ids"][0]
            out = call["output"][0]
            if out.shape[0] == NEW_TOKENS + 1 and int(out[0]) == tok.bos_token_id:
                out = out[1:]  # transformers 4.37 starts an inputs_embeds-only generation with the BOS id
            if out.shape[0] != NEW_TOKENS:
                raise SystemExit(f"{name}: the release stopped after {out.shape[0]} tokens; choose another SEED")
            keep = chosen_positions(prompt, ids["<IMG_CONTEXT>"])
            prefill, steps = rec.logits[0], rec.logits[1:]
            tensors[f"{name}.input_ids"] = prompt.clone()
            tensors[f"{name}.position_ids"] = call["position_ids"][0].long().clone()
            tensors[f"{name}.memory_position_ids"] = call["cross_attention_media_position_ids"][0].long().clone()
            tensors[f"{name}.positions"] = torch.tensor(keep)
            tensors[f"{name}.logits"] = prefill[keep].contiguous()
            tensors[f"{name}.step_logits"] = torch.stack([s[-1] for s in steps]).contiguous()
            tensors[f"{name}.generated"] = out.clone()
            meta["cases"][name] = {"images": imgs, "question": question, "positions": mode,
                                   "prompt_length": int(prompt.shape[0]), "decode_steps": len(steps)}
            print(f"{name}: {prompt.shape[0]} prompt tokens, generated {out.tolist()}")
    finally:
        torch.Tensor.cuda = cuda
    save_file(tensors, str(args.out / "cases.safetensors"))
    (args.out / "cases.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
