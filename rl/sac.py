"""A compact soft actor-critic (Haarnoja et al. 2018) that trains this project's behaviour policies.

The actor is small (two hidden layers of ``actor_hidden`` units) so that its snapshots ship inside the
package; the critics are only needed during training and are never shipped. Training saves an actor
snapshot every ``snapshot_every`` environment steps together with its measured return, which is what
``rl.generate`` needs to regenerate datasets deterministically (see ``rl/policies.py``).

CLI::

    python -m rl.sac --env Hopper-v5 --steps 300000 --seed 0 --out runs/sac-hopper

The run directory holds ``state.pt`` (full training state: networks, optimizers, replay buffer, RNG, step)
so an interrupted run resumes where it stopped, and ``snapshots.safetensors`` + ``snapshots.json`` (actor
weights per snapshot step and their returns).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.infra.cli import check_memory, nonempty_path, positive_int, run_cli, thread_count
from core.infra.fileio import set_file_mode, torch_load, torch_save_atomic
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["SACConfig", "Actor", "train_sac", "build_parser", "main"]

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclass(kw_only=True)
class SACConfig:
    """Hyperparameters of the behaviour-policy trainer (the SAC paper's, with narrower networks and batch for CPU)."""

    env: str = "Hopper-v5"  # gymnasium environment id
    steps: int = 300_000  # environment steps (one gradient update per step after `start_steps`)
    seed: int = 0  # seeds env, torch, numpy and python RNGs
    actor_hidden: int = 64  # actor width; small so that snapshots ship inside the package
    critic_hidden: int = 128  # critic width (never shipped)
    batch_size: int = 128  # minibatch size of each update
    lr: float = 3e-4  # Adam learning rate of actor, critics and temperature
    gamma: float = 0.99  # discount
    tau: float = 0.005  # Polyak factor of the target critics
    start_steps: int = 5_000  # uniform-random actions before the policy acts
    snapshot_every: int = 10_000  # actor snapshot (+ evaluated return) period, in env steps
    eval_episodes: int = 5  # episodes per snapshot evaluation (deterministic actor)
    checkpoint_every: int = 25_000  # full-state checkpoint period, in env steps

    def __post_init__(self) -> None:
        for name in ("steps", "actor_hidden", "critic_hidden", "batch_size", "snapshot_every", "eval_episodes",
                     "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau}")


class Actor(nn.Module):
    """Tanh-squashed Gaussian policy; ``act`` maps observations to actions in [-1, 1]^A, scaled by the env bounds."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, *, act_low: np.ndarray, act_high: np.ndarray):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 2 * act_dim)
        self.register_buffer("act_scale", torch.as_tensor((act_high - act_low) / 2.0, dtype=torch.float32))
        self.register_buffer("act_bias", torch.as_tensor((act_high + act_low) / 2.0, dtype=torch.float32))

    def dist(self, obs_BO: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean_BA, log_std_BA = self.head(self.net(obs_BO)).chunk(2, dim=-1)
        log_std_BA = torch.tanh(log_std_BA)
        log_std_BA = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std_BA + 1)
        return mean_BA, log_std_BA

    def sample(self, obs_BO: torch.Tensor, generator: torch.Generator | None = None):
        """Reparameterized sample: (action in env units, log-probability)."""
        mean, log_std = self.dist(obs_BO)
        std = log_std.exp()
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        u = mean + std * noise
        y = torch.tanh(u)
        logp = (-0.5 * noise.pow(2) - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)
        logp = logp - (torch.log(self.act_scale * (1 - y.pow(2)) + 1e-6)).sum(-1)
        return y * self.act_scale + self.act_bias, logp

    @torch.no_grad()
    def act(self, obs_BO: torch.Tensor, *, deterministic: bool, generator: torch.Generator | None = None):
        if deterministic:
            mean, _ = self.dist(obs_BO)
            return torch.tanh(mean) * self.act_scale + self.act_bias
        return self.sample(obs_BO, generator)[0]


class _Critic(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int):
        super().__init__()
        self.q1 = nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                nn.Linear(hidden, 1))
        self.q2 = copy.deepcopy(self.q1)
        for m in self.q2.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()

    def forward(self, obs, act):
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


def _make_env(env_id: str):
    try:
        import gymnasium as gym
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("rl needs gymnasium[mujoco]: pip install 'longctx-suite[rl]'") from e
    return gym.make(env_id)


def evaluate_actor(actor: Actor, env_id: str, *, episodes: int, seed: int, deterministic: bool = True) -> list[float]:
    """Undiscounted returns of ``episodes`` episodes (env seeds ``seed, seed+1, ...``)."""
    env = _make_env(env_id)
    gen = torch.Generator().manual_seed(seed)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done, ret = False, 0.0
        while not done:
            a = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=deterministic, generator=gen)
            obs, r, term, trunc, _ = env.step(a[0].numpy())
            ret += float(r)
            done = term or trunc
        returns.append(ret)
    env.close()
    return returns


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save_snapshots(out: Path, snaps: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
    from safetensors.torch import save_file

    flat = {f"{name}.{k}": v.contiguous() for name, sd in snaps.items() for k, v in sd.items()}
    tmp = out / "snapshots.safetensors.tmp"
    save_file(flat, str(tmp))
    set_file_mode(tmp)  # safetensors writes 0600: follow the user's umask
    os.replace(tmp, out / "snapshots.safetensors")
    _atomic_write_text(out / "snapshots.json", json.dumps(meta, indent=1))


def train_sac(cfg: SACConfig, out: str | os.PathLike, *, progress: bool = True) -> dict:
    """Train (or resume) SAC; returns the snapshot metadata (per snapshot: step, returns)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = _make_env(cfg.env)
    obs_dim = env.observation_space.shape[0]
    act_dim = env.action_space.shape[0]
    low, high = env.action_space.low.astype(np.float32), env.action_space.high.astype(np.float32)

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    actor = Actor(obs_dim, act_dim, cfg.actor_hidden, act_low=low, act_high=high)
    critic = _Critic(obs_dim, act_dim, cfg.critic_hidden)
    target = copy.deepcopy(critic).requires_grad_(False)
    log_alpha = torch.zeros((), requires_grad=True)
    opt_a = torch.optim.Adam(actor.parameters(), lr=cfg.lr)
    opt_c = torch.optim.Adam(critic.parameters(), lr=cfg.lr)
    opt_t = torch.optim.Adam([log_alpha], lr=cfg.lr)
    target_entropy = -float(act_dim)

    n = cfg.steps
    buf = {
        "obs": np.zeros((n, obs_dim), np.float32), "act": np.zeros((n, act_dim), np.float32),
        "rew": np.zeros(n, np.float32), "next_obs": np.zeros((n, obs_dim), np.float32),
        "term": np.zeros(n, np.float32),
    }
    step, episode, snaps, meta = 0, 0, {}, {"env": cfg.env, "config": asdict(cfg), "snapshots": []}
    state_path = out / "state.pt"
    if state_path.exists():
        st = torch_load(state_path, what="the training state written by rl.sac", map_location=None)
        actor.load_state_dict(st["actor"]); critic.load_state_dict(st["critic"]); target.load_state_dict(st["target"])
        with torch.no_grad():
            log_alpha.copy_(st["log_alpha"])
        opt_a.load_state_dict(st["opt_a"]); opt_c.load_state_dict(st["opt_c"]); opt_t.load_state_dict(st["opt_t"])
        step, episode, snaps, meta = st["step"], st["episode"], st["snaps"], st["meta"]
        for k in buf:
            buf[k][:step] = st["buf"][k]
        random.setstate(st["py_rng"]); np.random.set_state(st["np_rng"]); torch.set_rng_state(st["torch_rng"])
        logger.info("resumed %s at step %d", out, step)
        if "wall_s_total" not in meta:  # a run begun before cumulative wall time was recorded
            meta["wall_s_incomplete"] = True
    obs, _ = env.reset(seed=cfg.seed * 100_003 + episode)
    ep_ret, recent = 0.0, []
    env.action_space.seed(cfg.seed + step)
    bar = tqdm(total=n, initial=step, disable=not progress, desc=f"sac {cfg.env}")
    # Wall seconds accumulate across resumes (time between a stop and the next resume is not counted).
    t0 = time.time() - float(meta.get("wall_s_total", 0.0))
    while step < n:
        if step < cfg.start_steps:
            a = env.action_space.sample().astype(np.float32)
        else:
            a = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=False)[0].numpy()
        nobs, r, term, trunc, _ = env.step(a)
        buf["obs"][step], buf["act"][step], buf["rew"][step] = obs, a, r
        buf["next_obs"][step], buf["term"][step] = nobs, float(term)
        obs, ep_ret = nobs, ep_ret + float(r)
        step += 1
        if term or trunc:
            recent = (recent + [ep_ret])[-10:]
            episode += 1
            obs, _ = env.reset(seed=cfg.seed * 100_003 + episode)
            ep_ret = 0.0
        if step >= cfg.start_steps:
            idx = torch.from_numpy(np.random.randint(0, step, size=cfg.batch_size))
            b = {k: torch.from_numpy(v)[idx] for k, v in buf.items()}
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                na, nlogp = actor.sample(b["next_obs"])
                tq1, tq2 = target(b["next_obs"], na)
                y = b["rew"] + cfg.gamma * (1 - b["term"]) * (torch.min(tq1, tq2) - alpha * nlogp)
            q1, q2 = critic(b["obs"], b["act"])
            loss_c = F.mse_loss(q1, y) + F.mse_loss(q2, y)
            opt_c.zero_grad(set_to_none=True); loss_c.backward(); opt_c.step()
            pa, logp = actor.sample(b["obs"])
            critic.requires_grad_(False)
            pq1, pq2 = critic(b["obs"], pa)
            critic.requires_grad_(True)
            loss_a = (alpha * logp - torch.min(pq1, pq2)).mean()
            opt_a.zero_grad(set_to_none=True); loss_a.backward(); opt_a.step()
            loss_t = -(log_alpha * (logp.detach() + target_entropy).mean())
            opt_t.zero_grad(set_to_none=True); loss_t.backward(); opt_t.step()
            with torch.no_grad():
                for p, tp in zip(critic.parameters(), target.parameters()):
                    tp.mul_(1 - cfg.tau).add_(p, alpha=cfg.tau)
        bar.update(1)
        if step % cfg.snapshot_every == 0:
            rets = evaluate_actor(actor, cfg.env, episodes=cfg.eval_episodes, seed=10_000 + step)
            name = f"step{step:07d}"
            snaps[name] = {k: v.detach().clone() for k, v in actor.state_dict().items()}
            meta["wall_s_total"] = time.time() - t0
            meta["snapshots"].append({"name": name, "step": step, "returns": rets,
                                      "mean_return": float(np.mean(rets)), "wall_s": time.time() - t0})
            _save_snapshots(out, snaps, meta)
            bar.set_postfix(eval=f"{np.mean(rets):.0f}", train=f"{np.mean(recent) if recent else 0:.0f}")
            logger.info("step %d eval return %.1f", step, float(np.mean(rets)))
        if step % cfg.checkpoint_every == 0 or step == n:
            meta["wall_s_total"] = time.time() - t0
            torch_save_atomic({
                "actor": actor.state_dict(), "critic": critic.state_dict(), "target": target.state_dict(),
                "log_alpha": log_alpha.detach(), "opt_a": opt_a.state_dict(), "opt_c": opt_c.state_dict(),
                "opt_t": opt_t.state_dict(), "step": step, "episode": episode, "snaps": snaps, "meta": meta,
                "buf": {k: v[:step].copy() for k, v in buf.items()}, "py_rng": random.getstate(),
                "np_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(),
            }, state_path)
            # Episodes restart at a checkpoint so that a resumed run sees the same stream.
            obs, _ = env.reset(seed=cfg.seed * 100_003 + episode)
            ep_ret = 0.0
    bar.close()
    env.close()
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.sac", description="Train a SAC behaviour policy (resumable).")
    p.add_argument("--env", default="Hopper-v5", help="gymnasium env id")
    p.add_argument("--steps", type=positive_int, default=300_000, help="environment steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=nonempty_path, required=True, help="run directory (state.pt, snapshots.safetensors/json)")
    p.add_argument("--snapshot-every", type=positive_int, default=10_000)
    p.add_argument("--checkpoint-every", type=positive_int, default=25_000, help="full-state checkpoint period")
    p.add_argument("--actor-hidden", type=positive_int, default=64, help="actor width (shipped)")
    p.add_argument("--critic-hidden", type=positive_int, default=128, help="critic width (not shipped)")
    p.add_argument("--batch-size", type=positive_int, default=128)
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    # the replay buffer holds every step: (obs + next obs + action + reward + done) floats of the largest env
    check_memory(args.steps * 4 * (2 * 27 + 8 + 2), what="the replay buffer", options="--steps")
    check_memory(4 * (args.actor_hidden + 2 * args.critic_hidden) ** 2 * 8, what="the networks and their optimizer",
                 options="--actor-hidden/--critic-hidden")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = SACConfig(env=args.env, steps=args.steps, seed=args.seed, snapshot_every=args.snapshot_every,
                    actor_hidden=args.actor_hidden, critic_hidden=args.critic_hidden, batch_size=args.batch_size,
                    checkpoint_every=args.checkpoint_every)
    train_sac(cfg, args.out)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
