"""Pretrain TabICL on the synthetic prior: ``python -m tabular.pretrain --out runs/tabicl_small``.

Each step draws ``--batch-size`` fresh tables from :class:`tabular.prior.TablePrior` (per process), with a
curriculum over table sizes (see :func:`curriculum`), and minimises the cross-entropy of the test rows (logits of
classes a table does not have are masked). AdamW, linear warm-up then constant learning rate (or cosine with
``--cosine``), gradient-norm clipping. Every ``--ckpt-every`` steps a full-state checkpoint (model, optimizer,
scheduler, step, tables seen, wall time, every RNG) is written atomically to ``OUT/last.pt``; ``--resume``
continues from it exactly. Every ``--val-every`` steps the model is scored on a fixed held-out set of prior
tables; the best one is written to ``OUT/best.safetensors`` (and to ``--export`` with a model card beside it).
Metrics go to ``OUT/metrics.jsonl``.

Runs under ``torchrun --nproc_per_node=K`` (DDP; gloo on CPU, NCCL on GPU): each process draws its own tables
(seed + rank), gradients are averaged, rank 0 writes files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.infra.cli import (fraction, nonempty_path_obj, nonnegative_float, nonnegative_int, positive_float,
                            positive_int, run_cli, thread_count)
from core.infra.distributed import agreed_stop, finish
from core.infra.distributed import setup as distributed_setup
from core.infra.fileio import check_writable, torch_load, torch_save_atomic
from core.infra.device import add_device_options, resolve_device
from core.infra.guard import check_outputs
from tabular.model import CONFIGS, TabICL, TabICLConfig
from tabular.prior import PriorConfig, TablePrior
from tabular.weights_io import atomic_write_text, load_model, save_model

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "curriculum", "masked_loss", "Trainer", "evaluate"]


#: The curriculum's warm-up prior (see ``--easy-steps``).
EASY_PRIOR = PriorConfig(p_binary=0.7, max_classes=4, p_tree=0.2, p_categorical=0.1, p_missing_table=0.1,
                         p_rank_classes=1.0, min_layers=1, max_layers=2, max_noise=0.05, max_causes=4)


@dataclass(kw_only=True)
class Stage:
    """One curriculum stage: from ``start`` step on, tables have rows in [min_rows, max_rows]."""

    start: int  # first step of the stage
    min_rows: int  # fewest rows per table
    max_rows: int  # most rows per table
    max_features: int  # most features per table


def curriculum(step: int, scale: float = 1.0) -> Stage:
    """Table sizes for ``step``: small tables first, then longer and wider ones.

    The published recipe trains at 1,024 rows and then up to 40K rows; on CPU we start lower. ``scale``
    stretches the stage boundaries (e.g. ``scale=0.001`` in tests).
    """
    stages = [
        Stage(start=0, min_rows=64, max_rows=256, max_features=20),
        Stage(start=int(3000 * scale), min_rows=128, max_rows=512, max_features=40),
        Stage(start=int(20000 * scale), min_rows=256, max_rows=1024, max_features=100),
    ]
    current = stages[0]
    for s in stages:
        if step >= s.start:
            current = s
    return current


def masked_loss(logits: torch.Tensor, y: torch.Tensor, n_classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and accuracy of test rows; logits of classes ``>= n_classes[b]`` are masked out.

    Args:
        logits: ``(B, T, C)``; y: ``(B, T)``; n_classes: ``(B,)``.
    """
    C = logits.shape[-1]
    invalid = torch.arange(C, device=logits.device)[None, None, :] >= n_classes[:, None, None]
    logits = logits.masked_fill(invalid, float("-inf"))
    loss = F.cross_entropy(logits.reshape(-1, C), y.reshape(-1))
    acc = (logits.argmax(-1) == y).float().mean()
    return loss, acc


