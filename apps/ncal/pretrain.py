"""Masked-language-model pretraining of the default NCAL encoder on the train text of TMWPL and PMTD.

``python -m apps.ncal.pretrain --out runs/ncal_mlm --max-minutes 60``

Builds (or reuses) the character tokenizer from the train text of both sets (PMTD turns in their ``past``
context, see :mod:`apps.ncal.data`), holds out 2% of the texts for a validation MLM loss, and trains the
:class:`apps.ncal.encoder.TextEncoder` with BERT-style masking (15% of real tokens: 80% ``[MASK]``, 10% random,
10% kept). Batches group texts of similar length (less padding). AdamW with linear warm-up and cosine decay.
Every ``--ckpt-every`` steps the full state (model, head, optimizer, scheduler, step, RNG) goes atomically to
``OUT/last.pt``, the encoder alone to ``OUT/encoder.safetensors`` + ``OUT/encoder.json`` + ``OUT/tokenizer.json``;
metrics go to ``OUT/metrics.jsonl``. Rerunning the same command resumes from ``OUT/last.pt``. Test texts are
never read.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from apps.ncal.data import load_split
from apps.ncal.encoder import EncoderConfig, MLMHead, TextEncoder
from apps.ncal.tokenizer import CharTokenizer
from apps.ncal.weights_io import load_state, save_safetensors, save_state, write_json_atomic
from core.infra.cli import (add_run_options, configure_run, nonempty_path, nonnegative_float, nonnegative_int,
                            positive_float, positive_int, run_cli)
from core.infra.device import add_device_options, resolve_device
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "mask_tokens", "pretrain_texts", "save_encoder", "load_encoder"]


def pretrain_texts() -> list[str]:
    """Train texts of both shipped sets (no test text)."""
    texts = []
    for name in ("tmwpl", "pmtd"):
        ex, _ = load_split(name, "train")
        texts += [e.text for e in ex]
    return texts


def mask_tokens(ids_BS: torch.Tensor, real_BS: torch.Tensor, tok: CharTokenizer, *, prob: float = 0.15,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of real, non-special tokens. Returns ``(inputs (B, S), targets (B, S))``; targets are -100
    where nothing is predicted. At least one token per batch is masked."""
    special_BS = (ids_BS < 5) | ~real_BS
    u_BS = torch.rand(ids_BS.shape, generator=generator)
    pick_BS = (u_BS < prob) & ~special_BS
    if not pick_BS.any():
        cand = (~special_BS).nonzero()
        if len(cand):
            i, j = cand[torch.randint(len(cand), (1,), generator=generator)][0]
            pick_BS[i, j] = True
    targets_BS = torch.where(pick_BS, ids_BS, torch.full_like(ids_BS, -100))
    r_BS = torch.rand(ids_BS.shape, generator=generator)
    inputs_BS = ids_BS.clone()
    inputs_BS[pick_BS & (r_BS < 0.8)] = tok.mask_id
    rand_BS = pick_BS & (r_BS >= 0.8) & (r_BS < 0.9)
    inputs_BS[rand_BS] = torch.randint(5, len(tok), (int(rand_BS.sum()),), generator=generator)
    return inputs_BS, targets_BS


