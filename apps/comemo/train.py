"""Staged training of a CoMemo variant on the synthetic tasks: ``python -m apps.comemo.train``.

Stages (``--stage``; each later stage starts from the previous one with ``--init-from DIR/model.safetensors``):

==== ==================================================== =========================================
 0   text-only language modelling (question + answer text) decoder without its cross blocks
 1   alignment: vision encoder and LM frozen               projector + memory path (cross blocks, gates)
 2   LLM, vision encoder and gates frozen                  projector + memory path without its gates
 3   full fine-tuning                                      everything
==== ==================================================== =========================================

Stage 2 as CoMemo's released phase-2 script (the LLM and ViT stay frozen; the paper freezes the gates). Before
this, stage 2 trained everything but the gates. ``--freeze-gates`` keeps every gate at its initial 0 in every
stage: the memory path then changes nothing (its blocks get no gradient), the control that isolates it.

Samples are drawn on the fly: sample ``i`` of the run (counted over steps, ranks and the batch) comes from
its own seed (:func:`apps.comemo.synthetic.sample_seed`), with its task and image count (1..``--max-images``)
drawn from that seed, so a resumed run sees exactly the samples it would have seen. ``DIR/last.pt`` holds
model, optimizer, scheduler, step and RNG state (``--resume`` continues exactly); ``DIR/metrics.jsonl`` one
line per step (rank 0); ``DIR/model.safetensors`` the weights with the config; ``DIR/tokenizer.json`` the
tokenizer (trained at stage 0 or copied from the ``--init-from`` folder).

Runs under ``torchrun --nproc_per_node=K`` (DDP; gloo on CPU, NCCL on GPU): each rank draws its own samples.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shlex
import sys
import time
from pathlib import Path

import torch

from apps.comemo.batch import build_batch
from apps.comemo.model import (CROSS_PLACEMENTS, LEGACY_MEMORY, MEMORY_NORMS, MEMORY_QUERIES, VARIANTS, CoMemoConfig,
                               CoMemoModel, VisionConfig, lm_loss)
from apps.comemo.synthetic import TASKS, corpus_texts, make_sample, sample_seed
from apps.comemo.tokenizer import IMAGE_LABELS, CoMemoTokenizer, train_tokenizer
from core.infra.cli import (nonempty_path_obj, nonnegative_float, nonnegative_int, positive_float, positive_int,
                            run_cli, thread_count)
from core.infra.distributed import agreed_stop, finish
from core.infra.distributed import setup as distributed_setup
from core.infra.fileio import torch_load, torch_save_atomic, write_text_atomic
from core.infra.device import add_device_options, resolve_device
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["STAGES", "Trainer", "set_stage", "draw_examples", "parse_grid", "build_parser", "main"]

STAGES = (0, 1, 2, 3)
#: Arguments that define the run; on --resume they are taken from the checkpoint.
_RECIPE_KEYS = ("variant", "stage", "batch_size", "lr", "warmup", "weight_decay", "clip", "seed", "max_images",
                "tasks", "dim", "depth", "heads", "cross_every", "tile", "patch", "vision_dim", "vision_depth",
                "encoder", "encoder_kwargs", "min_images", "image_labels", "image_token_scale", "vision_lr_scale", "label_range",
                "mlp_ratio", "image_grid", "cross_placement", "memory_queries", "memory_norm", "freeze_gates")


def set_stage(model: CoMemoModel, stage: int, *, freeze_gates: bool = False) -> list[str]:
    """Set ``requires_grad`` for ``stage`` (see module docs); returns the names of the trained parameters.
    ``freeze_gates``: the tanh gates are never trained."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {list(STAGES)}")
    names = []
    for name, p in model.named_parameters():
        is_cross = name.startswith("decoder.cross.")
        is_gate = is_cross and name.endswith(("attn_gate", "ff_gate"))
        is_lm = name.startswith("decoder.") and not is_cross
        if stage == 0:
            train = is_lm
        elif stage == 1:
            train = name.startswith("projector.") or is_cross
        elif stage == 2:
            train = name.startswith("projector.") or (is_cross and not is_gate)
        else:
            train = True
        if is_gate and freeze_gates:
            train = False
        p.requires_grad_(train)
        if train:
            names.append(name)
    return names


_IMAGE_REF = re.compile(r"\bimage (\d+)\b")


