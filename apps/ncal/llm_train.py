"""Fine-tune a local decoder LLM to generate the class name (``apps.ncal.train --head lm``), with TC/ETF on the
last real prompt token's hidden state.

Called by :func:`apps.ncal.train.train` for ``head="lm"``; the same folder layout and resume rules as the
character encoder's runs: ``last.pt`` (the trainable weights — LoRA adapters —, loss state with the TC bank,
optimizer, scheduler, loss scaler, step, RNG; every ``ckpt_every`` optimizer steps and at each epoch end;
rerunning the same command resumes from it), ``metrics.jsonl`` (per epoch: train loss, the collapse term and
its gradient share, validation/test metrics and NC1/NC2), and at the end ``model.safetensors`` (trainable weights
only; the base model is read again from its folder) + ``ncal.json``, which
:func:`apps.ncal.model.load_checkpoint` and so ``evaluate``/``predict``/:class:`apps.ncal.NCALClassifier` read.

Loss per micro-batch: LM cross-entropy on the gold label tokens (``cb``: each example's tokens weighted by its
class-balanced weight), plus ``λ · tc_loss`` (``tc``; pairs also with the feature bank of ``bank_size`` recent
features, 0 under ``--preset reference``) or ``λ · dot_regression_loss`` to a fixed simplex ETF (``etf``) of the
features; the term is in the loss from optimizer step ``round(tc_start · total)`` on (:func:`tc_on_at`). The
preset's switches (:mod:`apps.ncal.presets`) also set the batching (``bucketed`` / ``random`` with the last
partial batch dropped), the prompt (``instruction`` / ``question``) and the evaluation (``constrained`` /
``sample``). AdamW, linear warm-up over ``warmup_frac`` of the optimizer steps
then linear decay to 0 (the published recipe's Trainer schedule), gradient clipping at 1, ``grad_accum``
micro-batches per step. Base weights in ``cfg.dtype`` (``auto``: bf16 on CUDA, fp32 on the CPU; see
:mod:`core.infra.device`), adapters in float32, autocast in the base dtype on CUDA, loss scaling with fp16. With
``max_steps`` the run (and its learning-rate schedule) ends after that many optimizer steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from apps.ncal.losses import LongTailLoss, LossConfig, tc_on_at, with_tc
from apps.ncal.metrics import classification_metrics, collapse_metrics
from apps.ncal.weights_io import load_state, save_safetensors, save_state, write_json_atomic
from core.collapse import dot_regression_loss, tc_loss

logger = logging.getLogger(__name__)

__all__ = ["train_lm", "build_lm", "lm_spec"]


def lm_spec(cfg, classes, ds_name: str) -> dict:
    """The ``ncal.json`` encoder description of an lm-head run (what :func:`build_lm` rebuilds)."""
    from apps.ncal.llm import LORA_TARGETS, default_instruction

    return {"kind": "hf-lm", "source": cfg.encoder, "classes": list(classes),
            "instruction": cfg.instruction or default_instruction(ds_name, classes),
            "max_prompt_tokens": cfg.max_prompt_tokens, "score": cfg.score, "prompt": cfg.prompt,
            "predict": cfg.predict, "eval_seed": cfg.eval_seed,
            "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                     "targets": list(LORA_TARGETS)},
            "dtype": cfg.dtype}


def build_lm(spec: dict, *, device=None, dtype=None):
    """``(LMClassifier, LMPrompter)`` from an ``hf-lm`` encoder description (adapters freshly initialised).

    ``device``: None = auto (CUDA when present). Base weights in ``dtype``, else the description's ``dtype``
    (``auto``: bf16 on CUDA, fp32 on the CPU); descriptions written before ``dtype`` existed say ``fp16``."""
    from core.infra.device import resolve_device, resolve_dtype

    from apps.ncal.hf_encoder import parse_hf_source
    from apps.ncal.llm import LMClassifier, LMPrompter, LoraSpec

    path = parse_hf_source(spec["source"])
    prompter = LMPrompter(path, spec["classes"], instruction=spec["instruction"],
                          max_prompt_tokens=spec.get("max_prompt_tokens", 2048),
                          prompt=spec.get("prompt", "instruction"))
    lo = spec.get("lora") or {}
    lora = LoraSpec(r=lo.get("r", 8), alpha=lo.get("alpha", 32), dropout=lo.get("dropout", 0.1),
                    targets=tuple(lo.get("targets") or ())) if lo.get("r", 0) > 0 else None
    dev = resolve_device(device)
    if dtype is None:
        dtype = spec.get("dtype") or ("float16" if spec.get("fp16") and dev.type == "cuda" else "auto")
    dtype = resolve_dtype(dtype, dev)
    model = LMClassifier(path, prompter.label_ids, pad_id=prompter.pad_id, lora=lora, dtype=dtype,
                         score=spec.get("score", "sum"))
    model.spec, model.base_dtype = spec, dtype
    model.predict, model.eval_seed = spec.get("predict", "constrained"), int(spec.get("eval_seed", 0))
    return model.to(dev), prompter


def _evaluate(model, prompter, examples, classes, bins, device, batch_size) -> dict:
    from apps.ncal.model import infer, predicted_labels

    probs, feats = infer(model, prompter, [e.text for e in examples], device=device, batch_size=batch_size)
    idx = {c: k for k, c in enumerate(classes)}
    y = [idx[e.label] for e in examples]
    m = classification_metrics(y, predicted_labels(probs), list(classes), bins)
    if len(set(y)) >= 2:
        cm = collapse_metrics(feats, y, len(classes))
        m.update({f"nc_{k}": v for k, v in cm.items() if k != "cosines"})
    return m


_KEEP = ("accuracy", "macro_f1", "unmatched", "recall_head", "recall_medium", "recall_tail", "nc_nc1", "nc_nc2",
         "nc_cos_mean")


def train_lm(cfg, *, progress: bool = True, examples=None) -> dict:
    """Run (or resume) one lm-head run (module docs); returns the ``ncal.json`` metadata."""
    from tqdm.auto import tqdm

    from apps.ncal.llm import pad
    from apps.ncal.presets import make_batches, num_batches
    from apps.ncal.train import class_stats, prepare_data

    from core.infra.device import resolve_device

    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train_ex, valid_ex, test_ex, classes, ds_name, valid_split = prepare_data(cfg, examples)
    label_idx, bins, counts, counts_K = class_stats(train_ex, classes)

    random.seed(cfg.seed); np.random.seed(cfg.seed); torch.manual_seed(cfg.seed)
    spec = lm_spec(cfg, classes, ds_name)
    dtype = cfg.dtype
    if cfg.lora_r == 0:  # every weight trains: float32 master weights (half weights would lose the updates)
        if cfg.dtype not in ("auto", "float32", "fp32"):
            raise ValueError(f"full fine-tuning (lora_r 0) trains float32 weights; dtype {cfg.dtype!r} needs LoRA "
                             "(--lora-r N) or --dtype float32")
        dtype = "float32"
    model, prompter = build_lm(spec, device=device, dtype=dtype)
    base_dtype = model.base_dtype
    use_amp = device.type == "cuda" and base_dtype in (torch.float16, torch.bfloat16)
    loss_fn = LongTailLoss(LossConfig(name=cfg.loss, tc_lambda=cfg.tc_lambda, bank_size=cfg.bank_size),
                           counts_K, model.feature_dim).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and base_dtype == torch.float16)
    prompts = [prompter.prompt_ids(e.text) for e in train_ex]
    y_all = torch.tensor([label_idx[e.label] for e in train_ex])
    n_micro = num_batches(len(prompts), cfg.batch_size, cfg.batching)
    steps_per_epoch = math.ceil(n_micro / cfg.grad_accum)
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    warm = max(1, int(round(cfg.warmup_frac * total)))
    tc_from = int(round(cfg.tc_start * total))  # first optimizer step whose loss has the TC term (tc_on_at)

    def lr_at(step: int) -> float:  # linear warm-up, then linear decay to 0
        return (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    settings = dataclasses.asdict(cfg)
    step, wall = 0, 0.0
    if (out / "last.pt").exists():
        st = load_state(out / "last.pt")
        same = {k: v for k, v in settings.items() if k not in ("out", "device", "ckpt_every")}
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        # settings added after a checkpoint was written count as their defaults
        old = {k: st["settings"].get(k, defaults.get(k)) for k in same}
        if old != same:
            diff = {k: (old.get(k), v) for k, v in same.items() if old.get(k) != v}
            raise ValueError(f"{out}/last.pt was written with other settings (old, new): {diff}; use a new --out")
        missing = set(model.trainable_state()) - set(st["model"])
        if missing:
            raise ValueError(f"{out}/last.pt lacks trainable weights: {sorted(missing)[:3]}")
        model.load_state_dict(st["model"], strict=False); loss_fn.load_state_dict(st["loss"])
        opt.load_state_dict(st["optimizer"]); sched.load_state_dict(st["scheduler"]); scaler.load_state_dict(st["scaler"])
        step, wall = st["step"], st["wall_s"]
        torch.set_rng_state(st["torch_rng"])
        logger.info("resumed %s at step %d of %d", out, step, total)
    if step >= total and (out / "ncal.json").exists():
        return json.loads((out / "ncal.json").read_text(encoding="utf-8"))

    def checkpoint():
        save_state(out / "last.pt", {"settings": settings, "model": model.trainable_state(), "loss": loss_fn.state_dict(),
                                     "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                     "scaler": scaler.state_dict(), "step": step, "wall_s": wall,
                                     "torch_rng": torch.get_rng_state()})

    def micro_loss(idx, tc_on: bool):
        b = pad_prompts([prompts[i] for i in idx])
        y_B = y_all[idx].to(device)
        with torch.autocast("cuda", dtype=base_dtype, enabled=use_amp):
            w = loss_fn.cb_weight_K[y_B] if cfg.loss == "cb" else None
            task, feats = model.lm_loss(b["input_ids"], b["attention_mask"], y_B, weight_B=w)
        reg = None
        if cfg.loss == "tc":
            bank_h, bank_y = loss_fn.bank.get()
            reg = tc_loss(feats, y_B, len(classes), bank_h_MD=bank_h, bank_y_M=bank_y)
            loss_fn.bank.push(feats, y_B)
        elif cfg.loss == "etf":
            reg = dot_regression_loss(feats, y_B, model.etf_W_KD)
        loss = with_tc(task, reg, cfg.tc_lambda, tc_on)
        return loss, task, reg

    def pad_prompts(seqs):
        return pad(seqs, prompter.pad_id, "right", device)

    bar = tqdm(total=total, initial=step, desc=f"{ds_name}/lm-{cfg.loss}/seed{cfg.seed}", disable=not progress,
               dynamic_ncols=True)
    last_test, last_valid = None, None
    lengths = [len(p) for p in prompts]
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as metrics_f:
        while step < total:
            epoch = step // steps_per_epoch
            micro = make_batches(len(prompts), lengths, cfg.batch_size, random.Random(cfg.seed * 1000 + epoch),
                                 cfg.batching)
            model.train(); loss_fn.train()
            run_loss, run_task, run_reg, run_n, shares, tc_steps = 0.0, 0.0, 0.0, 0, [], 0
            for s in range(step % steps_per_epoch, steps_per_epoch):
                if step >= total:  # --max-steps ends the run inside an epoch
                    break
                t0 = time.time()
                tc_on = tc_on_at(step, tc_from)
                tc_steps += int(tc_on)
                group = micro[s * cfg.grad_accum:(s + 1) * cfg.grad_accum]
                opt.zero_grad(set_to_none=True)
                for mi, idx in enumerate(group):
                    loss, task, reg = micro_loss(idx, tc_on)
                    if reg is not None and cfg.grad_share_every and step % cfg.grad_share_every == 0 and mi == 0:
                        shares.append(_share(task, cfg.tc_lambda * reg, params))
                    scaler.scale(loss / len(group)).backward()
                    run_loss += float(loss.detach()); run_task += float(task.detach()); run_n += 1
                    run_reg += float(reg.detach()) if reg is not None else 0.0
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(opt); scaler.update(); sched.step()
                step += 1
                wall += time.time() - t0
                bar.update(1); bar.set_postfix(loss=f"{run_loss / max(run_n, 1):.3f}")
                if step % cfg.ckpt_every == 0:
                    checkpoint()
            rec = {"epoch": epoch + 1, "step": step, "train_loss": round(run_loss / max(run_n, 1), 4),
                   "wall_s": round(wall, 1)}
            if cfg.loss in ("tc", "etf"):
                rec["train_task"] = round(run_task / max(run_n, 1), 4)  # the loss without the λ-weighted term
                rec["train_" + cfg.loss] = round(run_reg / max(run_n, 1), 4)
                rec["tc_active"] = tc_steps > 0  # the term was in the loss of (some) steps of this epoch
                rec["tc_steps"] = tc_steps  # steps of this epoch (this call) whose loss had it
                if shares:
                    rec["tc_grad_share"] = round(float(np.median(shares)), 4)
            eval_bs = max(1, cfg.batch_size)
            if valid_ex is not None:
                last_valid = _evaluate(model, prompter, valid_ex, classes, bins, device, eval_bs)
                rec.update({f"valid_{k}": last_valid.get(k) for k in _KEEP if k in last_valid})
            if test_ex is not None:
                last_test = _evaluate(model, prompter, test_ex, classes, bins, device, eval_bs)
                rec.update({f"test_{k}": last_test.get(k) for k in _KEEP if k in last_test})
            metrics_f.write(json.dumps(rec) + "\n"); metrics_f.flush()
            logger.info("epoch %d: %s", epoch + 1, rec)
            checkpoint()
    bar.close()
    meta = {"dataset": ds_name, "classes": list(classes), "bins": bins,
            "train_counts": {c: counts.get(c, 0) for c in classes}, "context": cfg.context,
            "loss": loss_fn.cfg.to_dict(), "head": "lm", "encoder": spec, "prompt_template": prompter.template,
            "settings": settings, "steps": step, "train_wall_s": round(wall, 1), "test": last_test}
    if valid_split is not None:
        meta["valid_split"], meta["valid"] = valid_split, last_valid
    if test_ex is not None and last_test is None:
        meta["test"] = _evaluate(model, prompter, test_ex, classes, bins, device, cfg.batch_size)
    if valid_ex is not None and last_valid is None:
        meta["valid"] = _evaluate(model, prompter, valid_ex, classes, bins, device, cfg.batch_size)
    save_safetensors(out / "model.safetensors", {k: v.float() for k, v in model.trainable_state().items()})
    from apps.ncal.model import record_base

    write_json_atomic(out / "ncal.json", record_base(meta, out))
    return meta


def _share(task: torch.Tensor, reg: torch.Tensor, params) -> float:
    """‖∇reg‖ / ‖∇task‖ over the trainable weights (graphs kept for the real backward)."""
    g_t = torch.autograd.grad(task, params, retain_graph=True, allow_unused=True)
    g_r = torch.autograd.grad(reg, params, retain_graph=True, allow_unused=True)
    norm = lambda gs: math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs if g is not None))
    return norm(g_r) / max(norm(g_t), 1e-30)
