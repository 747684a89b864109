"""∞-Video at a real size: a random InstructBLIP-Video with InstructBLIP Flan-T5-XL's published sizes streams 1K-16K frames.

The model is ``InstructBlipVideoForConditionalGeneration`` built from a config with the published sizes of
InstructBLIP (Flan-T5-XL): an EVA ViT-g/14 vision tower (width 1408, 39 layers, 224 px frames: 257 tokens), the
BLIP-2 Q-former (width 768, 12 layers, cross-attention every 2nd layer, 32 queries) and Flan-T5-XL (d_model 2048,
24 + 24 layers); random weights (nothing is downloaded). About 4.0B parameters: in bf16 it fits a 24 GB CPU machine.
On a CPU the frame encoder is kept cheap with ``--vision-layers`` (default 0 on CPU: the real patch embedding and
layer norm at 224 px, no transformer layer; all 39 on a GPU); the Q-former, its ∞-Video memory and the LLM are the
published sizes. Frames are random 224x224 images generated chunk by chunk (no video file is decoded).

Each length runs in a fresh process (``benchmarks.common.run_isolated``): the model is built, then
``InfiniteVideoLM.read_chunks`` streams the frames (chunks of 16 with 16 box functions, sticky, alpha 0.75; one
question). Recorded: the process's resident set after the build, the peak growth while streaming (``PeakRSS``), the
whole-process peak, the time per frame (wall and CPU), the memory state's size, and on CUDA the peak CUDA memory.

    python -m benchmarks.video_realsize --frames 1K,4K,16K --out benchmarks/results/video_realsize.json
    python -m benchmarks.video_realsize --device cuda --vision-layers 39 --frames 1K,4K   # the GPU check step
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from benchmarks.common import PeakRSS, env_info, format_table, parse_size, read_json, run_isolated, write_json_atomic
from core.infra.cli import run_cli
from core.infra.device import add_device_options
from core.infra.fileio import write_text_atomic

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"

# InstructBLIP (Flan-T5-XL) published sizes
VISION = dict(hidden_size=1408, intermediate_size=6144, num_hidden_layers=39, num_attention_heads=16, image_size=224,
              patch_size=14, qkv_bias=True, layer_norm_eps=1e-6)  # fmt: skip
QFORMER = dict(vocab_size=30523, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
               cross_attention_frequency=2, encoder_hidden_size=1408, max_position_embeddings=512)  # fmt: skip
TEXT = dict(model_type="t5", d_model=2048, d_ff=5120, num_layers=24, num_decoder_layers=24, num_heads=32, d_kv=64,
            vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False)  # fmt: skip
TINY = (dict(VISION, hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=28, patch_size=7),
        dict(QFORMER, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             encoder_hidden_size=32),
        dict(TEXT, d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16, vocab_size=64))


class _WordIds:
    """A stand-in instruction tokenizer (word -> id by a hash; [CLS] first): the Q-former reads 8 instruction tokens."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, texts, padding=True, return_tensors="pt"):
        import zlib

        import torch

        rows = [[101 % self.vocab] + [zlib.crc32(w.encode()) % self.vocab for w in t.split()] for t in texts]
        n = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}


