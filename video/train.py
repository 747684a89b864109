"""Train the video QA model (frame encoder + Q-former + answer head) on short synthetic clips.

Clips of 16 or 32 frames are rendered on the fly (:mod:`video.synthetic`), split into 1, 2 or 4 chunks
that the Q-former reads independently (no memory: the ∞-Video memory is added at inference without
retraining, as published), and every question about each clip is answered from one read (20 per clip)
through the answer head's read-out (``--aggregate``: ``mean`` over chunks or the ``last`` chunk, both of
a fixed size). ``--memory-in-loop`` instead reads the chunks in order through the continuous long-term
memory (a model trained with the memory, not the published recipe). ``--init-from`` starts from other
weights (tensors of the same shape are copied; new question types get fresh embeddings). Resumable:
``--out DIR`` holds ``checkpoint.pt`` (model, optimizer, scheduler, step, RNG state); rerunning the same
command continues where it stopped. The best model by validation accuracy is exported as safetensors + a
JSON model card.

    python -m video.train --out runs/videoqa --steps 3000 --export video/weights/videoqa_tiny.safetensors
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.continuous import ContinuousMemoryConfig
from core.infra.cli import (check_memory, fraction, nonempty_path, nonnegative_float, positive_float, positive_int,
                            run_cli, thread_count)
from core.infra.fileio import (check_writable, load_safetensors_model, open_safetensors, set_file_mode, torch_load,
                               torch_save_atomic)
from core.infra.guard import check_outputs
from video.model import AGGREGATES, VideoQAConfig, VideoQAModel
from video.synthetic import (
    COLOURS,
    QUESTION_TYPES,
    make_question,
    make_spec,
    random_after_question,
    random_next_question,
    render_frames,
)

logger = logging.getLogger(__name__)

__all__ = ["all_questions", "make_batch", "evaluate", "train", "init_from", "save_weights", "load_model",
           "build_parser", "main"]

def init_from(model: VideoQAModel, path) -> list[str]:
    """Copy the weights at ``path`` into ``model`` where shapes allow; returns the names not copied in full.

    Embedding tables that grew (more question types) keep their first rows from ``path``.
    """
    src = load_model(path).state_dict()
    dst = model.state_dict()
    partial = []
    for name, t in dst.items():
        if name not in src:
            partial.append(name)
            continue
        s = src[name]
        if s.shape == t.shape:
            dst[name] = s.clone()
        elif s.dim() == t.dim() and s.shape[1:] == t.shape[1:] and s.shape[0] < t.shape[0]:
            dst[name][: s.shape[0]] = s
            partial.append(name)
        else:
            partial.append(name)
    model.load_state_dict(dst)
    return partial


def all_questions(spec, rng: np.random.Generator, num_order: int = 2, num_next: int = 2, num_after: int = 2) -> list:
    """Every question type about a clip: first, last, count and exists for each colour, ``num_order`` order
    pairs, ``num_next`` next questions and ``num_after`` after questions (half asked to answer yes).

    A question that cannot be asked about the clip (an order pair with fewer than two colours present, say)
    leaves its slot None (ignored by the loss), so every clip has the same number of slots.
    """
    qs = [make_question(spec, "first"), make_question(spec, "last")]
    qs += [make_question(spec, "count", c) for c in range(len(COLOURS))]
    qs += [make_question(spec, "exists", c) for c in range(len(COLOURS))]
    present = sorted({e.colour for e in spec.events})
    for _ in range(num_order):
        if len(present) >= 2:
            a, b = (int(v) for v in rng.choice(present, size=2, replace=False))
            qs.append(make_question(spec, "order", a, b))
        else:
            qs.append(None)
    qs += [random_next_question(spec, rng) for _ in range(num_next)]
    qs += [random_after_question(spec, rng, want="yes" if i % 2 == 0 else "no") for i in range(num_after)]
    return qs


def make_batch(rng: np.random.Generator, batch_size: int, length: int, *, size: int = 32, with_tags: bool = False):
    """Render ``batch_size`` clips of ``length`` frames with every question about each.

    Returns:
        frames ``(B, L, H, W, 3)`` uint8, times ``(B, L)``, questions ``(B, K, 3)``, answers ``(B, K)``
        (-100 where a slot holds no question), question types ``(B, K)`` as a nested list, and with
        ``with_tags`` the colours each frame shows ``(B, L, num_colours)`` (auxiliary target).
    """
    frames, qrows, answers, qtypes, tags = [], [], [], [], []
    for _ in range(batch_size):
        spec = make_spec(length, seed=int(rng.integers(1 << 62)), size=size, event_length=(1, 3), num_events=(1, 8))
        frames.append(render_frames(spec, 0, length))
        tag = np.zeros((length, len(COLOURS)), dtype=np.float32)
        for e in spec.events:
            tag[e.start : e.start + e.length, e.colour] = 1.0
        tags.append(tag)
        qs = all_questions(spec, rng)
        qrows.append([[q.qtype_id, q.arg1 + 1, q.arg2 + 1] if q else [0, 0, 0] for q in qs])
        answers.append([q.answer_id if q else -100 for q in qs])
        qtypes.append([q.qtype if q else None for q in qs])
    frames_t = torch.from_numpy(np.stack(frames))  # (B, L, H, W, 3) uint8
    times = ((torch.arange(length, dtype=torch.float32) + 0.5) / length).expand(batch_size, -1)
    batch = (frames_t, times, torch.tensor(qrows, dtype=torch.long), torch.tensor(answers, dtype=torch.long), qtypes)
    return (*batch, torch.from_numpy(np.stack(tags))) if with_tags else batch


@torch.no_grad()
def evaluate(model: VideoQAModel, batches, *, aggregate: str = "attention", memory: ContinuousMemoryConfig | None = None,
             alpha: float = 0.75) -> dict[str, float]:
    """Accuracy overall and per question type on fixed validation batches ``(frames, times, q, ans, qtypes, chunks)``."""
    model.eval()
    correct = {t: [0, 0] for t in QUESTION_TYPES}
    for frames, times, q, ans, qtypes, chunks in batches:
        pred = model(frames, times, q, num_chunks=chunks, aggregate=aggregate, memory=memory, alpha=alpha).argmax(-1)
        for p_row, a_row, t_row in zip(pred.tolist(), ans.tolist(), qtypes):
            for p, a, t in zip(p_row, a_row, t_row):
                if t is None:
                    continue
                correct[t][0] += int(p == a)
                correct[t][1] += 1
    model.train()
    total = sum(c[0] for c in correct.values()) / max(1, sum(c[1] for c in correct.values()))
    out = {"accuracy": total}
    out.update({f"accuracy_{t}": c[0] / c[1] for t, c in correct.items() if c[1]})
    return out


def save_weights(model: VideoQAModel, path, card: dict) -> None:
    """Write the model's weights (safetensors, config in the metadata) and a JSON model card beside it, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    save_file(state, tmp, metadata={"config": json.dumps(model.config.to_dict())})
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, path)
    card_path = path.with_suffix(".json")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{card_path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(card, f, indent=2)
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, card_path)


