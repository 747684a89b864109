"""CoMemo at the released CoMemo-2B's shapes, random weights, end to end: write, convert, load, answer.

    python -m benchmarks.comemo_real_size --out benchmarks/results/comemo_real_size.json

Shapes (``SHAPES["2b"]``): InternViT-300M-448px (24 layers, hidden 1024, 16 heads, patch 14, 448-px tiles) +
InternLM2-chat-1.8B (24 layers, hidden 2048, 16 heads, 8 KV heads, FFN 8192, vocabulary 92,553, RoPE base 1e6 with
dynamic scaling x2, RMSNorm eps 1e-5) + memory blocks before every 4th layer (16 heads of 128, full-head K/V, SwiGLU
8192: the release's ``mixin_config`` defaults scaled to the 2,048-wide model; the published checkpoint's own value
is not in the release's code). ``--size 9b`` takes InternLM2-chat-7B's shapes (about 18 GB in bf16: a GPU or a large
machine).

Steps, each timed (wall clock) with the process's peak resident memory during the step (``VmHWM`` reset at its start,
absolute and as growth over the start; see ``benchmarks/common.py``) and, on CUDA, the peak CUDA memory:

1. ``write``: a released-format checkpoint folder (``model_type`` ``comemo_chat``, packed ``wqkv``, bf16 safetensors
   shards, a word-level tokenizer with InternLM2's special-token ids) with random weights, gates 0.5;
2. ``convert``: ``apps.comemo.convert`` (round-trip and layout checks, SHA-256 of the sources included);
3. ``load``: ``CoMemo.from_hf`` (``--device``/``--dtype``: auto = CUDA and bf16 when present; bf16 on the CPU by
   default when it has AVX512-BF16/AMX);
4. ``forward``: one forward over a prompt with two images of 2x2 tiles + thumbnail (2 x 5 x 256 image tokens);
5. ``generate``: 16 greedy tokens on the same prompt.

This is a feasibility run (does the released size load and run here, in what memory and time), not a speed
comparison: there is no peer to compare with before the real weights and a GPU are there.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import PeakRSS, _status_kb, env_info, write_json_atomic

logger = logging.getLogger(__name__)

VISION_300M = dict(architectures=["InternVisionModel"], model_type="intern_vit_6b", num_channels=3, patch_size=14,
                   image_size=448, qkv_bias=True, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                   qk_normalization=False, num_hidden_layers=24, use_flash_attn=False, hidden_act="gelu",
                   norm_type="layer_norm", layer_norm_eps=1e-6, dropout=0.0, drop_path_rate=0.0, attention_dropout=0.0,
                   initializer_range=0.02, initializer_factor=0.1)
_LM = dict(architectures=["InternLM2ForCausalLM"], model_type="internlm2", vocab_size=92553, hidden_act="silu",
           max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000, bias=False,
           rope_scaling={"type": "dynamic", "factor": 2.0}, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
           pad_token_id=2)
SHAPES = {
    "2b": dict(llm={**_LM, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "num_key_value_heads": 8},
               mixin=dict(mixin_every_n_layers=4, language_dim=2048, vision_dim=2048, head_dim=128, num_heads=16,
                          intermediate_size=8192)),
    "9b": dict(llm={**_LM, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8},
               mixin=dict(mixin_every_n_layers=4, language_dim=4096, vision_dim=4096, head_dim=128, num_heads=32,
                          intermediate_size=14336)),
    # the same layout at toy widths: the test runs it in seconds (tests/test_comemo_release.py)
    "tiny": dict(llm={**_LM, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2},
                 mixin=dict(mixin_every_n_layers=4, language_dim=64, vision_dim=64, head_dim=16, num_heads=4,
                            intermediate_size=96),
                 vision=dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=1)),
}
# InternLM2's special tokens at their ids (the rest of the vocabulary is filler: this is about shapes, not text)
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 92542, "<|im_start|>": 92543, "<img>": 92544,
           "</img>": 92545, "<IMG_CONTEXT>": 92546, "<video>": 92552}
WORDS = ["describe", "the", "two", "images", "what", "differs", "between", "them", "system", "user", "assistant",
         "a", "red", "square", "blue", "circle", "\n", "?", ".", ","]


def release_config(size: str) -> dict:
    s = SHAPES[size]
    return {"architectures": ["CoMemoChatModel"], "model_type": "comemo_chat",
            "vision_config": {**VISION_300M, **s.get("vision", {})},
            "llm_config": s["llm"], "mixin_config": s["mixin"], "select_layer": -1, "force_image_size": 448,
            "downsample_ratio": 0.5, "template": "internlm2-chat", "dynamic_image_size": True, "use_thumbnail": True,
            "ps_version": "v2", "min_dynamic_patch": 1, "max_dynamic_patch": 12, "use_temporal": False,
            "torch_dtype": "bfloat16"}


def _tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"<filler_{i}>": i for i in range(vocab_size)}
    free = [i for i in range(3, 92000) if i not in SPECIAL.values()]
    vocab.update({w: i for w, i in zip(WORDS, free)})
    inv = {i: t for t, i in vocab.items()}
    for tok, i in SPECIAL.items():
        inv[i] = tok
    vocab = {t: i for i, t in inv.items()}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tk.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}))


@torch.no_grad()
def write_release(folder: Path, size: str, *, seed: int = 0, shard_bytes: int = 2 * 1024 ** 3) -> int:
    """A released-format folder with random bf16 weights (written shard by shard); returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import InternVLForConditionalGeneration

    from apps.comemo.hf import HFCoMemo
    from apps.comemo.release import internvl_config, memory_config, release_tensors_from

    cfg = release_config(size)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    _tokenizer(folder, cfg["llm_config"]["vocab_size"])
    with torch.device("meta"):  # the shapes, from the converted layout mapped back to the release's keys
        model = InternVLForConditionalGeneration(internvl_config(cfg, image_token_id=SPECIAL["<IMG_CONTEXT>"]))
        base = dict(model.state_dict())
        mem = HFCoMemo(model, config=memory_config(cfg)).memory_state_dict()
    shapes = {k: tuple(v.shape) for k, v in release_tensors_from(base, mem, cfg).items()}
    g = torch.Generator().manual_seed(seed)
    shards, cur, nbytes, n_params = [], {}, 0, 0
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith(("attn_gate", "ff_gate")):
            t = torch.full(shape, 0.5)
        elif len(shape) == 1 and ("norm" in key or key.endswith((".ls1", ".ls2"))):
            t = torch.ones(shape)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            t = torch.randn(shape, generator=g) * (0.02 if len(shape) == 1 else 1 / math.sqrt(fan_in))
        cur[key] = t.to(torch.bfloat16)
        nbytes += cur[key].numel() * 2
        n_params += cur[key].numel()
        if nbytes >= shard_bytes:
            shards.append(cur)
            cur, nbytes = {}, 0
            save_file(shards[-1], str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards[-1] = {k: None for k in shards[-1]}  # keep the names, free the tensors
    shards.append(cur)
    save_file(cur, str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for i, (shard, name) in enumerate(zip(shards, names), 1):
        (folder / f"part-{i}.safetensors").rename(folder / name)
        weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return n_params


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)  # 896 x 896: InternVL's rule picks 2x2 tiles of 448 (+ a thumbnail)
    return Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)).resize((896, 896), Image.NEAREST)