def build(vision_layers: int, dtype, device, tiny: bool = False):
    """The random model (published sizes unless ``tiny``) and an :class:`video.hf.InfiniteVideoLM` around it."""
    import torch
    from transformers import InstructBlipVideoConfig, InstructBlipVideoForConditionalGeneration

    from video.hf import HFVideoConfig, InfiniteVideoLM, _default_preprocess

    vision, qformer, text = TINY if tiny else (VISION, QFORMER, TEXT)
    cfg = InstructBlipVideoConfig(vision_config=dict(vision, num_hidden_layers=vision_layers), qformer_config=qformer,
                                  text_config=text, num_query_tokens=32)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: a 4B-parameter model never exists in fp32 here
    try:
        with torch.device(device):  # initialised where it runs (a GPU draws 4B random numbers in seconds)
            model = InstructBlipVideoForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    m = model
    lm = InfiniteVideoLM(vision=lambda px: m.vision_model(pixel_values=px)[0], qformer=m.qformer,
                         query_tokens=m.query_tokens, projection=m.language_projection, language_model=m.language_model,
                         tokenizer=None, qformer_tokenizer=_WordIds(qformer["vocab_size"]), preprocess=_default_preprocess(vision["image_size"]), clip_frames=4,
                         config=HFVideoConfig(chunk_size=16, alpha=0.75), model=m)
    lm.progress = False
    counts = {name: sum(p.numel() for p in getattr(m, name).parameters())
              for name in ("vision_model", "qformer", "language_model", "language_projection")}
    counts["query_tokens"] = m.query_tokens.numel()
    return lm, counts, vision["image_size"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def case(frames: int, args) -> dict:
    """Child process: build the model, stream ``frames`` random frames, return the measurements."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from core.infra.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    lm, counts, size = build(args.vision_layers, dtype, device, tiny=args.tiny)
    build_s = time.perf_counter() - t0
    rss_built = _rss_mb()
    rng = np.random.default_rng(0)
    chunk = lm.chunk_size

    def chunks():
        for s in range(0, frames, chunk):
            n = min(chunk, frames - s)
            small = rng.integers(0, 256, (n, size // 8, size // 8, 3), dtype=np.uint8)
            yield np.repeat(np.repeat(small, 8, axis=1), 8, axis=2), np.arange(s, s + n)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = PeakRSS()
    peak.start()
    w0, c0 = time.perf_counter(), time.process_time()
    res = lm.read_chunks(chunks(), frames, ["what does the person do after opening the door?"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    mem_bytes = sum(c.numel() * c.element_size() for c in (res.coefficients or []))
    out = {"status": "ok", "frames": frames, "frames_read": res.frames_read, "chunks": res.num_chunks,
           "parameters": counts, "parameters_total": sum(counts.values()), "vision_layers": args.vision_layers,
           "dtype": str(dtype).removeprefix("torch."), "device": str(device), "build_s": round(build_s, 1),
           "rss_after_build_mb": round(rss_built, 1), "stream_peak_growth_mb": round(peak.peak_mb(), 1),
           "peak_method": peak.method, "process_peak_mb": round(rss_built + peak.peak_mb(), 1),
           "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "ms_per_frame_wall": round(1000 * wall / frames, 2),
           "ms_per_frame_cpu": round(1000 * cpu / frames, 2), "memory_state_bytes": mem_bytes,
           "features": list(res.features.shape), "finite": bool(torch.isfinite(res.features.float()).all())}
    if device.type == "cuda":
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def report(result: dict) -> str:
    rows = result["cases"]
    base = next((r for r in rows if r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") == "ok" and base is not None:
            r["peak_vs_first"] = round(r["process_peak_mb"] / base["process_peak_mb"], 3)
            r["growth_vs_first"] = round(r["stream_peak_growth_mb"] / max(base["stream_peak_growth_mb"], 1e-9), 3)
    a = result["args"]
    head = (f"InstructBLIP-Video, InstructBLIP Flan-T5-XL sizes, random weights ({base['parameters_total'] / 1e9:.2f}B "
            f"parameters with {a['vision_layers']} of 39 vision layers), {base['dtype']} on {base['device']}, "
            f"{a['threads']} thread(s); chunks of 16 frames, 16 box functions, sticky, alpha 0.75"
            if base else "no case finished")
    return "\n".join([head, "", format_table(rows, ["frames", "chunks", "rss_after_build_mb", "stream_peak_growth_mb",
                                                     "process_peak_mb", "peak_vs_first", "growth_vs_first",
                                                     "ms_per_frame_wall", "ms_per_frame_cpu", "memory_state_bytes",
                                                     "status"])])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.video_realsize", description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", default="1K,4K,16K", help="video lengths in frames (comma list)")
    p.add_argument("--vision-layers", type=int, default=None,
                   help="vision transformer layers run (of 39; default 0 on CPU, 39 on CUDA)")
    add_device_options(p, dtype_default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=str(RESULTS / "video_realsize.json"), help="JSON result (a .md table beside it)")
    p.add_argument("--case-timeout", type=float, default=5400, help="seconds per length")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke test of this script)")
    p.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.vision_layers is None:
        from core.infra.device import resolve_device

        args.vision_layers = 39 if resolve_device(args.device).type == "cuda" else 0
    if args.case is not None:
        print(json.dumps(case(args.case, args)))
        return 0
    out = Path(args.out)
    lengths = [parse_size(s) for s in args.frames.split(",") if s]
    run_args = {k: v for k, v in vars(args).items() if k not in ("case", "out", "frames", "case_timeout")}
    old = read_json(out)
    # a rerun with the same settings keeps the other lengths' finished cases (each length is its own process)
    cases = [c for c in (old or {}).get("cases", []) if c.get("frames") not in lengths and c.get("status") == "ok"
             and old.get("args") == run_args]
    result = {"args": run_args, "env": env_info(), "cases": cases}
    for f in lengths:
        argv = [sys.executable, "-m", "benchmarks.video_realsize", "--case", str(f), "--vision-layers",
                str(args.vision_layers), "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
        if args.tiny:
            argv.append("--tiny")
        logger.info("%d frames ...", f)
        r = run_isolated(argv, timeout_s=args.case_timeout)
        cases.append({"frames": f, **r})
        logger.info("%s", {k: r.get(k) for k in ("status", "process_peak_mb", "ms_per_frame_wall", "reason")})
        cases.sort(key=lambda c: c["frames"])
        write_json_atomic(out, result)
    table = report(result)
    write_json_atomic(out, result)
    write_text_atomic(out.with_suffix(".md"), table + "\n")
    print(table)
    return 0 if all(c.get("status") == "ok" for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
