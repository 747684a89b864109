"""Gradio tab: ask the shipped CoMemo model about images (uploaded, or a drawn sample set) and see how it read
them: the tiles each image was cut into, the RoPE-DHR id map, the memory path's gate values per layer, the
attention mass per image on both paths, and the answer."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "ask", "draw_sample", "tiles_figure", "dhr_figure", "gates_figure", "attention_figure",
           "EXAMPLE", "KEY", "NEEDLE_QUESTION"]

KEY = "comemo"
NEEDLE_QUESTION = "which image shows a digit and what digit is it ?"
EXAMPLE = {"task": "needle", "num_images": 6, "needle": 4, "seed": 0}
MAX_UPLOADS = 16  # images per question in the tab (the model takes up to 64; the plots stay readable to 16)
SAMPLE_SEED_BASE = 95_000_000  # the tab's samples: a stream seed that neither training nor the benchmark uses


def _fig_to_array(fig):
    import matplotlib.pyplot as plt
    import numpy as np

    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return img


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tiles_figure(images, tile: int, *, min_tiles: int = 1, max_tiles: int = 6):
    """Every image as the model sees it: its tiles (row-major, numbered) and, for several tiles, the thumbnail."""
    import numpy as np

    from apps.comemo.tiling import tile_image

    plt = _pyplot()
    lays = [tile_image(im, tile, min_tiles=min_tiles, max_tiles=max_tiles) for im in images]
    n = len(lays)
    cols = min(n, 8)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.7 * rows), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i, lay in enumerate(lays):
        ax = axes.flat[i]
        r, c = lay.grid
        canvas = np.full((r * (tile + 2), c * (tile + 2) + (tile + 4 if lay.thumbnail is not None else 0), 3), 255, np.uint8)
        for t, im in enumerate(lay.tiles):
            tr, tc = divmod(t, c)
            canvas[tr * (tile + 2):tr * (tile + 2) + tile, tc * (tile + 2):tc * (tile + 2) + tile] = im
        if lay.thumbnail is not None:
            x0 = c * (tile + 2) + 4
            canvas[:tile, x0:x0 + tile] = lay.thumbnail
        ax.imshow(canvas)
        ax.set_title(f"image {i + 1}: {r}×{c}" + (" + thumb" if lay.thumbnail is not None else ""), fontsize=7)
    fig.tight_layout()
    return _fig_to_array(fig)


def dhr_figure(image, tile: int, tokens_per_side: int, *, index: int = 0, max_tiles: int = 6):
    """Heatmap of the RoPE-DHR ids of one image's tile tokens (where they lie) beside its thumbnail's ids."""
    import numpy as np

    from apps.comemo.probe import dhr_id_map

    plt = _pyplot()
    m = dhr_id_map(image, tile, tokens_per_side, max_tiles=max_tiles)
    rows, cols = m["grid"]
    T = tokens_per_side
    fig, (a, b) = plt.subplots(1, 2, figsize=(7.0, 2.8), dpi=100, gridspec_kw={"width_ratios": [max(cols, 1.5), 1]})
    vmax = T * T - 1
    a.imshow(m["tiles"], cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
    for t in range(rows * cols):
        r, c = divmod(t, cols)
        a.add_patch(plt.Rectangle((c * T - 0.5, r * T - 0.5), T, T, fill=False, ec="white", lw=1.2))
        a.text(c * T + T / 2 - 0.5, r * T + T / 2 - 0.5, f"tile {t}", color="white", ha="center", va="center", fontsize=7)
    a.set_title(f"image {index + 1}: {rows}×{cols} tiles, {rows * cols * T * T} tokens", fontsize=8)
    a.set_xticks([]), a.set_yticks([])
    im = b.imshow(m["thumbnail"], cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
    for (r, c), v in np.ndenumerate(m["thumbnail"]):
        b.text(c, r, str(v), ha="center", va="center", fontsize=6, color="white")
    b.set_title(f"thumbnail: ids 0..{vmax}", fontsize=8)
    b.set_xticks([]), b.set_yticks([])
    fig.colorbar(im, ax=[a, b], shrink=0.8, label="position id (from the image's start)")
    return _fig_to_array(fig)


def gates_figure(gates: dict[str, float], variant: str):
    """Bar chart of tanh(gate) of every gated cross-attention block (memory path)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.2, 2.8), dpi=100)
    if gates:
        names = list(gates)
        ax.bar(range(len(names)), [gates[k] for k in names], color=["#3b6ea8" if k.endswith("attn") else "#a8743b" for k in names])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=7, rotation=20)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylim(min(-0.1, min(gates.values()) - 0.05), max(0.5, max(gates.values()) + 0.1))
        ax.set_ylabel("tanh(gate)")
    else:
        ax.text(0.5, 0.5, f"{variant}: no memory path (no gates)", ha="center", va="center")
        ax.axis("off")
    ax.set_title("memory-path gates per layer (blue: attention, brown: MLP)", fontsize=8)
    fig.tight_layout()
    return _fig_to_array(fig)