def parse_grid(text: str) -> tuple[int, int]:
    """``"1x2"`` -> ``(1, 2)``; a clear error for anything else."""
    try:
        rows, cols = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"image grid must be RxC with positive ints (e.g. 1x2), got {text!r}") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"image grid must be RxC with positive ints (e.g. 1x2), got {text!r}")
    return rows, cols


def draw_examples(seed: int, start: int, count: int, *, max_images: int, tasks: list[str], tile: int,
                  text_only: bool = False, min_images: int = 1, label_range: int = 0,
                  image_grid: tuple[int, int] = (1, 1)) -> list[tuple]:
    """Samples ``start .. start+count-1`` of the stream ``seed`` as ``(images, question, answer)``, each with
    ``min_images..max_images`` images (drawn uniformly from the sample's seed).

    ``label_range`` > 0 (for prompts with image labels): the labels of a sample start at a number drawn
    uniformly so that they stay within ``1..label_range``, and every ``image K`` of the question and answer
    is renumbered alike; the items are then ``(images, question, answer, label_start)``. Answers then name
    labels up to ``label_range`` although a sample has at most ``max_images`` images.
    ``image_grid``: tiles per image of the needle task (:func:`apps.comemo.synthetic.make_sample`).
    """
    if not 1 <= min_images <= max_images:
        raise ValueError(f"need 1 <= min_images <= max_images, got min_images={min_images}, max_images={max_images}")
    if label_range and label_range < max_images:
        raise ValueError(f"label_range ({label_range}) must be 0 (off) or >= max_images ({max_images})")
    out = []
    for i in range(start, start + count):
        s_seed = sample_seed(seed, i)
        r = random.Random(s_seed)
        task = tasks[r.randrange(len(tasks))]
        n = r.randint(min_images, max_images)
        s = make_sample(task, n, s_seed, tile=tile, **({"image_grid": image_grid} if task == "needle" else {}))
        if not label_range:
            out.append(([] if text_only else s.images, s.question, s.answer))
            continue
        first = r.randint(1, label_range - n + 1)
        shift = lambda text: _IMAGE_REF.sub(lambda m: f"image {int(m.group(1)) + first - 1}", text)  # noqa: E731
        out.append(([] if text_only else s.images, shift(s.question), shift(s.answer), first))
    return out