def _draw_sizes(rng: random.Random, stage: Stage, max_classes: int) -> tuple[int, int, int]:
    n_rows = rng.randint(stage.min_rows, stage.max_rows)
    frac = rng.uniform(0.5, 0.9)
    n_train = min(max(max_classes, int(n_rows * frac)), n_rows - 1)
    n_features = rng.randint(min(2, stage.max_features), stage.max_features)
    return n_rows, n_train, n_features


def validation_set(n_tables: int = 64, seed: int = 1_000_003, max_classes: int = 10, max_rows: int = 1024) -> list:
    """Fixed held-out prior tables (different seed from training): 8 batches of 128..1024 rows (capped)."""
    prior = TablePrior(PriorConfig(max_classes=max_classes), seed=seed)
    rng = random.Random(seed)
    batches = []
    per = max(1, n_tables // 8)
    for i in range(8):
        n_rows = max(2 * max_classes + 2, min(max_rows, [128, 256, 512, 1024][i % 4]))
        n_train = n_rows // 2 + n_rows // 4
        batches.append(prior.sample(per, n_rows, n_train, n_features=rng.randint(2, 40)))
    return batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, device: torch.device) -> dict[str, float]:
    """Mean test-row loss and accuracy over the validation batches."""
    was_training = model.training
    model.eval()
    losses, accs = [], []
    for b in batches:
        b = b.to(device)
        logits = model(b.X, b.y[:, : b.n_train])
        loss, acc = masked_loss(logits, b.y[:, b.n_train :], b.n_classes)
        losses.append(loss.item())
        accs.append(acc.item())
    model.train(was_training)
    return {"val_loss": float(np.mean(losses)), "val_acc": float(np.mean(accs))}


# Optional readouts of the config, and the ICL-stage projection each one adds (zero-initialised when added).
_READOUTS = {"icl_ridge": "ridge_proj", "icl_logistic": "logit_proj"}


