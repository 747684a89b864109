"""Gradio tab "Attention core": choose the sequence length, block size and k; see which key blocks each
query block selects, how far block-sparse attention is from dense attention, and each backend's time."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_demo", "EXAMPLE"]

KEY = "attention"
EXAMPLE = {"seq_len": 2048, "block_size": 64, "topk": 8, "causal": True, "seed": 0}


def _figure(block_map, *, block_size: int, salient: list[int]):
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 4.6), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    cmap = ListedColormap(["#f2f2f2", "#c6dbef", "#08306b"])  # invisible, skipped, selected
    ax.imshow(block_map.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
    ax.set_xlabel(f"key block ({block_size} tokens)")
    ax.set_ylabel(f"query block ({block_size} tokens)")
    title = "selected key blocks, head 0 (dark = selected)"
    if salient:
        title += f"\nsalient key blocks: {', '.join(map(str, salient))}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def run_demo(seq_len, block_size, topk, causal, seed):
    """Returns (status markdown, heatmap figure, timings table, error markdown)."""
    import pandas as pd
    import torch

    from apps.attention.demo import DemoConfig, run_attention_demo

    torch.set_num_threads(1)
    cfg = DemoConfig(seq_len=int(seq_len), block_size=int(block_size), topk=int(topk), causal=bool(causal), seed=int(seed))
    out = run_attention_demo(cfg)
    table = pd.DataFrame(out["timings"])
    table["seconds"] = table["seconds"].map(lambda s: None if s is None else round(float(s), 4))
    errors = (f"**block-sparse vs dense {out['err_vs']}**: max abs error {out['max_abs_err']:.3g}, "
              f"relative error (Frobenius) {out['rel_err']:.3g}, at block density {out['density']:.1%}.")
    sparse_t = next(t["seconds"] for t in out["timings"] if t["backend"] == "block-sparse: total")
    dense_t = [t["seconds"] for t in out["timings"] if t["note"] == "dense" and t["seconds"] is not None]
    speed = f", {min(dense_t) / sparse_t:.2f}x the fastest dense backend" if dense_t else ""
    status = (f"Done: S={cfg.seq_len}, block {cfg.block_size}, top-{cfg.topk}{' causal' if cfg.causal else ''}; "
              f"density {out['density']:.1%}, max abs error {out['max_abs_err']:.3g}{speed}.")
    fig = _figure(out["block_map"], block_size=cfg.block_size, salient=out["salient_blocks"])
    return status, fig, table, errors


def build_ui() -> None:
    import gradio as gr

    gr.Markdown(
        "## Attention core\nTop-k block-sparse attention: keys are cut into blocks summarised by their per-dimension "
        "min and max; each query block keeps the k blocks with the highest upper-bound score (plus the first and "
        "diagonal blocks) and attends exactly inside them. Inputs are synthetic (a few salient key blocks)."
    )
    with gr.Row():
        seq_len = gr.Slider(128, 16384, value=EXAMPLE["seq_len"], step=128, label="sequence length S")
        block_size = gr.Dropdown([16, 32, 64, 128, 256], value=EXAMPLE["block_size"], label="block size")
        topk = gr.Slider(1, 64, value=EXAMPLE["topk"], step=1, label="k (key blocks per query block)")
    with gr.Row():
        causal = gr.Checkbox(value=EXAMPLE["causal"], label="causal")
        seed = gr.Number(value=EXAMPLE["seed"], precision=0, label="seed")
    with gr.Row():
        run = gr.Button("Run", variant="primary")
        example = gr.Button("Run the default example (S=2048, block 64, k=8)", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    with gr.Row():
        plot = gr.Plot(label="selected-block map")
        with gr.Column():
            errors = gr.Markdown()
            table = gr.Dataframe(label="time per backend (median, seconds, 1 CPU thread)")

    def _run(n, b, kk, c, sd):
        try:
            return run_demo(n, b, kk, c, sd)
        except ValueError as err:
            raise gr.Error(str(err)) from err

    def _example():
        e = EXAMPLE
        return _run(e["seq_len"], e["block_size"], e["topk"], e["causal"], e["seed"])

    outs = [status, plot, table, errors]
    run.click(_run, [seq_len, block_size, topk, causal, seed], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