def save_encoder(out: Path, encoder: TextEncoder, tok: CharTokenizer, info: dict | None = None) -> None:
    """``encoder.safetensors`` (fp32), ``encoder.json`` (config + info), ``tokenizer.json`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(out / "encoder.safetensors", encoder.state_dict())
    write_json_atomic(out / "encoder.json", {"config": encoder.cfg.to_dict(), **(info or {})})
    tok.save(out / "tokenizer.json")


def load_encoder(folder: str | Path) -> tuple[TextEncoder, CharTokenizer]:
    """Encoder + tokenizer saved by :func:`save_encoder` (or an NCAL checkpoint folder holding them)."""
    from apps.ncal.weights_io import load_safetensors, read_json

    folder = Path(folder)
    cfg = EncoderConfig(**read_json(folder / "encoder.json")["config"])
    enc = TextEncoder(cfg)
    enc.load_state_dict(load_safetensors(folder / "encoder.safetensors", what="the encoder written by apps.ncal.pretrain"),
                        strict=True)
    return enc, CharTokenizer.load(folder / "tokenizer.json")


def _batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, then sort within windows of 50 batches by length, then shuffle the batches."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 50
    out = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s:s + window], key=lambda i: lengths[i])
        out += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path, required=True, help="run folder (resumes if it holds last.pt)")
    p.add_argument("--dim", type=positive_int, default=160, help="encoder width (default 160)")
    p.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--max-length", type=positive_int, default=160, help="tokens per text, specials included (default 160)")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=5e-4)
    p.add_argument("--epochs", type=positive_float, default=20.0, help="passes over the texts (default 20)")
    p.add_argument("--warmup", type=nonnegative_int, default=300, help="warm-up steps")
    p.add_argument("--max-minutes", type=nonnegative_float, default=None,
                   help="stop (after a checkpoint) past this wall time in this call")
    p.add_argument("--ckpt-every", type=positive_int, default=200, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    add_device_options(p, dtype=False)
    p.add_argument("--limit-texts", type=positive_int, default=None, help="use only the first N texts (tests)")
    add_run_options(p)
    return p


@torch.no_grad()
def _val_loss(enc, head, tok, texts, device, gen) -> float:
    enc.eval(); head.eval()
    tot, n = 0.0, 0
    for s in range(0, len(texts), 64):
        b = tok.batch(texts[s:s + 64])
        inp, tgt = mask_tokens(b["input_ids"], b["attention_mask"], tok, generator=gen)
        h = enc.hidden_states(inp.to(device), b["attention_mask"].to(device))
        sel = tgt != -100
        loss = F.cross_entropy(head(h[sel.to(device)]), tgt[sel].to(device), reduction="sum")
        tot += float(loss); n += int(sel.sum())
    enc.train(); head.train()
    return tot / max(n, 1)


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)  # a missing GPU is one line before any work
    check_outputs([("--out", args.out)])
    configure_run(args)
    from tqdm.auto import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = pretrain_texts()
    if args.limit_texts:
        texts = texts[: args.limit_texts]
    tok_path = out / "tokenizer.json"
    tok = CharTokenizer.load(tok_path) if tok_path.exists() else CharTokenizer.train(texts, max_length=args.max_length)
    rng = random.Random(args.seed)
    idx = list(range(len(texts)))
    rng.shuffle(idx)
    n_val = max(1, len(texts) // 50)
    val = [texts[i] for i in idx[:n_val]]
    train = [texts[i] for i in idx[n_val:]]
    lengths = [len(tok.ids(t)) for t in train]

    cfg = EncoderConfig(vocab_size=len(tok), dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                        max_length=tok.max_length)
    torch.manual_seed(args.seed)
    enc = TextEncoder(cfg).to(device)
    head = MLMHead(enc).to(device)
    params = list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = max(1, int(args.epochs * steps_per_epoch))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, total - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    step, wall = 0, 0.0
    gen = torch.Generator().manual_seed(args.seed)
    if (out / "last.pt").exists():
        st = load_state(out / "last.pt")
        if st["config"] != cfg.to_dict():
            raise ValueError(f"{out}/last.pt was made with config {st['config']}, this call asks for {cfg.to_dict()}")
        enc.load_state_dict(st["encoder"]); head.load_state_dict(st["head"])
        opt.load_state_dict(st["optimizer"]); sched.load_state_dict(st["scheduler"])
        step, wall = st["step"], st["wall_s"]
        gen.set_state(st["gen"]); torch.set_rng_state(st["torch_rng"])
        logger.info("resumed at step %d (%.0f s of training so far)", step, wall)
    else:
        tok.save(tok_path)
    logger.info("%d train / %d val texts, vocab %d, %d params, %d steps", len(train), len(val), len(tok),
                sum(p.numel() for p in enc.parameters()), total)

    def checkpoint():
        save_state(out / "last.pt", {"config": cfg.to_dict(), "encoder": enc.state_dict(), "head": head.state_dict(),
                                     "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
                                     "wall_s": wall, "gen": gen.get_state(), "torch_rng": torch.get_rng_state()})
        save_encoder(out, enc, tok, {"step": step, "wall_s": round(wall, 1), "texts": len(train),
                                     "command": "python -m apps.ncal.pretrain " + " ".join(sys.argv[1:] if argv is None else argv)})

    t_call = time.time()
    bar = tqdm(total=total, initial=step, desc="mlm", dynamic_ncols=True)
    enc.train(); head.train()
    last_loss = float("nan")
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as mf:
        while step < total:
            epoch = step // steps_per_epoch
            batches = _batches(lengths, args.batch_size, random.Random(args.seed * 1000 + epoch))
            for bi in range(step % steps_per_epoch, len(batches)):
                t0 = time.time()
                b = tok.batch([train[i] for i in batches[bi]])
                inp, tgt = mask_tokens(b["input_ids"], b["attention_mask"], tok, generator=gen)
                h = enc.hidden_states(inp.to(device), b["attention_mask"].to(device))
                sel = (tgt != -100).to(device)
                loss = F.cross_entropy(head(h[sel]), tgt.to(device)[sel])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step(); sched.step()
                step += 1
                wall += time.time() - t0
                last_loss = loss.item()
                bar.update(1); bar.set_postfix(loss=f"{last_loss:.3f}")
                rec = {"step": step, "loss": round(last_loss, 4), "lr": sched.get_last_lr()[0], "wall_s": round(wall, 1)}
                done = step >= total
                out_of_time = args.max_minutes is not None and time.time() - t_call > args.max_minutes * 60
                if step % args.ckpt_every == 0 or done or out_of_time:
                    rec["val_loss"] = round(_val_loss(enc, head, tok, val, device, torch.Generator().manual_seed(1)), 4)
                    checkpoint()
                    logger.info("step %d: loss %.3f val %.3f", step, last_loss, rec["val_loss"])
                if step % 20 == 0 or "val_loss" in rec:
                    mf.write(json.dumps(rec) + "\n"); mf.flush()
                if done or out_of_time:
                    break
            if args.max_minutes is not None and time.time() - t_call > args.max_minutes * 60:
                break
    bar.close()
    return {"step": step, "total": total, "loss": last_loss}


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
