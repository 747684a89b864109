"""Training and cross-validation of slide models on patch-feature bags (one HDF5 file per slide).

Classification: cross-entropy per slide (class-weighted by default); metrics AUC (one-vs-rest macro
for >2 classes) and balanced accuracy. Survival: Cox partial likelihood over the slides of a step
(Breslow ties); metric Harrell's C-index.

The default recipe was chosen on lab-sized development cohorts (60-300 slides, docs/experiments/pathology.md):
AdamW at lr 3e-3 with cosine decay over up to 80 epochs, weight decay 0.05, 4 slides per step, 512 random patches
per slide per step, dropout 0.1 on the input features; early stopping on the validation AUC of a split held out
from the training patients, averaged over 5 epochs (ties: the validation loss), never before epoch 30, patience
15, the best epoch's weights kept; the class-1 threshold with the best balanced accuracy on that split gives the
predicted class. Features are standardised with the training patches' per-dimension mean and standard deviation;
afterwards the standardisation is folded into the model's first linear layer, so the returned model takes raw
features. A fold whose best epoch is the first one early stopping could keep, or that predicts one class for
every test slide, gets a warning saying what to try (:func:`fit_warnings`).
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import os
import re
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from core.infra.fileio import set_file_mode
from pathology.features import Bag, class_names, load_bags  # re-exported: bags are built where feature files are read
from pathology.mil import build_model
from pathology.optim import OPTIMIZERS, build_optimizer
from pathology.querent import QuerentConfig

logger = logging.getLogger(__name__)

__all__ = ["Bag", "load_bags", "class_names", "TrainConfig", "cox_loss", "concordance_index", "feature_stats",
           "fold_standardization", "train_model", "evaluate", "predict_outputs", "patient_folds", "choose_threshold",
           "predicted_classes", "fit_warnings",
           "validation_split", "read_splits", "cross_validate", "save_training_curves", "predict_bag"]


def cox_loss(risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    """Negative Cox partial log-likelihood (Breslow), averaged over events; 0 when there is no event."""
    order = torch.argsort(time, descending=True)
    r, e = risk[order], event[order].float()
    log_cum = torch.logcumsumexp(r, dim=0)  # risk set of each subject: everyone with time >= its time
    n_ev = e.sum()
    if n_ev == 0:
        return risk.sum() * 0.0
    return -((r - log_cum) * e).sum() / n_ev


def concordance_index(time: np.ndarray, risk: np.ndarray, event: np.ndarray) -> float:
    """Harrell's C: fraction of comparable pairs (earlier time had an event) ordered correctly by risk."""
    time, risk, event = map(np.asarray, (time, risk, event))
    num = den = 0.0
    for i in range(len(time)):
        if not event[i]:
            continue
        later = time > time[i]
        den += later.sum()
        num += (risk[i] > risk[later]).sum() + 0.5 * (risk[i] == risk[later]).sum()
    return float(num / den) if den > 0 else float("nan")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation settings shared by every model (defaults: see the module docstring)."""

    epochs: int = 80  # most passes over the training slides (the cosine decay spans them); early stopping may end sooner
    # AdamW peak learning rate (cosine decay over `epochs`). CLAM's 2e-4 needs ~60 epochs to leave ln 2 on a
    # 10-slide planted-cluster cohort with standardised features (tests/test_pathology_train.py); with 4 slides per
    # step, mean pooling on 120 slides learnt at 3e-3 what it did not at 1e-3 (docs/experiments/pathology.md)
    lr: float = 3e-3
    weight_decay: float = 5e-2  # AdamW weight decay
    batch_slides: int = 4  # slides per optimizer step (survival uses >= 8 so the Cox loss has risk sets)
    max_patches: int | None = 512  # random subset of patches per slide per training step (None = all)
    standardize: bool = True  # z-score features with the training patches' mean/std (raw features vary in scale)
    class_weights: bool = True  # weight the cross-entropy by inverse class frequency (imbalanced cohorts)
    val_fraction: float = 0.2  # share of training patients held out for early stopping (cross_validate)
    patience: int = 15  # epochs without a better early-stopping score before stopping (CLAM: 20)
    min_delta: float = 1e-3  # a validation loss must drop by more than this to reset the patience
    min_epochs: int = 30  # never stop before this epoch (on a lab-sized cohort models start to learn after 10-40)
    # What early stopping watches: "auc" (classification: validation AUC averaged over the last `smooth` epochs, ties
    # broken by the smoothed validation loss) or "loss" (the smoothed validation loss). On a few dozen validation
    # bags the loss of a model that ranks well but grows confident rises from the first epochs on, so "loss" kept
    # epoch 1 and a model that predicts one class (docs/experiments/pathology.md, 2026-12-05)
    monitor: str = "auc"
    smooth: int = 5  # epochs averaged by the early-stopping score (1 = the epoch's own value)
    feature_dropout: float = 0.1  # dropout on the (standardised) input features while training
    # "adamw" (this recipe) or "radam_lookahead" (TransMIL's published optimiser, pathology.optim)
    optimizer: str = "adamw"
    schedule: str = "cosine"  # learning rate: "cosine" decay over `epochs`, or "constant" (TransMIL's release)
    # Querent only: for this many epochs the layers are left out, so the model trains as its depth-0 form (embedding,
    # gated pooling, head) and its pooling can find the informative patches before the layers can fit the bags another
    # way; afterwards the whole model trains. Early stopping counts only epochs with the layers (0: from the start)
    layers_from: int = 0
    # How the first stage ends: "fixed" (after `layers_from` epochs of the one schedule) or "early_stop" (by early
    # stopping on the validation bags, at most `layers_from` epochs; its best weights are restored and the layers then
    # train for up to `epochs` more epochs with a schedule of their own)
    stage_end: str = "fixed"
    # With `layers_from`: from the second stage on, the embedding and the attention pooling keep what the depth-0
    # stage learnt (only the layers and the head train), so the pooling cannot lose the patches it found
    freeze_pooling: bool = False
    seed: int = 0  # seeds model init, shuffling, patch sampling and the validation split
    device: str = "cpu"  # torch device

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_slides < 1:
            raise ValueError(f"epochs ({self.epochs}) and batch_slides ({self.batch_slides}) must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr ({self.lr}) must be > 0")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction ({self.val_fraction}) must be in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer ({self.optimizer!r}) must be one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule ({self.schedule!r}) must be 'cosine' or 'constant'")
        if self.monitor not in ("auc", "loss"):
            raise ValueError(f"monitor ({self.monitor!r}) must be 'auc' or 'loss'")
        if self.smooth < 1 or not 0 <= self.feature_dropout < 1:
            raise ValueError(f"smooth ({self.smooth}) must be >= 1 and feature_dropout ({self.feature_dropout}) in [0, 1)")
        if self.stage_end not in ("fixed", "early_stop"):
            raise ValueError(f"stage_end ({self.stage_end!r}) must be 'fixed' or 'early_stop'")
        if not 0 <= self.layers_from < self.epochs and not (self.stage_end == "early_stop" and self.layers_from > 0):
            raise ValueError(f"layers_from ({self.layers_from}) must be >= 0 and below epochs ({self.epochs})")
        if self.patience < 1 or self.min_epochs < 0 or self.min_delta < 0:
            raise ValueError(f"patience ({self.patience}) must be >= 1, min_epochs ({self.min_epochs}) and "
                             f"min_delta ({self.min_delta}) >= 0")


def feature_stats(bags: list[Bag]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and standard deviation over all patches of ``bags`` (float64 sums, no concatenation).

    Dimensions that are (nearly) constant get std 1 so they are only centred.
    """
    d = bags[0].features.shape[1]
    s, s2, n = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), 0
    for b in bags:
        f = b.features.to(torch.float64)
        s += f.sum(0)
        s2 += (f * f).sum(0)
        n += f.shape[0]
    mean = s / n
    std = (s2 / n - mean * mean).clamp_min(0).sqrt()
    std = torch.where(std > 1e-6 * max(float(std.max()), 1e-12), std, torch.ones_like(std))
    return mean.float(), std.float()