def _cuda_peak_gb(device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 1024 ** 3, 2)


def run(size: str, work: Path, *, device=None, dtype=None, threads: int | None = None) -> dict:
    from apps.comemo import CoMemo
    from apps.comemo.convert import convert
    from core.infra.device import resolve_device, resolve_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype if dtype is not None else ("bfloat16" if dev.type == "cpu" else None), dev)
    if threads:
        torch.set_num_threads(threads)
    steps: dict[str, dict] = {}
    peak = PeakRSS()

    def step(name, fn):
        peak.start()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        out = fn()
        hwm = _status_kb("VmHWM")
        steps[name] = {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_growth_gb": round(peak.peak_mb() / 1024, 2),
                       "process_peak_rss_gb": None if hwm is None else round(hwm / 1024 ** 2, 2),
                       "peak_cuda_gb": _cuda_peak_gb(dev)}
        logger.info("%s: %s", name, steps[name])
        return out

    release, converted = work / "release", work / "converted"
    n_params = step("write", lambda: write_release(release, size))
    prov = step("convert", lambda: convert(release, converted))
    model = step("load", lambda: CoMemo.from_hf(converted, device=dev, dtype=dt))
    enc = model.prompt([_image(1), _image(2)], "Image-1: <image>\nImage-2: <image>\nWhat differs between them?")
    pv = enc.pixel_values.to(device=dev, dtype=dt)
    ids = enc.input_ids.to(dev)

    def forward():
        with torch.no_grad():
            return model(ids, pv, image_grids=enc.image_grids).logits[0, -1].float()

    last = step("forward", forward)
    gen = step("generate", lambda: model.generate(ids, pv, image_grids=enc.image_grids, max_new_tokens=16)[0])
    return {
        "size": size, "device": str(dev), "dtype": str(dt).removeprefix("torch."), "threads": torch.get_num_threads(),
        "parameters": n_params, "memory_config": prov["memory"], "grids": enc.image_grids,
        "prompt_tokens": int(ids.shape[1]), "image_tokens": int((ids == model.image_token_id).sum()),
        "generated": gen.tolist(), "last_logits_finite": bool(torch.isfinite(last).all()),
        "steps": steps, "peak_rss_gb": max(s["process_peak_rss_gb"] or 0 for s in steps.values()),
        "memory_method": peak.method, "env": env_info(),
    }


def build_parser() -> argparse.ArgumentParser:
    from core.infra.device import add_device_options

    p = argparse.ArgumentParser(prog="python -m benchmarks.comemo_real_size", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="2b",
                   help="released model whose shapes to build (tiny: the same layout at toy widths)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/comemo_real_size.json"), help="results JSON")
    p.add_argument("--work", type=Path, help="folder for the two model folders (default: a temporary one, removed)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    add_device_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = args.work or Path(tempfile.mkdtemp(prefix="comemo_real_size_"))
    try:
        result = run(args.size, work, device=None if args.device == "auto" else args.device,
                     dtype=None if args.dtype == "auto" else args.dtype, threads=args.threads)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    write_json_atomic(args.out, result)
    print(json.dumps({k: result[k] for k in ("size", "device", "dtype", "parameters", "prompt_tokens", "steps",
                                             "peak_rss_gb")}, indent=1))
    return 0


if __name__ == "__main__":
    from core.infra.cli import run_cli

    raise SystemExit(run_cli(main))