def add_size_args(p: argparse.ArgumentParser) -> None:
    """The model-size options shared by this CLI and ``apps.comemo.vision_pretrain`` (same names, same defaults)."""
    p.add_argument("--dim", type=positive_int, default=128, help="decoder width")
    p.add_argument("--depth", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--heads", type=positive_int, default=4, help="decoder heads")
    p.add_argument("--mlp-ratio", type=positive_float, default=4.0,
                   help="decoder MLP width / dim (7 gives a context-only variant the parameters of the memory variants)")
    p.add_argument("--cross-every", type=positive_int, default=2,
                   help="a gated cross-attention block before every k-th layer")
    p.add_argument("--tile", type=positive_int, default=32, help="tile side in pixels")
    p.add_argument("--patch", type=positive_int, default=4, help="ViT patch side in pixels")
    p.add_argument("--vision-dim", type=positive_int, default=96, help="ViT width")
    p.add_argument("--vision-depth", type=positive_int, default=2, help="ViT blocks")
    p.add_argument("--vocab-size", type=positive_int, default=320, help="tokenizer size when one is trained here")
    p.add_argument("--cross-placement", default="reference", choices=CROSS_PLACEMENTS,
                   help="memory blocks before layer i with (i+1) %% k == 0 (reference) or before layers 0, k, 2k (first)")
    p.add_argument("--memory-queries", default="all", choices=MEMORY_QUERIES,
                   help="tokens that query the memory: every token (all, the reference) or text tokens only")
    p.add_argument("--memory-norm", default="shared", choices=MEMORY_NORMS,
                   help="one norm for text and memory (shared, the reference) or a separate memory LayerNorm (own)")


def model_config(args, vocab_size: int) -> CoMemoConfig:
    return CoMemoConfig(
        variant=args.variant, vocab_size=vocab_size, dim=args.dim, depth=args.depth, num_heads=args.heads, mlp_ratio=args.mlp_ratio,
        cross_every=args.cross_every, image_labels=args.image_labels, image_token_scale=args.image_token_scale,
        cross_placement=args.cross_placement, memory_queries=args.memory_queries, memory_norm=args.memory_norm,
        vision=VisionConfig(tile=args.tile, patch=args.patch, dim=args.vision_dim, depth=args.vision_depth,
                            encoder=args.encoder, encoder_weights=None if args.encoder_weights is None else str(args.encoder_weights),
                            encoder_kwargs=json.loads(args.encoder_kwargs)),
    )


class Trainer:
    """Model, optimizer and counters of one run; ``train_step() -> dict`` and a full ``state_dict``."""

    def __init__(self, args: argparse.Namespace, tok: CoMemoTokenizer, *, rank: int = 0, world: int = 1,
                 device: torch.device | None = None) -> None:
        self.args, self.tok = args, tok
        self.rank, self.world = rank, world
        self.device = device or torch.device("cpu")
        torch.manual_seed(args.seed)
        self.model = CoMemoModel(model_config(args, tok.vocab_size)).to(self.device)
        self.step = 0
        self.samples_seen = 0
        self.wall_time = 0.0
        self.commands: list[dict] = []
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        self.trained = set_stage(self.model, self.args.stage, freeze_gates=getattr(self.args, "freeze_gates", False))
        self.ddp_model: torch.nn.Module = self.model
        if self.world > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        vision = [p for n, p in self.model.named_parameters() if p.requires_grad and n.startswith("vision.")]
        rest = [p for n, p in self.model.named_parameters() if p.requires_grad and not n.startswith("vision.")]
        scale = getattr(self.args, "vision_lr_scale", 1.0)  # a pretrained ViT (stage -1) can move slower
        if scale == 1.0:  # one group, as before the option (checkpoints of that time resume)
            groups = [{"params": [p for p in self.model.parameters() if p.requires_grad], "lr": self.args.lr}]
        else:
            groups = [g for g in ({"params": rest, "lr": self.args.lr}, {"params": vision, "lr": self.args.lr * scale})
                      if g["params"]]
        self.opt = torch.optim.AdamW(groups, lr=self.args.lr, weight_decay=self.args.weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up then cosine decay to 10% over ``--steps``."""
        a = self.args
        if step < a.warmup:
            return (step + 1) / a.warmup
        frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    def init_from(self, path: Path, prefixes: list[str] | None = None) -> None:
        """Weights of another run (any variant): matching keys (those starting with one of ``prefixes``, if
        given) are loaded, the rest keeps its initialisation."""
        src = CoMemoModel.load(path)
        own = self.model.state_dict()
        shared = {k: v for k, v in src.state_dict().items() if k in own and own[k].shape == v.shape
                  and (not prefixes or k.startswith(tuple(prefixes)))}
        self.model.load_state_dict(shared, strict=False)
        fresh = sorted(set(own) - set(shared))
        if fresh:
            logger.info("initialised from %s; %d tensors keep their initialisation (e.g. %s)", path, len(fresh), fresh[:3])

    def examples(self, step: int, rank: int) -> list[tuple]:
        a = self.args
        start = (step * self.world + rank) * a.batch_size
        return draw_examples(a.seed, start, a.batch_size, max_images=a.max_images, tasks=a.tasks, tile=a.tile,
                             text_only=a.stage == 0, min_images=a.min_images, label_range=a.label_range,
                             image_grid=parse_grid(a.image_grid))

    def train_step(self) -> dict[str, float]:
        self.model.train()
        batch = build_batch(self.examples(self.step, self.rank), self.tok, self.model.cfg,
                            label_prompt=self.args.stage == 0).to(self.device)
        out = self.ddp_model(batch)
        loss, metrics = lm_loss(out.logits, batch.labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.args.clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.samples_seen += self.args.batch_size * self.world
        return {**metrics, "grad_norm": float(gn), "lr": self.sched.get_last_lr()[0], "tokens": int(batch.input_ids.numel())}

    @torch.no_grad()
    def validate(self, examples: list[tuple]) -> dict[str, float]:
        self.model.eval()
        losses, accs = [], []
        for i in range(0, len(examples), self.args.batch_size):
            b = build_batch(examples[i:i + self.args.batch_size], self.tok, self.model.cfg,
                            label_prompt=self.args.stage == 0).to(self.device)
            _, m = lm_loss(self.model(b).logits, b.labels)
            losses.append(m["loss"])
            accs.append(m["token_acc"])
        return {"val_loss": sum(losses) / len(losses), "val_token_acc": sum(accs) / len(accs)}

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "step": self.step, "samples_seen": self.samples_seen, "wall_time": self.wall_time, "world": self.world,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "args": vars(self.args).copy(),
            "commands": self.commands, "config": self.model.cfg.to_json(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.samples_seen, self.wall_time = state["step"], state["samples_seen"], state["wall_time"]
        self.commands = list(state.get("commands", []))
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, help=f"one of {', '.join(VARIANTS)}")
    p.add_argument("--stage", type=int, required=True, help="0 text-only LM, 1 projector + memory path, 2 gates frozen, 3 all")
    p.add_argument("--out", type=nonempty_path_obj, required=True,
                   help="run folder (last.pt, metrics.jsonl, model.safetensors, tokenizer.json)")
    p.add_argument("--init-from", type=Path, help="weights of a previous stage (its tokenizer.json must lie beside it)")
    p.add_argument("--init-only", nargs="+", metavar="PREFIX",
                   help="with --init-from: load only the tensors whose names start with these prefixes (e.g. vision.)")
    p.add_argument("--freeze-gates", action="store_true",
                   help="keep every memory gate at 0 in every stage (the control that isolates the memory path)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps of this stage")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step and rank")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--vision-lr-scale", type=nonnegative_float, default=1.0,
                   help="factor on --lr for the vision encoder (e.g. 0.1 to keep a stage -1 ViT close to its weights)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay")
    p.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clip")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the sample stream")
    p.add_argument("--max-images", type=positive_int, default=8, help="train on 1..N images per sample")
    p.add_argument("--min-images", type=positive_int, default=1, help="train on --min-images..--max-images images per sample")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="tasks to train on")
    p.add_argument("--image-labels", default="none", choices=IMAGE_LABELS,
                   help="a text label 'image K' before (InternVL's layout) or after each image in the prompt")
    p.add_argument("--label-range", type=nonnegative_int, default=0,
                   help="with --image-labels: number a sample's labels from a random start within 1..N (0: from 1)")
    p.add_argument("--image-grid", default="1x1", metavar="RxC",
                   help="tiles per image of the needle task: RxC gives high-resolution needles (rows x cols tiles "
                        "each, the digit in one tile; with RoPE-DHR an image keeps one tile's ids); 1x1: one tile")
    p.add_argument("--image-token-scale", type=positive_float, default=1.0,
                   help="factor on the projected image tokens (they start ~10x the norm of token embeddings)")
    add_size_args(p)
    p.add_argument("--encoder", default="vit", help="vision encoder: vit (built here), timm:<name> or open_clip:<name>")
    p.add_argument("--encoder-weights", type=Path, help="local weights file of a timm/open_clip encoder")
    p.add_argument("--encoder-kwargs", default="{}", help='JSON constructor kwargs of the encoder, e.g. \'{"img_size": 32}\'')
    p.add_argument("--val-every", type=int, default=50, help="validation loss every N steps")
    p.add_argument("--val-samples", type=positive_int, default=32, help="fixed validation samples (seed stream 10**6 + seed)")
    p.add_argument("--ckpt-every", type=int, default=50, help="write last.pt every N steps")
    p.add_argument("--max-minutes", type=nonnegative_float, help="stop (and checkpoint) after this many minutes")
    p.add_argument("--threads", type=thread_count, help="torch CPU threads")
    add_device_options(p, dtype=False)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _tokenizer(args) -> CoMemoTokenizer:
    if args.init_from is not None:
        path = args.init_from.parent / "tokenizer.json"
        if not path.is_file():
            raise SystemExit(f"--init-from {args.init_from}: no tokenizer.json beside it")
        return CoMemoTokenizer.load(path)
    if (args.out / "tokenizer.json").is_file():
        return CoMemoTokenizer.load(args.out / "tokenizer.json")
    return train_tokenizer(corpus_texts(), vocab_size=args.vocab_size)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_device(args.device)  # a missing GPU is one line before any work
    check_outputs([("--out", args.out)], inputs=[args.init_from, args.encoder_weights])
    if args.encoder_weights is not None:
        if not args.encoder_weights.is_file():
            raise FileNotFoundError(f"--encoder-weights {str(args.encoder_weights)!r} is not a file; give the local "
                                    "weights of the --encoder")
        if args.encoder == "vit":
            raise SystemExit("--encoder-weights needs --encoder timm:<name> or open_clip:<name> (the vit encoder is "
                             "built here)")
    if args.variant not in VARIANTS:
        raise SystemExit(f"unknown --variant {args.variant!r}; choose one of {list(VARIANTS)}")
    if args.stage not in STAGES:
        raise SystemExit(f"unknown --stage {args.stage}; choose one of {list(STAGES)}")
    if args.label_range and args.image_labels == "none":
        raise SystemExit("--label-range needs --image-labels before or after (there are no labels to number)")
    if args.label_range and args.label_range < args.max_images:
        raise SystemExit(f"--label-range ({args.label_range}) must be 0 or >= --max-images ({args.max_images})")
    try:
        parse_grid(args.image_grid)
    except ValueError as e:
        raise SystemExit(f"--image-grid: {e}") from None
    if not args.vision_lr_scale >= 0:
        raise SystemExit(f"--vision-lr-scale must be >= 0, got {args.vision_lr_scale}")
    for name in ("steps", "batch_size", "max_images", "min_images", "val_every", "val_samples", "ckpt_every", "warmup"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    out: Path = args.out
    last = out / "last.pt"
    state = None
    if args.resume:
        if not last.is_file():
            raise SystemExit(f"--resume given but {last} does not exist")
        state = torch_load(last, what="the training state written by apps.comemo.train")
        for key in _RECIPE_KEYS:
            if key in LEGACY_MEMORY and key not in state["args"]:  # a checkpoint from before the layout options
                setattr(args, key, LEGACY_MEMORY[key])
            old = state["args"].get(key)
            if old is not None and old != getattr(args, key):
                logger.warning("--%s %s ignored: the resumed run uses %s", key.replace("_", "-"), getattr(args, key), old)
                setattr(args, key, old)
    elif last.exists():
        raise SystemExit(f"{last} exists: pass --resume to continue that run or choose another --out")
    rank, world, device = distributed_setup(args.device)
    tok = _tokenizer(args)
    trainer = Trainer(args, tok, rank=rank, world=world, device=device)
    if state is not None:
        trainer.load_state_dict(state)
        logger.info("resumed from %s at step %d", last, trainer.step)
    elif args.init_from is not None:
        trainer.init_from(args.init_from, args.init_only)
    command = "python -m apps.comemo.train " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    trainer.commands.append({"from_step": trainer.step, "command": command})
    metrics_path = out / "metrics.jsonl"
    val_examples = []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        tok.save(out / "tokenizer.json")
        if metrics_path.exists():  # drop records of steps after the checkpoint (a stop between checkpoints)
            lines = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= trainer.step]
            write_text_atomic(metrics_path, "".join(ln + "\n" for ln in lines))
        val_examples = draw_examples(10**6 + args.seed, 0, args.val_samples, max_images=args.max_images,
                                     tasks=args.tasks, tile=args.tile, text_only=args.stage == 0,
                                     min_images=args.min_images)
    logger.info("variant %s stage %d: %d trained tensors, %d parameters in all", args.variant, args.stage,
                len(trainer.trained), sum(p.numel() for p in trainer.model.parameters()))
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=trainer.step, desc=f"comemo {args.variant} stage {args.stage}", dynamic_ncols=True)
    t_start = t_last = time.time()
    try:
        while trainer.step < args.steps:
            if args.max_minutes is not None and agreed_stop(time.time() - t_start >= 60 * args.max_minutes, device):
                logger.info("stopping after --max-minutes %.1f at step %d", args.max_minutes, trainer.step)
                break
            m = trainer.train_step()
            now = time.time()
            trainer.wall_time += now - t_last
            t_last = now
            if rank != 0:
                continue
            rec = {"step": trainer.step, "samples_seen": trainer.samples_seen, "wall_time_s": round(trainer.wall_time, 2),
                   **m, "gates": trainer.model.gates()}
            if trainer.step % args.val_every == 0 or trainer.step == args.steps:
                rec.update(trainer.validate(val_examples))
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps:
                torch_save_atomic(trainer.state_dict(), last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['token_acc']:.3f}")
    finally:
        if rank == 0:
            torch_save_atomic(trainer.state_dict(), last)
            trainer.model.save(out / "model.safetensors", metadata={
                "variant": args.variant, "stage": str(args.stage), "step": str(trainer.step),
                "commands": json.dumps(trainer.commands)})
        if bar is not None:
            bar.close()
    finish()  # only after a clean finish: after a failure the launcher stops the other ranks
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
