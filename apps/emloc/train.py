"""Meta-train the EMLoC host for many-shot in-context classification: ``python -m apps.emloc.train``.

Every step draws ``--batch-size`` training episodes (classes and a random label mapping each, see
:mod:`apps.emloc.data`) of ``--demos`` demonstrations; the loss is the cross-entropy of each demo's label
predicted at its last image patch from the demos before it (so one sequence teaches 0..K-1 shots), plus
``--next-weight`` times the cross-entropy of the "next" token at label positions.

Episode ``b`` of step ``s`` comes from seed ``seed * 1_000_003 + s * batch + b``, so a resumed run sees
exactly the episodes it would have seen. ``DIR/last.pt`` holds model, optimizer, step and RNG state
(``--resume`` continues exactly); ``DIR/metrics.jsonl`` one line per logged step (lines past the checkpoint
are dropped on resume); ``DIR/model.safetensors`` the weights. Evaluation (``--eval-every``) runs held-out
episodes (classes never seen in training) and records accuracy by number of preceding demos.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from apps.emloc.data import EpisodeConfig, make_episode
from apps.emloc.model import EMLoCHost, HostConfig
from core.infra.cli import nonempty_path_obj, nonnegative_float, nonnegative_int, positive_float, positive_int, run_cli
from core.infra.fileio import torch_load, torch_save_atomic
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["Trainer", "episode_batch", "episode_loss", "shot_accuracy", "build_parser", "main"]

#: Accuracy buckets by number of preceding demonstrations (lo, hi inclusive).
SHOT_BUCKETS = ((0, 0), (1, 3), (4, 15), (16, 31), (32, 63), (64, 127), (128, 255), (256, 511))


def episode_batch(seeds: list[int], *, num_demos: int, split: str, config: EpisodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Demo images ``(B, K, size, size)`` and labels ``(B, K)`` of the episodes with these seeds."""
    eps = [make_episode(s, num_demos=num_demos, num_queries=0, split=split, config=config) for s in seeds]
    return torch.stack([e.demo_images for e in eps]), torch.stack([e.demo_labels for e in eps])


def episode_loss(model: EMLoCHost, images: torch.Tensor, labels: torch.Tensor, *, next_weight: float = 0.1):
    """``(loss, correct (B, K) bool)``: label CE at last patches (+ next-token CE at labels)."""
    c = model.config
    B, K = labels.shape
    x = model.embed_demos(images, labels)
    logits = model.decoder(inputs_embeds=x, use_cache=False).logits  # (B, K*(P+1), V)
    logits = logits.reshape(B, K, c.tokens_per_demo, c.vocab_size)
    lab_logits = logits[:, :, c.tokens_per_image - 1, : c.num_labels]  # (B, K, num_labels)
    loss = F.cross_entropy(lab_logits.reshape(B * K, -1), labels.reshape(-1))
    if next_weight > 0:
        nxt = logits[:, :, c.tokens_per_image].reshape(B * K, -1)
        loss = loss + next_weight * F.cross_entropy(nxt, torch.full((B * K,), c.next_id, dtype=torch.long))
    return loss, lab_logits.argmax(-1) == labels


def shot_accuracy(correct_BK: torch.Tensor) -> dict[str, float]:
    """Accuracy per bucket of preceding-demo counts (position k has k demos before it)."""
    K = correct_BK.shape[1]
    out = {}
    for lo, hi in SHOT_BUCKETS:
        if lo >= K:
            break
        out[f"acc_shots_{lo}-{hi}"] = float(correct_BK[:, lo : min(hi, K - 1) + 1].float().mean())
    return out


