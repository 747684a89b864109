"""Train the default patch encoder (a small CNN) on tiles of synthetic slides.

The encoder learns to tell the synthetic tile classes apart (background, tissue, lesion, pattern A,
pattern B) from the slides' layout maps. It is a stand-in that makes the pipeline run out of the box;
it knows nothing about real histology beyond the ``ihc.png`` texture the slides are made of.

``python -m pathology.train_encoder --out DIR [--steps 1500] [--threads 1]``; resumable from
``DIR/patch_encoder_small.ckpt``; writes ``patch_encoder_small.safetensors`` and a model card
``patch_encoder_small.json``. ``--out`` has no default: ``--out pathology/weights`` replaces the shipped encoder.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from core.infra.cli import check_memory, nonempty_path, positive_float, positive_int, run_cli, thread_count
from core.infra.fileio import set_file_mode, torch_load
from core.infra.guard import check_outputs
from pathology.encoders import IMAGENET_MEAN, IMAGENET_STD, SmallPatchCNN
from pathology.synthetic import CLASSES, LAYOUT_SCALE, TILE, _pad, _Renderer, render_layout, sample_spec

logger = logging.getLogger(__name__)

NUM_CLASSES = len(CLASSES)


def tile_label(classes: np.ndarray, alpha: np.ndarray, y0: int, x0: int) -> int:
    """Class of the level-0 tile at (y0, x0): a special class covering >= 30% wins, else tissue/background."""
    s = LAYOUT_SCALE
    c = classes[y0 // s : (y0 + TILE) // s, x0 // s : (x0 + TILE) // s]
    a = alpha[y0 // s : (y0 + TILE) // s, x0 // s : (x0 + TILE) // s]
    if c.size == 0:
        return 0
    for k in (CLASSES["lesion"], CLASSES["pattern_a"], CLASSES["pattern_b"]):
        if (c == k).mean() >= 0.3:
            return k
    return CLASSES["tissue"] if a.mean() >= 0.5 else CLASSES["background"]


def make_tile_bank(n_slides: int, per_slide: int, seed: int, size: int, input_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Render tiles from ``n_slides`` synthetic slides; positions are biased towards the rare classes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(n_slides):
        spec = sample_spec(rng, name=f"enc_{i}", width=size, height=size, mpp=0.5)
        _pad(spec)
        classes, alpha, art = render_layout(spec)
        r = _Renderer(spec, classes, alpha, art, down=4)
        s = LAYOUT_SCALE
        for j in range(per_slide):
            want = rng.integers(NUM_CLASSES)
            cy, cx = np.nonzero(classes == want) if want > 0 else np.nonzero(alpha < 0.1)
            if len(cy) == 0:
                cy, cx = np.nonzero(classes >= 0)
            k = rng.integers(len(cy))
            y0 = int(np.clip(cy[k] * s - TILE // 2 + rng.integers(-64, 64), 0, spec.height - TILE)) // s * s
            x0 = int(np.clip(cx[k] * s - TILE // 2 + rng.integers(-64, 64), 0, spec.width - TILE)) // s * s
            tile = r.tile(y0, x0)
            xs.append(np.asarray(Image.fromarray(tile).resize((input_size, input_size), Image.BILINEAR)))
            ys.append(tile_label(classes, alpha, y0, x0))
        logger.info("tile bank: slide %d/%d", i + 1, n_slides)
    return np.stack(xs), np.asarray(ys, np.int64)


def _augment(x_BCHW: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if torch.rand(1, generator=g).item() < 0.5:
        x_BCHW = x_BCHW.flip(-1)
    x_BCHW = torch.rot90(x_BCHW, int(torch.randint(4, (1,), generator=g)), dims=(-2, -1))
    b = x_BCHW.shape[0]
    gain = 1 + 0.15 * (torch.rand(b, 3, 1, 1, generator=g) - 0.5)
    bias = 0.1 * (torch.rand(b, 1, 1, 1, generator=g) - 0.5)
    return x_BCHW * gain + bias


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.train_encoder", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=nonempty_path, required=True,
                   help="output folder (pathology/weights replaces the shipped encoder)")
    p.add_argument("--steps", type=positive_int, default=400, help="optimizer steps")
    p.add_argument("--batch", type=positive_int, default=32, help="batch size")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--slides", type=positive_int, default=36, help="synthetic slides for training tiles")
    p.add_argument("--val-slides", type=positive_int, default=6, help="held-out synthetic slides for validation")
    p.add_argument("--per-slide", type=positive_int, default=120, help="tiles rendered per slide")
    p.add_argument("--size", type=positive_int, default=4096, help="synthetic slide side (pixels)")
    p.add_argument("--input-size", type=positive_int, default=64, help="encoder input side (tiles are resized)")
    p.add_argument("--dim", type=positive_int, default=128, help="feature dimension")
    p.add_argument("--widths", default="16,32,48,64,96", help="channels of the five conv stages")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=positive_int, default=100, help="checkpoint every this many steps")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    check_memory(args.batch * args.input_size**2 * 4 * (3 + 4 * max(int(w) for w in args.widths.split(",") if w.strip())),
                 what="one training batch of tiles with the encoder's activations", options="--batch/--input-size/--widths")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    bank_path = os.path.join(args.out, ".encoder_tiles.npz")
    if os.path.exists(bank_path):
        z = np.load(bank_path)
        xtr, ytr, xva, yva = z["xtr"], z["ytr"], z["xva"], z["yva"]
    else:
        t0 = time.time()
        xtr, ytr = make_tile_bank(args.slides, args.per_slide, args.seed, args.size, args.input_size)
        xva, yva = make_tile_bank(args.val_slides, args.per_slide, args.seed + 1000, args.size, args.input_size)
        np.savez(bank_path + ".tmp.npz", xtr=xtr, ytr=ytr, xva=xva, yva=yva)
        os.replace(bank_path + ".tmp.npz", bank_path)
        logger.info("tile bank: %d train / %d val tiles in %.0f s", len(ytr), len(yva), time.time() - t0)
    logger.info("train class counts %s", np.bincount(ytr, minlength=NUM_CLASSES).tolist())
    if xtr.shape[1] != args.input_size:  # a cached bank rendered at another size: resize once
        from PIL import Image

        def _rs(x: np.ndarray) -> np.ndarray:
            return np.stack([np.asarray(Image.fromarray(t).resize((args.input_size, args.input_size), Image.BILINEAR))
                             for t in x])

        xtr, xva = _rs(xtr), _rs(xva)
    widths = tuple(int(w) for w in args.widths.split(","))

    torch.manual_seed(args.seed)
    model = SmallPatchCNN(dim=args.dim, widths=widths, num_classes=NUM_CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    g = torch.Generator().manual_seed(args.seed)
    step, elapsed = 0, 0.0
    ckpt = os.path.join(args.out, "patch_encoder_small.ckpt")
    if os.path.exists(ckpt):
        st = torch_load(ckpt, what="the checkpoint written by pathology.train_encoder")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        g.set_state(st["gen"])
        step, elapsed = st["step"], st["elapsed"]
        logger.info("resumed at step %d", step)
    if step >= args.steps:
        logger.info("already trained for %d steps", step)
        return 0
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def prep(x: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255.0 - mean) / std

    def evaluate() -> dict:
        model.eval()
        with torch.no_grad():
            preds = torch.cat([model.head(model(prep(xva[i : i + 256]))).argmax(-1) for i in range(0, len(xva), 256)])
        model.train()
        yv = torch.from_numpy(yva)
        per = {name: float((preds[yv == k] == k).float().mean()) for name, k in CLASSES.items() if (yv == k).any()}
        return {"val_accuracy": float((preds == yv).float().mean()), "val_per_class_recall": per}

    def save(final: bool) -> dict:
        from safetensors.torch import save_file

        metrics = evaluate()
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("head.")}
        meta = {"dim": str(args.dim), "input_size": str(args.input_size), "widths": args.widths}
        out = os.path.join(args.out, "patch_encoder_small.safetensors")
        save_file(sd, out + ".tmp", metadata=meta)
        set_file_mode(out + ".tmp")  # safetensors writes 0600: follow the user's umask
        os.replace(out + ".tmp", out)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": g.get_state(), "step": step,
                    "elapsed": elapsed}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        n_params = sum(p.numel() for k, p in model.state_dict().items() if not k.startswith("head."))
        card = {
            "name": "longctx patch_encoder_small",
            "what_it_is": f"A small CNN (5 conv stages, {n_params} parameters) trained by this project on tiles of its own "
                          "synthetic slides to separate background, tissue, lesion, pattern A and pattern B. It is a "
                          "STAND-IN so the pipeline runs out of the box; it is NOT a histology foundation model and "
                          "its features carry no meaning on real slides. For real work pass a trusted encoder "
                          "(timm:<name> or open_clip:<name> with --weights PATH).",
            "command": "python -m pathology.train_encoder " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "data": f"{len(ytr)} train / {len(yva)} validation tiles (256 px at 0.5 um/px resized to "
                    f"{args.input_size}) rendered from {args.slides}/{args.val_slides} synthetic slides "
                    f"(pathology.synthetic, seeds {args.seed} and {args.seed + 1000}), texture from scikit-image ihc.png",
            "input": f"RGB uint8 patch resized to {args.input_size}x{args.input_size}, ImageNet mean/std",
            "output_dim": args.dim,
            "steps": step,
            "batch": args.batch,
            "wall_time_s": round(elapsed, 1),
            "threads": args.threads,
            "metrics": metrics,
            "finished": final,
        }
        with open(os.path.join(args.out, "patch_encoder_small.json.tmp"), "w") as f:
            json.dump(card, f, indent=2)
        os.replace(os.path.join(args.out, "patch_encoder_small.json.tmp"), os.path.join(args.out, "patch_encoder_small.json"))
        logger.info("step %d saved: %s", step, metrics)
        return metrics

    from tqdm import tqdm

    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="encoder", unit="step")
    while step < args.steps:
        t0 = time.time()
        idx = torch.randint(len(ytr), (args.batch,), generator=g).numpy()
        x = _augment(prep(xtr[idx]), g)
        y = torch.from_numpy(ytr[idx])
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for pg in opt.param_groups:
            pg["lr"] = lr
        loss = nn.functional.cross_entropy(model.head(model(x)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        elapsed += time.time() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.save_every == 0 or step == args.steps:
            save(step == args.steps)
    bar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
