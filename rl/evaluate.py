"""Roll out a trained Decision Transformer / Mixer in its environment and report normalized scores.

    python -m rl.evaluate --checkpoint runs/dm-hopper --episodes 10 [--target-return 3600]

Episodes run in lockstep in a synchronous vector environment (one batched model call per step); episode
``i`` resets with seed ``seed + i``. Scores are D4RL-normalized (see :mod:`rl.references`).

``--json`` and ``--video`` are checked before any episode runs, and the JSON is written as soon as the returns are
in (before the video). A target return whose evaluation fails is named on stderr and the others are still
evaluated and written (``failed`` in the JSON); the exit code is then 1 (2 when none could be evaluated).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.infra.cli import InputTally, UsageError, capped_int, finite_float, print_error, run_cli, thread_count
from core.infra.fileio import load_safetensors_model
from core.infra.guard import check_outputs
from rl.envs import make_env, make_vector_env
from rl.references import normalized_score

logger = logging.getLogger(__name__)

#: caps of --episodes and --batch (environments held in memory together)
MAX_EPISODES = 100_000
MAX_BATCH_ENVS = 1_000

__all__ = ["EpisodeResult", "check_routing", "rollout", "evaluate_returns", "heldout_action_mse", "load_policy",
           "write_video", "shipped_policies", "build_parser", "main"]


@dataclass
class EpisodeResult:
    """One or more episodes run together."""

    returns: np.ndarray  # (E,) undiscounted returns
    lengths: np.ndarray  # (E,) steps until terminal or time limit
    rewards: list[np.ndarray] = field(default_factory=list)  # per episode, (length,)
    routed: np.ndarray | None = None  # (E, steps, L, 2) bool: was the newest return/state token routed, per routed layer
    frames: list[np.ndarray] = field(default_factory=list)  # rgb frames of episode 0 (if rendered)


def check_routing(model, routing: str) -> None:
    """Refuse a selection ``model`` cannot act with (``ValueError`` naming what is accepted)."""
    if routing not in ("aux", "prefix"):
        raise ValueError(f"routing must be 'aux' or 'prefix' (causal selections), got {routing!r}")
    if routing == "prefix" and getattr(model.config, "capacity_input", "mean") == "flatten":
        raise ValueError("routing 'prefix' needs a capacity from the tokens so far; this model's comes from all 3 K "
                         "tokens flattened (the reference preset), which has no causal prefix form: use 'aux'")


@torch.no_grad()
def rollout(model, env_id: str, *, target_return: float, episodes: int = 1, seed: int = 0,
            max_steps: int | None = None, render: bool = False, render_every: int = 1,
            width: int = 320, height: int = 240, progress=None, routing: str = "aux",
            obs_transform=None) -> EpisodeResult:
    """Run ``episodes`` episodes with ``model`` conditioned on ``target_return``.

    ``routing`` is the routed layers' causal selection when acting: ``"aux"`` (the auxiliary predictor, the
    default) or ``"prefix"`` (causal prefix top-k, what a DM trained with ``train_selection="prefix"`` used).

    ``obs_transform`` (optional): maps the observations ``(E, obs_dim)`` before the policy sees them (e.g.
    :func:`rl.partial.mask_observations` for a partially observed task); returns stay the environment's.

    With ``render=True`` only one episode may run; frames come from MuJoCo's offscreen renderer
    (``MUJOCO_GL=egl`` on a machine without a display).
    """
    check_routing(model, routing)
    model.eval()
    cfg = model.config
    K = cfg.context
    max_steps = max_steps or cfg.max_ep_len
    if episodes <= 0:
        raise ValueError(f"episodes must be positive, got {episodes}")
    if render:
        if episodes != 1:
            raise ValueError(f"render=True runs one episode, got episodes={episodes}")
        env = make_env(env_id, render_mode="rgb_array", width=width, height=height)
        obs, _ = env.reset(seed=seed)
        obs = obs[None]
        envs = None
    else:
        envs = make_vector_env(env_id, episodes)
        obs, _ = envs.reset(seed=[seed + i for i in range(episodes)])
    E = episodes
    S, A = cfg.state_dim, cfg.act_dim
    states = torch.zeros(E, 0, S)
    actions = torch.zeros(E, 0, A)
    rtg = torch.zeros(E, 0, 1)
    times = torch.zeros(E, 0, dtype=torch.long)
    cur_rtg = torch.full((E, 1), float(target_return))
    done = np.zeros(E, dtype=bool)
    returns, lengths = np.zeros(E), np.zeros(E, dtype=np.int64)
    rewards = [[] for _ in range(E)]
    routed_steps, frames = [], []
    if render:
        frames.append(env.render())
    for t in range(max_steps):
        seen = obs if obs_transform is None else obs_transform(np.asarray(obs))
        states = torch.cat([states, torch.as_tensor(seen, dtype=torch.float32)[:, None]], 1)[:, -K:]
        actions = torch.cat([actions, torch.zeros(E, 1, A)], 1)[:, -K:]
        rtg = torch.cat([rtg, cur_rtg[:, None]], 1)[:, -K:]
        times = torch.cat([times, torch.full((E, 1), t, dtype=torch.long)], 1)[:, -K:]
        pred, infos = model(states, actions, rtg, times, mode=routing)
        a = pred[:, -1]
        if infos:
            # newest return and state tokens sit at positions -3 and -2 of the 3T sequence
            routed_steps.append(torch.stack([i.mask[:, -3:-1] for i in infos], 1).numpy())  # (E, L, 2)
        actions[:, -1] = a
        a_np = a.numpy()
        if render:
            o, r, term, trunc, _ = env.step(a_np[0])
            obs, r, term, trunc = o[None], np.array([r]), np.array([term]), np.array([trunc])
            if t % render_every == 0 or term or trunc:
                frames.append(env.render())
        else:
            obs, r, term, trunc, _ = envs.step(a_np)
        for i in range(E):
            if not done[i]:
                returns[i] += float(r[i])
                lengths[i] += 1
                rewards[i].append(float(r[i]))
        done |= np.asarray(term) | np.asarray(trunc)
        cur_rtg = cur_rtg - torch.as_tensor(np.asarray(r, dtype=np.float32))[:, None]
        if progress is not None:
            progress(t + 1, max_steps)
        if done.all():
            break
    (env if render else envs).close()
    routed = None
    if routed_steps:
        routed = np.stack(routed_steps, 1)  # (E, steps, L, 2)
    return EpisodeResult(returns=returns, lengths=lengths, rewards=[np.array(r) for r in rewards],
                         routed=routed, frames=frames)


def evaluate_returns(model, env_id: str, *, target_return: float, episodes: int, seed: int = 0,
                     batch: int = 10, routing: str = "aux", obs_transform=None) -> np.ndarray:
    """Returns of ``episodes`` episodes, run ``batch`` at a time (``routing``, ``obs_transform``: see :func:`rollout`)."""
    out = []
    for start in range(0, episodes, batch):
        n = min(batch, episodes - start)
        out.append(rollout(model, env_id, target_return=target_return, episodes=n, seed=seed + start,
                           routing=routing, obs_transform=obs_transform).returns)
    return np.concatenate(out)


@torch.no_grad()
def heldout_action_mse(model, trajectories, *, batch: int = 256, routing: str = "aux") -> float:
    """Mean squared action error of ``model`` in evaluation mode on whole trajectories it was not trained on.

    Each trajectory is cut into consecutive segments of ``context`` steps from its first step (the last one
    shorter, right-padded); the model sees the true states, returns-to-go and past actions, and predicts every
    action causally (a position sees only earlier tokens of its segment; a Decision Mixer routes with the causal
    ``routing`` it uses when acting, ``"aux"`` by default). The MSE is averaged over all steps and action dims.
    """
    from rl.data import returns_to_go

    check_routing(model, routing)
    model.eval()
    K = model.config.context
    segs = []
    for tr in trajectories:
        rtg = returns_to_go(tr.rewards)
        for start in range(0, tr.length, K):
            sl = slice(start, min(start + K, tr.length))
            segs.append((tr.observations[sl], tr.actions[sl], rtg[sl], np.arange(sl.start, sl.stop)))
    if not segs:
        raise ValueError("heldout_action_mse needs at least one trajectory")
    total, count = 0.0, 0
    for b0 in range(0, len(segs), batch):
        chunk = segs[b0:b0 + batch]
        n = len(chunk)
        s = np.zeros((n, K, model.config.state_dim), np.float32)
        a = np.zeros((n, K, model.config.act_dim), np.float32)
        r = np.zeros((n, K, 1), np.float32)
        ts = np.zeros((n, K), np.int64)
        valid = np.zeros((n, K), bool)
        for i, (so, ac, rt, tt) in enumerate(chunk):
            m = len(tt)
            s[i, :m], a[i, :m], r[i, :m, 0], ts[i, :m], valid[i, :m] = so, ac, rt, tt, True
        a_t, v_t = torch.from_numpy(a), torch.from_numpy(valid)
        pred, _ = model(torch.from_numpy(s), a_t, torch.from_numpy(r), torch.from_numpy(ts), valid_BT=v_t,
                        mode=routing)
        err = ((pred - a_t) ** 2).sum(-1)[v_t]
        total += float(err.sum())
        count += int(v_t.sum()) * model.config.act_dim
    return total / count


def load_policy(checkpoint: str | os.PathLike):
    """Load ``model.safetensors`` + ``config.json`` from a training directory, or ``NAME.safetensors`` +
    ``NAME.json`` (a shipped policy, given either file).

    Returns ``(model, info)`` with ``info`` the JSON (algo, env, model config, target returns).
    """
    from rl.models import build_model, config_from_dict

    d = Path(checkpoint)
    cfg_path, w_path = policy_files(d)
    if not cfg_path.exists() or not w_path.exists():
        raise FileNotFoundError(f"{str(d)!r} holds no trained policy (needs {cfg_path.name} and {w_path.name}; "
                                f"train one with `python -m rl.train`)")
    try:
        info = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{cfg_path} is not JSON ({err}); expected the config.json written by rl.train") from err
    try:
        model = build_model(info["algo"], config_from_dict(info["algo"], info["model"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{cfg_path} is not a policy config ({type(err).__name__}: {err}); expected the JSON "
                         f"written by rl.train or rl.ship, with 'algo' ('dt'|'dm') and 'model' "
                         f"(state_dim, act_dim, ...)") from err
    load_safetensors_model(model, w_path, what="policy weights written by rl.train or rl.ship for this config")
    return model.eval(), info


def policy_files(checkpoint: str | os.PathLike) -> tuple[Path, Path]:
    """The config and weights files :func:`load_policy` reads for ``checkpoint``: ``NAME.json`` +
    ``NAME.safetensors`` for a shipped policy (either file given), else ``config.json`` + ``model.safetensors``."""
    d = Path(checkpoint)
    if d.suffix in (".safetensors", ".json"):
        return d.with_suffix(".json"), d.with_suffix(".safetensors")
    return d / "config.json", d / "model.safetensors"


def shipped_policies() -> dict[str, Path]:
    """Policies shipped in ``rl/weights`` (``dm_*.safetensors`` / ``dt_*.safetensors`` with a JSON card)."""
    wdir = Path(__file__).resolve().parent / "weights"
    return {p.stem: p for p in sorted(wdir.glob("d[mt]_*.safetensors")) if p.with_suffix(".json").exists()}


def write_video(frames: list[np.ndarray], path: str | os.PathLike, *, fps: int = 30) -> Path:
    """Encode RGB frames ``(H, W, 3)`` uint8 as H.264 MP4 (PyAV) written atomically; GIF (Pillow) without PyAV."""
    path = Path(path)
    if not frames:
        raise ValueError("no frames to write")
    try:
        import av
    except ImportError:
        from PIL import Image

        path = path.with_suffix(".gif")
        tmp = path.with_name(path.name + ".tmp.gif")
        imgs = [Image.fromarray(f) for f in frames]
        imgs[0].save(tmp, save_all=True, append_images=imgs[1:], duration=int(1000 / fps), loop=0)
        os.replace(tmp, path)
        return path
    h, w = frames[0].shape[:2]
    h2, w2 = h - h % 2, w - w % 2
    tmp = path.with_name(path.name + ".tmp.mp4")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w2, h2, "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f[:h2, :w2]), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.evaluate", description="Evaluate a trained policy (normalized score).")
    p.add_argument("--checkpoint", required=True, help="training output directory (config.json + model.safetensors)")
    p.add_argument("--episodes", type=capped_int(MAX_EPISODES, why="episodes per target return"), default=10)
    p.add_argument("--target-return", type=finite_float, action="append", default=None,
                   help="return to condition on (repeatable; default: the ones used in training)")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--batch", type=capped_int(MAX_BATCH_ENVS, why="environments held in memory together"), default=10,
                   help="environments stepped together")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--video", default=None, help="also run one rendered episode (first target) and write it here (.mp4)")
    p.add_argument("--routing", choices=("aux", "prefix"), default="aux",
                   help="DM routing when acting: the auxiliary predictor (default) or causal prefix top-k")
    p.add_argument("--threads", type=thread_count, default=1)
    return p


def main(argv=None) -> int:
    from core.infra.fileio import check_writable, write_json_atomic

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("episodes", "batch", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.target_return is not None and not all(np.isfinite(args.target_return)):
        raise UsageError(f"--target-return must be finite numbers, got {args.target_return}")
    # the outputs are checked before the rollouts whose results they record
    check_outputs([("--json", args.json), ("--video", args.video)],
                  inputs=[args.checkpoint, *policy_files(args.checkpoint)])
    if args.json is not None:
        check_writable(args.json, what="--json")
    if args.video is not None:
        check_writable(args.video, what="--video")
    torch.set_num_threads(args.threads)
    model, info = load_policy(args.checkpoint)
    try:
        check_routing(model, args.routing)
    except ValueError as e:
        raise UsageError(f"--routing {args.routing}: {args.checkpoint}: {e}") from e
    env_id = info["env"]
    targets = args.target_return or info.get("eval_targets") or [3600.0]
    tally = InputTally("target return")
    results, failed = [], []
    for tr in targets:
        try:
            rets = evaluate_returns(model, env_id, target_return=tr, episodes=args.episodes, seed=args.seed,
                                    batch=args.batch, routing=args.routing)
            scores = normalized_score(env_id, rets)
            if not (np.isfinite(rets).all() and np.isfinite(scores).all()):
                raise ValueError(f"the returns are not finite ({rets.tolist()[:3]}...): the policy "
                                 f"{args.checkpoint} gives non-finite actions")
        except Exception as err:  # noqa: BLE001 - a failed target is reported; the others are still evaluated
            tally.fail(f"target {tr:g}", err)
            failed.append({"target_return": tr, "error": " ".join(str(err).split()) or type(err).__name__})
            continue
        tally.ok()
        results.append({"target_return": tr, "returns": rets.tolist(), "return_mean": float(rets.mean()),
                        "score_mean": float(scores.mean()), "score_std": float(scores.std())})
        print(f"{env_id} target {tr:g}: return {rets.mean():.1f} ± {rets.std():.1f}, "
              f"normalized score {scores.mean():.1f} ± {scores.std():.1f} over {len(rets)} episodes")
    if args.json is not None and results:
        record = {"checkpoint": str(args.checkpoint), "env": env_id, "results": results}
        if failed:
            record["failed"] = failed
        write_json_atomic(args.json, record)
    code = tally.finish()
    if args.video is not None and results:
        try:
            ep = rollout(model, env_id, target_return=results[0]["target_return"], episodes=1, seed=args.seed,
                         render=True, routing=args.routing)
            Path(args.video).parent.mkdir(parents=True, exist_ok=True)
            path = write_video(ep.frames, args.video)
        except Exception as err:  # noqa: BLE001 - the returns written above are kept; the video is reported
            print_error(f"--video {args.video}: {type(err).__name__}: {err}")
            code = max(code, 1)
        else:
            print(f"video of one episode (return {ep.returns[0]:.1f}, {ep.lengths[0]} steps): {path}")
    return code


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