def _first_linear(model: nn.Module) -> nn.Linear:
    emb = getattr(model, "embed", None)
    layer = emb[0] if isinstance(emb, nn.Sequential) and len(emb) else emb
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no 'embed' linear layer to fold the standardisation into")
    return layer


@torch.no_grad()
def fold_standardization(model: nn.Module, mean_D: torch.Tensor, std_D: torch.Tensor) -> nn.Module:
    """Fold ``(x - mean) / std`` into the model's first linear layer (``model.embed[0]``), in place.

    ``W (x - m) / s + b = (W / s) x + (b - W (m / s))``: afterwards the model on raw features gives what
    it gave on standardised ones.
    """
    lin = _first_linear(model)
    w = lin.weight.double()  # (dim, D)
    m, s = mean_D.to(w), std_D.to(w)
    b = lin.bias.double() if lin.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    new_b = b - w @ (m / s)
    lin.weight.copy_((w / s).to(lin.weight.dtype))
    if lin.bias is None:
        lin.bias = nn.Parameter(new_b.to(lin.weight.dtype))
    else:
        lin.bias.copy_(new_b.to(lin.bias.dtype))
    return model


def _subsample(bag: Bag, max_patches: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = bag.features.shape[0]
    if max_patches is None or n <= max_patches:
        return bag.features, bag.coords
    idx = torch.randperm(n, generator=g)[:max_patches]
    return bag.features[idx], bag.coords[idx]


def _class_weight(bags: list[Bag], n_classes: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor([b.label for b in bags]), minlength=n_classes).double()
    present = counts > 0
    w = torch.ones(n_classes, dtype=torch.float64)
    w[present] = counts.sum() / (present.sum() * counts[present])  # n / (C · n_c), as scikit-learn's "balanced"
    return w.float()


def _loss(logits: torch.Tensor, batch: list[Bag], survival: bool, weight: torch.Tensor | None) -> torch.Tensor:
    dev = logits.device
    if survival:
        return cox_loss(logits[:, 0], torch.tensor([b.time for b in batch], device=dev),
                        torch.tensor([b.event for b in batch], device=dev))
    return nn.functional.cross_entropy(logits, torch.tensor([b.label for b in batch], device=dev),
                                       weight=None if weight is None else weight.to(dev))


def _freeze_pooling(model: nn.Module, frozen: bool) -> None:
    """Hold (or free) a Querent's patch embedding and attention pooling (``TrainConfig.freeze_pooling``)."""
    for mod in (model.embed, model.pool):
        for prm in mod.parameters():
            prm.requires_grad_(not frozen)


def train_model(name: str, model_cfg: QuerentConfig, bags: list[Bag], cfg: TrainConfig, progress: bool = False,
                val_bags: list[Bag] | None = None) -> tuple[nn.Module, dict]:
    """Train a fresh model ``name`` on ``bags``.

    With ``val_bags`` the validation loss is computed after every epoch; training stops after
    ``cfg.patience`` epochs without improvement (not before ``cfg.min_epochs``) and the best epoch's
    weights are returned. Without them all ``cfg.epochs`` run.

    Returns:
        The model (eval mode, taking raw features) and a summary: ``steps``, ``epochs_run``,
        ``best_epoch``, ``stopped_early``, ``train_seconds``, ``final_loss`` (mean training loss of the
        last epoch), ``best_val_loss`` and ``history`` (per epoch: ``epoch``, ``train_loss``,
        ``val_loss`` or ``None``, ``lr``).
    """
    if not bags:
        raise ValueError("no training bags")
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    dev = torch.device(cfg.device)
    model = build_model(name, model_cfg).to(dev)
    opt = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay)
    survival = model_cfg.task == "survival"
    weight = _class_weight(bags, model_cfg.num_classes) if cfg.class_weights and not survival else None
    if cfg.standardize:
        mean, std = feature_stats(bags)
        mean, std = mean.to(dev), std.to(dev)
    bs = max(cfg.batch_slides, 8) if survival else cfg.batch_slides
    steps_per_epoch = math.ceil(len(bags) / bs)

    def prep(f: torch.Tensor) -> torch.Tensor:
        f = f.to(dev)
        return (f - mean) / std if cfg.standardize else f

    step, t0, history = 0, time.perf_counter(), []
    best = ((-float("inf"),), 0, None)  # (early-stopping key, epoch, state): the weights returned
    ref, ref_epoch = None, 0  # the patience counts epochs since the key last improved by > min_delta
    by_auc = cfg.monitor == "auc" and not survival
    staged = cfg.layers_from > 0 and hasattr(model, "skip_layers")
    adaptive = staged and cfg.stage_end == "early_stop"
    stage1 = staged  # the layers are held back
    # "fixed": the layers come in after epoch `layers_from` of the one schedule; "early_stop": the first stage ends by
    # early stopping (at most `layers_from` epochs), its best weights are restored and the second stage has `epochs`
    # epochs of its own schedule (`switch`: epochs run before the layers; `limit`: most epochs in all)
    switch = cfg.layers_from if staged and not adaptive else 0
    limit = cfg.layers_from + cfg.epochs if adaptive else cfg.epochs
    s0_step, span = 0, (cfg.layers_from if adaptive else cfg.epochs) * steps_per_epoch  # the schedule's start, length
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=limit, desc=f"train {name}", unit="epoch", leave=False)
    stopped, epoch = False, 0
    while epoch < limit:
        if staged:
            model.skip_layers = stage1 if adaptive else epoch < cfg.layers_from
            if cfg.freeze_pooling and not model.skip_layers:  # the second stage: the pooling keeps what it found
                _freeze_pooling(model, True)
        model.train()
        order = torch.randperm(len(bags), generator=g).tolist()
        losses = []
        for s0 in range(0, len(order), bs):
            batch = [bags[i] for i in order[s0 : s0 + bs]]
            t = (step - s0_step) / max(1, span)
            lr = cfg.lr * (0.5 * (1 + math.cos(math.pi * t)) if cfg.schedule == "cosine" else 1.0)
            for pg in opt.param_groups:
                pg["lr"] = lr
            outs = []
            for b in batch:
                f, c = _subsample(b, cfg.max_patches, g)
                x = prep(f)
                if cfg.feature_dropout:
                    x = nn.functional.dropout(x, cfg.feature_dropout)
                outs.append(model(x, c.to(dev), patch_size_level0=b.patch_size_level0).logits)
            loss = _loss(torch.cat(outs, 0), batch, survival, weight)  # logits (b, C)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
        epoch += 1
        rec = {"epoch": epoch, "train_loss": float(np.mean(losses)), "val_loss": None, "lr": lr}
        if staged:
            rec["layers"] = not model.skip_layers
        end = limit if not stage1 or not adaptive else cfg.layers_from  # the last epoch of this stage
        if val_bags:
            model.eval()
            with torch.no_grad():
                logits = torch.cat([model(prep(b.features), b.coords.to(dev),
                                          patch_size_level0=b.patch_size_level0).logits for b in val_bags], 0)
                rec["val_loss"] = float(_loss(logits, val_bags, survival, weight))
            if not survival:
                rec["val_auc"] = _metrics(logits.float().cpu(), val_bags, "cls")["auc"]
            recent = (history + [rec])[-cfg.smooth:]
            s_loss = float(np.mean([r["val_loss"] for r in recent]))
            s_auc = float(np.nanmean([r["val_auc"] for r in recent])) if by_auc else float("nan")
            key = (s_auc, -s_loss) if by_auc and s_auc == s_auc else (-s_loss,)
            # an epoch is a candidate once its score spans `smooth` epochs (or it is the last one): one epoch's AUC
            # on a few dozen bags is noise, and epoch 1 kept by luck is a model that has learnt nothing. With staged
            # layers only epochs whose whole window ran in the current stage: the returned model has its layers
            full = epoch - switch >= min(cfg.smooth, end - switch)
            if full and (len(key) != len(best[0]) or key > best[0]):
                best = (key, epoch, copy.deepcopy(model.state_dict()))
            counts = full if staged and not (adaptive and stage1) else True  # the patience counts within a stage
            if counts and (ref is None or len(key) != len(ref) or key[0] > ref[0] + cfg.min_delta):
                ref, ref_epoch = key, epoch
        history.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['train_loss']:.3f}", val=f"{rec['val_loss']:.3f}" if val_bags else "-")
        floor = cfg.min_epochs + (switch if adaptive else 0)  # the second stage has its own floor
        done = val_bags and ref is not None and epoch >= floor and epoch - ref_epoch >= cfg.patience
        if adaptive and stage1 and (done or epoch == end):  # the depth-0 stage is over: on to the layers
            if best[2] is not None:
                model.load_state_dict(best[2])
            rec["stage_best_epoch"] = best[1] or epoch
            stage1, switch, limit = False, epoch, epoch + cfg.epochs
            best, ref, ref_epoch = ((-float("inf"),), 0, None), None, 0
            s0_step, span = step, cfg.epochs * steps_per_epoch
            if bar is not None:
                bar.total = limit
            continue
        if done:
            stopped = True
            break
    if bar is not None:
        bar.close()
    if staged and cfg.freeze_pooling:
        _freeze_pooling(model, False)
    if best[2] is not None:
        model.load_state_dict(best[2])
    if cfg.standardize:
        fold_standardization(model, mean, std)
    model.eval()
    best_val = history[best[1] - 1]["val_loss"] if val_bags and best[1] else None
    info = {"steps": step, "epochs_run": len(history), "best_epoch": best[1] if val_bags else len(history),
            "stopped_early": stopped, "layers_from_epoch": switch if staged else None, "train_seconds": round(time.perf_counter() - t0, 2),
            "final_loss": history[-1]["train_loss"], "best_val_loss": best_val, "monitor": cfg.monitor if val_bags
            else None, "first_candidate": min(cfg.smooth, cfg.epochs), "threshold": None, "history": history}
    if val_bags and not survival and model_cfg.num_classes == 2:
        info["threshold"] = choose_threshold(torch.softmax(predict_outputs(model, val_bags, cfg.device), -1)[:, 1].numpy(),
                                             np.array([b.label for b in val_bags]))
    return model, info