def attention_figure(attn: dict, num_images: int, needle: int | None = None):
    """Attention mass of the answer's first query on each image, context path and memory path side by side."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 2.8), dpi=100)
    x = list(range(1, num_images + 1))
    w = 0.4
    shown = False
    if attn.get("context") is not None:
        ax.bar([i - w / 2 for i in x], attn["context"], width=w, label="context path (self-attention)", color="#3b6ea8")
        shown = True
    if attn.get("memory") is not None:
        ax.bar([i + w / 2 for i in x], attn["memory"], width=w, label="memory path (cross-attention)", color="#5aa83b")
        shown = True
    if needle is not None:
        ax.axvspan(needle + 1 - 0.5, needle + 1 + 0.5, color="#f2c94c", alpha=0.35, label="image with the digit", zorder=0)
    ax.set_xticks(x)
    ax.set_xlabel("image")
    ax.set_ylabel("attention mass")
    if shown:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("where the last prompt token looks (mean over layers and heads)", fontsize=8)
    fig.tight_layout()
    return _fig_to_array(fig)


def draw_sample(task, num_images, needle, seed):
    """A sample set from the synthetic tasks: ``(images, question, answer, needle index or None)``."""
    from apps.comemo.synthetic import make_sample, sample_seed

    if task not in ("needle", "detail"):
        raise ValueError(f"task must be 'needle' or 'detail', got {task!r}")
    try:
        n, s = int(num_images), int(seed)
    except (TypeError, ValueError):
        raise ValueError(f"number of images and seed must be whole numbers, got {num_images!r}, {seed!r}") from None
    if not 1 <= n <= MAX_UPLOADS:
        raise ValueError(f"number of images must be in 1..{MAX_UPLOADS}, got {n}")
    pos = None
    if task == "needle":
        try:
            pos = int(needle) - 1
        except (TypeError, ValueError):
            raise ValueError(f"needle position must be a whole number, got {needle!r}") from None
        if not 0 <= pos < n:
            raise ValueError(f"needle position must be in 1..{n} (the number of images), got {needle}")
    sample = make_sample(task, n if task == "needle" else 1, sample_seed(SAMPLE_SEED_BASE, s),
                         tile=_model().model.cfg.vision.tile, needle=pos)
    return sample.images, sample.question, sample.answer, sample.needle


def _load_uploads(files) -> list:
    from apps.comemo.batch import load_image

    if not files:
        raise ValueError("upload at least one image, or draw a sample set")
    paths = [getattr(f, "name", f) for f in files]
    if len(paths) > MAX_UPLOADS:
        raise ValueError(f"{len(paths)} images uploaded; this tab takes at most {MAX_UPLOADS}")
    cfg = _model().model.cfg
    return [load_image(p, max_pixels=cfg.max_pixels, index=i) for i, p in enumerate(paths)]


def ask(images, question, *, expected: str | None = None, needle: int | None = None):
    """Answer ``question`` about ``images`` with the shipped model: returns (answer markdown, tiles image, DHR
    map image, gates image, attention image, status markdown). ``ValueError`` for bad input."""
    from apps.comemo.infer import generate_answer
    from apps.comemo.probe import attention_per_image

    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty; type one (e.g. " + NEEDLE_QUESTION + ")")
    m = _model()
    cfg = m.model.cfg
    t = time.perf_counter()
    res = generate_answer(m.model, m.tokenizer, list(images), question.strip(), max_new_tokens=64)
    seconds = time.perf_counter() - t
    attn = attention_per_image(m.model, m.tokenizer, list(images), question.strip())
    T = cfg.vision.tokens_per_side
    biggest = max(range(len(images)), key=lambda i: images[i].shape[0] * images[i].shape[1])
    lines = [f"**Answer:** {res['answer'] or '(empty)'}"]
    if expected is not None:
        ok = res["answer"].strip() == expected
        lines.append(f"**Expected:** {expected} ({'right' if ok else 'wrong'})")
    lines.append(f"{len(images)} image(s); variant `{cfg.variant}`; {seconds * 1000:.0f} ms on this machine.")
    tiles_img = tiles_figure(images, cfg.vision.tile, min_tiles=cfg.min_tiles, max_tiles=cfg.max_tiles)
    dhr_img = dhr_figure(images[biggest], cfg.vision.tile, T, index=biggest, max_tiles=cfg.max_tiles)
    gates_img = gates_figure(m.model.gates(), cfg.variant)
    attn_img = attention_figure(attn, len(images), needle)
    status = f"Done: answered {res['answer']!r}."
    return "\n\n".join(lines), tiles_img, dhr_img, gates_img, attn_img, status


def ask_sample(task, num_images, needle, seed):
    images, question, answer, pos = draw_sample(task, num_images, needle, seed)
    return (question, *ask(images, question, expected=answer, needle=pos))


@functools.lru_cache(maxsize=2)
def _hf_model(folder: str, mtime: float):
    import torch

    from apps.comemo.api import CoMemo

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    return CoMemo.from_hf(folder)


def check_hf_folder(model: str | None) -> Path:
    """The own-model field: a local InternVL folder or an ``apps.comemo.convert`` output folder (with
    ``config.json`` and a processor); anything else is one ``ValueError`` line naming what is accepted."""
    model = (model or "").strip()
    if not model:
        raise ValueError("give a local InternVL folder or an apps.comemo.convert output folder")
    p = Path(model).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"{model} is not a model folder (no config.json); give a transformers InternVL folder or the "
                         "output of `python -m apps.comemo.convert RELEASE_DIR OUT_DIR` (a released CoMemo-2B/9B)")
    return p


def ask_own_model(model: str | None, files, question: str, max_new_tokens: int = 32) -> str:
    """Answer ``question`` about the uploaded images with your own model (``CoMemo.from_hf(DIR).answer``: the folder's
    chat template and processor, tile grids derived, RoPE-DHR on); returns the status markdown."""
    folder = check_hf_folder(model)
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty; type one")
    if not files:
        raise ValueError("upload at least one image (the 'Or upload images' field above)")
    paths = [getattr(f, "name", f) for f in files]
    if len(paths) > MAX_UPLOADS:
        raise ValueError(f"{len(paths)} images uploaded; this tab takes at most {MAX_UPLOADS}")
    images = [str(p) for p in paths]  # answer() reads them with the folder's own processor
    try:
        cm = _hf_model(str(folder), os.path.getmtime(folder / "config.json"))
    except (KeyError, TypeError, RuntimeError) as err:
        raise ValueError(f"{model} could not be loaded as InternVL/CoMemo ({type(err).__name__}: {err})") from None
    t = time.perf_counter()
    answer = cm.answer(images, question.strip(), max_new_tokens=int(max_new_tokens))
    return (f"**Answer:** {answer or '(empty)'}\n\nDone: your model {folder.name} answered about {len(images)} "
            f"image(s) in {time.perf_counter() - t:.1f} s (RoPE-DHR positions, memory path before every "
            f"{cm.every}th layer).")


_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        from apps.comemo.api import CoMemo

        _MODEL = CoMemo.load()
    return _MODEL


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-model field (``python -m apps --app comemo --model DIR``)."""
    import gradio as gr

    gr.Markdown("## CoMemo\nA small vision-language model with two paths for images: their tokens in the decoder's "
                "input with RoPE-DHR positions (context path) and tanh-gated cross-attention from the text to all "
                "image tokens (memory path). The shipped model (1.5M parameters, trained here on 1-8 images) answers "
                f"`{NEEDLE_QUESTION}` about synthetic images; it was not trained on other questions, and beyond 8 "
                "images the image number it names is wrong (see the README).")
    with gr.Row():
        with gr.Column():
            gr.Markdown("**Draw a sample set**")
            task = gr.Radio(["needle", "detail"], value=EXAMPLE["task"], label="task (detail: one wide or tall tiled image)")
            n = gr.Slider(1, MAX_UPLOADS, value=EXAMPLE["num_images"], step=1, label="number of images (needle)")
            pos = gr.Number(value=EXAMPLE["needle"], precision=0, label="image with the digit (1-based, needle)")
            seed = gr.Number(value=EXAMPLE["seed"], precision=0, label="sample seed")
            draw = gr.Button("Draw and ask", variant="primary")
        with gr.Column():
            gr.Markdown("**Or upload images**")
            files = gr.File(file_count="multiple", file_types=["image"], label=f"images (at most {MAX_UPLOADS}, in order)",
                            elem_id=f"{KEY}-files")
            question = gr.Textbox(value=NEEDLE_QUESTION, label="question")
            go = gr.Button("Ask about the uploaded images")
    example = gr.Button(f"Run the example ({EXAMPLE['num_images']} images, digit in image {EXAMPLE['needle']})",
                        elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    answer = gr.Markdown()
    with gr.Row():
        tiles_img = gr.Image(label="tiles (row-major) and thumbnails", type="numpy")
        dhr_img = gr.Image(label="RoPE-DHR ids of the largest image", type="numpy")
    with gr.Row():
        attn_img = gr.Image(label="attention per image, both paths", type="numpy")
        gates_img = gr.Image(label="memory-path gates", type="numpy")
    outs = [answer, tiles_img, dhr_img, gates_img, attn_img, status]
    with gr.Accordion("Your own model: a local InternVL or a converted CoMemo release", open=model is not None):
        gr.Markdown("A transformers InternVL folder, or a released CoMemo-2B/9B converted with "
                    "`python -m apps.comemo.convert RELEASE_DIR OUT_DIR`; it answers about the uploaded images above "
                    "with its own chat template and tiling.")
        with gr.Row():
            own = gr.Textbox(value=model or "", label="model folder", elem_id=f"{KEY}-own-model",
                             placeholder="/path/to/CoMemo-2B-converted")
            own_q = gr.Textbox(value="Describe the image.", label="question", elem_id=f"{KEY}-own-question")
        own_run = gr.Button("Answer with this model", elem_id=f"{KEY}-own-run")
        own_status = gr.Markdown(elem_id=f"{KEY}-own-status")

    def _own(m, files_, q):
        try:
            return ask_own_model(m, files_, q)
        except (ValueError, FileNotFoundError) as e:
            raise gr.Error(str(e)) from e

    own_run.click(_own, [own, files, own_q], own_status, api_name=f"{KEY}_own")

    def _sample(task_, n_, pos_, seed_):
        try:
            return ask_sample(task_, n_, pos_, seed_)
        except ValueError as e:
            raise gr.Error(str(e)) from e

    def _upload(files_, question_):
        try:
            return ask(_load_uploads(files_), question_)
        except ValueError as e:
            raise gr.Error(str(e)) from e

    draw.click(_sample, [task, n, pos, seed], [question, *outs], api_name=f"{KEY}_sample")
    go.click(_upload, [files, question], outs, api_name=f"{KEY}_ask")
    example.click(lambda: _sample(EXAMPLE["task"], EXAMPLE["num_images"], EXAMPLE["needle"], EXAMPLE["seed"]), None,
                  [question, *outs], api_name=f"{KEY}_example")
