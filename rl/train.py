"""Train a Decision Transformer (``dt``) or Decision Mixer (``dm``) on an offline dataset.

    python -m rl.train --algo dm --dataset data/hopper-medium.npz --steps 20000 --seed 0 --out runs/dm-hopper

AdamW with linear warmup, gradient-norm clipping, MSE on actions (+ the routing losses for ``dm``). The output
directory holds ``checkpoint.pt`` (model, optimizer, scheduler, step, sampler and torch RNG states: ``--resume``
continues exactly as an uninterrupted run with the same seed), ``model.safetensors`` + ``config.json`` (what
``rl.evaluate`` and the demo load) and ``metrics.jsonl`` (training losses; evaluation returns and normalized
scores at several target returns every ``--eval-every`` steps).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.infra.cli import (capped_int, check_memory, finite_float, fraction, nonempty_path, nonnegative_float,
                            nonnegative_int, positive_float, positive_int, run_cli, thread_count)
from core.infra.fileio import set_file_mode, torch_load
from core.infra.guard import check_outputs
from rl.data import OfflineDataset, check_env_compat, load_dataset, returns_to_go
from rl.models import DMConfig, DTConfig, build_model, config_from_dict, config_to_dict
from rl.release import PRESETS, preset_overrides

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "SegmentSampler", "SEGMENT_ANCHORS", "Trainer", "train", "build_parser", "main"]

SEGMENT_ANCHORS = ("start", "end")  # where a training segment sits relative to its uniform step (SegmentSampler)

# Per-environment defaults: target returns for evaluation (DT's choices) and the return scale.
ENV_DEFAULTS = {
    "Hopper-v5": {"targets": [3600.0, 1800.0], "return_scale": 1000.0},
    "HalfCheetah-v5": {"targets": [12000.0, 6000.0], "return_scale": 1000.0},
    "Walker2d-v5": {"targets": [5000.0, 2500.0], "return_scale": 1000.0},
}


@dataclass(kw_only=True)
class TrainConfig:
    """Optimization and bookkeeping settings (the model's shape is in DTConfig / DMConfig)."""

    algo: str = "dm"  # "dm" (Decision Mixer) or "dt" (Decision Transformer)
    steps: int = 10_000  # gradient steps in total (a resumed run stops at the same total)
    seed: int = 0  # seeds model init, batch sampling and dropout
    batch_size: int = 64  # segments per batch
    lr: float = 1e-4  # AdamW peak learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    warmup_steps: int = 1_000  # linear warmup from 0 to `lr`
    grad_clip: float = 0.25  # max global gradient norm
    log_every: int = 100  # training metrics period (steps)
    eval_every: int = 0  # evaluation period in steps (0: only at the end if eval_episodes > 0)
    eval_episodes: int = 5  # episodes per target return per evaluation (0: never evaluate)
    eval_targets: list[float] = field(default_factory=list)  # target returns (empty: the env's defaults)
    checkpoint_every: int = 1_000  # full-state checkpoint period (steps)
    segment_anchor: str = "start"  # training segments start ("start", DT's sampling) or end ("end") at a uniform step
    # DM's routed layers: "project" (DMConfig's defaults, this project's fixes) or "reference" (the released
    # code's routed layer, rl.release.preset_overrides; shape and everything else unchanged)
    preset: str = "project"

    def __post_init__(self) -> None:
        if self.algo not in ("dm", "dt"):
            raise ValueError(f"algo must be 'dm' or 'dt', got {self.algo!r}")
        if self.segment_anchor not in SEGMENT_ANCHORS:
            raise ValueError(f"segment_anchor must be 'start' or 'end', got {self.segment_anchor!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {PRESETS}, got {self.preset!r}")
        if self.preset != "project" and self.algo != "dm":
            raise ValueError(f"preset {self.preset!r} sets the routed layers: it applies to algo 'dm' only")
        for name in ("steps", "batch_size", "log_every", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "eval_episodes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"lr ({self.lr}) and grad_clip ({self.grad_clip}) must be > 0")


class SegmentSampler:
    """Random length-``K`` segments of trajectories (trajectories drawn in proportion to their length).

    ``anchor="start"`` (the Decision Transformer's sampling): a segment starts at a uniform position of the
    trajectory and runs up to ``K`` steps, fewer at its end. Timestep ``t`` then lies in ``min(t + 1, K)``
    segments, so the first steps of every episode weigh up to ``K`` times less in the loss than the middle.
    ``anchor="end"`` (d3rlpy's sampling): a segment ends at a uniform position and reaches back up to ``K``
    steps, fewer at its start; the first steps weigh fully and the last ones less. Either way a segment shorter
    than ``K`` is stored from position 0 and right-padded (``valid`` False); with causal attention and absolute
    timestep embeddings that is the same as left padding.
    """

    def __init__(self, ds: OfflineDataset, context: int, seed: int, anchor: str = "start"):
        if anchor not in SEGMENT_ANCHORS:
            raise ValueError(f"anchor must be 'start' or 'end', got {anchor!r}")
        self.anchor = anchor
        self.trajs = ds.trajectories()
        self.rtg = [returns_to_go(t.rewards) for t in self.trajs]
        lengths = np.array([t.length for t in self.trajs], dtype=np.float64)
        self.p = lengths / lengths.sum()
        self.K = context
        self.S, self.A = ds.obs_dim, ds.act_dim
        self.rng = np.random.default_rng(seed)

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        K = self.K
        s = np.zeros((batch_size, K, self.S), np.float32)
        a = np.zeros((batch_size, K, self.A), np.float32)
        r = np.zeros((batch_size, K, 1), np.float32)
        ts = np.zeros((batch_size, K), np.int64)
        valid = np.zeros((batch_size, K), bool)
        idx = self.rng.choice(len(self.trajs), size=batch_size, p=self.p)
        for b, i in enumerate(idx):
            tr = self.trajs[i]
            pos = int(self.rng.integers(0, tr.length))
            if self.anchor == "start":
                start, n = pos, min(K, tr.length - pos)
            else:
                start = max(0, pos - K + 1)
                n = pos - start + 1
            sl = slice(start, start + n)
            s[b, :n], a[b, :n], r[b, :n, 0] = tr.observations[sl], tr.actions[sl], self.rtg[i][sl]
            ts[b, :n] = np.arange(start, start + n)
            valid[b, :n] = True
        return {"states": torch.from_numpy(s), "actions": torch.from_numpy(a), "returns": torch.from_numpy(r),
                "timesteps": torch.from_numpy(ts), "valid": torch.from_numpy(valid)}

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, st: dict) -> None:
        self.rng.bit_generator.state = st["rng"]


class Trainer:
    """Owns model, optimizer, scheduler and sampler; ``train_step`` returns float metrics."""

    def __init__(self, model, cfg: TrainConfig, sampler: SegmentSampler):
        self.model, self.cfg, self.sampler = model, cfg, sampler
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (decay if p.ndim >= 2 and "embed_timestep" not in n else no_decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        warm = max(cfg.warmup_steps, 1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm))
        self.step = 0

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        routed = getattr(self.model.config, "train_selection", "topk")  # "topk" or causal "prefix"
        pred, infos = self.model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"],
                                 valid_BT=batch["valid"], mode=routed)
        valid = batch["valid"].unsqueeze(-1).float()
        mse = (F.mse_loss(pred, batch["actions"], reduction="none") * valid).sum() / (valid.sum() * pred.shape[-1])
        extra = self.model.routing_losses(infos)
        total = mse + sum(extra.values()) if extra else mse
        metrics = {"loss": float(total.detach()), "action_mse": float(mse.detach())}
        metrics.update({k: float(v.detach()) for k, v in extra.items()})
        if infos:
            metrics["routed_fraction"] = float(np.mean([i.mask.float().sum().item() / max(
                1.0, float(batch["valid"].sum() * 3)) for i in infos]))
        return total, metrics

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        self.model.train()
        total, metrics = self.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        metrics["grad_norm"] = float(gn)
        metrics["lr"] = self.sched.get_last_lr()[0]
        return metrics

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "step": self.step, "sampler": self.sampler.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, st: dict) -> None:
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step = int(st["step"])
        self.sampler.load_state_dict(st["sampler"])
        torch.set_rng_state(st["torch_rng"])


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    set_file_mode(tmp)  # safetensors writes 0600: follow the user's umask
    os.replace(tmp, path)