def choose_threshold(prob: np.ndarray, y: np.ndarray) -> float:
    """The probability threshold of class 1 with the best balanced accuracy on ``(prob, y)`` (the midpoint between
    neighbouring scores; ties: the one nearest 0.5). 0.5 when a class is missing."""
    prob, y = np.asarray(prob, np.float64), np.asarray(y)
    if len(set(y.tolist())) < 2:
        return 0.5
    s = np.unique(prob)
    cands = np.concatenate([[s[0] - 1e-9], (s[:-1] + s[1:]) / 2, [s[-1] + 1e-9]]) if len(s) > 1 else np.array([0.5])
    best = (-1.0, 0.0, 0.5)
    for t in cands:
        pred = prob > t
        bacc = 0.5 * (pred[y == 1].mean() + (~pred[y == 0]).mean())
        cand = (round(float(bacc), 9), -abs(float(t) - 0.5), float(t))
        best = max(best, cand)
    return best[2]


@torch.no_grad()
def predict_bag(model: nn.Module, bag: Bag, device: str = "cpu"):
    """Model output for one bag (eval mode, all patches)."""
    model.eval()
    return model(bag.features.to(device), bag.coords.to(device), patch_size_level0=bag.patch_size_level0)


@torch.no_grad()
def predict_outputs(model: nn.Module, bags: list[Bag], device: str = "cpu") -> torch.Tensor:
    """Logits (classification) or risk in column 0 (survival) for every bag: (n_bags, C) float32 on the CPU."""
    return torch.cat([predict_bag(model, b, device).logits.float().cpu() for b in bags], 0)


