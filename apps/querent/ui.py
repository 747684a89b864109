"""Gradio tab: pick a bundled synthetic slide or upload one; see the tissue mask and patch grid, Querent's
prediction and attention heatmap, and, for a clicked patch, the regions its region attended to."""


import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_slide", "KEY"]

KEY = "querent"


def _sample_choices() -> dict[str, str]:
    from pathology.inference import bundled_samples

    return {os.path.basename(p): p for p in bundled_samples()}


def check_model(model: str | None) -> str | None:
    """The own-model field: None (the shipped slide model), or a ``pathology.train`` output folder (or a slide
    model ``.safetensors`` with its ``.json``); anything else is one ``ValueError`` line naming what is accepted."""
    model = (model or "").strip()
    if not model:
        return None
    p = os.path.expanduser(model)
    if not os.path.exists(p):
        raise ValueError(f"no slide model at {model}; give a pathology.train output folder (with its fold models)")
    if os.path.isdir(p) and not any(f.endswith("_config.json") for f in os.listdir(p)):
        raise ValueError(f"{model} is not a pathology.train output folder (no <model>_config.json in it); "
                         "train one with `python -m pathology.train`")
    if os.path.isfile(p) and not (p.endswith(".safetensors") or p.endswith("_config.json")):
        raise ValueError(f"{model} is not a slide model; accepted: a pathology.train output folder, its "
                         "<model>_config.json, or a slide model .safetensors with its .json")
    return p


def run_slide(sample: str | None, upload: str | None, slide_mpp: float | None, model: str | None = None):
    """Analyse one slide with the shipped slide model or ``model`` (a ``pathology.train`` output folder); returns
    (overview, heatmap, prediction markdown, status markdown, analysis)."""
    from pathology.inference import analyze_slide
    from pathology.slide import SlideError

    path = upload or _sample_choices().get(sample or "")
    if not path:
        raise ValueError("pick a bundled slide or upload a slide file")
    mpp = float(slide_mpp) if slide_mpp else None
    model_path = check_model(model)
    try:
        a = analyze_slide(path, slide_mpp=mpp, model_path=model_path)
    except (SlideError, FileNotFoundError) as e:
        raise ValueError(str(e)) from e
    if a.n_patches == 0:
        pred = "**No tissue found**: the slide gives an empty bag; no prediction."
    else:
        best = max(range(len(a.probabilities)), key=lambda i: a.probabilities[i])
        pred = f"**Prediction: {a.class_names[best]}** (" + ", ".join(
            f"{n}: {p:.3f}" for n, p in zip(a.class_names, a.probabilities)) + ")"
    t = a.timings
    which = f"your model {os.path.basename(model_path.rstrip('/'))}" if model_path else "the shipped model"
    status = (f"Done: {a.slide_id} with {which}, {a.n_patches} patches; features {t.get('patches_per_s', 0):.0f} patches/s, "
              f"model {t.get('model_s', 0) * 1000:.0f} ms. Click the heatmap to see a patch's chosen regions.")
    return a.overview, a.heatmap, pred, status, a


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-model field (``python -m apps --app querent --model DIR``)."""
    import gradio as gr

    from pathology.inference import regions_overlay

    gr.Markdown("## Querent\nQuery-aware region attention over every patch of a whole-slide image. The shipped "
                "models (patch encoder and slide model) are small stand-ins trained on this project's synthetic "
                "slides; they only know those.")
    choices = list(_sample_choices())
    with gr.Row():
        sample = gr.Dropdown(choices, value=choices[0] if choices else None, label="bundled slide")
        upload = gr.File(label="or upload a slide (SVS, NDPI, MRXS, TIFF, ...)", type="filepath")
        mpp = gr.Number(value=None, label="µm/px of the slide (only if its file lacks it)")
    with gr.Accordion("Your own model: a pathology.train output folder", open=model is not None):
        gr.Markdown("The folder `python -m pathology.train` wrote (its fold models are averaged; patches are cut "
                    "at the settings it records). Leave empty for the shipped slide model.")
        own = gr.Textbox(value=model or "", label="slide model folder", elem_id=f"{KEY}-own-model",
                         placeholder="/path/to/runs/querent")
    with gr.Row():
        run = gr.Button("Analyse", variant="primary", elem_id=f"{KEY}-run")
        example = gr.Button("Run the bundled example", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    pred = gr.Markdown()
    with gr.Row():
        overview = gr.Image(label="tissue mask (green) and patch grid (blue)", type="numpy")
        heat = gr.Image(label="Querent attention heatmap (click a patch)", type="numpy")
    regions_text = gr.Markdown()
    state = gr.State(None)
    outs = [overview, heat, pred, status, state]

    def _run(s, u, m, own_model=None):
        try:
            return run_slide(s, u, m, own_model)
        except ValueError as e:
            raise gr.Error(str(e)) from e

    def _example():
        c = list(_sample_choices())
        if not c:
            raise gr.Error("no bundled slides are installed")
        return _run(c[0], None, None)

    def _click(a, evt: gr.SelectData):
        if a is None:
            raise gr.Error("analyse a slide first")
        x, y = evt.index
        img, text = regions_overlay(a, float(x), float(y))
        return img, text

    run.click(_run, [sample, upload, mpp, own], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
    heat.select(_click, [state], [heat, regions_text], api_name=f"{KEY}_regions")
