"""Train an NCAL classifier: ``python -m apps.ncal.train --dataset tmwpl --loss tc --seed 0 --out runs/ncal/tmwpl_tc_0``.

``--dataset`` is ``tmwpl``, ``pmtd`` (the shipped sets; evaluated on their official test split every epoch) or a
JSONL path (TMWPL or PMTD layout; ``--test PATH`` for an evaluation file). ``--encoder`` is ``default`` (the
character transformer pretrained here by MLM, shipped in ``apps/ncal/weights/mlm_encoder``), ``scratch`` (same
shape, random), a folder written by ``python -m apps.ncal.pretrain``, or ``hf:/path/to/model`` (a local Hugging
Face checkpoint; ``--lora-r 8`` for LoRA through ``peft``). ``--head lm`` with an ``hf:`` decoder LLM trains the
LLM to generate the class name instead (:mod:`apps.ncal.llm`, :mod:`apps.ncal.llm_train`); ``--tc-start`` delays
the TC term, and ``tc_grad_share`` in ``metrics.jsonl`` measures its gradient against cross-entropy's.

Writes to ``OUT``: ``last.pt`` (full state every ``--ckpt-every`` steps and at each epoch end: model, loss state
with its TC feature bank, optimizer, scheduler, step, RNG; rerunning the same command resumes from it),
``metrics.jsonl`` (one line per epoch: train loss, test accuracy / macro-F1 / bin recall, NC1 and NC2 of the
train and test features), and at the end the checkpoint (``model.safetensors``, ``ncal.json``, tokenizer) that
``apps.ncal.evaluate`` / ``predict`` / :class:`apps.ncal.NCALClassifier` read. The test split never steers
training: the run keeps its last epoch.

``--valid-frac F`` (default 0: none) holds out a stratified share ``F`` of the train set for validation
(:func:`apps.ncal.data.stratified_holdout`: fixed split seed, independent of ``--seed``, so every loss and seed
sees the same validation items); the model trains on the rest, ``metrics.jsonl`` gets ``valid_*`` columns and
``ncal.json`` a ``"valid"`` entry (metrics of the last epoch) and ``"valid_split"`` (fraction, seed, sizes,
classes without a validation item). Use it to choose a loss or setting without looking at the test split.

Runs under ``torchrun --nproc_per_node=K`` (DDP; gloo on CPU, NCCL on GPU): each process takes every K-th
batch, gradients are averaged, rank 0 evaluates and writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from apps.ncal.data import (
    CONTEXTS,
    DATASETS,
    VALID_SEED,
    Example,
    classes_from,
    load_split,
    longtail_bins,
    read_jsonl,
    stratified_holdout,
)
from apps.ncal.losses import LOSSES, LongTailLoss, LossConfig, tc_on_at, with_tc
from apps.ncal.metrics import classification_metrics, collapse_metrics
from apps.ncal.model import NCALModel, build_encoder, infer, save_checkpoint
from apps.ncal.presets import add_preset_options, make_batches, num_batches, resolve_switches
from apps.ncal.weights_io import load_state, save_state
from core.infra.cli import (add_run_options, configure_run, fraction, nonempty_path, nonnegative_float, nonnegative_int,
                            positive_float, positive_int, run_cli)
from core.infra.distributed import finish
from core.infra.device import add_device_options, device_from_args, resolve_device
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "train", "build_parser", "main", "DEFAULT_ENCODER", "load_data"]

DEFAULT_ENCODER = Path(__file__).resolve().parent / "weights" / "mlm_encoder"
#: losses of the lm head: LM cross-entropy on the label tokens, + λ·TC, + λ·dot-regression to a fixed ETF
#: (both on the last real prompt token's hidden state), or class-balanced weights per example
LM_LOSSES = ("ce", "tc", "etf", "cb")


@dataclass(kw_only=True)
class TrainConfig:
    """One fine-tuning run."""

    dataset: str  # "tmwpl", "pmtd" or a JSONL path
    out: str  # run folder
    test: str | None = None  # evaluation JSONL for a user dataset (shipped sets use their test split)
    loss: str = "tc"  # one of LOSSES
    tc_lambda: float = 0.1  # TC weight (NCAL: 0.1)
    # preset: "project" (this project's choices) or "reference" (the released code's); it sets the four switches
    # below that are left None (apps.ncal.presets): bank_size, batching, and for the lm head prompt and predict
    preset: str = "project"
    bank_size: int | None = None  # TC feature bank (0 = pairs within the batch only, the release); None: preset
    batching: str | None = None  # "bucketed" (length windows, last partial kept) or "random" (drop_last); None: preset
    tc_start: float = 0.0  # share of the training steps before the TC term enters the loss (0: every step)
    grad_share_every: int = 50  # tc: every N steps, measure ‖∇(λ·TC)‖ / ‖∇CE‖ over the trainable weights (0: never)
    encoder: str = "default"  # "default", "scratch", a pretrain folder, or "hf:/path"
    lora_r: int = 0  # LoRA rank for an hf: encoder (0 = full fine-tuning)
    pool: str | None = None  # feature pooling; None = "mean" for the character encoder, "last" for hf:
    context: str = "past"  # PMTD context (see apps.ncal.data)
    epochs: int = 4  # passes over the train set
    batch_size: int = 32  # examples per step (per process under torchrun)
    lr: float = 2e-4  # peak AdamW learning rate (linear warm-up, cosine decay)
    weight_decay: float = 0.01
    warmup_frac: float = 0.06  # share of steps spent warming up
    seed: int = 0
    valid_frac: float = 0.0  # stratified share of train held out for validation (0 = none; fixed split seed)
    ckpt_every: int = 200  # steps between full-state checkpoints (also at every epoch end)
    nc_train_sample: int = 1024  # train examples whose features give the train NC1/NC2 each epoch
    device: str | None = None  # None/"auto": CUDA when present (core.infra.device)
    max_steps: int | None = None  # stop after this many optimizer steps (a smoke run; the schedule spans them)
    # the LLM recipe (head "lm": the class name generated as text by a local decoder LLM, apps.ncal.llm)
    head: str = "auto"  # "auto" (linear head; the fixed ETF for the etf loss) or "lm" (needs an hf: encoder)
    grad_accum: int = 1  # micro-batches per optimizer step (lm head)
    lora_alpha: int = 32  # LoRA α (lm head; LoRA rank: lora_r)
    lora_dropout: float = 0.1  # LoRA dropout (lm head)
    dtype: str = "auto"  # lm head base weights: auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16
    instruction: str | None = None  # lm head: the prompt's instruction (None: the dataset's default)
    max_prompt_tokens: int = 2048  # lm head: prompt cut-off (the text's end is cut)
    score: str = "sum"  # lm head: class score = sum (or mean) of the class name's token log-probabilities
    prompt: str | None = None  # lm head: "instruction" (system message + text) or "question" (text alone); None: preset
    predict: str | None = None  # lm head: "constrained" (class-set argmax) or "sample" (T 0.7, top-p 0.9, match)
    eval_seed: int = 0  # lm head, predict "sample": seed of the sampling generator (fixed: same draws every epoch)

    def __post_init__(self) -> None:
        sw = resolve_switches(self.preset, bank_size=self.bank_size, batching=self.batching, prompt=self.prompt,
                              predict=self.predict)
        self.bank_size, self.batching, self.prompt, self.predict = (int(sw["bank_size"]), sw["batching"],
                                                                     sw["prompt"], sw["predict"])
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head not in ("auto", "lm"):
            raise ValueError(f"head must be 'auto' or 'lm', got {self.head!r}")
        if self.head == "lm":
            if not self.encoder.startswith("hf:"):
                raise ValueError(f"the lm head needs a local decoder LLM: --encoder hf:/path/to/model, got {self.encoder!r}")
            if self.loss not in LM_LOSSES:
                raise ValueError(f"the lm head trains with {LM_LOSSES}, got loss {self.loss!r}")
        if self.score not in ("sum", "mean"):
            raise ValueError(f"score must be 'sum' or 'mean', got {self.score!r}")
        if self.grad_accum < 1 or self.max_prompt_tokens < 8:
            raise ValueError(f"grad_accum must be >= 1 and max_prompt_tokens >= 8, got {self.grad_accum}, "
                             f"{self.max_prompt_tokens}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or None for every epoch), got {self.max_steps!r}")
        if not 0.0 <= self.tc_start < 1.0:
            raise ValueError(f"tc_start must be in [0, 1) (a share of the training steps), got {self.tc_start!r}")
        if self.grad_share_every < 0:
            raise ValueError(f"grad_share_every must be >= 0, got {self.grad_share_every}")
        if not 0.0 <= self.valid_frac < 1.0:
            raise ValueError(f"valid_frac must be in [0, 1) (0 = no validation split), got {self.valid_frac!r}")


def load_data(dataset: str, test: str | None, context: str) -> tuple[list[Example], list[Example] | None, tuple[str, ...], str]:
    """``(train, test or None, classes, dataset name)`` for a shipped name or a JSONL path."""
    if dataset.lower() in DATASETS:
        tr, classes = load_split(dataset, "train", context=context)
        te = read_jsonl(test, classes=classes, context=context) if test else load_split(dataset, "test", context=context)[0]
        return tr, te, classes, dataset.lower()
    if not (dataset.endswith(".jsonl") or Path(dataset).is_file()):
        raise ValueError(f"unknown dataset {dataset!r}; known datasets: {sorted(DATASETS)} or a path to a .jsonl file")
    tr = read_jsonl(dataset, context=context)
    classes = classes_from(tr)
    te = read_jsonl(test, classes=classes, context=context) if test else None
    return tr, te, classes, str(dataset)


def _encoder_spec(cfg: TrainConfig) -> tuple[dict, dict | None, Path | None]:
    """(ncal.json encoder description, initial encoder weights or None, tokenizer path or None)."""
    if cfg.encoder.startswith("hf:"):
        return ({"kind": "hf", "source": cfg.encoder, "pool": cfg.pool or "last", "lora_r": cfg.lora_r}, None, None)
    from apps.ncal.weights_io import load_safetensors, read_json

    folder = DEFAULT_ENCODER if cfg.encoder in ("default", "scratch") else Path(cfg.encoder)
    if not (folder / "encoder.json").is_file():
        raise FileNotFoundError(f"no pretrained encoder at {folder} (expected encoder.json, encoder.safetensors, "
                                f"tokenizer.json from python -m apps.ncal.pretrain)")
    enc_cfg = dict(read_json(folder / "encoder.json")["config"])
    enc_cfg["pool"] = cfg.pool or "mean"
    weights = None if cfg.encoder == "scratch" else load_safetensors(
        folder / "encoder.safetensors", what="the encoder written by apps.ncal.pretrain")
    return {"kind": "char", "config": enc_cfg, "init": cfg.encoder}, weights, folder / "tokenizer.json"


def class_stats(train_ex, classes) -> tuple[dict, dict, Counter, torch.Tensor]:
    """Class index, long-tail bins, train counts (Counter and a float64 (K,) tensor) of the training examples."""
    label_idx = {c: k for k, c in enumerate(classes)}
    counts = Counter(e.label for e in train_ex)
    counts_K = torch.tensor([counts.get(c, 0) for c in classes], dtype=torch.float64)
    return label_idx, longtail_bins([e.label for e in train_ex], classes), counts, counts_K


def _evaluate(model, tok, examples, classes, bins, device, label_idx) -> tuple[dict, torch.Tensor]:
    probs, feats = infer(model, tok, [e.text for e in examples], device=device)
    y = [label_idx[e.label] for e in examples]
    m = classification_metrics(y, probs.argmax(1).tolist(), list(classes), bins)
    present = len(set(y))
    if present >= 2:
        cm = collapse_metrics(feats, y, len(classes))
        m.update({f"nc_{k}": v for k, v in cm.items() if k != "cosines"})
    return m, feats


def prepare_data(cfg: TrainConfig, examples=None):
    """``(train, valid or None, test or None, classes, dataset name, valid split record or None)``: the data of a
    run, with the stratified validation hold-out taken out of train when ``cfg.valid_frac > 0``."""
    if examples is None:
        train_ex, test_ex, classes, ds_name = load_data(cfg.dataset, cfg.test, cfg.context)
    else:
        (train_ex, test_ex, classes), ds_name = examples, cfg.dataset
    valid_ex, valid_split = None, None
    if cfg.valid_frac > 0:
        keep, held = stratified_holdout([e.label for e in train_ex], cfg.valid_frac)
        if not held:
            raise ValueError(f"valid_frac={cfg.valid_frac} leaves no validation item: every class has a single item")
        valid_ex = [train_ex[i] for i in held]
        train_ex = [train_ex[i] for i in keep]
        split_counts = Counter(e.label for e in valid_ex)
        valid_split = {"frac": cfg.valid_frac, "seed": VALID_SEED, "n_train": len(train_ex), "n_valid": len(valid_ex),
                       "valid_counts": {c: split_counts.get(c, 0) for c in classes},
                       "not_in_valid": [c for c in classes if split_counts.get(c, 0) == 0]}
        logger.info("validation split: %d of %d train items (frac %.3f, seed %d)", len(valid_ex),
                    len(valid_ex) + len(train_ex), cfg.valid_frac, VALID_SEED)
    return train_ex, valid_ex, test_ex, classes, ds_name, valid_split


_EPOCH_KEYS = ("accuracy", "macro_f1", "recall_head", "recall_medium", "recall_tail", "nc_nc1", "nc_nc2", "nc_cos_mean")


def _step_with_share(loss_fn, feats_BD, logits_BK, y_B, params, tc_on: bool):
    """Backward of the loss with the two terms' weight gradients taken apart: returns ``(loss, parts, share)``,
    ``share = ‖∇(λ·TC)‖ / ‖∇task‖`` (measured even while the TC term is off; then only the task term is applied)."""
    task, reg = loss_fn.terms(feats_BD, logits_BK, y_B)
    lam = loss_fn.cfg.tc_lambda
    g_task = torch.autograd.grad(task, params, retain_graph=True, allow_unused=True)
    g_reg = torch.autograd.grad(lam * reg, params, allow_unused=True)
    norm = lambda gs: math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs if g is not None))
    share = norm(g_reg) / max(norm(g_task), 1e-30)
    for p, gt, gr in zip(params, g_task, g_reg):
        g = gt if gt is not None else None
        if tc_on and gr is not None:
            g = gr if g is None else g + gr
        p.grad = g
    if loss_fn.training:
        loss_fn.bank.push(feats_BD, y_B)
    loss = with_tc(task, reg, lam, tc_on)
    return loss.detach(), {"task": float(task.detach()), "tc": float(reg.detach())}, share


def train(cfg: TrainConfig, *, progress: bool = True,
          examples: tuple[list[Example], list[Example] | None, tuple[str, ...]] | None = None) -> dict:
    """Run (or resume) one fine-tuning run; returns the final ``ncal.json`` metadata (with test metrics).

    ``examples``: ``(train, test or None, classes)`` given in memory (then ``cfg.dataset`` is only a name).
    """
    if cfg.head == "lm":
        from apps.ncal.llm_train import train_lm

        return train_lm(cfg, progress=progress, examples=examples)
    from tqdm.auto import tqdm

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(cfg.device)
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train_ex, valid_ex, test_ex, classes, ds_name, valid_split = prepare_data(cfg, examples)
    label_idx, bins, counts, counts_K = class_stats(train_ex, classes)

    random.seed(cfg.seed); np.random.seed(cfg.seed); torch.manual_seed(cfg.seed)
    enc_spec, enc_weights, tok_path = _encoder_spec(cfg)
    encoder, tok = build_encoder(enc_spec, tokenizer_path=tok_path)
    if enc_weights is not None:
        encoder.load_state_dict(enc_weights, strict=True)
    model = NCALModel(encoder, len(classes), head="etf" if cfg.loss == "etf" else "linear").to(device)
    loss_fn = LongTailLoss(LossConfig(name=cfg.loss, tc_lambda=cfg.tc_lambda, bank_size=cfg.bank_size),
                           counts_K, encoder.feature_dim).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    texts = [e.text for e in train_ex]
    y_all = torch.tensor([label_idx[e.label] for e in train_ex])
    lengths = [len(t) for t in texts]
    n_batches = num_batches(len(texts), cfg.batch_size, cfg.batching)
    steps_per_epoch = math.ceil(n_batches / world)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    warm = max(1, int(cfg.warmup_frac * total))
    tc_from = int(round(cfg.tc_start * total))  # first step whose loss has the TC term

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    ddp_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    settings = dataclasses.asdict(cfg)
    step, wall = 0, 0.0
    if (out / "last.pt").exists():
        st = load_state(out / "last.pt")
        same = {k: v for k, v in settings.items() if k not in ("out", "device", "ckpt_every")}
        defaults = dataclasses.asdict(TrainConfig(dataset=cfg.dataset, out=cfg.out))
        # settings added after a checkpoint was written count as their defaults (valid_frac: 0, the project preset)
        old = {k: st["settings"].get(k, defaults.get(k)) for k in same}
        if old != same:
            diff = {k: (old.get(k), v) for k, v in same.items() if old.get(k) != v}
            raise ValueError(f"{out}/last.pt was written with other settings (old, new): {diff}; use a new --out")
        model.load_state_dict(st["model"]); loss_fn.load_state_dict(st["loss"])
        opt.load_state_dict(st["optimizer"]); sched.load_state_dict(st["scheduler"])
        step, wall = st["step"], st["wall_s"]
        torch.set_rng_state(st["torch_rng"])
        logger.info("resumed %s at step %d of %d", out, step, total)
    if step >= total and (out / "ncal.json").exists():
        logger.info("%s is complete (%d steps); nothing to do", out, total)
        return json.loads((out / "ncal.json").read_text(encoding="utf-8"))

    def checkpoint():
        if rank == 0:
            save_state(out / "last.pt", {"settings": settings, "model": model.state_dict(), "loss": loss_fn.state_dict(),
                                         "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                         "step": step, "wall_s": wall, "torch_rng": torch.get_rng_state()})

    nc_idx = random.Random(cfg.seed + 7).sample(range(len(train_ex)), min(cfg.nc_train_sample, len(train_ex)))
    bar = tqdm(total=total, initial=step, desc=f"{ds_name}/{cfg.loss}/seed{cfg.seed}", disable=not progress or rank != 0,
               dynamic_ncols=True)
    metrics_f = open(out / "metrics.jsonl", "a", encoding="utf-8") if rank == 0 else None
    last_test, last_valid = None, None
    try:
        while step < total:
            epoch = step // steps_per_epoch
            batches = make_batches(len(texts), lengths, cfg.batch_size, random.Random(cfg.seed * 1000 + epoch),
                                   cfg.batching)[rank::world]
            model.train(); loss_fn.train()
            run_loss, run_n, run_tc, shares, tc_steps = 0.0, 0, 0.0, [], 0
            for bi in range(step % steps_per_epoch, steps_per_epoch):
                if step >= total:  # --max-steps ends the run inside an epoch
                    break
                t0 = time.time()
                idx = batches[bi % len(batches)]
                b = tok.batch([texts[i] for i in idx], device=device)
                y_B = y_all[idx].to(device)
                feats_BD, logits_BK = ddp_model(b["input_ids"], b["attention_mask"])
                tc_on = tc_on_at(step, tc_from)
                tc_steps += int(tc_on)
                opt.zero_grad(set_to_none=True)
                if cfg.loss == "tc" and cfg.grad_share_every and step % cfg.grad_share_every == 0 and world == 1:
                    loss, parts, share = _step_with_share(loss_fn, feats_BD, logits_BK, y_B, params, tc_on)
                    shares.append(share)
                else:
                    loss, parts = loss_fn(feats_BD, logits_BK, y_B, model.etf_W_KD, tc_on=tc_on)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step(); sched.step()
                step += 1
                wall += time.time() - t0
                run_loss += loss.item(); run_n += 1; run_tc += parts.get("tc", 0.0)
                bar.update(1); bar.set_postfix(loss=f"{loss.item():.3f}")
                if step % cfg.ckpt_every == 0:
                    checkpoint()
            if rank == 0:
                rec = {"epoch": epoch + 1, "step": step, "train_loss": round(run_loss / max(run_n, 1), 4), "wall_s": round(wall, 1)}
                if cfg.loss == "tc":  # the TC term alone (before λ), mean over this call's steps of the epoch
                    rec["train_tc"] = round(run_tc / max(run_n, 1), 4)
                    rec["tc_active"] = tc_steps > 0  # the TC term was in the loss for (some) steps of this epoch
                    rec["tc_steps"] = tc_steps  # steps of this epoch (this call) whose loss had the TC term
                    if shares:  # ‖∇(λ·TC)‖ / ‖∇CE‖ over the trainable weights, median of the measured steps
                        rec["tc_grad_share"] = round(float(np.median(shares)), 4)
                sub = [train_ex[i] for i in nc_idx]
                tr_m, _ = _evaluate(model, tok, sub, classes, bins, device, label_idx)
                rec["train_nc1"], rec["train_nc2"] = tr_m.get("nc_nc1"), tr_m.get("nc_nc2")
                if valid_ex is not None:
                    last_valid, _ = _evaluate(model, tok, valid_ex, classes, bins, device, label_idx)
                    rec.update({f"valid_{k}": v for k, v in last_valid.items()
                                if k in _EPOCH_KEYS})
                if test_ex is not None:
                    last_test, _ = _evaluate(model, tok, test_ex, classes, bins, device, label_idx)
                    rec.update({f"test_{k}": v for k, v in last_test.items()
                                if k in _EPOCH_KEYS})
                metrics_f.write(json.dumps(rec) + "\n"); metrics_f.flush()
                logger.info("epoch %d: %s", epoch + 1, rec)
            checkpoint()
    finally:
        bar.close()
        if metrics_f:
            metrics_f.close()
    meta = {
        "dataset": ds_name,
        "classes": list(classes),
        "bins": bins,
        "train_counts": {c: counts.get(c, 0) for c in classes},
        "context": cfg.context,
        "loss": loss_fn.cfg.to_dict(),
        "encoder": enc_spec,
        "settings": settings,
        "steps": step,
        "train_wall_s": round(wall, 1),
        "test": last_test,
    }
    if valid_split is not None:
        meta["valid_split"] = valid_split
        meta["valid"] = last_valid
    if rank == 0:
        if test_ex is not None and last_test is None:  # resumed right at the end: evaluate once
            meta["test"], _ = _evaluate(model, tok, test_ex, classes, bins, device, label_idx)
        if valid_ex is not None and last_valid is None:
            meta["valid"], _ = _evaluate(model, tok, valid_ex, classes, bins, device, label_idx)
        save_checkpoint(out, model, tok, meta)
    return meta


def _share_before_end(text: str) -> float:
    """A share of the training steps in [0, 1)."""
    value = fraction(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (1 would never switch the TC term on), got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.train", description=__doc__.split("\n\n")[0])
    d = TrainConfig(dataset="tmwpl", out="x")
    p.add_argument("--dataset", required=True, help="tmwpl, pmtd, or a JSONL path")
    p.add_argument("--out", type=nonempty_path, required=True, help="run folder (resumes if it holds last.pt)")
    p.add_argument("--test", default=None, help="evaluation JSONL for a user dataset")
    p.add_argument("--loss", default=d.loss, choices=LOSSES)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tc-lambda", type=nonnegative_float, default=d.tc_lambda)
    add_preset_options(p, lm_only="lm head: ")
    p.add_argument("--tc-start", type=_share_before_end, default=d.tc_start,
                   help="share of the training steps before the TC term enters the loss (0: every step)")
    p.add_argument("--grad-share-every", type=nonnegative_int, default=d.grad_share_every,
                   help="tc: steps between measurements of the TC gradient's share (0: never)")
    p.add_argument("--encoder", default=d.encoder, help="default, scratch, a pretrain folder, or hf:/path/to/model")
    p.add_argument("--lora-r", type=nonnegative_int, default=None,
                   help="LoRA rank for hf: encoders (0 = full fine-tuning; default 0, 8 with --head lm)")
    p.add_argument("--head", default=d.head, choices=("auto", "lm"),
                   help="auto: linear (ETF for --loss etf); lm: the class name generated by the hf: decoder LLM")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, help="lm head: micro-batches per step")
    p.add_argument("--lora-alpha", type=positive_int, default=d.lora_alpha, help="lm head: LoRA alpha")
    p.add_argument("--lora-dropout", type=_share_before_end, default=d.lora_dropout, help="lm head: LoRA dropout")
    p.add_argument("--fp16", action="store_true", help="lm head: the same as --dtype float16 (loss scaling on CUDA)")
    p.add_argument("--instruction", default=None, help="lm head: the prompt's instruction (default: the dataset's)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=d.max_prompt_tokens, help="lm head: prompt cut-off")
    p.add_argument("--score", default=d.score, choices=("sum", "mean"),
                   help="lm head: class score from the name's token log-probabilities")
    p.add_argument("--warmup-frac", type=_share_before_end, default=d.warmup_frac, help="share of steps warming up")
    p.add_argument("--pool", default=None, choices=("mean", "cls", "last"))
    p.add_argument("--context", default=d.context, choices=CONTEXTS, help="PMTD context (default past: no future turn)")
    p.add_argument("--epochs", type=positive_int, default=d.epochs)
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--valid-frac", type=fraction, default=d.valid_frac,
                   help="stratified share of train held out for validation (0 = none; same split for every seed)")
    p.add_argument("--ckpt-every", type=positive_int, default=d.ckpt_every)
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after N optimizer steps, evaluate and save (a smoke run; default: every epoch)")
    add_device_options(p)
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device, _ = device_from_args(args)  # a missing GPU is one line before any work
    check_outputs([("--out", args.out)], inputs=[args.dataset, args.test, args.encoder])
    configure_run(args)
    cfg = TrainConfig(dataset=args.dataset, out=args.out, test=args.test, loss=args.loss, seed=args.seed,
                      tc_lambda=args.tc_lambda, preset=args.preset, bank_size=args.bank_size, batching=args.batching,
                      prompt=args.prompt, predict=args.predict, eval_seed=args.eval_seed, tc_start=args.tc_start,
                      grad_share_every=args.grad_share_every, encoder=args.encoder,
                      lora_r=args.lora_r if args.lora_r is not None else (8 if args.head == "lm" else 0),
                      pool=args.pool, context=args.context, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, valid_frac=args.valid_frac, ckpt_every=args.ckpt_every, device=str(device),
                      head=args.head, grad_accum=args.grad_accum, lora_alpha=args.lora_alpha,
                      lora_dropout=args.lora_dropout, dtype="float16" if args.fp16 else args.dtype,
                      instruction=args.instruction, max_steps=args.max_steps,
                      max_prompt_tokens=args.max_prompt_tokens, score=args.score, warmup_frac=args.warmup_frac)
    meta = train(cfg)
    finish()  # under torchrun: every rank waits for rank 0's evaluation, then the group is torn down
    if meta.get("valid"):
        v = meta["valid"]
        logger.info("validation: accuracy %.4f, macro-F1 %.4f", v["accuracy"], v["macro_f1"])
    if meta.get("test"):
        t = meta["test"]
        logger.info("test: accuracy %.4f, macro-F1 %.4f, tail recall %s", t["accuracy"], t["macro_f1"], t.get("recall_tail"))
    return meta


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
