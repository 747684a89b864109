"""Training and cross-validation of slide models on patch-feature bags (one HDF5 file per slide).

Classification: cross-entropy per slide; metrics AUC (one-vs-rest macro for >2 classes) and balanced
accuracy. Survival: Cox partial likelihood over the slides of a step (Breslow ties); metric Harrell's
C-index.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pathology.mil import build_model
from pathology.querent import QuerentConfig

logger = logging.getLogger(__name__)

__all__ = ["Bag", "load_bags", "TrainConfig", "cox_loss", "concordance_index", "train_model", "evaluate",
           "cross_validate", "predict_bag"]


@dataclass
class Bag:
    """One slide's patch features and label."""

    slide_id: str
    features: torch.Tensor  # (N, D) float32
    coords: torch.Tensor  # (N, 2) int64 level-0 (x, y)
    patch_size_level0: float
    label: int = 0  # class (classification)
    time: float = 0.0  # survival time
    event: int = 0  # 1 = event observed


def load_bags(features_dir: str, labels_csv: str, *, task: str = "cls", target: str = "label",
              time_col: str = "time", event_col: str = "event", id_col: str = "slide_id") -> list[Bag]:
    """Bags for every labelled slide that has ``<features_dir>/<slide_id>.h5``; empty bags are skipped (logged)."""
    from pathology.patching import read_h5

    if not os.path.isdir(features_dir):
        raise FileNotFoundError(f"features folder not found: {features_dir!r}")
    if not os.path.isfile(labels_csv):
        raise FileNotFoundError(f"labels file not found: {labels_csv!r}")
    with open(labels_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{labels_csv!r} has no rows")
    need = [id_col] + ([target] if task == "cls" else [time_col, event_col])
    missing = [c for c in need if c not in rows[0]]
    if missing:
        raise ValueError(f"{labels_csv!r} lacks column(s) {missing}; it has {list(rows[0])}")
    bags = []
    for r in rows:
        path = os.path.join(features_dir, f"{r[id_col]}.h5")
        if not os.path.exists(path):
            logger.warning("no features for %s (%s); skipped", r[id_col], path)
            continue
        d = read_h5(path)
        if d["features"] is None:
            raise ValueError(f"{path!r} has coords but no 'features' (run the batch CLI with --task feat)")
        if len(d["coords"]) == 0:
            logger.warning("%s has no patches (no tissue); skipped", r[id_col])
            continue
        bags.append(Bag(
            slide_id=r[id_col], features=torch.from_numpy(d["features"]).float(),
            coords=torch.from_numpy(d["coords"]).long(), patch_size_level0=float(d["attrs"]["patch_size_level0"]),
            label=int(float(r[target])) if task == "cls" else 0,
            time=float(r[time_col]) if task == "survival" else 0.0,
            event=int(float(r[event_col])) if task == "survival" else 0,
        ))
    if not bags:
        raise ValueError(f"no slide of {labels_csv!r} has features in {features_dir!r}")
    return bags


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
    """Optimisation settings shared by every model."""

    epochs: int = 20  # passes over the training slides
    lr: float = 2e-4  # AdamW peak learning rate (cosine decay)
    weight_decay: float = 1e-2  # AdamW weight decay
    batch_slides: int = 1  # slides per optimizer step (survival uses >= 8 so the Cox loss has risk sets)
    max_patches: int | None = 8192  # random subset of patches per slide per training step (None = all)
    seed: int = 0  # seeds model init, shuffling and patch sampling
    device: str = "cpu"  # torch device

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_slides < 1:
            raise ValueError(f"epochs ({self.epochs}) and batch_slides ({self.batch_slides}) must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr ({self.lr}) must be > 0")


def _subsample(bag: Bag, max_patches: int | None, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = bag.features.shape[0]
    if max_patches is None or n <= max_patches:
        return bag.features, bag.coords
    idx = torch.randperm(n, generator=g)[:max_patches]
    return bag.features[idx], bag.coords[idx]


def train_model(name: str, model_cfg: QuerentConfig, bags: list[Bag], cfg: TrainConfig,
                progress: bool = False) -> tuple[nn.Module, dict]:
    """Train a fresh model ``name`` on ``bags``; returns the model (eval mode) and a summary dict."""
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    dev = torch.device(cfg.device)
    model = build_model(name, model_cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    survival = model_cfg.task == "survival"
    bs = max(cfg.batch_slides, 8) if survival else cfg.batch_slides
    steps_per_epoch = math.ceil(len(bags) / bs)
    total = cfg.epochs * steps_per_epoch
    step, t0, losses = 0, time.perf_counter(), []
    it = range(cfg.epochs)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"train {name}", unit="epoch", leave=False)
    model.train()
    for _ in it:
        order = torch.randperm(len(bags), generator=g).tolist()
        for s0 in range(0, len(order), bs):
            batch = [bags[i] for i in order[s0 : s0 + bs]]
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / max(1, total)))
            for pg in opt.param_groups:
                pg["lr"] = lr
            outs = []
            for b in batch:
                f, c = _subsample(b, cfg.max_patches, g)
                outs.append(model(f.to(dev), c.to(dev), patch_size_level0=b.patch_size_level0).logits)
            logits = torch.cat(outs, 0)  # (b, C)
            if survival:
                loss = cox_loss(logits[:, 0], torch.tensor([b.time for b in batch], device=dev),
                                torch.tensor([b.event for b in batch], device=dev))
            else:
                loss = nn.functional.cross_entropy(logits, torch.tensor([b.label for b in batch], device=dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
    model.eval()
    return model, {"steps": step, "train_seconds": round(time.perf_counter() - t0, 2),
                   "final_loss": float(np.mean(losses[-steps_per_epoch:])) if losses else float("nan")}


@torch.no_grad()
def predict_bag(model: nn.Module, bag: Bag, device: str = "cpu"):
    """Model output for one bag (eval mode, all patches)."""
    model.eval()
    return model(bag.features.to(device), bag.coords.to(device), patch_size_level0=bag.patch_size_level0)


@torch.no_grad()
def evaluate(model: nn.Module, bags: list[Bag], task: str, device: str = "cpu") -> dict:
    """AUC + balanced accuracy (cls) or C-index (survival) on ``bags``."""
    outs = torch.cat([predict_bag(model, b, device).logits.float().cpu() for b in bags], 0)
    if task == "survival":
        return {"c_index": concordance_index(np.array([b.time for b in bags]), outs[:, 0].numpy(),
                                             np.array([b.event for b in bags]))}
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    y = np.array([b.label for b in bags])
    prob = torch.softmax(outs, -1).numpy()
    res = {"balanced_accuracy": float(balanced_accuracy_score(y, prob.argmax(1)))}
    try:
        if prob.shape[1] == 2:
            res["auc"] = float(roc_auc_score(y, prob[:, 1]))
        else:
            res["auc"] = float(roc_auc_score(y, prob, multi_class="ovr", labels=list(range(prob.shape[1]))))
    except ValueError:  # a fold with one class only
        res["auc"] = float("nan")
    return res


def cross_validate(name: str, model_cfg: QuerentConfig, bags: list[Bag], cfg: TrainConfig, *, folds: int = 5,
                   progress: bool = False, save_dir: str | None = None) -> dict:
    """``folds``-fold CV (stratified on the label, or on the event for survival); metrics per fold and mean/std."""
    from sklearn.model_selection import StratifiedKFold

    if folds < 2:
        raise ValueError(f"folds ({folds}) must be >= 2")
    strat = np.array([b.event if model_cfg.task == "survival" else b.label for b in bags])
    if np.bincount(strat).min() < folds:
        raise ValueError(f"folds ({folds}) exceeds the size of the smallest class ({np.bincount(strat).min()} slides)")
    skf = StratifiedKFold(n_splits=folds, shuffle=True, random_state=cfg.seed)
    per_fold = []
    for k, (tr, te) in enumerate(skf.split(np.zeros(len(bags)), strat)):
        model, info = train_model(name, model_cfg, [bags[i] for i in tr], cfg, progress=progress)
        m = evaluate(model, [bags[i] for i in te], model_cfg.task, cfg.device)
        m.update(info, fold=k, n_train=len(tr), n_test=len(te))
        per_fold.append(m)
        logger.info("%s fold %d: %s", name, k, {a: b for a, b in m.items() if isinstance(b, float)})
        if save_dir:
            from safetensors.torch import save_file

            os.makedirs(save_dir, exist_ok=True)
            p = os.path.join(save_dir, f"{name}_fold{k}.safetensors")
            save_file({a: b.detach().cpu().contiguous() for a, b in model.state_dict().items()}, p + ".tmp")
            os.replace(p + ".tmp", p)
    keys = [k for k in per_fold[0] if k in ("auc", "balanced_accuracy", "c_index")]
    summary = {k: {"mean": float(np.nanmean([f[k] for f in per_fold])), "std": float(np.nanstd([f[k] for f in per_fold]))}
               for k in keys}
    return {"model": name, "task": model_cfg.task, "folds": per_fold, "summary": summary}