def predicted_classes(outs: torch.Tensor, threshold: float | None = None) -> np.ndarray:
    """Class per row of logits: class 1 when its probability is above ``threshold`` (two classes), else the argmax."""
    prob = torch.softmax(outs.float(), -1).numpy()
    if threshold is not None and prob.shape[1] == 2:
        return (prob[:, 1] > threshold).astype(np.int64)
    return prob.argmax(1)


def _metrics(outs: torch.Tensor, bags: list[Bag], task: str, pred: np.ndarray | None = None) -> dict:
    if task == "survival":
        return {"c_index": concordance_index(np.array([b.time for b in bags]), outs[:, 0].numpy(),
                                             np.array([b.event for b in bags]))}
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    y = np.array([b.label for b in bags])
    prob = torch.softmax(outs, -1).numpy()
    pred = prob.argmax(1) if pred is None else pred
    res = {"balanced_accuracy": float(balanced_accuracy_score(y, pred))}
    try:
        if prob.shape[1] == 2:
            res["auc"] = float(roc_auc_score(y, prob[:, 1]))
        else:
            res["auc"] = float(roc_auc_score(y, prob, multi_class="ovr", labels=list(range(prob.shape[1]))))
    except ValueError:  # a fold with one class only
        res["auc"] = float("nan")
    return res