def _export(out: Path, trainer: Trainer, info: dict) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().contiguous() for k, v in trainer.model.state_dict().items()}
    _atomic(out / "model.safetensors", lambda p: save_file(sd, str(p)))
    _atomic(out / "config.json", lambda p: p.write_text(json.dumps({**info, "step": trainer.step}, indent=1)))


def _model_config(algo: str, ds: OfflineDataset, env, overrides: dict, preset: str = "project") -> DTConfig:
    env_id = ds.metadata.get("env")
    base = {"state_dim": ds.obs_dim, "act_dim": ds.act_dim,
            "return_scale": ENV_DEFAULTS.get(env_id, {}).get("return_scale", 1000.0),
            "action_scale": float(np.max(np.abs(env.action_space.high)))}
    if algo == "dm":
        overrides = preset_overrides(preset, overrides, embed_dim=overrides.get("embed_dim") or DMConfig.embed_dim)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return (DMConfig if algo == "dm" else DTConfig)(**base)


def train(cfg: TrainConfig, dataset: str | os.PathLike, out: str | os.PathLike, *, model_overrides: dict | None = None,
          resume: bool = False, progress: bool = True, env_id: str | None = None) -> list[dict]:
    """Train (or resume) and return the metrics records written in this call.

    ``env_id`` names the environment when the dataset's metadata does not (a D4RL HDF5 file from elsewhere), or
    overrides it."""
    from tqdm.auto import tqdm

    from rl.envs import SUPPORTED_ENVS, make_env
    from rl.evaluate import evaluate_returns
    from rl.references import normalized_score

    out = Path(out)
    ds = load_dataset(dataset)
    if env_id is not None:
        if ds.metadata.get("env") not in (None, env_id):
            logger.warning("dataset %s names env %r; training for %r as asked", dataset, ds.metadata["env"], env_id)
        ds.metadata["env"] = env_id
    env_id = ds.metadata.get("env")
    if env_id not in SUPPORTED_ENVS:
        raise ValueError(f"dataset {str(dataset)!r} names env {env_id!r} in its metadata; supported: "
                         f"{list(SUPPORTED_ENVS)} (name it with --env)")
    env = make_env(env_id)
    check_env_compat(ds, env.observation_space, env.action_space, env_id=env_id)
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists() and not resume:
        raise ValueError(f"{str(out)!r} already holds a run (checkpoint.pt); pass --resume to continue it or choose "
                         f"another --out")
    torch.manual_seed(cfg.seed)
    mcfg = _model_config(cfg.algo, ds, env, model_overrides or {}, cfg.preset)  # a preset that cannot apply stops here
    env.close()
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.algo, mcfg)
    model.set_state_normalization(ds.observations.mean(0), ds.observations.std(0))
    sampler = SegmentSampler(ds, mcfg.context, seed=cfg.seed, anchor=cfg.segment_anchor)
    trainer = Trainer(model, cfg, sampler)
    targets = cfg.eval_targets or ENV_DEFAULTS[env_id]["targets"]
    info = {"algo": cfg.algo, "preset": cfg.preset, "env": env_id, "model": config_to_dict(mcfg), "train": asdict(cfg),
            "dataset": {"path": Path(dataset).name, "metadata": {k: v for k, v in ds.metadata.items()
                                                                  if k != "episode_returns"}},
            "eval_targets": targets}
    metrics_path = out / "metrics.jsonl"
    if resume and ckpt_path.exists():
        st = torch_load(ckpt_path, what="the checkpoint written by rl.train", map_location=None)
        # a config saved before a later option gets the value it was trained with (config_from_dict)
        saved = config_to_dict(config_from_dict(st["train_config"]["algo"], st["model_config"]))
        saved_preset = st["train_config"].get("preset", "project")  # checkpoints from before the option
        if saved_preset != cfg.preset:
            raise ValueError(f"--resume: {str(out)!r} was trained with preset {saved_preset!r}, not {cfg.preset!r}; "
                             f"choose another --out")
        if st["train_config"]["algo"] != cfg.algo or saved != config_to_dict(mcfg):
            now = config_to_dict(mcfg)
            diff = {k: (saved.get(k), now.get(k)) for k in sorted(set(now) | set(saved)) if saved.get(k) != now.get(k)}
            raise ValueError(f"--resume: {str(out)!r} was trained with a different algo or model config "
                             f"(saved, now): {diff}")
        saved_anchor = st["train_config"].get("segment_anchor", "start")  # checkpoints from before the option
        if saved_anchor != cfg.segment_anchor:
            raise ValueError(f"--resume: {str(out)!r} was trained with segment_anchor={saved_anchor!r}, "
                             f"not {cfg.segment_anchor!r}")
        trainer.load_state_dict(st["trainer"])
        if metrics_path.exists():  # drop records written after the checkpoint
            keep = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= trainer.step]
            _atomic(metrics_path, lambda p: p.write_text("".join(k + "\n" for k in keep)))
        logger.info("resumed %s at step %d", out, trainer.step)
    elif metrics_path.exists():
        metrics_path.unlink()

    def evaluate(step: int) -> dict:
        rng = torch.get_rng_state()
        rec = {"step": step, "kind": "eval"}
        for tr in targets:
            rets = evaluate_returns(model, env_id, target_return=tr, episodes=cfg.eval_episodes, seed=10_000)
            sc = normalized_score(env_id, rets)
            rec[f"return@{tr:g}"] = float(rets.mean())
            rec[f"score@{tr:g}"] = float(sc.mean())
            rec[f"score_std@{tr:g}"] = float(sc.std())
        torch.set_rng_state(rng)
        return rec

    acc: dict[str, list[float]] = {}
    if resume and ckpt_path.exists():
        acc = st.get("pending_metrics", {})  # training metrics of steps since the last log record
    records = []
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=not progress, desc=f"{cfg.algo} {env_id}")
    t_last, c_last = time.perf_counter(), time.process_time()
    with open(metrics_path, "a") as mf:
        def write(rec):
            records.append(rec)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()

        while trainer.step < cfg.steps:
            m = trainer.train_step(sampler.sample(cfg.batch_size))
            for k, v in m.items():
                acc.setdefault(k, []).append(v)
            bar.update(1)
            s = trainer.step
            if s % cfg.log_every == 0:
                now, cnow = time.perf_counter(), time.process_time()
                # Wall seconds depend on what else runs on the machine; CPU seconds of this process do not
                # (with one torch thread they are what the steps take on an idle core).
                rec = {"step": s, "kind": "train", **{k: float(np.mean(v)) for k, v in acc.items()},
                       "sec_per_1k_steps": (now - t_last) * 1000.0 / cfg.log_every,
                       "cpu_sec_per_1k_steps": (cnow - c_last) * 1000.0 / cfg.log_every}
                write(rec)
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
                acc, t_last, c_last = {}, now, cnow
            if cfg.eval_episodes > 0 and ((cfg.eval_every and s % cfg.eval_every == 0) or s == cfg.steps):
                rec = evaluate(s)
                write(rec)
                logger.info("step %d eval %s", s, {k: round(v, 1) for k, v in rec.items() if k.startswith("score@")})
                t_last, c_last = time.perf_counter(), time.process_time()
            if s % cfg.checkpoint_every == 0 or s == cfg.steps:
                st = {"trainer": trainer.state_dict(), "train_config": asdict(cfg), "model_config": config_to_dict(mcfg),
                      "pending_metrics": acc}
                _atomic(ckpt_path, lambda p: torch.save(st, p))
                _export(out, trainer, info)
    bar.close()
    return records