class Trainer:
    """Owns model, optimizer, prior and counters; ``train_step() -> dict`` and a full ``state_dict``."""

    def __init__(self, args: argparse.Namespace, *, rank: int = 0, world: int = 1, device: torch.device | None = None) -> None:
        self.args = args
        self.rank, self.world = rank, world
        self.device = device or torch.device("cpu")
        self.model_config: TabICLConfig = CONFIGS[args.config]()
        for name in _READOUTS:
            if getattr(args, name, None):
                self.model_config = dataclasses.replace(self.model_config, **{name: tuple(getattr(args, name))})
        torch.manual_seed(args.seed)
        self.model = TabICL(self.model_config).to(self.device)
        self.ddp_model: torch.nn.Module = self.model
        if world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.prior = TablePrior(PriorConfig(max_classes=self.model_config.max_classes, p_factor=args.p_factor),
                                seed=args.seed * 1000 + rank, device=self.device)
        # Warm-up stage of the curriculum (first --easy-steps steps): shallow, low-noise SCMs, mostly binary,
        # balanced classes; lets the model learn to read labels before the full prior's harder tables.
        self.easy_prior = TablePrior(EASY_PRIOR, seed=args.seed * 1000 + rank + 500, device=self.device)
        self.size_rng = random.Random(args.seed)  # same on every rank: all ranks use one table size per step
        self.step = 0
        self.tables_seen = 0
        self.wall_time = 0.0
        self.best_val_loss = math.inf  # the selection score: val loss, or -val accuracy with --select acc
        self.best_step = -1
        self.val_signature = _val_signature(args)
        # Every invocation that trained this run, with the step it started from (a resume may change
        # runtime options such as --max-features, so one command does not describe the run).
        self.commands: list[dict] = []
        self.max_features_seen: int | None = 0  # widest table trained on (None: unknown, from an older checkpoint)

    def _lr_factor(self, step: int) -> float:
        warm = max(1, self.args.warmup)
        f = min(1.0, (step + 1) / warm)
        if self.args.cosine and self.args.steps > warm:
            t = min(1.0, max(0.0, (step - warm) / (self.args.steps - warm)))
            f *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
        if self.args.anneal_from is not None and step >= self.args.anneal_from:
            # Warmup-stable-decay: a branch of the run decays the rate linearly to zero over --anneal-steps.
            f *= max(0.0, 1.0 - (step - self.args.anneal_from) / self.args.anneal_steps)
        return f

    def stage(self) -> Stage:
        """The curriculum stage of the current step with the runtime size options applied."""
        stage = curriculum(self.step, self.args.curriculum_scale)
        if self.args.max_rows is not None:
            stage.max_rows = min(stage.max_rows, self.args.max_rows)
            stage.min_rows = min(stage.min_rows, stage.max_rows)
        if self.args.feature_bound is not None:
            stage.max_features = self.args.feature_bound
        if self.args.max_features is not None:
            stage.max_features = min(stage.max_features, self.args.max_features)
        return stage

    def train_step(self) -> dict[str, float]:
        stage = self.stage()
        n_rows, n_train, n_features = _draw_sizes(self.size_rng, stage, self.model_config.max_classes)
        prior = self.easy_prior if self.step < self.args.easy_steps else self.prior
        batch = prior.sample(self.args.batch_size, n_rows, n_train, n_features=n_features)
        n_rows, n_train, n_features = batch.X.shape[1], batch.n_train, batch.X.shape[2]
        if self.max_features_seen is not None:
            self.max_features_seen = max(self.max_features_seen, n_features)
        logits = self.ddp_model(batch.X, batch.y[:, :n_train])
        loss, acc = masked_loss(logits, batch.y[:, n_train:], batch.n_classes)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.tables_seen += self.args.batch_size * self.world
        return {"loss": loss.item(), "acc": acc.item(), "grad_norm": float(gnorm), "lr": self.sched.get_last_lr()[0],
                "rows": n_rows, "features": n_features}

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "model_config": self.model_config.to_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": self.step,
            "tables_seen": self.tables_seen,
            "wall_time": self.wall_time,
            "best_val_loss": self.best_val_loss,
            "best_step": self.best_step,
            "val_signature": self.val_signature,
            "prior_rng": self.prior.get_state(),
            "easy_prior_rng": self.easy_prior.get_state(),
            "size_rng": self.size_rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "args": vars(self.args),
            "world": self.world,
            "commands": self.commands,
            "max_features_seen": self.max_features_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        if TabICLConfig(**state["model_config"]).to_dict() != self.model_config.to_dict():  # older: no readouts
            raise ValueError(f"checkpoint config {state['model_config']} differs from --config {self.args.config!r}"
                             f"{self._readout_flags()}")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.max_features_seen = state.get("max_features_seen")
        self.tables_seen = state["tables_seen"]
        self.wall_time = state["wall_time"]
        self.commands = list(state.get("commands") or [
            {"from_step": 0, "command": "not recorded: this run began before invocations were recorded"}])
        if state.get("val_signature") == self.val_signature:
            self.best_val_loss = state["best_val_loss"]
            self.best_step = state["best_step"]
        else:  # another validation set or selection rule: earlier scores are not comparable, start the best anew
            logger.warning("validation set / selection changed (%s -> %s): best checkpoint selection restarts",
                           state.get("val_signature"), self.val_signature)
        if state.get("world", 1) == self.world:
            self.prior.set_state(state["prior_rng"])  # per-rank streams differ; rank 0's state restores rank 0 exactly
            if "easy_prior_rng" in state:
                self.easy_prior.set_state(state["easy_prior_rng"])
        self.size_rng.setstate(state["size_rng"])
        torch.set_rng_state(state["torch_rng"])

    def _readout_flags(self) -> str:
        """This run's readout options as command-line flags, for error messages."""
        return "".join(f" --{name.replace('_', '-')} {' '.join(map(str, getattr(self.model_config, name))) or '(none)'}"
                       for name in _READOUTS)

    def init_from_weights(self, path: Path) -> None:
        """Start the trainer from exported weights (a run's ``best``/``last`` ``.safetensors``, well under the size of
        a full ``last.pt``): the model, and the step, tables seen, wall time, widest table and invocations of its card,
        so the curriculum and the rate schedule continue where that run was; the optimizer state starts fresh."""
        src = load_model(path, device=self.device)
        # readouts the weights lack and this run asks for are added (zero-initialised, so the function is unchanged)
        added = [name for name in _READOUTS if not getattr(src.config, name) and getattr(self.model_config, name)]
        want = dataclasses.replace(self.model_config, **{name: () for name in added})
        if src.config.to_dict() != want.to_dict():
            raise ValueError(f"{path} holds a {src.config.to_dict()} model, not --config {self.args.config!r}"
                             f"{self._readout_flags()}")
        missing, unexpected = self.model.load_state_dict(src.state_dict(), strict=not added)
        prefixes = tuple(f"icl.{_READOUTS[name]}." for name in added)
        if added and (unexpected or any(not k.startswith(prefixes) for k in missing)):
            raise ValueError(f"{path}: unexpected weights {unexpected} or missing {missing} when adding {added}")
        for name in added:
            logger.info("added the %s readout %s (zero-initialised) to the weights of %s", name.removeprefix("icl_"),
                        getattr(self.model_config, name), path)
        card = src.card
        self.step, self.tables_seen = int(card.get("step") or 0), int(card.get("tables_seen") or 0)
        self.wall_time = float(card.get("wall_time_s") or 0.0)
        self.max_features_seen = card.get("pretrained_max_features")
        self.commands = list(card.get("commands") or [])
        # the rate of the run's schedule at this step
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor, last_epoch=self.step - 1)


