"""Convert a released CoMemo checkpoint for ``CoMemo.from_hf``: ``python -m apps.comemo.convert RELEASE_DIR OUT_DIR``.

``RELEASE_DIR`` is the authors' folder (CoMemo-2B or CoMemo-9B as downloaded: ``config.json`` with ``model_type``
``comemo_chat``, safetensors weights, ``tokenizer.json`` or ``tokenizer.model``). ``OUT_DIR`` becomes a transformers
InternVL folder with the memory blocks beside it (:mod:`apps.comemo.release`), then::

    from apps.comemo import CoMemo
    model = CoMemo.from_hf("OUT_DIR")              # memory architecture as released, chosen from the folder
    print(model.answer(["photo.jpg"], "Describe the image."))

Checks before anything is kept: every tensor of the release is claimed (another layout is refused in one line naming
what was found and what is accepted); the conversion's inverse gives back every tensor bit for bit (the round trip);
the written keys and shapes are exactly those of the model ``from_hf`` builds. The folder is written under
``OUT_DIR.partial`` and renamed at the end, with ``comemo_conversion.json`` (provenance: source files and their
SHA-256, settings, checks) and a model card ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from core.infra.cli import UsageError, run_cli

logger = logging.getLogger(__name__)

__all__ = ["convert", "build_parser", "main", "PROVENANCE", "SHARD_BYTES"]

PROVENANCE = "comemo_conversion.json"
SHARD_BYTES = 4 * 1024 ** 3  # the converted weights are cut into files of at most this many bytes
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _special_tokens(folder: Path) -> dict:
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = folder / name
        if p.is_file():
            cfg = json.loads(p.read_text(encoding="utf-8"))
            for k in _SPECIAL:
                v = cfg.get(k)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str) and k not in found:
                    found[k] = v
    return found


def build_tokenizer(folder: Path, template: str):
    """The release's tokenizer as a ``PreTrainedTokenizerFast`` with InternVL's image tokens and the chat template."""
    from transformers import PreTrainedTokenizerFast

    from apps.comemo.release import chat_template

    special = _special_tokens(folder)
    # InternVL's processor also names a video token; one the vocabulary lacks is added after the last id
    extra = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    if (folder / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special,
                                      extra_special_tokens=extra)
    elif (folder / "tokenizer.model").is_file():
        try:
            import google.protobuf  # noqa: F401
            import sentencepiece  # noqa: F401
        except ImportError:
            raise UsageError(f"{folder}/tokenizer.model is a sentencepiece model: converting it needs the sentencepiece "
                             "and protobuf packages (pip install 'longctx-suite[comemo-convert]')") from None
        from transformers import LlamaTokenizerFast

        # as transformers' InternVL conversion builds InternLM2 tokenizers: the slow sentencepiece model converted to
        # a fast one, no prefix space prepended
        tok = LlamaTokenizerFast(vocab_file=str(folder / "tokenizer.model"), legacy=False, from_slow=True,
                                 add_prefix_space=False, **special, extra_special_tokens=extra)
    else:
        raise ValueError(f"{folder}: no tokenizer.json or tokenizer.model; accepted: a released checkpoint folder with "
                         "its tokenizer")
    missing = [t for k, t in extra.items() if k != "video_token" and t not in tok.get_vocab()]
    if missing:
        raise ValueError(f"{folder}: the tokenizer has no {', '.join(missing)} token(s); accepted: InternVL's image "
                         "tokens <img>, </img>, <IMG_CONTEXT>")
    tok.chat_template = chat_template(template)
    return tok


def _video_processor():
    from transformers import InternVLVideoProcessor

    return InternVLVideoProcessor()


def build_processor(cfg: dict, tok):
    """InternVL's processor at the release's tile size and tile range (ImageNet mean/std, bicubic, thumbnail)."""
    from transformers import InternVLProcessor
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor

    from apps.comemo.hf_prompt import IMAGENET_MEAN, IMAGENET_STD
    from apps.comemo.release import _image_size, chat_template, num_image_tokens

    size = _image_size(cfg)
    if not cfg.get("use_thumbnail", True):
        raise ValueError("use_thumbnail false is not supported; accepted: released checkpoints that append a thumbnail")
    image_processor = GotOcr2ImageProcessor(
        size={"height": size, "width": size}, crop_to_patches=bool(cfg.get("dynamic_image_size", True)),
        min_patches=int(cfg.get("min_dynamic_patch", 1)), max_patches=int(cfg.get("max_dynamic_patch", 12)),
        image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD), do_resize=True, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    return InternVLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=_video_processor(),
                             image_seq_length=num_image_tokens(cfg),
                             chat_template=chat_template(cfg.get("template") or "internlm2-chat"))


def _check_layout(config, base: dict, memory: dict, mem_cfg) -> None:
    """The written keys and shapes are exactly those of the model ``from_hf`` builds (built on the meta device)."""
    from transformers import InternVLForConditionalGeneration

    from apps.comemo.hf import HFCoMemo

    with torch.device("meta"):
        model = InternVLForConditionalGeneration(config)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        wrapped = HFCoMemo(model, config=mem_cfg)
    got = {k: tuple(v.shape) for k, v in base.items()}
    mem_want = {k: tuple(v.shape) for k, v in wrapped.memory_state_dict().items()}
    mem_got = {k: tuple(v.shape) for k, v in memory.items()}
    for what, w, g in (("model", want, got), ("memory", mem_want, mem_got)):
        if w != g:
            missing, extra = sorted(set(w) - set(g))[:3], sorted(set(g) - set(w))[:3]
            shapes = [k for k in set(w) & set(g) if w[k] != g[k]][:3]
            raise ValueError(f"the converted {what} does not fit the InternVL model: missing {missing}, unexpected "
                             f"{extra}, other shapes {[(k, g[k], w[k]) for k in shapes]}")


def _save_shards(tensors: dict[str, torch.Tensor], folder: Path) -> list[str]:
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if cur and size + n > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = tensors[k].contiguous(), size + n
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def _card(prov: dict) -> str:
    lines = ["---", "library_name: transformers", "pipeline_tag: image-text-to-text", "tags:", "- comemo",
             "- internvl", "- converted", "---", "", f"# {prov['source']['folder']} (converted for longctx CoMemo)", "",
             "The authors' released CoMemo checkpoint, converted by `python -m apps.comemo.convert` into a transformers "
             "InternVL folder (`InternVLForConditionalGeneration`, the InternLM2 language model in the Llama layout) "
             "and `comemo_memory.safetensors` (the memory blocks and their architecture).", "",
             "## Use", "", "```python", "from apps.comemo import CoMemo", "model = CoMemo.from_hf(\"THIS_FOLDER\")",
             "print(model.answer([\"image.jpg\"], \"Describe the image.\"))", "```", "",
             "## Conversion", ""]
    for k, v in prov.items():
        if k != "source":
            lines.append(f"- **{k}**: `{json.dumps(v, ensure_ascii=False)}`")
    lines += ["", "## Source", ""] + [f"- `{name}`: SHA-256 `{h}`" for name, h in prov["source"]["files"].items()]
    lines += ["", "## Limitations", "",
              "The weights are the authors'; their licence and intended use apply. The conversion changes only the "
              "tensor layout (checked by an exact round trip); numbers produced with the release's own code on a tiny "
              "model are reproduced within 1e-4 in fp32 (tests/test_comemo_release.py).", ""]
    return "\n".join(lines)


def convert(release: Path, out: Path, *, dtype: str = "keep", reference: bool = False, hash_files: bool = True) -> dict:
    """Convert ``release`` into ``out`` (see module docs); returns the provenance record."""
    from apps.comemo.hf import MEMORY_FILE, MEMORY_FORMAT
    from apps.comemo.release import (convert_tensors, internvl_config, memory_config, read_release_config,
                                     read_release_tensors, release_tensors_from)
    from core.infra.fileio import file_sha256

    t0 = time.time()
    cfg = read_release_config(release)
    template = cfg.get("template") or "internlm2-chat"
    tok = build_tokenizer(release, template)
    processor = build_processor(cfg, tok)
    config = internvl_config(cfg, image_token_id=int(tok.convert_tokens_to_ids("<IMG_CONTEXT>")))
    if len(tok) > config.text_config.vocab_size:
        logger.warning("the tokenizer has %d tokens, the model's vocabulary %d: ids past it (%s) must not be used",
                       len(tok), config.text_config.vocab_size, "<video>")
    mem_cfg = memory_config(cfg, reference=reference)
    tensors = read_release_tensors(release)
    source_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if dtype != "keep":
        tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
    base, memory = convert_tensors(tensors, cfg)
    back = release_tensors_from(base, memory, cfg)
    bad = sorted(set(back) ^ set(tensors)) or [k for k in tensors if not torch.equal(back[k], tensors[k])]
    if bad:
        raise ValueError(f"the conversion does not round-trip: {bad[:5]}")
    del back
    _check_layout(config, base, memory, mem_cfg)

    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    config.save_pretrained(str(partial))
    eos = [i for i in {tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None,
                       tok.eos_token_id} if i is not None]
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=sorted(eos), bos_token_id=tok.bos_token_id).save_pretrained(str(partial))
    files = _save_shards(base, partial)
    from safetensors.torch import save_file

    layers = sorted(int(k.split(".", 1)[0]) for k in memory if k.endswith(".attn_gate"))
    meta_cfg = {**mem_cfg.to_dict(), "layers": layers, "mlp_hidden_dim": mem_cfg.ffn_hidden}
    save_file({k: v.contiguous() for k, v in memory.items()}, str(partial / MEMORY_FILE),
              metadata={"format": MEMORY_FORMAT, "config": json.dumps(meta_cfg)})
    processor.save_pretrained(str(partial))
    src_files = sorted(p.name for p in release.iterdir() if p.suffix in (".safetensors", ".json", ".model"))
    prov = {
        "format": "longctx.comemo.release-conversion.v1",
        "source": {"folder": release.name, "files": {n: file_sha256(release / n) if hash_files else "not computed"
                                                      for n in src_files}},
        "source_model_type": cfg.get("model_type"), "source_dtypes": source_dtypes,
        "dtype": dtype if dtype != "keep" else source_dtypes, "template": template,
        "memory": meta_cfg, "tensors": len(tensors), "memory_tensors": len(memory), "weight_files": files,
        "round_trip": "every tensor equal", "layout_check": "keys and shapes equal to InternVLForConditionalGeneration",
        "seconds": round(time.time() - t0, 1),
    }
    (partial / PROVENANCE).write_text(json.dumps(prov, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (partial / "README.md").write_text(_card(prov), encoding="utf-8")
    partial.rename(out)
    return prov


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("release", type=Path, help="the released checkpoint folder (CoMemo-2B / CoMemo-9B)")
    p.add_argument("out", type=Path, help="the folder to write (must not exist)")
    p.add_argument("--dtype", choices=("keep", "float32", "bfloat16", "float16"), default="keep",
                   help="weights dtype of the converted folder (default: the checkpoint's own)")
    p.add_argument("--reference", action="store_true",
                   help="record the release's tile order and decode query positions instead of the project's fixes")
    p.add_argument("--no-hash", action="store_true", help="skip the SHA-256 of the source files in the provenance")
    return p


def main(argv: list[str] | None = None) -> int:
    from core.infra.guard import check_output

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.release.is_dir():
        raise UsageError(f"RELEASE_DIR {args.release}: not a folder")
    check_output(args.out, inputs=[args.release], flag="OUT_DIR")
    if args.out.exists():
        raise UsageError(f"OUT_DIR {args.out} exists; choose a new folder (a conversion never overwrites one)")
    prov = convert(args.release, args.out, dtype=args.dtype, reference=args.reference, hash_files=not args.no_hash)
    print(f"wrote {args.out}: {prov['tensors']} tensors ({prov['memory_tensors']} memory), round trip exact, "
          f"{prov['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