#: the longest segment: gymnasium's MuJoCo episodes (Hopper, HalfCheetah, Walker2d v5) end at 1000 steps
MAX_CONTEXT = 1000


def check_train_memory(args: argparse.Namespace) -> None:
    """Refuse (``UsageError``) model and batch options whose training batch would not fit in memory: per layer,
    activations ``B·3K·E`` (about 64 bytes each with the backward pass) and attention scores ``B·H·(3K)²``."""
    K, E = args.context or 20, args.embed_dim or 128
    L, H = args.layers or (6 if args.algo == "dm" else 3), args.heads or 1
    T = 3 * K
    check_memory(L * args.batch_size * (T * E * 64 + H * T * T * 12) + 16 * 12 * L * E * E * 4,
                 what="one training batch with its model", options="--batch-size/--context/--embed-dim/--layers/--heads")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.train", description="Train a Decision Transformer / Mixer offline.")
    p.add_argument("--algo", choices=("dm", "dt"), required=True)
    p.add_argument("--dataset", required=True,
                   help=".npz from `python -m rl.generate`, D4RL-style .hdf5/.h5, or minari:/path/to/dataset")
    p.add_argument("--steps", type=positive_int, required=True, help="total gradient steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=nonempty_path, required=True, help="output directory")
    p.add_argument("--env", default=None, help="environment id, for a dataset whose metadata names none (or another)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=1e-4)
    p.add_argument("--weight-decay", type=nonnegative_float, default=1e-4)
    p.add_argument("--warmup-steps", type=nonnegative_int, default=1000)
    p.add_argument("--grad-clip", type=positive_float, default=0.25)
    p.add_argument("--log-every", type=positive_int, default=100)
    p.add_argument("--eval-every", type=nonnegative_int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval-episodes", type=nonnegative_int, default=5, help="episodes per target return (0: no evaluation)")
    p.add_argument("--eval-target", type=finite_float, action="append", default=None, help="target return (repeatable)")
    p.add_argument("--checkpoint-every", type=positive_int, default=1000)
    p.add_argument("--segment-anchor", choices=SEGMENT_ANCHORS, default="start",
                   help="training segments start (DT's sampling) or end (d3rlpy's) at a uniform step")
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=PRESETS, default="project",
                   help="dm: routed layers as this project fixes them (project, the default) or as the released "
                        "code has them (reference: capacity without gradient, strict threshold, s·f(x); rl/README.md)")
    g.add_argument("--context", type=capped_int(MAX_CONTEXT, why="the longest episode of the supported environments"),
                   default=None, help=f"timesteps per segment K (default 20, at most {MAX_CONTEXT})")
    g.add_argument("--embed-dim", type=positive_int, default=None, help="token width (default 128)")
    g.add_argument("--layers", type=positive_int, default=None, help="blocks (default: dt 3, dm 6)")
    g.add_argument("--heads", type=positive_int, default=None, help="attention heads (default 1)")
    g.add_argument("--dropout", type=fraction, default=None, help="dropout probability in [0, 1) (default 0.1)")
    g.add_argument("--routed-layers", type=str, default=None, help="dm: comma-separated zero-based layer ids (default 1,3,5)")
    g.add_argument("--capacity", type=fraction, default=None, help="dm: initial routed fraction (default 0.5)")
    g.add_argument("--capacity-cost", type=nonnegative_float, default=None,
                   help="dm: weight of the mean routed fraction in the loss")
    g.add_argument("--aux-weight", type=nonnegative_float, default=None, help="dm: weight of the auxiliary predictor's BCE")
    g.add_argument("--probe-tokens", type=nonnegative_int, default=None,
                   help="dm: unselected tokens past the cut that run a routed block for the capacity gradient "
                        "(default 4; 0: gradient through selected tokens only)")
    g.add_argument("--train-selection", choices=("topk", "prefix"), default=None,
                   help="dm: routing in training: top-k over the whole segment (default) or causal prefix top-k")
    g.add_argument("--threads", type=thread_count, default=1, help="torch threads")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.dataset.removeprefix("minari:")])
    check_train_memory(args)
    if args.resume and not (Path(args.out) / "checkpoint.pt").is_file():
        raise SystemExit(f"--resume given but {Path(args.out) / 'checkpoint.pt'} does not exist")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.algo == "dt" and args.preset != "project":
        raise SystemExit(f"--preset {args.preset} sets the routed layers: it applies to --algo dm only")
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(algo=args.algo, steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                      weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, grad_clip=args.grad_clip,
                      log_every=args.log_every, eval_every=args.eval_every, eval_episodes=args.eval_episodes,
                      eval_targets=args.eval_target or [], checkpoint_every=args.checkpoint_every,
                      segment_anchor=args.segment_anchor, preset=args.preset)
    overrides = {"context": args.context, "embed_dim": args.embed_dim, "num_layers": args.layers,
                 "num_heads": args.heads, "dropout": args.dropout, "capacity": args.capacity,
                 "capacity_cost_weight": args.capacity_cost, "aux_loss_weight": args.aux_weight,
                 "probe_tokens": args.probe_tokens, "train_selection": args.train_selection}
    if args.routed_layers is not None:
        if args.algo != "dm":
            raise SystemExit("--routed-layers applies to --algo dm only")
        overrides["routed_layers"] = tuple(int(x) for x in args.routed_layers.split(",") if x.strip())
    if args.algo == "dt":
        for k in ("capacity", "capacity_cost_weight", "aux_loss_weight", "probe_tokens", "train_selection"):
            if overrides.pop(k) is not None and k in ("probe_tokens", "train_selection"):
                raise SystemExit(f"--{k.replace('_', '-')} applies to --algo dm only")
    try:
        train(cfg, args.dataset, args.out, model_overrides=overrides, resume=args.resume, env_id=args.env)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from e


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