def _val_signature(args) -> dict:
    return {"val_tables": args.val_tables, "val_max_rows": args.val_max_rows, "select": args.select}


def _data_line(args) -> str:
    """What this invocation trained on, for the card."""
    p = float(getattr(args, "p_factor", 0.0) or 0.0)
    mix = "70% MLP-SCM, 30% tree-SCM" if p == 0 else f"{100 - 30 - 100 * p:g}% MLP-SCM, 30% tree-SCM, {100 * p:g}% factor-SCM"
    return (f"synthetic tables from tabular.prior.TablePrior ({mix}), fresh every step; "
            f"the first {args.easy_steps} steps from the easy warm-up prior tabular.pretrain.EASY_PRIOR")


def model_card(trainer: Trainer, val: dict[str, float], command: str) -> dict:
    """The card written beside an exported checkpoint."""
    n_params = sum(p.numel() for p in trainer.model.parameters())
    return {
        "model": f"TabICL ({trainer.args.config})",
        "config": trainer.model_config.to_dict(),
        "parameters": n_params,
        "command": command,
        "commands": trainer.commands,  # every invocation of the run, with the step it started from
        "data": _data_line(trainer.args),
        "step": trainer.step,
        "tables_seen": trainer.tables_seen,
        "pretrained_max_features": trainer.max_features_seen,  # TabICLClassifier warns on wider tables
        "wall_time_s": round(trainer.wall_time, 1),
        "processes": trainer.world,
        "validation_on_held_out_prior": val,
        "validation_set": (f"tabular.pretrain.validation_set(): {trainer.args.val_tables} full-prior tables, seed 1000003, "
                           f"128-1024 rows capped at {trainer.args.val_max_rows}, 2-40 features; best by val {trainer.args.select}"),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tabular.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model size")
    p.add_argument("--out", type=nonempty_path_obj, default=Path("runs/tabicl_small"),
                   help="run folder (checkpoints, metrics)")
    p.add_argument("--steps", type=positive_int, default=100_000, help="stop after this many optimizer steps")
    p.add_argument("--max-minutes", type=nonnegative_float, default=None,
                   help="stop after this much wall time (this invocation)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="tables per step per process")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay")
    p.add_argument("--warmup", type=nonnegative_int, default=500, help="linear warm-up steps")
    p.add_argument("--cosine", action="store_true", help="cosine decay to 10%% of the peak at --steps")
    p.add_argument("--anneal-from", type=nonnegative_int, default=None,
                   help="from this step on, decay the rate linearly to zero over --anneal-steps (run it on a copy "
                        "of the run's last.pt, with --steps at the end of the decay)")
    p.add_argument("--anneal-steps", type=int, default=500, help="length of the --anneal-from decay")
    p.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--seed", type=int, default=0, help="seed of model init, prior and sizes")
    p.add_argument("--curriculum-scale", type=positive_float, default=1.0, help="stretch factor of the curriculum stages")
    p.add_argument("--easy-steps", type=nonnegative_int, default=1500, help="warm-up steps on the easy prior (EASY_PRIOR)")
    p.add_argument("--max-rows", type=positive_int, default=None, help="cap on rows per table (overrides the curriculum)")
    p.add_argument("--max-features", type=int, default=None,
                   help="cap on features per table (only lowers the curriculum's bound)")
    p.add_argument("--feature-bound", type=int, default=None,
                   help="most features per table, replacing the curriculum's bound (raises it too)")
    p.add_argument("--icl-ridge", type=nonnegative_float, nargs="+", default=None, metavar="ALPHA",
                   help="add the in-context ridge readout with these penalties to the model (tabular.model; "
                        "with --init-from from weights without it, the readout starts at zero)")
    p.add_argument("--icl-logistic", type=nonnegative_float, nargs="+", default=None, metavar="ALPHA",
                   help="add the in-context logistic readout (tabular.readout) with these penalties to the model; "
                        "like --icl-ridge, it starts at zero when added with --init-from")
    p.add_argument("--p-factor", type=fraction, default=0.0,
                   help="share of factor-SCM tables in the full prior (tabular.prior; taken from the MLP share)")
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between full-state checkpoints")
    p.add_argument("--val-every", type=int, default=500, help="steps between validations (and best exports)")
    p.add_argument("--val-tables", type=positive_int, default=64, help="held-out prior tables for validation")
    p.add_argument("--val-max-rows", type=positive_int, default=512,
                   help="row cap of the validation tables (fixed, independent of the training caps)")
    p.add_argument("--select", choices=("acc", "loss"), default="acc",
                   help="which validation score picks the best checkpoint (accuracy, or log-loss)")
    p.add_argument("--export", type=nonempty_path_obj, default=None,
                   help="also write the best model here (.safetensors + card)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start a new run folder from exported weights (.safetensors written by this script): model, "
                        "step and tables seen from its card; fresh optimizer state")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads per process")
    add_device_options(p, dtype=False)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


#: Arguments that define the recipe; on --resume they are taken from the checkpoint.
_RECIPE_KEYS = ("batch_size", "lr", "weight_decay", "warmup", "cosine", "clip", "seed", "curriculum_scale", "easy_steps")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_device(args.device)  # a missing GPU is one line before any work
    check_outputs([("--out", args.out), ("--export", args.export)], inputs=[args.init_from])
    if args.export is not None:
        check_writable(args.export, what="--export")
    for name in ("steps", "batch_size", "ckpt_every", "val_every", "val_tables", "val_max_rows", "anneal_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_features", "feature_bound"):  # the prior draws 2..100 features
        v = getattr(args, name)
        if v is not None and not 2 <= v <= 100:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [2, 100], got {v}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world, device = distributed_setup(args.device)
    out: Path = args.out
    trainer = Trainer(args, rank=rank, world=world, device=device)
    last = out / "last.pt"
    if args.resume:
        if not last.is_file():
            raise SystemExit(f"--resume given but {last} does not exist")
        state = torch_load(last, what="the training state written by tabular.pretrain", map_location=device)
        # The run's recipe comes from the checkpoint, so a resumed run continues the same schedule.
        for key in _RECIPE_KEYS:
            old = state["args"].get(key)
            if old is not None and old != getattr(args, key):
                logger.warning("--%s %s ignored: the resumed run uses %s", key.replace("_", "-"), getattr(args, key), old)
                setattr(args, key, old)
        trainer.load_state_dict(state)
        logger.info("resumed from %s at step %d (%d tables seen)", last, trainer.step, trainer.tables_seen)
    elif last.exists() and rank == 0:
        raise SystemExit(f"{last} exists: pass --resume to continue that run or choose another --out")
    if args.init_from is not None:
        if args.resume:
            raise SystemExit("--init-from starts a new run folder; it cannot be combined with --resume")
        trainer.init_from_weights(args.init_from)
        logger.info("initialised from %s at step %d (%d tables seen)", args.init_from, trainer.step, trainer.tables_seen)
    command = "python -m tabular.pretrain " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    trainer.commands.append({"from_step": trainer.step, "command": command})
    val_batches = []
    if rank == 0:
        val_batches = validation_set(args.val_tables, max_classes=trainer.model_config.max_classes,
                                     max_rows=args.val_max_rows)
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if metrics_path.exists():  # drop records of steps after the checkpoint (a stop between checkpoints)
            lines = metrics_path.read_text().splitlines()
            kept = [(ln, rec) for ln in lines if ln and (rec := json.loads(ln))["step"] <= trainer.step]
            if len(kept) != len(lines):
                atomic_write_text(metrics_path, "".join(ln + "\n" for ln, _ in kept))
            recs = [rec for _, rec in kept]
            if trainer.max_features_seen is None and recs:  # older checkpoint: the log has every step's width
                if {r["step"] for r in recs} == set(range(1, trainer.step + 1)) and all("features" in r for r in recs):
                    trainer.max_features_seen = max(r["features"] for r in recs)
    # SIGTERM / SIGINT end a one-process run after the current step, which the final checkpoint then holds.
    # (Not under DDP: ranks could stop at different steps and hang in a collective; torchrun's own shutdown
    # applies, and the run resumes from its last periodic checkpoint.)
    stop_requested: list[int] = []
    previous_handlers = {}
    if world == 1 and threading.current_thread() is threading.main_thread():
        previous_handlers = {sig: signal.signal(sig, lambda signum, frame: stop_requested.append(signum))
                             for sig in (signal.SIGTERM, signal.SIGINT)}
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=trainer.step, desc="pretrain", dynamic_ncols=True)
    t_start = time.time()
    t_last = t_start
    try:
        while trainer.step < args.steps:
            if stop_requested:
                logger.info("stopping on signal %d at step %d", stop_requested[0], trainer.step)
                break
            if args.max_minutes is not None and agreed_stop(time.time() - t_start > 60 * args.max_minutes, device):
                logger.info("stopping after --max-minutes %.1f", args.max_minutes)
                break
            m = trainer.train_step()
            now = time.time()
            trainer.wall_time += now - t_last
            t_last = now
            if rank != 0:
                continue
            rec = {"step": trainer.step, "tables_seen": trainer.tables_seen, "wall_time_s": round(trainer.wall_time, 2), **m}
            if trainer.step % args.val_every == 0 or trainer.step == args.steps:
                val = evaluate(trainer.model, val_batches, device)
                rec.update(val)
                score = val["val_loss"] if args.select == "loss" else -val["val_acc"]
                if score < trainer.best_val_loss:
                    trainer.best_val_loss, trainer.best_step = score, trainer.step
                    card = model_card(trainer, val, command)
                    save_model(trainer.model, out / "best.safetensors", extra=card)
                    atomic_write_text(out / "best.json", json.dumps(card, indent=2) + "\n")
                    if args.export is not None:
                        save_model(trainer.model, args.export, extra=card)
                        atomic_write_text(args.export.with_suffix(".json"), json.dumps(card, indent=2) + "\n")
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps:
                torch_save_atomic(trainer.state_dict(), last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", rows=m["rows"])
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if rank == 0:
            torch_save_atomic(trainer.state_dict(), last)
            # The weights alone (a quarter of last.pt, no optimizer state): what --init-from starts from.
            save_model(trainer.model, out / "last.safetensors", extra=model_card(trainer, {}, command))
        if bar is not None:
            bar.close()
    finish()  # only after a clean finish (see core.infra.distributed)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
