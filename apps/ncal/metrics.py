"""Classification metrics for long-tailed sets: accuracy, macro-F1, per-class recall, head/medium/tail recall,
confusion matrix, and the neural-collapse measures of a set of features."""

from __future__ import annotations

import numpy as np
import torch

from core.collapse import class_mean_cosines, mean_offdiag_cosine, nc1, nc2

__all__ = ["classification_metrics", "collapse_metrics", "confusion_matrix"]


def confusion_matrix(y_true, y_pred, num_classes: int) -> np.ndarray:
    """``(K, K)`` counts; row = true class, column = predicted class."""
    cm = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(cm, (np.asarray(y_true, dtype=np.int64), np.asarray(y_pred, dtype=np.int64)), 1)
    return cm


def classification_metrics(y_true, y_pred, classes: list[str], bins: dict[str, str] | None = None) -> dict:
    """Accuracy, macro-F1 (mean over all K classes of per-class F1, 0 for a class never predicted nor present),
    per-class recall and F1, recall averaged over each long-tail bin (classes present in ``y_true`` only), the
    confusion matrix. Values in [0, 1]. A prediction of -1 (no class) counts as wrong; ``unmatched`` counts them."""
    K = len(classes)
    y_true, y_pred = np.asarray(y_true, dtype=np.int64), np.asarray(y_pred, dtype=np.int64)
    none = y_pred < 0  # a prediction of no class (a sampled answer that named none): wrong, nobody's false positive
    cm = confusion_matrix(y_true[~none], y_pred[~none], K)
    tp = np.diag(cm).astype(float)
    support = (cm.sum(1) + np.bincount(y_true[none], minlength=K)).astype(float)
    predicted = cm.sum(0).astype(float)
    recall = np.divide(tp, support, out=np.zeros(K), where=support > 0)
    precision = np.divide(tp, predicted, out=np.zeros(K), where=predicted > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(K), where=(precision + recall) > 0)
    out = {
        "n": int(len(y_true)),
        "accuracy": float(tp.sum() / max(len(y_true), 1)),
        "macro_f1": float(f1.mean()),
        "recall": {c: float(recall[k]) for k, c in enumerate(classes)},
        "f1": {c: float(f1[k]) for k, c in enumerate(classes)},
        "confusion": cm.tolist(),
    }
    if none.any():
        out["unmatched"] = int(none.sum())
    if bins:
        for b in ("head", "medium", "tail"):
            ks = [k for k, c in enumerate(classes) if bins.get(c) == b and support[k] > 0]
            out[f"recall_{b}"] = float(recall[ks].mean()) if ks else None
    return out


def collapse_metrics(feats_ND: torch.Tensor, y_N, num_classes: int) -> dict:
    """NC1, NC2, the mean cosine of different classes' raw means and the centred class-mean cosine matrix (list of lists; NaN → None) of features."""
    y = torch.as_tensor(np.asarray(y_N), dtype=torch.long)
    cos = class_mean_cosines(feats_ND, y, num_classes)
    return {
        "nc1": nc1(feats_ND, y, num_classes),
        "nc2": nc2(feats_ND, y, num_classes),
        "cos_mean": mean_offdiag_cosine(feats_ND, y, num_classes),  # raw class means (ETF: -1/(K-1))
        "cosines": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in cos.tolist()],
    }
