"""Gradio tab: pick a bundled table or upload a CSV, choose the target column, and compare TabICL with
LogisticRegression, RandomForest, HistGradientBoosting and kNN on a held-out split (accuracy, timings), with
TabICL's confusion matrix and predicted probabilities."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_comparison", "EXAMPLE"]

KEY = "tabicl"
EXAMPLE = {"dataset": "iris", "target": "target", "test_size": 0.3, "n_estimators": 4, "seed": 0, "finetune_steps": 0}
MAX_FINETUNE_STEPS = 300


def _table(dataset: str, csv_path):
    import pandas as pd

    from tabular.compare import load_bundled

    if csv_path:
        try:
            return pd.read_csv(csv_path)
        except (OSError, ValueError, pd.errors.ParserError) as e:
            raise ValueError(f"could not read the uploaded CSV: {e}") from e
    return load_bundled(dataset)


def check_checkpoint(path: str | None) -> str | None:
    """The own-model field: None (the shipped checkpoint) or an existing ``.ckpt`` / ``.safetensors`` file;
    anything else is one ``ValueError`` line saying what is accepted."""
    path = (path or "").strip()
    if not path:
        return None
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"no checkpoint at {path}; give an official TabICL .ckpt or a tabular.convert .safetensors file")
    if p.is_dir() or p.suffix not in (".ckpt", ".safetensors"):
        raise ValueError(f"{path} is not a TabICL checkpoint file; accepted: an official TabICL .ckpt "
                         "(e.g. tabicl-classifier-v2-20260212.ckpt) or a tabular.convert .safetensors file")
    return str(p)


def run_comparison(dataset: str, csv_path, target: str, test_size: float, n_estimators: int, seed: int,
                   finetune_steps: int = 0, verbose: bool = False, checkpoint: str | None = None,
                   official: bool = True):
    """Returns (models table, confusion matrix table, probabilities table, status text). ``verbose``: TabICL's
    progress bars (the tab shows them through ``gr.Progress(track_tqdm=True)``). ``checkpoint``: your own
    checkpoint file (official ``.ckpt`` or converted ``.safetensors``; None: the shipped one), run through the
    official package's preprocessing and ensembling when ``official`` and the file is an official ``.ckpt``."""
    import pandas as pd
    import torch

    from tabular.compare import compare_on_table

    torch.set_num_threads(1)
    checkpoint = check_checkpoint(checkpoint)
    official = bool(official) and checkpoint is not None and checkpoint.endswith(".ckpt")
    df = _table(dataset, csv_path)
    n_estimators = int(n_estimators)
    if not 1 <= n_estimators <= 32:
        raise ValueError(f"ensemble members must be in [1, 32], got {n_estimators}")
    finetune_steps = int(finetune_steps or 0)
    if not 0 <= finetune_steps <= MAX_FINETUNE_STEPS:
        raise ValueError(f"fine-tuning steps must be in [0, {MAX_FINETUNE_STEPS}], got {finetune_steps}")
    try:
        out = compare_on_table(df, target, test_size=float(test_size), seed=int(seed), n_estimators=n_estimators,
                               finetune_steps=finetune_steps, verbose=verbose, checkpoint=checkpoint, official=official)
    except (KeyError, RuntimeError) as err:  # a file that loads but is not a TabICL checkpoint of a known layout
        raise ValueError(f"{checkpoint or 'the shipped checkpoint'} could not be used: {err}") from None
    models = pd.DataFrame(out["models"])[["model", "accuracy", "seconds"]].round(4)
    conf = pd.DataFrame(out["confusion"], columns=[f"pred {c}" for c in out["classes"]])
    conf.insert(0, "true", out["classes"])
    proba = pd.DataFrame(out["proba_head"], columns=[f"P({c})" for c in out["classes"]]).round(4)
    proba.insert(0, "true", out["true_head"])
    tab = out["models"][0]
    best = max((m for m in out["models"] if m["accuracy"] is not None), key=lambda m: m["accuracy"])
    model_name = (f"your checkpoint {Path(checkpoint).name}" + (" (official pipeline)" if official else "")
                  if checkpoint else "the shipped checkpoint")
    status = (f"Done: TabICL ({model_name}) accuracy {tab['accuracy']:.3f} in {tab['seconds']:.1f} s on {out['n_test']} held-out rows "
              f"({out['n_train']} train rows, {out['features']} features, {len(out['classes'])} classes); "
              f"best: {best['model']} ({best['accuracy']:.3f}).")
    red = out.get("tabicl_reduction")
    if red:
        status += (f"\n\nTabICL projected the {red['numeric_columns']} numeric columns onto {red['components']} principal "
                   f"components ({'standardised' if red['standardize'] else 'centred'}; "
                   f"{red['explained_variance']:.0%} of the variance), chosen over keeping them on a holdout of the train rows.")
    losses = out.get("tabicl_finetune_loss") or []
    if losses:
        k = min(10, len(losses))
        status += (f"\n\nTabICL was fine-tuned on the train rows for {len(losses)} steps first (in-context loss "
                   f"{sum(losses[:k]) / k:.3f} over the first {k} steps, "
                   f"{sum(losses[-k:]) / k:.3f} over the last {k}).")
    elif finetune_steps:
        status += "\n\nFine-tuning was skipped: too few train rows to hold out queries."
    for note in out["tabicl_warnings"]:
        status += f"\n\nNote: {note}."
    return models, conf, proba, status


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-checkpoint field (``python -m apps --app tabicl --model FILE``)."""
    import gradio as gr

    from tabular.compare import BUNDLED

    gr.Markdown("## TabICL\nIn-context classification: the pretrained transformer reads the train rows with their "
                "labels and predicts the test rows in one forward pass, no training. Compare it with classical "
                "baselines on a held-out split of a bundled table or your CSV. Optionally, fine-tune the model on "
                "the train rows first (a few gradient steps; slower, often more accurate on small tables).")
    with gr.Row():
        dataset = gr.Dropdown(list(BUNDLED), value=EXAMPLE["dataset"], label="bundled table")
        csv = gr.File(label="or upload a CSV", file_types=[".csv"], type="filepath")
        target = gr.Dropdown(["target"], value="target", label="target column", allow_custom_value=True)
    with gr.Row():
        test_size = gr.Slider(0.1, 0.9, value=EXAMPLE["test_size"], step=0.05, label="held-out share")
        n_est = gr.Slider(1, 32, value=EXAMPLE["n_estimators"], step=1, label="TabICL ensemble members")
        seed = gr.Number(value=EXAMPLE["seed"], precision=0, label="split seed")
        ft = gr.Slider(0, MAX_FINETUNE_STEPS, value=EXAMPLE["finetune_steps"], step=10,
                       label="TabICL fine-tuning steps (0 = purely in context)")
    with gr.Accordion("Your own model: an official TabICL checkpoint", open=model is not None):
        gr.Markdown("An official `.ckpt` (v1, v1.1, v2 from the Hugging Face repository `jingang/TabICL`, downloaded "
                    "yourself) or a `tabular.convert` `.safetensors` file. Leave empty for the shipped checkpoint.")
        with gr.Row():
            own = gr.Textbox(value=model or "", label="checkpoint file", elem_id=f"{KEY}-own-model",
                             placeholder="/path/to/tabicl-classifier-v2-20260212.ckpt")
            official = gr.Checkbox(value=True, label="official preprocessing and ensembling (.ckpt only)")
    with gr.Row():
        run = gr.Button("Compare", variant="primary", elem_id=f"{KEY}-run")
        example = gr.Button("Run the bundled example (iris)", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    models = gr.Dataframe(label="held-out accuracy and fit + predict time")
    with gr.Row():
        conf = gr.Dataframe(label="TabICL confusion matrix")
        proba = gr.Dataframe(label="TabICL probabilities (first 10 test rows)")

    def _columns(ds, path):
        try:
            cols = list(_table(ds, path).columns)
        except ValueError as err:
            raise gr.Error(str(err)) from err
        return gr.update(choices=cols, value="target" if "target" in cols else cols[-1])

    def _run(ds, path, tgt, ts, n, sd, steps, ck=None, off=True, progress=gr.Progress(track_tqdm=True)):
        try:  # verbose: TabICL's progress bars, shown by gr.Progress(track_tqdm=True)
            return run_comparison(ds, path, tgt, ts, n, sd, steps, verbose=True, checkpoint=ck, official=off)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    def _example(progress=gr.Progress(track_tqdm=True)):
        e = EXAMPLE
        return _run(e["dataset"], None, e["target"], e["test_size"], e["n_estimators"], e["seed"], e["finetune_steps"])

    dataset.change(_columns, [dataset, csv], target, api_name=f"{KEY}_columns")
    csv.change(_columns, [dataset, csv], target, api_name=f"{KEY}_columns_csv")
    outs = [models, conf, proba, status]
    run.click(_run, [dataset, csv, target, test_size, n_est, seed, ft, own, official], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