def evaluate(model: nn.Module, bags: list[Bag], task: str, device: str = "cpu") -> dict:
    """AUC + balanced accuracy (cls) or C-index (survival) on ``bags``."""
    return _metrics(predict_outputs(model, bags, device), bags, task)


# ------------------------------------------------------------------------------------------------ splits


def _strata(bags: list[Bag], task: str) -> dict[str, int]:
    """Each patient's stratum: its most common label (cls) or whether any of its slides has an event."""
    per: dict[str, list[int]] = {}
    for b in bags:
        per.setdefault(b.patient_id, []).append(b.event if task == "survival" else b.label)
    return {p: (max(v) if task == "survival" else Counter(v).most_common(1)[0][0]) for p, v in per.items()}


def patient_folds(bags: list[Bag], folds: int, *, task: str = "cls",
                  seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``folds`` (train, test) index lists stratified on the label (event for survival); a patient in one fold."""
    from sklearn.model_selection import StratifiedGroupKFold

    if folds < 2:
        raise ValueError(f"folds ({folds}) must be >= 2")
    strata = _strata(bags, task)
    smallest = min(Counter(strata.values()).values())
    if len(set(strata.values())) > 1 and smallest < folds:
        raise ValueError(f"folds ({folds}) exceeds the number of patients in the smallest class ({smallest})")
    if len(strata) < folds:
        raise ValueError(f"folds ({folds}) exceeds the number of patients ({len(strata)})")
    y = np.array([strata[b.patient_id] for b in bags])
    groups = np.array([b.patient_id for b in bags])
    sgkf = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
    return [(tr.tolist(), te.tolist()) for tr, te in sgkf.split(np.zeros(len(bags)), y, groups)]


def validation_split(bags: list[Bag], idx: list[int], fraction: float, *, task: str = "cls",
                     seed: int = 0) -> tuple[list[int], list[int]]:
    """Hold out ``fraction`` of the patients of ``bags[idx]`` per stratum (at least one of a stratum with >= 3).

    Returns ``(train_idx, val_idx)``; ``val_idx`` is empty when the strata are too small.
    """
    if fraction <= 0:
        return list(idx), []
    strata = _strata([bags[i] for i in idx], task)
    rng = np.random.default_rng(seed)
    val_patients: set[str] = set()
    for s in sorted(set(strata.values())):
        pats = sorted(p for p, v in strata.items() if v == s)
        k = int(round(fraction * len(pats)))
        k = 1 if k == 0 and len(pats) >= 3 else min(k, len(pats) - 1)
        val_patients.update(rng.permutation(pats)[:k].tolist())
    if len(set(strata.values())) > 1 and len({strata[p] for p in val_patients}) < len(set(strata.values())):
        val_patients = set()  # a validation split without every class measures the wrong loss
    keep = [i for i in idx if bags[i].patient_id not in val_patients]
    return keep, [i for i in idx if bags[i].patient_id in val_patients]


def read_splits(path: str) -> list[dict[str, list[str]]]:
    """Folds from CLAM's ``splits_<k>.csv`` layout: columns ``train``, ``val``, ``test`` of slide ids.

    ``path`` is one such file or a folder holding ``splits_0.csv``, ``splits_1.csv``, ... (CLAM's
    ``splits_<k>_bool.csv`` / ``_descriptor.csv`` beside them are ignored). Empty cells pad the columns.
    """
    if os.path.isdir(path):
        found = sorted(((int(m.group(1)), f) for f in os.listdir(path) if (m := re.fullmatch(r"splits_(\d+)\.csv", f))))
        if not found:
            raise FileNotFoundError(f"no splits_<k>.csv in {path!r}")
        files = [os.path.join(path, f) for _, f in found]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"splits file or folder not found: {path!r}")
    out = []
    for fp in files:
        with open(fp, newline="") as f:
            rows = list(csv.DictReader(f))
        cols = rows[0].keys() if rows else []
        if not {"train", "test"} <= set(cols):
            raise ValueError(f"{fp!r} needs columns 'train' and 'test' (CLAM splits layout); it has {list(cols)}")
        out.append({c: [r[c].strip() for r in rows if (r.get(c) or "").strip()] for c in ("train", "val", "test")})
    return out


def _folds_from_splits(bags: list[Bag],
                       splits: list[dict[str, list[str]]]) -> list[tuple[list[int], list[int], list[int]]]:
    where = {b.slide_id: i for i, b in enumerate(bags)}
    unknown = sorted({s for sp in splits for c in sp.values() for s in c} - set(where))
    if unknown:
        logger.warning("%d slide id(s) of the splits have no features or label (e.g. %s); ignored",
                       len(unknown), unknown[:3])
    folds = []
    for k, sp in enumerate(splits):
        ix = {c: [where[s] for s in sp[c] if s in where] for c in ("train", "val", "test")}
        pats = {c: {bags[i].patient_id for i in ix[c]} for c in ix}
        for a, b in (("train", "test"), ("val", "test"), ("train", "val")):
            leak = sorted(pats[a] & pats[b])
            if leak:
                raise ValueError(f"split {k}: patient(s) {leak[:3]} have slides in both {a} and {b}")
        if not ix["train"] or not ix["test"]:
            raise ValueError(f"split {k} has no train or no test slide with features")
        folds.append((ix["train"], ix["val"], ix["test"]))
    return folds


# ------------------------------------------------------------------------------------------ cross-validation


def _spread(values: list[float]) -> dict[str, float]:
    a = np.array(values, dtype=np.float64)
    ok = a[~np.isnan(a)]
    if not len(ok):
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": float(ok.mean()), "std": float(ok.std()), "min": float(ok.min()), "max": float(ok.max()),
            "n": int(len(ok))}


def cross_validate(name: str, model_cfg: QuerentConfig, bags: list[Bag], cfg: TrainConfig, *, folds: int = 5,
                   progress: bool = False, save_dir: str | None = None,
                   splits: list[dict[str, list[str]]] | None = None, on_fold=None) -> dict:
    """Cross-validation at the patient level, out-of-fold predictions for every slide, metrics with fold spread.

    Folds come from ``splits`` (:func:`read_splits`) or from :func:`patient_folds`. Each fold's
    training patients give up ``cfg.val_fraction`` of them for early stopping (a split's own ``val``
    column is used when it has one). ``on_fold(k, model, train_bags, test_bags)``, when given, is called with
    every fold's trained model (eval mode); what it returns is stored as the fold's ``diagnostics``.

    Returns:
        ``model``, ``task``, ``classes``, ``folds`` (per fold: metrics, training summary with its
        per-epoch ``history``, sizes), ``summary`` (per metric ``mean``/``std``/``min``/``max``/``n``
        over folds), ``pooled`` (the metrics of all out-of-fold predictions together) and ``oof`` (one row per
        test slide and fold: ``slide_id``, ``patient_id``, ``fold``, label or time/event, and
        ``prob_<class>`` or ``risk``).
    """
    task = model_cfg.task
    names = class_names(bags) if task == "cls" else []
    if splits is not None:
        plan = _folds_from_splits(bags, splits)
    else:
        plan = [(tr, [], te) for tr, te in patient_folds(bags, folds, task=task, seed=cfg.seed)]
    per_fold, oof, oof_out, oof_bags, oof_pred = [], [], [], [], []
    for k, (tr, va, te) in enumerate(plan):
        if not va:
            tr, va = validation_split(bags, tr, cfg.val_fraction, task=task, seed=cfg.seed + k)
            if not va and cfg.val_fraction > 0:
                logger.warning("fold %d: too few patients per class for a validation split; training %d epochs without "
                               "early stopping", k, cfg.epochs)
        model, info = train_model(name, model_cfg, [bags[i] for i in tr], cfg, progress=progress,
                                  val_bags=[bags[i] for i in va] or None)
        test = [bags[i] for i in te]
        outs = predict_outputs(model, test, cfg.device)
        pred = predicted_classes(outs, info.get("threshold")) if task == "cls" else None
        m = _metrics(outs, test, task, pred)
        m.update(info, fold=k, n_train=len(tr), n_val=len(va), n_test=len(te))
        if task == "cls":
            m["predicted_counts"] = np.bincount(pred, minlength=len(names)).tolist()
        if on_fold is not None:
            m["diagnostics"] = on_fold(k, model, [bags[i] for i in tr], test)
        m["warnings"] = fit_warnings(name, m, k)
        for w in m["warnings"]:
            logger.warning(w)
        per_fold.append(m)
        if pred is not None:
            oof_pred.append(pred)
        logger.info("%s fold %d: %s (best epoch %d of %d)", name, k,
                    {a: round(b, 4) for a, b in m.items() if isinstance(b, float) and a in ("auc", "balanced_accuracy",
                                                                                            "c_index")},
                    info["best_epoch"], info["epochs_run"])
        prob = torch.softmax(outs, -1).numpy() if task == "cls" else None
        for j, b in enumerate(test):
            row = {"slide_id": b.slide_id, "patient_id": b.patient_id, "fold": k}
            if task == "cls":
                row.update(label=b.label, label_name=b.label_name, predicted=names[int(pred[j])])
                row.update({f"prob_{c}": float(prob[j, i]) for i, c in enumerate(names)})
            else:
                row.update(time=b.time, event=b.event, risk=float(outs[j, 0]))
            oof.append(row)
        oof_out.append(outs)
        oof_bags += test
        if save_dir:
            from safetensors.torch import save_file

            os.makedirs(save_dir, exist_ok=True)
            p = os.path.join(save_dir, f"{name}_fold{k}.safetensors")
            save_file({a: b.detach().cpu().contiguous() for a, b in model.state_dict().items()}, p + ".tmp")
            set_file_mode(p + ".tmp")  # the safetensors writer makes 0600: follow the user's umask
            os.replace(p + ".tmp", p)
    keys = [k for k in ("auc", "balanced_accuracy", "c_index") if k in per_fold[0]]
    summary = {k: _spread([f[k] for f in per_fold]) for k in keys}
    pooled = _metrics(torch.cat(oof_out, 0), oof_bags, task, np.concatenate(oof_pred) if oof_pred else None)
    return {"model": name, "task": task, "classes": names, "folds": per_fold, "summary": summary, "pooled": pooled,
            "oof": oof}


def fit_warnings(name: str, fold: dict, k: int) -> list[str]:
    """What looks wrong in one fold's fit (a training summary with ``best_epoch``, ``epochs_run`` and, for
    classification, ``predicted_counts``), each as a sentence that says what to try; empty when nothing does."""
    out = []
    first = fold.get("first_candidate") or 1  # the first epoch early stopping can keep (its score spans `smooth`)
    if fold.get("epochs_run", 0) > first and fold.get("best_epoch") == first:
        out.append(f"{name} fold {k}: the best validation epoch is the first one early stopping could keep "
                   f"(epoch {first} of {fold['epochs_run']}): the model never "
                   "improved on its validation patients after one epoch (it fits the training slides without "
                   "generalising, or the validation split is too small to tell). Try: a smaller model (--dim 32, "
                   "--depth 1), fewer patches per step (--max-patches 512), --feature-dropout 0.1, more weight decay "
                   "(--weight-decay 0.05), --batch-slides 4, --monitor auc, or mean pooling as a baseline")
    counts = fold.get("predicted_counts")
    if counts and sum(c > 0 for c in counts) == 1 and sum(counts) > 1:
        out.append(f"{name} fold {k}: every test slide is predicted as one class (balanced accuracy is chance whatever "
                   "the AUC). Try: the validation threshold (kept with a validation split, --val-fraction > 0), "
                   "class weights (--class-weights balanced), --monitor auc, or the remedies for a first best epoch")
    return out


def save_training_curves(folds: list[dict], path: str, *, title: str = "") -> str:
    """PNG of the training and validation loss per epoch of every fold (the best epoch marked); atomic write."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for f in folds:
        h, c = f["history"], colors[f["fold"] % len(colors)]
        ep = [r["epoch"] for r in h]
        ax.plot(ep, [r["train_loss"] for r in h], color=c, lw=1.2, label=f"fold {f['fold']} train")
        if any(r["val_loss"] is not None for r in h):
            ax.plot(ep, [r["val_loss"] for r in h], color=c, lw=1.2, ls="--", label=f"fold {f['fold']} val")
            ax.axvline(f["best_epoch"], color=c, lw=0.6, ls=":")
    ax.axhline(math.log(2), color="grey", lw=0.6, ls=":")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title or "training curves (dotted verticals: best validation epoch; grey: ln 2)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
