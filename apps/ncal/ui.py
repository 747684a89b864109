"""Gradio tab: type or pick a maths word problem or a dialogue turn → class probabilities from the shipped NCAL
model; beside it the shipped run's class-mean cosine matrix next to the ideal simplex ETF, and its NC1/NC2
curves over training."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_classify", "as_row", "collapse_figure", "curves_figure", "class_legend", "EXAMPLE", "examples_for"]

KEY = "ncal"
#: English glosses shown beside the class names (fonts without CJK glyphs still show something readable).
GLOSS = {"回忆": "Recall", "识别": "Identify", "表征建模": "Represent", "选取策略": "Formulate", "过程实施": "Implement",
         "推断": "Inferences", "分析": "Analyze", "I-Q": "teacher initiation", "I-H": "teacher initiation",
         "R-RR": "student response", "R-SR": "student response", "R-FR": "student response",
         "F-I": "teacher feedback", "F-F": "teacher feedback", "U": "unrelated"}  # as in data/README.md


def display(c: str) -> str:
    """Class name with its English gloss."""
    return f"{c} ({GLOSS[c]})" if c in GLOSS else c
EXAMPLE = {"model": "tmwpl", "pick": 0}
N_PICKS = 3  # test items offered per class


def examples_for(model: str) -> list[tuple[str, str, dict]]:
    """``(label, true class, fields)`` of a few test items per class of a shipped set (raw fields, for the form)."""
    from apps.ncal.data import DATA_DIR, resolve_dataset

    spec = resolve_dataset(model)
    per: dict[str, int] = {}
    out = []
    with open(DATA_DIR / spec.test, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            c = rec["class"]
            if per.get(c, 0) >= N_PICKS:
                continue
            per[c] = per.get(c, 0) + 1
            if "question" in rec:
                fields = {"text": rec["question"], "speaker": None, "previous": "", "previous_speaker": None}
            else:
                hist = [next(iter(t.items())) for t in rec.get("dialog_history") or []]
                i = 1 if len(hist) == 3 else 0
                who = hist[i][0] if hist else None
                prev = hist[i - 1] if i >= 1 else (None, "")
                fields = {"text": rec["dialog_content"], "speaker": who, "previous": prev[1], "previous_speaker": prev[0]}
            short = fields["text"].replace("\n", " ")
            out.append((f"[{c}] {short[:40]}{'…' if len(short) > 40 else ''}", c, fields))
    return sorted(out, key=lambda e: spec.classes.index(e[1]))


def _shipped_dir(model: str):
    from apps.ncal.estimator import resolve_checkpoint

    return resolve_checkpoint(model)


def as_row(text) -> dict | None:
    """``text`` as a data row: a dict, or a string holding one JSON object (a pasted JSONL line); else None."""
    if isinstance(text, dict):
        return text
    if isinstance(text, str) and text.strip().startswith("{"):
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            return None
        return rec if isinstance(rec, dict) else None
    return None


def check_model(own: str | None):
    """The own-model field: None (the shipped model chosen above) or an ``apps.ncal.train`` output folder (a small
    model or a LoRA adapter with its ``ncal.json``); anything else is one ``ValueError`` line."""
    from pathlib import Path

    own = (own or "").strip()
    if not own:
        return None
    p = Path(own).expanduser()
    if not p.is_dir():
        raise ValueError(f"no model folder at {own}; give an apps.ncal.train output folder (with ncal.json and "
                         "model.safetensors)")
    if not (p / "ncal.json").is_file():
        raise ValueError(f"{own} is not an apps.ncal.train output folder: it has no ncal.json (train one with "
                         "`python -m apps.ncal.train --dataset ... --out DIR`)")
    return str(p)


def run_classify(model: str, text, speaker: str | None = None, previous: str = "",
                 previous_speaker: str | None = None, own_model: str | None = None):
    """Returns (probabilities {class: p}, status text).

    ``text`` is a problem or dialogue turn (validated; the dialogue fields apply to ``pmtd`` only), or a data row
    (a dict, or a pasted JSONL line): it is formatted as the model's training data (its own ``dialog_history``
    gives a turn's context, so the dialogue fields are not used).
    """
    from apps.ncal.data import check_texts, format_turn
    from apps.ncal.inputs import row_layout
    from apps.ncal.predict import cached_checkpoint, classify

    own = check_model(own_model)
    if own is not None:
        model = own
    layout = row_layout(cached_checkpoint(model).meta)
    row = as_row(text)
    if row is not None:
        inputs = [row]
    else:
        check_texts([text or ""])
        if layout == "pmtd":
            text = format_turn(text, speaker=speaker or None, previous=previous or None,
                               previous_speaker=previous_speaker or None)
        inputs = [text]
    probs = {display(c): p for c, p in classify(model, inputs)[0].items()}
    meta = cached_checkpoint(model).meta
    best = max(probs, key=probs.get)
    t = meta.get("test") or {}
    name = f"your model {model}" if own is not None else model
    status = (f"Done: **{best}** ({probs[best]:.1%}). Model: {name} ({meta['loss']['name']} loss, "
              f"{meta.get('steps', '?')} steps); its test accuracy {t.get('accuracy', float('nan')):.3f}, "
              f"macro-F1 {t.get('macro_f1', float('nan')):.3f}.")
    if row is not None:
        status += f" Input: a data row, formatted as the {name} training data (the dialogue fields are not used)."
    return probs, status


def collapse_figure(model: str):
    """Matplotlib figure: the shipped model's centred class-mean cosines on its test set beside the ETF's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from apps.ncal.fonts import text_family
    from core.collapse import etf_gram

    folder = _shipped_dir(model)
    col = json.loads((folder / "collapse.json").read_text(encoding="utf-8"))
    cos = np.array([[np.nan if v is None else v for v in row] for row in col["cosines"]], dtype=float)
    K = cos.shape[0]
    ideal = etf_gram(K).numpy()
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 4))
    for ax, m, title in ((axes[0], cos, f"class means, test set (NC2 {col['nc2']:.2f})"), (axes[1], ideal, "simplex ETF")):
        im = ax.imshow(m, vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("class index (legend below)", fontsize=7)
        ax.set_xticks(range(K)); ax.set_yticks(range(K))
        ax.set_xticklabels([str(k) for k in range(K)], fontsize=7); ax.set_yticklabels([str(k) for k in range(K)], fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8)
    legend = class_legend(col["classes"])
    fig.text(0.01, 0.01, legend, fontsize=7, family=text_family(legend))
    return fig


def class_legend(classes) -> str:
    """``"0: name  1: name ..."`` for a figure. Chinese names with their gloss when a CJK font is installed (see
    :mod:`apps.ncal.fonts`); without one only the gloss, so that no glyph is drawn as an empty box."""
    from apps.ncal.fonts import cjk_family

    cjk = cjk_family() is not None
    names = [c if c.isascii() else display(c) if cjk else GLOSS.get(c, "?") for c in classes]
    legend = "  ".join(f"{k}: {n}" for k, n in enumerate(names))
    if "?" in names:
        legend += "  (install a CJK font, e.g. Debian's fonts-noto-cjk, to show the Chinese class names)"
    return legend


def curves_figure(model: str):
    """NC1 and NC2 (train sample and test) per epoch of the shipped run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = _shipped_dir(model)
    recs = [json.loads(line) for line in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    ep = [r["epoch"] for r in recs]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2))
    for ax, key in ((axes[0], "nc1"), (axes[1], "nc2")):
        ax.plot(ep, [r.get(f"train_{key}") for r in recs], "o-", label="train sample")
        ax.plot(ep, [r.get(f"test_nc_{key}") for r in recs], "s--", label="test")
        ax.set_xlabel("epoch"); ax.set_title(key.upper(), fontsize=9); ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-model field (``python -m apps --app ncal --model DIR``)."""
    import gradio as gr

    from apps.ncal.data import DATASETS

    own_value = model

    gr.Markdown("## NCAL\nLong-tailed classification of Chinese educational text: maths word problems → TIMSS "
                "cognitive level (TMWPL), teacher–student dialogue turns → dialogue act (PMTD). The shipped models "
                "are a small character transformer pretrained here, fine-tuned with the loss that scored best on a "
                "validation hold-out of the train split (never on the test split; see the model cards). For a dialogue turn, give its speaker and the previous turn (the next turn is not used), or paste "
                "a JSONL row of the dataset as it is (its `dialog_history` gives the context).")
    picks0 = examples_for(EXAMPLE["model"])
    with gr.Row():
        model = gr.Dropdown(list(DATASETS), value=EXAMPLE["model"], label="model")
        pick = gr.Dropdown([p[0] for p in picks0], value=None, label="or pick a test item ([true class] text)")
    text = gr.Textbox(label="problem or dialogue turn (or a JSONL row of the dataset)", lines=3, elem_id=f"{KEY}-text")
    with gr.Row():
        speaker = gr.Dropdown(["", "teacher", "student"], value="", label="speaker (PMTD)")
        previous = gr.Textbox(label="previous turn (PMTD)", lines=1)
        prev_speaker = gr.Dropdown(["", "teacher", "student"], value="", label="previous speaker (PMTD)")
    with gr.Accordion("Your own model: an apps.ncal.train output folder", open=own_value is not None):
        gr.Markdown("A folder written by `python -m apps.ncal.train` (a small model, or a LoRA adapter of a local LLM "
                    "trained with `--head lm`; the adapter finds its base model as its `ncal.json` records). Leave "
                    "empty for the shipped model chosen above.")
        own = gr.Textbox(value=own_value or "", label="model folder", elem_id=f"{KEY}-own-model",
                         placeholder="/path/to/runs/ncal_tmwpl")
    with gr.Row():
        run = gr.Button("Classify", variant="primary", elem_id=f"{KEY}-run")
        example = gr.Button("Run the bundled example (a TMWPL test problem)", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    probs = gr.Label(label="class probabilities", num_top_classes=8)
    with gr.Row():
        cos_plot = gr.Plot(label="class-mean cosines vs the ideal ETF")
        nc_plot = gr.Plot(label="NC1 / NC2 over training (shipped run)")

    def _model_changed(m):
        try:
            return gr.update(choices=[p[0] for p in examples_for(m)], value=None), collapse_figure(m), curves_figure(m)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    def _picked(m, label):
        for lab, _, f in examples_for(m):
            if lab == label:
                return f["text"], f["speaker"] or "", f["previous"] or "", f["previous_speaker"] or ""
        return gr.update(), gr.update(), gr.update(), gr.update()

    def _run(m, t, sp, pv, psp, o=None):
        try:
            return run_classify(m, t, sp or None, pv or "", psp or None, o)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    def _example():
        m = EXAMPLE["model"]
        lab, _, f = examples_for(m)[EXAMPLE["pick"]]
        p, s = _run(m, f["text"], None, "", None)
        return m, f["text"], p, s, collapse_figure(m), curves_figure(m)

    model.change(_model_changed, model, [pick, cos_plot, nc_plot], api_name=f"{KEY}_model")
    pick.change(_picked, [model, pick], [text, speaker, previous, prev_speaker], api_name=f"{KEY}_pick")
    run.click(_run, [model, text, speaker, previous, prev_speaker, own], [probs, status], api_name=f"{KEY}_run")
    example.click(_example, None, [model, text, probs, status, cos_plot, nc_plot], api_name=f"{KEY}_example")
