"""Gradio tab: draw a held-out many-shot episode, compress its demonstrations with EMLoC under a JS bound δ,
and compare with the full context: per-layer keep ratios, the kept-token map over the demonstrations, and
accuracy and latency of both on the episode's queries."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_episode", "run_own_model", "keep_ratio_figure", "kept_map_figure", "EXAMPLE", "KEY"]

KEY = "emloc"
EXAMPLE = {"num_demos": 64, "delta": 0.005, "seed": 0}
MAX_DEMOS = 512  # the tab's limit (a 512-demo episode compresses in seconds on one core)
NUM_QUERIES = 50


def _fig_to_array(fig):
    """Render a pyplot figure to an ``(H, W, 3)`` uint8 array and close it."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return img


def keep_ratio_figure(ratios: list[float], full_tokens: int):
    """Bar chart of EMLoC's kept fraction per layer (an RGB array)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=100)
    ax.bar(range(len(ratios)), ratios, color="#3b6ea8")
    for i, r in enumerate(ratios):
        ax.text(i, r + 0.02, f"{r:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(ratios)))
    ax.set_xlabel("layer")
    ax.set_ylabel("fraction of demo tokens kept")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"EMLoC keep ratio per layer ({full_tokens} tokens before)", fontsize=9)
    fig.tight_layout()
    return _fig_to_array(fig)


def kept_map_figure(kept, tokens_per_demo: int):
    """Heatmap of which (layer, KV head) keeps which demo token (rows) over the token axis (an RGB array)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H, S = kept.shape
    fig, ax = plt.subplots(figsize=(8.0, 2.6), dpi=100)
    ax.imshow(kept.reshape(L * H, S).float().numpy(), aspect="auto", interpolation="nearest", cmap="Greens", vmin=0, vmax=1)
    ax.set_yticks(range(L * H))
    ax.set_yticklabels([f"L{l} h{h}" for l in range(L) for h in range(H)], fontsize=7)
    step = max(1, (S // tokens_per_demo) // 8)
    ticks = list(range(0, S, tokens_per_demo * step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t // tokens_per_demo) for t in ticks], fontsize=7)
    ax.set_xlabel(f"demonstration (each {tokens_per_demo} tokens: image patches then label); green = kept")
    fig.tight_layout()
    return _fig_to_array(fig)


def _check(num_demos, delta, seed) -> tuple[int, float, int]:
    try:
        K = int(num_demos)
    except (TypeError, ValueError):
        raise ValueError(f"number of demonstrations must be a whole number, got {num_demos!r}") from None
    if not 2 <= K <= MAX_DEMOS:
        raise ValueError(f"number of demonstrations must be in 2..{MAX_DEMOS}, got {K}")
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"δ must be a number > 0, got {delta!r}") from None
    if not (d > 0 and math.isfinite(d)):
        raise ValueError(f"δ must be a number > 0 (JS divergence in nats, e.g. 0.005), got {delta!r}")
    try:
        s = int(seed)
    except (TypeError, ValueError):
        raise ValueError(f"seed must be a whole number, got {seed!r}") from None
    return K, d, s


def run_episode(num_demos, delta, seed):
    """One held-out 5-way episode with the shipped host: returns (keep-ratio image, kept-map image, result
    markdown, status markdown). ``ValueError`` for bad input."""
    from apps.emloc.api import compress
    from apps.emloc.data import EpisodeConfig, make_episode

    K, d, s = _check(num_demos, delta, seed)
    model = _host()
    ep = make_episode(90_000_000 + s, num_demos=K, num_queries=NUM_QUERIES, split="eval", config=EpisodeConfig(n_way=5))
    demos = (ep.demo_images, ep.demo_labels)
    t = time.perf_counter()
    full = compress(model, demos, policy="full")
    t_full = time.perf_counter() - t
    t = time.perf_counter()
    em = compress(model, demos, delta=d)
    t_em = time.perf_counter() - t

    def answer(ctx):
        t = time.perf_counter()
        acc = float((ctx.predict(ep.query_images) == ep.query_labels).float().mean())
        return acc, 1000 * (time.perf_counter() - t) / NUM_QUERIES

    acc_full, ms_full = answer(full)
    acc_em, ms_em = answer(em)
    frac = em.keep_fraction()
    worst_js = max((max(r.js) for r in em.reports), default=0.0)
    table = "\n".join([
        f"**{K} demonstrations** of 5 held-out classes with a random label mapping; {NUM_QUERIES} queries; chance 0.20.",
        "",
        "| context | cache entries kept | accuracy | prefill / compression | per query |",
        "|---|---|---|---|---|",
        f"| full | 100% | {acc_full:.2f} | {1000 * t_full:.0f} ms | {ms_full:.1f} ms |",
        f"| EMLoC (δ = {d:g}) | {100 * frac:.0f}% | {acc_em:.2f} | {1000 * t_em:.0f} ms | {ms_em:.1f} ms |",
        "",
        f"Largest per-layer JS divergence at the answer tokens over {len(em.reports)} chunks: {worst_js:.4f} (bound δ = {d:g}).",
    ])
    keep_img = keep_ratio_figure(em.keep_ratios(), em.num_tokens)
    map_img = kept_map_figure(em.kept_map(), model.config.tokens_per_demo)
    status = f"Done: EMLoC kept {100 * frac:.0f}% of the cache; accuracy {acc_em:.2f} against {acc_full:.2f} with the full context."
    return keep_img, map_img, table, status


OWN_MAX_DEMOS = 64  # the tab's limit with a real VLM (the recipe, apps.emloc.recipes.qwen2vl, takes any number)
OWN_MAX_QUERIES = 20


@functools.lru_cache(maxsize=2)
def _vlm(folder: str, mtime: float):
    import torch

    from core.hf import load

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    return load(folder)


def _check_vlm_folder(model: str | None) -> Path:
    model = (model or "").strip()
    if not model:
        raise ValueError("give a local VLM folder (Qwen2-VL, Qwen2.5-VL or InternVL, saved with its processor)")
    p = Path(model).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"{model} is not a transformers model folder (no config.json); give a local Qwen2-VL, "
                         "Qwen2.5-VL or InternVL folder saved with save_pretrained and its processor")
    return p


def run_own_model(model: str | None, data: str | None, num_demos, delta, seed):
    """Your own VLM on your own labelled images: ``data`` is a CSV with the columns ``image`` (a path relative to
    the CSV), ``label`` and optionally ``split`` (``train`` rows are demonstrations, others queries), as
    ``apps.emloc.recipes.qwen2vl --data`` reads it. Compresses ``num_demos`` demonstrations with EMLoC under ``delta``
    and answers up to ``OWN_MAX_QUERIES`` queries; returns (keep-ratio image, result markdown, status markdown)."""
    from apps.emloc.hf import compress_hf
    from apps.emloc.recipes.qwen2vl import episode, read_data
    from core.infra.cli import UsageError

    folder = _check_vlm_folder(model)
    if not (data or "").strip():
        raise ValueError("give the demonstrations as a CSV file (columns image,label[,split])")
    K, d, s = _check(num_demos, delta, seed)
    K = min(K, OWN_MAX_DEMOS)
    try:
        train, test = read_data(Path(data))
        pool = sum(len(v) for v in train.values())
        queries = 1 if test is None else 0
        demos, qs, classes = episode(train, test, 0, min(K, pool - (len(train) if test is None else 0)), max(queries, 1), s)
    except UsageError as err:
        raise ValueError(str(err).replace("--data ", "")) from None
    loaded = _vlm(str(folder), os.path.getmtime(folder / "config.json"))
    if loaded.processor is None:
        raise ValueError(f"{folder} has no processor (a chat template and an image processor are needed)")
    t = time.perf_counter()
    ctx = compress_hf(loaded.model, demos, processor=loaded.processor, delta=d, seed=s, image_size=(224, 224))
    t_c = time.perf_counter() - t
    qs = qs[:OWN_MAX_QUERIES]
    correct = sum(ctx.predict(p, classes) == c for p, c in qs)
    frac = ctx.keep_fraction()
    table = "\n".join([
        f"**{len(demos)} demonstrations** of {len(classes)} labels from your CSV; {len(qs)} queries; chance {1 / len(classes):.2f}.",
        "",
        "| context | cache entries kept | accuracy | compression |",
        "|---|---|---|---|",
        f"| EMLoC (δ = {d:g}) | {100 * frac:.0f}% | {correct / len(qs):.2f} | {t_c:.1f} s |",
    ])
    keep_img = keep_ratio_figure(ctx.keep_ratios(), ctx.num_tokens)
    status = (f"Done: your model {folder.name}: EMLoC kept {100 * frac:.0f}% of the cache; accuracy "
              f"{correct / len(qs):.2f} on {len(qs)} queries.")
    return keep_img, table, status


_HOST = None


def _host():
    global _HOST
    if _HOST is None:
        from apps.emloc.model import EMLoCHost

        _HOST = EMLoCHost.load()
    return _HOST


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-model field (``python -m apps --app emloc --model DIR``)."""
    import gradio as gr

    gr.Markdown("## EMLoC\nMany labelled demonstrations compressed once into a short KV prefix, layer by layer, "
                "while the output at the demonstrations' answer tokens stays within a Jensen–Shannon divergence δ "
                "of the uncompressed one. The host is a small decoder meta-trained here for in-context image "
                "classification (16×16 procedural shapes and scikit-learn digits); episodes use classes it never "
                "saw in training and a fresh label mapping, so it can only read labels from the demonstrations.")
    with gr.Row():
        k = gr.Slider(4, MAX_DEMOS, value=EXAMPLE["num_demos"], step=4, label="number of demonstrations")
        d = gr.Number(value=EXAMPLE["delta"], label="δ (JS bound, nats)")
        s = gr.Number(value=EXAMPLE["seed"], precision=0, label="episode seed")
    with gr.Row():
        run = gr.Button("Compress and answer", variant="primary")
        example = gr.Button("Run the example (64 demos, δ = 0.005)", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    result = gr.Markdown()
    with gr.Row():
        keep_img = gr.Image(label="keep ratio per layer", type="numpy")
        map_img = gr.Image(label="kept tokens over the demonstrations", type="numpy")
    outs = [keep_img, map_img, result, status]

    def _run(k_, d_, s_):
        try:
            return run_episode(k_, d_, s_)
        except ValueError as e:
            raise gr.Error(str(e)) from e

    with gr.Accordion("Your own model: a local VLM and your labelled images", open=model is not None):
        gr.Markdown("A transformers Qwen2-VL, Qwen2.5-VL or InternVL folder (saved with its processor) and a CSV of "
                    "demonstrations: columns `image` (path relative to the CSV), `label`, optionally `split` "
                    f"(`train` rows are demonstrations, the others queries). Up to {OWN_MAX_DEMOS} demonstrations "
                    "here; `python -m apps.emloc.recipes.qwen2vl` takes any number.")
        with gr.Row():
            own = gr.Textbox(value=model or "", label="model folder", elem_id=f"{KEY}-own-model",
                             placeholder="/path/to/Qwen2-VL-2B-Instruct")
            own_csv = gr.Textbox(label="demonstrations CSV", elem_id=f"{KEY}-own-data", placeholder="/path/to/demos.csv")
        own_run = gr.Button("Compress and answer with this model", elem_id=f"{KEY}-own-run")
        own_status = gr.Markdown(elem_id=f"{KEY}-own-status")
        own_result = gr.Markdown()
        own_img = gr.Image(label="keep ratio per layer (your model)", type="numpy")

    def _own(m, c, k_, d_, s_):
        try:
            return run_own_model(m, c, k_, d_, s_)
        except (ValueError, FileNotFoundError) as e:
            raise gr.Error(str(e)) from e

    own_run.click(_own, [own, own_csv, k, d, s], [own_img, own_result, own_status], api_name=f"{KEY}_own")
    run.click(_run, [k, d, s], outs, api_name=f"{KEY}_run")
    example.click(lambda: _run(EXAMPLE["num_demos"], EXAMPLE["delta"], EXAMPLE["seed"]), None, outs, api_name=f"{KEY}_example")
