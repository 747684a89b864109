"""Stage -1: pretrain CoMemo's vision encoder on tile classification: ``python -m apps.comemo.vision_pretrain``.

Trained end to end from the language-model loss alone, the small ViT did not learn to read a digit from one
tile in a few hundred steps (a single-image needle probe stayed near chance; see
``docs/experiments/comemo_learning.md``). This stage teaches it what the synthetic tasks ask about, with
plain classification heads on the pixel-shuffled tokens (the tokens the projector sees):

- ``digit``: which digit the tile shows, or 10 for none (mean over the tile's tokens, 11 classes);
- ``quadrant`` q = 0..3 (top left, top right, bottom left, bottom right): the colour and shape drawn in
  that quadrant, ``colour * 3 + shape``, or 18 for none (from the tokens covering that quadrant, 19 classes).

Tiles are drawn like the tasks draw them: a needle digit (3/4 of the tile), a detail digit (1/2 of the tile,
anywhere), or 1-3 shapes in distinct quadrants. Sample ``i`` comes from its own seed, as in training.

The output is a full CoMemo weights file (``DIR/model.safetensors``, variant ``--variant``, decoder and
projector at their initialisation, the trained ViT) plus ``DIR/tokenizer.json``, so any variant's stage 0
or stage 3 can start from it with ``--init-from DIR/model.safetensors`` (matching tensors are loaded).
The heads are not part of the model; their accuracy is logged to ``DIR/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from einops import rearrange
from PIL import ImageDraw
from torch import nn
from torch.nn import functional as F

from apps.comemo.model import VARIANTS, CoMemoConfig, CoMemoModel, VisionConfig, normalise_tiles, pixel_shuffle
from apps.comemo.synthetic import (
    COLOURS,
    POSITIONS,
    SHAPES,
    _background,
    _digit,
    _draw_shape,
    _paste_digit,
    _quadrant_box,
    sample_seed,
)
from apps.comemo.train import add_size_args
from core.infra.cli import nonempty_path_obj, positive_float, positive_int, run_cli, thread_count
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["NO_DIGIT", "NO_SHAPE", "make_tile", "draw_tiles", "TileHeads", "pretrain_vision", "build_parser", "main"]

NO_DIGIT = 10  # digit label of a tile without a digit
NO_SHAPE = len(COLOURS) * len(SHAPES)  # quadrant label of an empty quadrant (18)


def make_tile(seed: int, tile: int) -> tuple[np.ndarray, int, list[int]]:
    """One ``(tile, tile, 3)`` uint8 tile and its labels ``(digit, [4 quadrant labels])`` from ``seed``."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    img = _background(nrng, tile, tile)
    quads = [NO_SHAPE] * 4
    kind = rng.randrange(3)
    if kind < 2:  # a digit, needle-sized or detail-sized
        digit, glyph = _digit(rng)
        size = tile * 3 // 4 if kind == 0 else tile // 2
        _paste_digit(img, glyph, rng.randint(0, tile - size), rng.randint(0, tile - size), size)
        return np.asarray(img), digit, quads
    draw = ImageDraw.Draw(img)
    colours = list(COLOURS)
    for pos in rng.sample(POSITIONS, rng.randint(1, 3)):
        c, s = rng.randrange(len(colours)), rng.randrange(len(SHAPES))
        _draw_shape(draw, SHAPES[s], colours[c], _quadrant_box(pos, 0, 0, tile, rng))
        quads[POSITIONS.index(pos)] = c * len(SHAPES) + s
    return np.asarray(img), NO_DIGIT, quads