def load_model(path) -> VideoQAModel:
    """Load a model written by :func:`save_weights`."""
    path = Path(path)
    what = "video QA weights written by video.train (--export)"
    with open_safetensors(path, what=what) as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{str(path)!r} has no 'config' metadata; expected a file written by video.train")
    try:
        model = VideoQAModel(VideoQAConfig(**json.loads(meta["config"])))
    except (TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} holds no video QA model config ({type(err).__name__}: {err}); expected {what}") from err
    load_safetensors_model(model, path, what=what)
    return model.eval()


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    torch.manual_seed(args.seed)
    model = VideoQAModel(VideoQAConfig(dim=args.dim, encoder_dim=args.dim, encoder_width=args.width,
                                       num_layers=args.layers, num_queries=args.queries, num_heads=args.heads,
                                       input_size=args.input_size, readout=args.aggregate))
    if args.init_from and not ckpt_path.exists():
        partial = init_from(model, args.init_from)
        logger.info("initialised from %s (not copied in full: %s)", args.init_from, partial)
    lengths = [int(v) for v in args.clip_lengths.split(",")]
    counts = [int(v) for v in args.chunk_counts.split(",")]
    memory = ContinuousMemoryConfig(num_basis=args.mem_basis, num_samples=args.mem_samples,
                                    num_points=args.mem_points) if args.memory_in_loop else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    rng = np.random.default_rng(args.seed)
    step, best, elapsed, history = 0, -1.0, 0.0, []
    if ckpt_path.exists():
        ck = torch_load(ckpt_path, what="the checkpoint written by video.train")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        step, best, elapsed, history = ck["step"], ck["best"], ck["elapsed"], ck["history"]
        rng.bit_generator.state = ck["rng"]
        torch.set_rng_state(ck["torch_rng"])
        logger.info("resumed at step %d (best validation accuracy %.3f)", step, best)
    val_rng = np.random.default_rng(10_000 + args.seed)
    val = []
    for i in range(args.val_batches):
        L = lengths[i % len(lengths)]
        val.append((*make_batch(val_rng, args.batch_size, L), counts[i % len(counts)]))
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", disable=not args.progress)
    t0 = time.time() - elapsed
    model.train()
    while step < args.steps:
        L = lengths[int(rng.integers(len(lengths)))]
        chunks = counts[int(rng.integers(len(counts)))]
        frames, times, q, ans, _, tag_target = make_batch(rng, args.batch_size, L, with_tags=True)
        tags = []
        logits = model(frames, times, q, num_chunks=chunks, tags=tags, aggregate=args.aggregate,
                       memory=memory, alpha=args.alpha)  # (B, K, answers)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ans.reshape(-1), ignore_index=-100)
        # auxiliary: which colours each frame shows (teaches the frame encoder what to look at)
        loss = loss + args.tag_weight * F.binary_cross_entropy_with_logits(tags[0], tag_target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            metrics = evaluate(model, val, aggregate=args.aggregate, memory=memory, alpha=args.alpha)
            metrics.update(step=step, loss=float(loss.item()), wall_s=time.time() - t0)
            history.append(metrics)
            logger.info("step %d: %s", step, {k: round(v, 3) for k, v in metrics.items()})
            if metrics["accuracy"] > best and args.export:
                best = metrics["accuracy"]
                card = {
                    "model": "VideoQAModel (tiny frame encoder + Q-former + answer head)",
                    "config": model.config.to_dict(),
                    "command": "python -m video.train " + " ".join(args.argv),
                    "data": f"synthetic clips of {args.clip_lengths} frames rendered by video.synthetic (32x32 px, "
                            f"1-8 events of 1-3 frames), read as {args.chunk_counts} chunks "
                            + ("in order through the continuous memory (memory in the training loop, alpha "
                               f"{args.alpha}, {args.mem_basis} box functions)" if memory else "without memory")
                            + f", answered from the '{args.aggregate}' read-out, plus an auxiliary per-frame "
                            "colour-tag loss on the frame encoder; every question per clip (first, last, count and "
                            "exists for each colour, two order pairs, two next and two after questions)",
                    "aggregate": args.aggregate,
                    "memory_in_loop": bool(memory),
                    "init_from": Path(args.init_from).name if args.init_from else None,
                    "steps": step,
                    "batch_size": args.batch_size,
                    "wall_time_s": round(time.time() - t0, 1),
                    "validation": {k: round(v, 4) for k, v in metrics.items() if k.startswith("accuracy")},
                    "validation_set": f"{args.val_batches * args.batch_size} clips (all their questions), seed {10_000 + args.seed}",
                    "parameters": sum(p.numel() for p in model.parameters()),
                }
                save_weights(model, args.export, card)
            torch_save_atomic({
                "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "best": best, "elapsed": time.time() - t0, "history": history,
                "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
            }, ckpt_path)
    bar.close()
    return {"step": step, "best": best, "history": history}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m video.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path, required=True, help="run folder (checkpoint.pt lives here; rerun to resume)")
    p.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps in total")
    p.add_argument("--batch-size", type=positive_int, default=32, help="clips per step")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (one-cycle schedule)")
    p.add_argument("--eval-every", type=positive_int, default=100, help="validate and checkpoint every N steps")
    p.add_argument("--val-batches", type=positive_int, default=12, help="fixed validation batches")
    p.add_argument("--export", type=nonempty_path, default=None,
                   help="write the best model here (.safetensors + .json card)")
    p.add_argument("--dim", type=positive_int, default=64, help="token / query features")
    p.add_argument("--width", type=positive_int, default=16, help="channels of the tiny encoder's first conv")
    p.add_argument("--input-size", type=positive_int, default=16, help="frames are resized to this square for the encoder")
    p.add_argument("--layers", type=positive_int, default=2, help="Q-former blocks")
    p.add_argument("--queries", type=positive_int, default=8, help="learned queries")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--tag-weight", type=nonnegative_float, default=1.0, help="weight of the auxiliary per-frame colour loss")
    p.add_argument("--seed", type=int, default=0, help="seed of the training stream")
    p.add_argument("--clip-lengths", default="16,32", help="clip lengths in frames (comma list)")
    p.add_argument("--chunk-counts", default="1,2,4", help="chunks each clip is split into (comma list)")
    p.add_argument("--aggregate", default="mean", choices=AGGREGATES,
                   help="answer read-out: mean over chunks or last chunk (fixed size), or attention over all chunks")
    p.add_argument("--init-from", default=None, type=nonempty_path, help="start from these weights (same-shape tensors copied)")
    p.add_argument("--memory-in-loop", action="store_true",
                   help="read the chunks in order through the continuous memory while training (not the published recipe)")
    p.add_argument("--alpha", type=fraction, default=0.75, help="short-term weight with --memory-in-loop")
    p.add_argument("--mem-basis", type=positive_int, default=64, help="basis functions of the memory with --memory-in-loop")
    p.add_argument("--mem-samples", type=positive_int, default=512, help="old-signal samples per consolidation")
    p.add_argument("--mem-points", type=positive_int, default=1000, help="integration points of the continuous attention")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import sys

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out), ("--export", args.export)], inputs=[args.init_from])
    if args.export:
        check_writable(args.export, what="--export")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("clip_lengths", "chunk_counts"):
        try:
            vals = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            raise SystemExit(f"--{name.replace('_', '-')} must be a comma list of integers, got {getattr(args, name)!r}")
        if not vals or min(vals) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} values must be >= 1, got {getattr(args, name)!r}")
    bad = [(L, c) for L in map(int, args.clip_lengths.split(",")) for c in map(int, args.chunk_counts.split(",")) if L % c]
    if bad:
        raise SystemExit(f"every chunk count must divide every clip length; these do not: {bad}")
    longest = max(int(v) for v in args.clip_lengths.split(","))
    check_memory(16 * args.batch_size * longest * args.input_size**2 * (3 + args.width) + 64 * args.dim**2 * args.layers,
                 what="one training batch of clips (frames, encoder activations, gradients)",
                 options="--batch-size/--clip-lengths/--input-size/--width/--dim/--layers")
    random.seed(args.seed)
    result = train(args)
    logger.info("done: step %d, best validation accuracy %.3f", result["step"], result["best"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
