"""Gradio tab: draw a held-out many-shot episode, compress its demonstrations with EMLoC under a JS bound δ,
and compare with the full context: per-layer keep ratios, the kept-token map over the demonstrations, and
accuracy and latency of both on the episode's queries."""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_episode", "keep_ratio_figure", "kept_map_figure", "EXAMPLE", "KEY"]

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


_HOST = None


def _host():
    global _HOST
    if _HOST is None:
        from apps.emloc.model import EMLoCHost

        _HOST = EMLoCHost.load()
    return _HOST


def build_ui() -> None:
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

    run.click(_run, [k, d, s], outs, api_name=f"{KEY}_run")
    example.click(lambda: _run(EXAMPLE["num_demos"], EXAMPLE["delta"], EXAMPLE["seed"]), None, outs, api_name=f"{KEY}_example")
