"""Gradio tab: pick an environment and a shipped policy, run an episode, see the video, the return over time and
which (return, state) tokens the routed layers selected at each step."""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["build_ui", "run_episode", "EXAMPLE"]

KEY = "decision_mixer"
EXAMPLE = {"env": "Hopper-v5", "target_return": 3600.0, "max_steps": 60, "seed": 0}


@functools.lru_cache(maxsize=4)
def _load(checkpoint: str):
    from rl.evaluate import load_policy

    return load_policy(checkpoint)


def _checkpoints() -> dict[str, str]:
    from rl.evaluate import shipped_policies

    return {name: str(path) for name, path in shipped_policies().items()}


def _figures(result, env_id: str, layer_ids: list[int]):
    from matplotlib.figure import Figure

    from rl.references import normalized_score

    rew = result.rewards[0]
    fig_r = Figure(figsize=(6, 2.6), tight_layout=True)
    ax = fig_r.add_subplot()
    ax.plot(np.arange(1, len(rew) + 1), np.cumsum(rew), color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("return so far")
    ax.set_title(f"{env_id}: return {rew.sum():.1f} (normalized {float(normalized_score(env_id, rew.sum())):.1f})")
    fig_m = Figure(figsize=(6, 2.6), tight_layout=True)
    ax = fig_m.add_subplot()
    if result.routed is None:
        ax.text(0.5, 0.5, "plain Decision Transformer: no routed layers", ha="center", va="center")
        ax.set_axis_off()
    else:
        r = result.routed[0]  # (steps, L, 2): newest return / state token routed?
        steps, L, _ = r.shape
        img = r.reshape(steps, L * 2).T.astype(float)  # rows: layer x token kind
        ax.imshow(img, aspect="auto", interpolation="nearest", cmap="Greens", vmin=0, vmax=1)
        ax.set_yticks(range(L * 2), [f"layer {layer_ids[i]} {k}" for i in range(L) for k in ("R", "s")])
        ax.set_xlabel("step")
        ax.set_title(f"routed tokens (green): {100 * r.mean():.0f}% of return/state tokens")
    return fig_r, fig_m


def run_episode(checkpoint: str, env_id: str, target_return: float, max_steps: int, seed: int,
                own_policy: str | None = None):
    """Run one rendered episode with a shipped policy, or ``own_policy`` (an ``rl.train`` output folder or a policy
    ``.safetensors``; it runs on the environment it was trained on); returns (video path, return figure, routing
    figure, status text)."""
    import torch

    from rl.evaluate import rollout, write_video

    paths = _checkpoints()
    own = (own_policy or "").strip()
    if own:
        path = str(Path(own).expanduser())
        if not Path(path).exists():
            raise ValueError(f"no policy at {own}; give an rl.train output folder or a policy .safetensors file")
        try:
            model, info = _load(path)
        except (KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"{own} is not a policy written by rl.train ({type(err).__name__}: {err})") from None
        env_id = info["env"]
    else:
        path = paths.get(checkpoint, checkpoint)
        if not path or not Path(path).exists():
            raise ValueError(f"unknown checkpoint {checkpoint!r}; shipped: {sorted(paths)} (or give a training directory)")
        model, info = _load(path)
    if info["env"] != env_id:
        raise ValueError(f"checkpoint {checkpoint!r} was trained on {info['env']}, not {env_id}; pick {info['env']}")
    max_steps = int(max_steps)
    if not 1 <= max_steps <= 1000:
        raise ValueError(f"max steps must be in [1, 1000], got {max_steps}")
    torch.set_num_threads(1)
    result = rollout(model, env_id, target_return=float(target_return), episodes=1, seed=int(seed), max_steps=max_steps,
                     render=True, render_every=2, width=240, height=180)
    out = Path(tempfile.mkdtemp(prefix="dm-demo-")) / "episode.mp4"
    video = write_video(result.frames, out, fps=25)
    fig_r, fig_m = _figures(result, env_id, list(info["model"].get("routed_layers", [])))
    which = f"your policy {Path(path).name}" if own else checkpoint
    status = (f"Done: {info['algo'].upper()} ({which}) on {env_id}, {int(result.lengths[0])} steps, return "
              f"{result.returns[0]:.1f} (target {float(target_return):g}).")
    return str(video), fig_r, fig_m, status


def build_ui(model: str | None = None) -> None:
    """The tab; ``model`` fills the own-policy field (``python -m apps --app decision_mixer --model PATH``)."""
    import gradio as gr

    from rl.envs import SUPPORTED_ENVS

    names = sorted(_checkpoints())
    gr.Markdown("## Decision Mixer\nOffline-RL policies over (return-to-go, state, action) tokens; routed layers run "
                "only on the tokens their router selects. Pick a shipped policy, run an episode (MuJoCo rendering on "
                "CPU), and see which tokens each routed layer used.")
    with gr.Row():
        ckpt = gr.Dropdown(names, value=names[0] if names else None, label="policy (shipped, or a training directory)",
                           allow_custom_value=True)
        env = gr.Dropdown(list(SUPPORTED_ENVS), value=EXAMPLE["env"], label="environment")
        target = gr.Number(value=EXAMPLE["target_return"], label="target return")
        steps = gr.Slider(10, 1000, value=EXAMPLE["max_steps"], step=10, label="max steps")
        seed = gr.Number(value=EXAMPLE["seed"], precision=0, label="seed")
    with gr.Accordion("Your own model: a policy trained with rl.train", open=model is not None):
        gr.Markdown("An `rl.train` output folder (or its policy `.safetensors`); the episode runs on the environment "
                    "it was trained on. Leave empty to use the policy chosen above.")
        own = gr.Textbox(value=model or "", label="policy folder or file", elem_id=f"{KEY}-own-model",
                         placeholder="/path/to/runs/dm_hopper")
    with gr.Row():
        run = gr.Button("Run episode", variant="primary", elem_id=f"{KEY}-run")
        example = gr.Button("Run the bundled example", elem_id=f"{KEY}-example")
    status = gr.Markdown(elem_id=f"{KEY}-status")
    with gr.Row():
        video = gr.Video(label="episode")
        with gr.Column():
            ret_plot = gr.Plot(label="return over time")
            map_plot = gr.Plot(label="router selection")

    def _run(c, e, t, s, sd, o=None):
        try:
            return run_episode(c, e, t, s, sd, o)
        except (ValueError, FileNotFoundError) as err:
            raise gr.Error(str(err)) from err

    def _example():
        if not names:
            raise gr.Error("no shipped policy found in rl/weights")
        return _run(names[0], EXAMPLE["env"], EXAMPLE["target_return"], EXAMPLE["max_steps"], EXAMPLE["seed"])

    outs = [video, ret_plot, map_plot, status]
    run.click(_run, [ckpt, env, target, steps, seed, own], outs, api_name=f"{KEY}_run")
    example.click(_example, None, outs, api_name=f"{KEY}_example")
