"""Tiny random transformers models of the real architectures, built from configs (no weights, milliseconds), and
inputs for them. Shared by the core.hf tests; each builder returns ``(model, inputs)`` with the model in eval mode
under ``attn_implementation="eager"`` (switch with ``model.set_attn_implementation``)."""

from __future__ import annotations

import torch

VOCAB = 160
LLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)  # fmt: skip


def _finish(model):
    model.config._attn_implementation = "eager"
    model.set_attn_implementation("eager")
    return model.eval()


def _ids(B: int, S: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB - 8, (B, S), generator=g)


def llama(B=2, S=24):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _finish(LlamaForCausalLM(LlamaConfig(**LLM))), {"input_ids": _ids(B, S)}


def qwen2(B=2, S=24):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _finish(Qwen2ForCausalLM(Qwen2Config(**LLM))), {"input_ids": _ids(B, S)}


def mistral(B=2, S=24, window=7):
    """Sliding window 7 < prompt length, so the window bites in prefill and decode."""
    from transformers import MistralConfig, MistralForCausalLM

    return _finish(MistralForCausalLM(MistralConfig(**LLM, sliding_window=window))), {"input_ids": _ids(B, S)}


def gemma2(B=2, S=24, window=6):
    """Alternating sliding/full layers, attention logit soft-capping (small cap so it bites), GQA."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**{**LLM, "num_hidden_layers": 4}, head_dim=16, sliding_window=window,
                       attn_logit_softcapping=1.5, final_logit_softcapping=30.0)  # fmt: skip
    return _finish(Gemma2ForCausalLM(cfg)), {"input_ids": _ids(B, S)}


QWEN2VL_IMAGE = 150


def qwen2_vl(B=1, S_text=10):
    """Qwen2-VL with a depth-2 vision tower and one 56x56 image (4x4 patches of 14 -> 4 merged tokens)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}  # sections sum to head_dim/2
    text = {**LLM, "bos_token_id": 1, "eos_token_id": 2, "rope_parameters": rope}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)  # fmt: skip
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN2VL_IMAGE, video_token_id=151,
                        vision_start_token_id=152, vision_end_token_id=153)  # fmt: skip
    model = _finish(Qwen2VLForConditionalGeneration(cfg))
    grid = torch.tensor([[1, 4, 4]] * B)  # t, h, w patches per image
    n_img = 4  # 16 patches / merge 2x2
    g = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(B * 16, 3 * 2 * 14 * 14, generator=g)
    ids = _ids(B, S_text)
    img = torch.tensor([152] + [QWEN2VL_IMAGE] * n_img + [153]).expand(B, -1)
    input_ids = torch.cat([ids[:, :3], img, ids[:, 3:]], dim=1)
    mm = (input_ids == QWEN2VL_IMAGE).int()
    return model, {"input_ids": input_ids, "pixel_values": pixel_values, "image_grid_thw": grid,
                   "mm_token_type_ids": mm}  # fmt: skip


INTERNVL_IMAGE = 150


def internvl(B=1, S_text=10):
    """InternVL: InternViT-style vision tower (2 layers, 28x28 image, 4 image tokens) + a Qwen2 LM."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  image_size=[28, 28], patch_size=[7, 7])  # fmt: skip
    text = {**LLM, "model_type": "qwen2"}
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=INTERNVL_IMAGE, image_seq_length=4)
    model = _finish(InternVLForConditionalGeneration(cfg))
    g = torch.Generator().manual_seed(2)
    pixel_values = torch.randn(B, 3, 28, 28, generator=g)
    ids = _ids(B, S_text)
    input_ids = torch.cat([ids[:, :2], torch.full((B, 4), INTERNVL_IMAGE), ids[:, 2:]], dim=1)
    return model, {"input_ids": input_ids, "pixel_values": pixel_values}


BLIP_VIDEO = 150


def instructblip_video(B=1, S_text=8, frames=2, queries=4):
    """InstructBLIP-Video: EVA-style ViT (2 layers), BLIP-2 Q-former with cross-attention (2 layers), Llama LM."""
    from transformers import InstructBlipVideoConfig, InstructBlipVideoForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)  # fmt: skip
    qformer = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=64, cross_attention_frequency=1, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)  # fmt: skip
    text = {**LLM, "model_type": "llama"}
    cfg = InstructBlipVideoConfig(vision_config=vision, qformer_config=qformer, text_config=text,
                                  num_query_tokens=queries, video_token_index=BLIP_VIDEO)  # fmt: skip
    model = _finish(InstructBlipVideoForConditionalGeneration(cfg))
    g = torch.Generator().manual_seed(3)
    pixel_values = torch.randn(B, frames, 3, 28, 28, generator=g)
    ids = _ids(B, S_text)
    input_ids = torch.cat([torch.full((B, frames * queries), BLIP_VIDEO), ids], dim=1)
    q_ids = _ids(B, 5, seed=4)
    return model, {"input_ids": input_ids, "pixel_values": pixel_values, "qformer_input_ids": q_ids,
                   "qformer_attention_mask": torch.ones_like(q_ids)}  # fmt: skip


FAMILIES = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral-sliding": mistral,
    "gemma2-sliding-softcap": gemma2,
    "qwen2-vl": qwen2_vl,
    "internvl": internvl,
    "instructblip-video": instructblip_video,
}
TEXT_ONLY = ("llama", "qwen2", "mistral-sliding", "gemma2-sliding-softcap")


# --- families whose attention calls carry extra keywords or patterns (served by the core, never eager) ------------


def gpt_oss(B=2, S=14, window=6):
    """GPT-OSS: attention sinks (``s_aux``, drawn large so that they matter), sliding and full layers, GQA."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{**LLM, "num_hidden_layers": 2}, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                       sliding_window=window, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    model = _finish(GptOssForCausalLM(cfg))
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return model, {"input_ids": _ids(B, S)}