def draw_tiles(seed: int, start: int, count: int, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles ``start .. start+count-1`` of stream ``seed``: ``(N, 3, tile, tile)`` normalised, digit ``(N,)``,
    quadrant labels ``(N, 4)``."""
    imgs, digits, quads = [], [], []
    for i in range(start, start + count):
        a, d, q = make_tile(sample_seed(seed, i), tile)
        imgs.append(a), digits.append(d), quads.append(q)
    return (normalise_tiles(torch.from_numpy(np.stack(imgs))), torch.tensor(digits), torch.tensor(quads))


class TileHeads(nn.Module):
    """Linear heads on pixel-shuffled tokens ``(N, T*T, C)``: digit (mean over tokens) and one per quadrant."""

    def __init__(self, in_dim: int, tokens_per_side: int) -> None:
        super().__init__()
        if tokens_per_side % 2:
            raise ValueError(f"quadrant heads need an even number of tokens per side, got {tokens_per_side}")
        self.T = tokens_per_side
        self.digit = nn.Linear(in_dim, NO_DIGIT + 1)
        self.quadrant = nn.Linear(in_dim, NO_SHAPE + 1)

    def forward(self, feats_NTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> digit logits ``(N, 11)``, quadrant logits ``(N, 4, 19)`` (quadrants row-major)."""
        half = self.T // 2
        q = rearrange(feats_NTC, "n (qy y qx x) c -> n (qy qx) (y x) c", qy=2, y=half, qx=2, x=half)
        return self.digit(feats_NTC.mean(1)), self.quadrant(q.mean(2))


def pretrain_vision(model: CoMemoModel, *, steps: int, batch_size: int, lr: float, seed: int,
                    log_every: int = 25, metrics_path: Path | None = None, progress=None) -> dict[str, float]:
    """Train ``model.vision`` with :class:`TileHeads` for ``steps`` AdamW steps; returns the last metrics.

    Validation: 512 fixed tiles of stream ``10**6 + seed`` (digit and quadrant accuracy).
    """
    v = model.cfg.vision
    in_dim = model.vision.width * v.shuffle ** 2
    heads = TileHeads(in_dim, v.tokens_per_side)
    params = list(model.vision.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.05, 1 - s / steps))
    val = draw_tiles(10**6 + seed, 0, 512, v.tile)

    def run(tiles):
        return heads(pixel_shuffle(model.vision(tiles), v.shuffle))

    rec: dict[str, float] = {}
    t0 = time.time()
    for step in range(1, steps + 1):
        model.vision.train()
        tiles, dig, quad = draw_tiles(seed, (step - 1) * batch_size, batch_size, v.tile)
        d_logits, q_logits = run(tiles)
        loss = F.cross_entropy(d_logits, dig) + F.cross_entropy(q_logits.flatten(0, 1), quad.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            model.vision.eval()
            with torch.no_grad():
                d_logits, q_logits = run(val[0])
            rec = {"step": step, "loss": float(loss.detach()), "wall_time_s": round(time.time() - t0, 2),
                   "val_digit_acc": float((d_logits.argmax(-1) == val[1]).float().mean()),
                   "val_quadrant_acc": float((q_logits.argmax(-1) == val[2]).float().mean())}
            logger.info("step %d: %s", step, rec)
            if metrics_path is not None:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        if progress is not None:
            progress.update(1)
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.vision_pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path_obj, required=True,
                   help="folder for model.safetensors, tokenizer.json, metrics.jsonl")
    p.add_argument("--variant", default="comemo", help=f"variant of the saved file (any of {', '.join(VARIANTS)}; "
                   "the ViT is shared by all)")
    p.add_argument("--steps", type=positive_int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=64, help="tiles per step")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (AdamW; warm-up 5%%, linear decay)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the tile stream")
    add_size_args(p)  # the saved file's sizes, as apps.comemo.train names them
    p.add_argument("--threads", type=thread_count, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.variant not in VARIANTS:
        raise SystemExit(f"unknown --variant {args.variant!r}; choose one of {list(VARIANTS)}")
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from apps.comemo.synthetic import corpus_texts
    from apps.comemo.tokenizer import train_tokenizer

    tok = train_tokenizer(corpus_texts(), vocab_size=args.vocab_size)
    torch.manual_seed(args.seed)
    cfg = CoMemoConfig(variant=args.variant, vocab_size=tok.vocab_size, dim=args.dim, depth=args.depth,
                       num_heads=args.heads, mlp_ratio=args.mlp_ratio, cross_every=args.cross_every,
                       cross_placement=args.cross_placement, memory_queries=args.memory_queries,
                       memory_norm=args.memory_norm, vision=VisionConfig(tile=args.tile, patch=args.patch, dim=args.vision_dim, depth=args.vision_depth))
    model = CoMemoModel(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    metrics = args.out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    with tqdm(total=args.steps, desc="vision pretrain", disable=args.no_progress) as bar:
        rec = pretrain_vision(model, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                              metrics_path=metrics, progress=bar)
    tok.save(args.out / "tokenizer.json")
    model.save(args.out / "model.safetensors", metadata={
        "variant": args.variant, "stage": "-1", "step": str(args.steps), "vision_pretrain": json.dumps(rec),
        "commands": json.dumps([{"from_step": 0, "command": "python -m apps.comemo.vision_pretrain " + " ".join(
            argv if argv is not None else sys.argv[1:])}])})
    logger.info("saved %s (digit acc %.3f, quadrant acc %.3f)", args.out / "model.safetensors",
                rec.get("val_digit_acc", float("nan")), rec.get("val_quadrant_acc", float("nan")))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
