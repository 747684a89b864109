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


def run_slide(sample: str | None, upload: str | None, slide_mpp: float | None):
    """Analyse one slide; returns (overview, heatmap, prediction markdown, status markdown, analysis)."""
    from pathology.inference import analyze_slide
    from pathology.slide import SlideError

    path = upload or _sample_choices().get(sample or "")
    if not path:
        raise ValueError("pick a bundled slide or upload a slide file")
    mpp = float(slide_mpp) if slide_mpp else None
    try:
        a = analyze_slide(path, slide_mpp=mpp)
    except (SlideError, FileNotFoundError) as e:
        raise ValueError(str(e)) from e
    if a.n_patches == 0:
        pred = "**No tissue found**: the slide gives an empty bag; no prediction."
    else:
        best = max(range(len(a.probabilities)), key=lambda i: a.probabilities[i])
        pred = f"**Prediction: {a.class_names[best]}** (" + ", ".join(
            f"{n}: {p:.3f}" for n, p in zip(a.class_names, a.probabilities)) + ")"
    t = a.timings
    status = (f"Done: {a.slide_id}, {a.n_patches} patches; features {t.get('patches_per_s', 0):.0f} patches/s, "
              f"model {t.get('model_s', 0) * 1000:.0f} ms. Click the heatmap to see a patch's chosen regions.")
    return a.overview, a.heatmap, pred, status, a


def build_ui() -> None:
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
    with gr.Row():
        run = gr.Button("Analyse", variant="primary")
        example = gr.Button("Run the bundled example", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    pred = gr.Markdown()
    with gr.Row():
        overview = gr.Image(label="tissue mask (green) and patch grid (blue)", type="numpy")
        heat = gr.Image(label="Querent attention heatmap (click a patch)", type="numpy")
    regions_text = gr.Markdown()
    state = gr.State(None)
    outs = [overview, heat, pred, status, state]

    def _run(s, u, m):
        try:
            return run_slide(s, u, m)
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

    run.click(_run, [sample, upload, mpp], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
    heat.select(_click, [state], [heat, regions_text], api_name=f"{KEY}_regions")