class Trainer:
    """Meta-training state: model, AdamW, warmup + cosine schedule, step."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        torch.manual_seed(args.seed)
        self.model = EMLoCHost(HostConfig(dim=args.dim, depth=args.depth, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                          image_summary=args.image_summary))
        self.episodes = EpisodeConfig(n_way=args.n_way)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
        self.step = 0
        self.seconds = 0.0  # wall time of training so far, across resumes

    def lr_at(self, step: int) -> float:
        a = self.args
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def train_step(self) -> dict[str, float]:
        a = self.args
        seeds = [a.seed * 1_000_003 + self.step * a.batch_size + b for b in range(a.batch_size)]
        images, labels = episode_batch(seeds, num_demos=a.demos, split="train", config=self.episodes)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.model.train()
        loss, correct = episode_loss(self.model, images, labels, next_weight=a.next_weight)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return {"loss": float(loss.detach()), "acc": float(correct.float().mean()), "grad_norm": float(gn), "lr": self.lr_at(self.step - 1)}

    @torch.no_grad()
    def evaluate(self, num_episodes: int, num_demos: int) -> dict[str, float]:
        self.model.eval()
        seeds = [10_000_019 + i for i in range(num_episodes)]  # fixed held-out episodes
        images, labels = episode_batch(seeds, num_demos=num_demos, split="eval", config=self.episodes)
        loss, correct = episode_loss(self.model, images, labels, next_weight=0.0)
        return {"eval_loss": float(loss), **{f"eval_{k}": v for k, v in shot_accuracy(correct).items()}}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                "rng": torch.get_rng_state(), "args": vars(self.args), "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self.seconds = float(state.get("seconds", 0.0))  # checkpoints from before the field: unknown, counted from 0
        torch.set_rng_state(state["rng"])


def _trim_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after the checkpoint step (they will be logged again)."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    path.write_text("".join(l + "\n" for l in keep))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.emloc.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=nonempty_path_obj,
                   help="run folder (last.pt, metrics.jsonl, model.safetensors)")
    p.add_argument("--steps", type=positive_int, default=3000)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--demos", type=positive_int, default=64, help="demonstrations per training episode")
    p.add_argument("--n-way", type=positive_int, default=5)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup", type=nonnegative_int, default=200)
    p.add_argument("--next-weight", type=nonnegative_float, default=0.1)
    p.add_argument("--dim", type=positive_int, default=128)
    p.add_argument("--depth", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--image-summary", action="store_true", help="host option HostConfig.image_summary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--eval-every", type=positive_int, default=200)
    p.add_argument("--eval-episodes", type=positive_int, default=32)
    p.add_argument("--ckpt-every", type=positive_int, default=100)
    p.add_argument("--resume", action="store_true", help="continue exactly from DIR/last.pt")
    p.add_argument("--max-minutes", type=nonnegative_float, default=None, help="checkpoint and stop after this wall time")
    return p


def main(argv: list[str] | None = None) -> int:
    import time

    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ckpt, metrics = args.out / "last.pt", args.out / "metrics.jsonl"
    if args.resume and not ckpt.is_file():
        raise SystemExit(f"--resume given but {ckpt} does not exist")
    if not args.resume and ckpt.exists():
        raise SystemExit(f"{ckpt} exists: pass --resume to continue that run or choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        state = torch_load(ckpt, what="the training state written by apps.emloc.train", map_location=None)
        saved = state["args"]
        for k in ("batch_size", "demos", "n_way", "lr", "warmup", "next_weight", "dim", "depth", "heads", "kv_heads", "seed"):
            setattr(args, k, saved[k])
        args.image_summary = saved.get("image_summary", False)  # runs from before the option had none
        trainer = Trainer(args)
        trainer.load_state_dict(state)
        _trim_metrics(metrics, trainer.step)
        logger.info("resumed at step %d", trainer.step)
    else:
        trainer = Trainer(args)
        if metrics.exists():
            metrics.unlink()
    t0, base_seconds = time.monotonic(), trainer.seconds

    def checkpoint():
        trainer.seconds = base_seconds + time.monotonic() - t0
        torch_save_atomic(trainer.state_dict(), ckpt)
        trainer.model.save(args.out / "model.safetensors", metadata={"step": str(trainer.step)})

    with open(metrics, "a") as mf, tqdm(total=args.steps, initial=trainer.step, desc="meta-train") as bar:
        while trainer.step < args.steps:
            m = trainer.train_step()
            bar.update(1)
            rec = None
            if trainer.step % args.log_every == 0:
                rec = {"step": trainer.step, **m}
            if trainer.step % args.eval_every == 0 or trainer.step == args.steps:
                rec = {"step": trainer.step, **m, **trainer.evaluate(args.eval_episodes, args.demos)}
                logger.info("step %d: %s", trainer.step, {k: round(v, 3) for k, v in rec.items() if k.startswith("eval_")})
            if rec is not None:
                rec["elapsed_s"] = round(base_seconds + time.monotonic() - t0, 1)
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.2f}")
            stop = args.max_minutes is not None and time.monotonic() - t0 > 60 * args.max_minutes
            if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps or stop:
                mf.flush()
                checkpoint()
            if stop:
                logger.info("time limit reached at step %d; resume with --resume", trainer.step)
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
