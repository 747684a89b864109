"""A tiny random Qwen2-VL that meets the reference implementation's hard-coded assumptions, buildable identically in
transformers 4.48 (the release's fork) and in this project's transformers.

What the release's wrapper (``qwen2_vl_custom.py``) assumes and this model meets:

- the real vocabulary size (151,936) and the real special-token ids: ``<|im_start|>`` 151644, ``<|im_end|>`` 151645,
  ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655, and the word ``assistant`` as
  token 77091 (the wrapper finds answers after it), ``\\n`` as 198, ``user`` 872, ``system`` 8948;
- the real Qwen2-VL chat template (its default system header is the 58 characters the wrapper cuts off with
  ``[58:-22]``; the generation prompt is the last 22);
- Qwen2's pre-tokenisation (its split pattern, then byte-level), so spaces and newlines become tokens as in the
  real tokenizer. Words outside the few ids above get fixed ids of their own (the tokenizer is word-level over a
  small word list: every word the fixtures use).

Weights are not random draws of either library's initialiser (their order differs between versions): every
parameter is filled from a generator seeded by its name (``canonical_name``: the same in both versions), so the
two libraries build the same numbers. No code of the release is here.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

VOCAB_SIZE = 151936  # Qwen2-VL's (2B and 7B)
SPECIAL = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}  # fmt: skip
IM_END, VISION_END, IMAGE, ASSISTANT, NEWLINE = 151645, 151653, 151655, 77091, 198

# Byte-level pieces (space = "Ġ", newline = "Ċ") and their ids: the real Qwen2 ids where they are known, fixed others.
WORDS = {
    "Ċ": 198, "user": 872, "system": 8948, "assistant": 77091, "You": 2610, "Ġare": 525, "Ġa": 264, "Ġhelpful": 10950,
    "Ġassistant": 17847, ".": 13, "What": 3838, "Ġis": 374, "Ġin": 304, "Ġthe": 279, "Ġimage": 2168, "?": 30,
    "tabby": 41001, "Ġcat": 8251, "red": 1151, "Ġfox": 38835, "sea": 36441, "Ġotter": 78879, "snow": 74478,
    "Ġowl": 52269, "grey": 34571, "Ġwolf": 36542,
}  # fmt: skip
LABELS = ("tabby cat", "red fox", "sea otter", "snow owl", "grey wolf")

# The real Qwen2-VL-Instruct chat template (chat_template.json).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content"
    " or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split pattern (tokenizer.json of the Qwen2 family).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
         r"|\s+")

#: The tiny model: 4 layers, hidden 64, 4 query / 2 key-value heads of 16 (GQA as in the 2B: 12 / 2), tied
#: embeddings (as the 2B), a depth-2 vision tower; 224x224 images give 64 image tokens.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=1_000_000.0, mrope_section=[2, 3, 3], max_position_embeddings=32768,
            vision=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2))  # fmt: skip
#: Qwen2-VL-2B-Instruct's published shapes (config.json), for the memory benchmark.
QWEN2VL_2B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1_000_000.0, mrope_section=[16, 24, 24],
                  max_position_embeddings=32768,
                  vision=dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, in_channels=3,
                              patch_size=14, spatial_merge_size=2, temporal_patch_size=2))  # fmt: skip
IMAGE_SIDE = 224  # pixels per side of the fixtures' images (multiples of 28 are left as they are by both pipelines)
#: Standard deviations of the fill, per kind of parameter (chosen so that pruning moves the answers' distributions
#: around the published delta = 0.005: a mix of accepted ratios and whole layers).
STD = dict(embed=0.2, linear=0.2, vision=0.05, bias=0.02)


def _major_minor() -> tuple[int, int]:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2])


def build_config(shape: dict = TINY):
    """A ``Qwen2VLConfig`` of ``shape`` in whichever transformers is installed (4.48's flat form or the nested one)."""
    from transformers import Qwen2VLConfig

    s = dict(shape)
    vision = s.pop("vision")
    section = s.pop("mrope_section")
    ids = dict(image_token_id=IMAGE, video_token_id=SPECIAL["<|video_pad|>"], vision_start_token_id=151652,
               vision_end_token_id=VISION_END, vision_token_id=151654)  # fmt: skip
    common = dict(vocab_size=VOCAB_SIZE, bos_token_id=151643, eos_token_id=IM_END, tie_word_embeddings=True,
                  use_sliding_window=False, sliding_window=s["max_position_embeddings"],
                  max_window_layers=s["num_hidden_layers"], attention_dropout=0.0, hidden_act="silu")  # fmt: skip
    if _major_minor() < (4, 50):
        return Qwen2VLConfig(**s, **common, **ids, vision_config=vision,
                             rope_scaling={"type": "mrope", "mrope_section": section})  # fmt: skip
    theta = s.pop("rope_theta")
    text = {**s, **common, "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": theta}}
    text.pop("tie_word_embeddings")
    vision = {**vision, "hidden_act": "quick_gelu"}
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def canonical_name(name: str) -> str:
    """A parameter's name, the same in both library versions: ``lm.`` + the language model's own name, or
    ``visual.`` + the vision tower's, or ``lm_head.``."""
    for prefix, to in (("model.language_model.", "lm."), ("model.visual.", "visual."), ("visual.", "visual."),
                       ("model.", "lm.")):  # fmt: skip
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name