def modernbert(B=2, S=30):
    """ModernBERT: bidirectional local layers (window 8, ``|q - kv| <= 4``) and global layers, ``deterministic``."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                           max_position_embeddings=128)  # fmt: skip
    return _finish(ModernBertForMaskedLM(cfg)), {"input_ids": _ids(B, S)}


def llama4(B=2, S=30, chunk=8):
    """Llama 4 text: chunked attention (chunks of 8) on three layers, full attention (no RoPE) on the fourth."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(**{**LLM, "num_hidden_layers": 4}, head_dim=16, attention_chunk_size=chunk,
                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0])  # fmt: skip
    return _finish(Llama4ForCausalLM(cfg)), {"input_ids": _ids(B, S)}


def deepseek_v32(B=2, S=20):
    """DeepSeek-V3.2: MLA attention over the top-6 keys per query its lightning indexer selects (``indices``)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                            topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, index_topk=6, index_n_heads=2, index_head_dim=16, pad_token_id=0,
                            max_position_embeddings=128)  # fmt: skip
    return _finish(DeepseekV32ForCausalLM(cfg)), {"input_ids": _ids(B, S)}


def minimax_m3(B=2, S=23):
    """MiniMax-M3 text: a sparse layer attending the top-2 key blocks of 4 per query and key/value head
    (``block_indices``), then a full layer."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    cfg = MiniMaxM3VLTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                dense_intermediate_size=64, shared_intermediate_size=32, rotary_dim=8, index_n_heads=2,
                                index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
                                layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"],
                                pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)  # fmt: skip
    return _finish(MiniMaxM3VLForCausalLM(cfg)), {"input_ids": _ids(B, S)}


def inkling2(B=2, S=20):
    """Inkling 2: per-row attention sinks (``sinks``, projected from the hidden states) and a relative position
    bias, a sliding layer (window 6) and a full one."""
    from transformers import Inkling2ForCausalLM
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    cfg = Inkling2TextConfig(vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                             swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=6, d_rel=4, rel_extent=8,
                             log_scaling_n_floor=16, layer_types=["hybrid_sliding", "hybrid"],
                             max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=4,
                             num_experts_per_tok=2, n_layers_per_attn_res_block=1, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)  # fmt: skip
    return _finish(Inkling2ForCausalLM(cfg)), {"input_ids": _ids(B, S)}


GEMMA3_IMAGE = 150


def gemma3(B=2, S=16):
    """Gemma 3 with a 1-layer SigLIP tower: one image (4 tokens, bidirectional among themselves) per row, a
    sliding layer (window 6) and a full layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {**LLM, "head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
            "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7)  # fmt: skip
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=GEMMA3_IMAGE,
                       boi_token_index=151, eoi_token_index=152)  # fmt: skip
    model = _finish(Gemma3ForConditionalGeneration(cfg))
    ids = _ids(B, S)
    img = torch.tensor([151] + [GEMMA3_IMAGE] * 4 + [152]).expand(B, -1)
    input_ids = torch.cat([ids[:, :7], img, ids[:, 7:]], dim=1)
    g = torch.Generator().manual_seed(5)
    return model, {"input_ids": input_ids, "pixel_values": torch.randn(B, 3, 28, 28, generator=g),
                   "token_type_ids": (input_ids == GEMMA3_IMAGE).long()}  # fmt: skip


SERVED_FAMILIES = {
    "gpt-oss-sinks": gpt_oss,
    "inkling2-row-sinks": inkling2,
    "modernbert-bidirectional-window": modernbert,
    "llama4-chunked": llama4,
    "deepseek-v32-indices": deepseek_v32,
    "minimax-m3-block-indices": minimax_m3,
    "gemma3-image-groups": gemma3,
}