def _std(cname: str, p: torch.Tensor) -> float | None:
    """None = a norm's weight (ones) or bias (zeros)."""
    if "norm" in cname or ".ln_q." in cname:
        return None
    if cname.endswith(".bias"):
        return STD["bias"]
    if "embed_tokens" in cname:
        return STD["embed"]
    if cname.startswith("visual."):
        return STD["vision"]
    return STD["linear"]


@torch.no_grad()
def fill_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with numbers drawn from a generator seeded by ``seed`` and its canonical name
    (tied weights once)."""
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        cname = canonical_name(name)
        std = _std(cname, p)
        if std is None:
            p.fill_(0.0 if cname.endswith(".bias") else 1.0)
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(cname.encode()))
        p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float32) * std).to(p.dtype))
    return model


def build_model(shape: dict = TINY, seed: int = 0, dtype=torch.float32, attn_implementation: str = "eager"):
    """The model of ``shape`` with :func:`fill_weights` (eval mode)."""
    from transformers import Qwen2VLForConditionalGeneration

    cfg = build_config(shape)
    cfg._attn_implementation = attn_implementation
    if getattr(cfg, "vision_config", None) is not None:
        cfg.vision_config._attn_implementation = attn_implementation
    model = Qwen2VLForConditionalGeneration(cfg)
    fill_weights(model, seed)
    return model.to(dtype).eval()


def build_tokenizer():
    """A fast tokenizer with Qwen2's pre-tokenisation and the ids above (unknown words: ``<|endoftext|>``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**WORDS, **SPECIAL}
    used = set(vocab.values())
    vocab.update({f"<unused{i}>": i for i in range(max(used) + 1) if i not in used})  # no holes in the id range
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    kw = dict(tokenizer_object=tok, unk_token="<|endoftext|>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
              padding_side="left")  # fmt: skip
    if _major_minor() < (4, 50):  # 4.48's processor insists on the Qwen2 tokenizer class
        from transformers import Qwen2TokenizerFast

        return Qwen2TokenizerFast(**kw)
    kw["extra_special_tokens"] = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    return PreTrainedTokenizerFast(**kw)


def build_processor(image_side: int = IMAGE_SIDE):
    """Qwen2-VL's processor (its slow image processor, fixed to ``image_side`` squared pixels) over
    :func:`build_tokenizer`, with the real chat template."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    pixels = image_side * image_side
    image = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels)
    kw = {}
    if _major_minor() >= (4, 50):
        try:
            from transformers import Qwen2VLVideoProcessor

            kw["video_processor"] = Qwen2VLVideoProcessor()
        except Exception:  # noqa: BLE001 - the video processor needs torchvision; images do not
            kw["video_processor"] = None
    return Qwen2VLProcessor(image_processor=image, tokenizer=build_tokenizer(), chat_template=CHAT_TEMPLATE, **kw)


def images(n: int, seed: int, side: int = IMAGE_SIDE) -> list[np.ndarray]:
    """``n`` random RGB images ``(side, side, 3)`` uint8."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(n)]


#: The fixtures' episode: 8 demonstrations (2 chunks of 4) and 3 queries.
EPISODE = dict(demo_seed=11, query_seed=12, num_demos=8, num_queries=3, chunk_demos=4, delta=0.005,
               ratios=(0.1, 0.2, 0.5), prompt="What is in the image?",
               labels=("tabby cat", "red fox", "sea otter", "tabby cat", "snow owl", "red fox", "grey wolf",
                       "sea otter"))  # fmt: skip


def episode():
    """``(demos [(image, label)], queries [image])`` of :data:`EPISODE`."""
    e = EPISODE
    demos = list(zip(images(e["num_demos"], e["demo_seed"]), e["labels"]))
    return demos, images(e["num_queries"], e["query_seed"])
