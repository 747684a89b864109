"""``NCALClassifier``: scikit-learn ``fit`` / ``predict`` / ``predict_proba`` on lists of texts or data rows.

>>> from apps.ncal import NCALClassifier
>>> clf = NCALClassifier.load("tmwpl")              # the shipped model
>>> clf.predict(["小明有5个苹果，又买了3个，现在有几个？"])
>>> NCALClassifier.load("pmtd").predict(rows)       # PMTD JSONL rows (dicts with dialog_history), as they are
>>> clf = NCALClassifier(loss="tc", epochs=4).fit(texts, labels)   # your own long-tailed labels

``predict``, ``predict_proba`` and ``transform`` take strings as model inputs already formatted, or the datasets'
own rows (dicts, or a pandas DataFrame), which they format as the model's training data was formatted
(:mod:`apps.ncal.inputs`): the shipped PMTD model saw the previous turn and the current one, each with its
speaker, and a row gives them through ``dialog_history``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from apps.ncal.data import DATASETS, Example, check_texts
from apps.ncal.inputs import model_inputs, row_layout

logger = logging.getLogger(__name__)

__all__ = ["NCALClassifier", "resolve_checkpoint", "WEIGHTS_DIR"]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A shipped model name (``tmwpl``, ``pmtd``) or a checkpoint folder → its folder."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if str(name_or_path).lower() in DATASETS:
        shipped = WEIGHTS_DIR / str(name_or_path).lower()
        if not (shipped / "ncal.json").is_file():
            raise FileNotFoundError(f"the shipped {name_or_path!r} model is missing at {shipped}")
        return shipped
    raise FileNotFoundError(f"no checkpoint folder at {name_or_path!r}; give a folder written by apps.ncal.train "
                            f"or a shipped model name {sorted(DATASETS)}")


class NCALClassifier(ClassifierMixin, BaseEstimator):
    """Long-tailed text classifier: the NCAL encoder fine-tuned with a long-tail loss (default ``tc``).

    Args:
        loss: ``ce``, ``tc``, ``cb``, ``la``, ``focal`` or ``etf`` (see :mod:`apps.ncal.losses`).
        epochs: passes over the training texts.
        batch_size: texts per step.
        lr: peak learning rate.
        encoder: ``default`` (shipped MLM-pretrained character transformer), ``scratch``, a pretrain folder, or
            ``hf:/path/to/model``.
        lora_r: LoRA rank for an ``hf:`` encoder.
        tc_lambda: TC weight.
        bank_size: TC feature bank size.
        seed: training seed.
        device: torch device (default: CUDA if available).
        work_dir: where ``fit`` writes its run folder (default: a new temporary folder).
        batch_size_predict: texts per inference batch.
    """

    def __init__(self, *, loss: str = "tc", epochs: int = 4, batch_size: int = 32, lr: float = 2e-4,
                 encoder: str = "default", lora_r: int = 0, tc_lambda: float = 0.1, bank_size: int = 256,
                 seed: int = 0, device: str | None = None, work_dir: str | None = None,
                 batch_size_predict: int = 64) -> None:
        self.loss = loss
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.encoder = encoder
        self.lora_r = lora_r
        self.tc_lambda = tc_lambda
        self.bank_size = bank_size
        self.seed = seed
        self.device = device
        self.work_dir = work_dir
        self.batch_size_predict = batch_size_predict

    def fit(self, X, y) -> "NCALClassifier":
        """Fine-tune on texts ``X`` (strings, used as they are) with labels ``y`` (any hashable labels; at least
        2 classes). The fitted model then predicts from strings only (it records no row layout)."""
        from apps.ncal.model import load_checkpoint
        from apps.ncal.train import TrainConfig, train

        texts = check_texts(X)
        y = list(y)
        if len(y) != len(texts):
            raise ValueError(f"X has {len(texts)} texts but y has {len(y)} labels")
        classes = np.unique(np.asarray(y, dtype=object).astype(str) if not _all_numbers(y) else np.asarray(y))
        if len(classes) < 2:
            raise ValueError(f"need at least 2 classes, got {list(classes)}")
        names = tuple(str(c) for c in classes)
        if len(set(names)) != len(names):
            raise ValueError(f"labels {list(classes)} are not distinct as text")
        train_ex = [Example(text=t, label=str(lab), id=str(i), line=i + 1) for i, (t, lab) in enumerate(zip(texts, y))]
        out = Path(self.work_dir) if self.work_dir else Path(tempfile.mkdtemp(prefix="ncal_fit_"))
        cfg = TrainConfig(dataset="user", out=str(out), loss=self.loss, epochs=self.epochs, batch_size=self.batch_size,
                          lr=self.lr, encoder=self.encoder, lora_r=self.lora_r, tc_lambda=self.tc_lambda,
                          bank_size=self.bank_size, seed=self.seed, device=self.device)
        train(cfg, progress=False, examples=(train_ex, None, names))
        self._set_checkpoint(load_checkpoint(out, device=self.device), classes)
        return self

    def _set_checkpoint(self, ckpt, classes) -> None:
        self.checkpoint_ = ckpt
        self.classes_ = np.asarray(classes)
        model_classes = ckpt.classes
        order = {c: k for k, c in enumerate(model_classes)}
        self.column_order_ = np.asarray([order[str(c)] for c in self.classes_])
        self.n_features_in_ = 1

    @classmethod
    def load(cls, name_or_path: str | Path, *, device: str | None = None,
             base_model: str | Path | None = None) -> "NCALClassifier":
        """A fitted classifier from a shipped model name (``tmwpl``, ``pmtd``) or a checkpoint folder
        (``base_model``: an adapter's base model folder, when not where its ``ncal.json`` says)."""
        from apps.ncal.model import load_checkpoint

        ckpt = load_checkpoint(resolve_checkpoint(name_or_path), device=device, base_model=base_model)
        s = ckpt.meta.get("settings", {})
        est = cls(loss=ckpt.meta["loss"]["name"], epochs=s.get("epochs", 4), seed=s.get("seed", 0), device=device)
        est._set_checkpoint(ckpt, np.asarray(sorted(ckpt.classes)))
        return est

    def _inputs(self, X) -> list[str]:
        meta = self.checkpoint_.meta
        return model_inputs(X, layout=row_layout(meta), context=meta.get("context", "past"))

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``(N, K)``, columns in ``classes_`` order.

        Args:
            X: a list of model inputs: strings, taken as already formatted and used unchanged (a PMTD turn as
                :func:`apps.ncal.data.format_turn` makes it), and/or rows of the data the model was trained on as
                dicts, formatted as training formatted them (the shipped ``pmtd`` model: ``dialog_content`` and
                ``dialog_history``; ``tmwpl``: ``question``; other keys are ignored). Also one row dict, or a
                pandas DataFrame of rows. A model fitted on texts takes strings only.

        Raises:
            ValueError: a row missing a field (named, with what is accepted), an empty text, an item of
                another type.
        """
        from apps.ncal.model import infer

        check_is_fitted(self, "checkpoint_")
        texts = self._inputs(X)
        probs, _ = infer(self.checkpoint_.model, self.checkpoint_.tokenizer, texts, batch_size=self.batch_size_predict)
        return probs.numpy()[:, self.column_order_]

    def predict(self, X) -> np.ndarray:
        """Predicted labels ``(N,)`` from ``classes_``; ``X`` as for :meth:`predict_proba` (strings or rows).

        An LLM model that reads a sampled answer (``predict = "sample"``, the reference preset) gives a row of
        zeros in :meth:`predict_proba` when the answer names no class; :meth:`predict` then takes that row's
        class-set argmax (the ``constrained`` reading) and logs how many rows it did so for, instead of a class
        the model never named.
        """
        from apps.ncal.model import infer

        proba = self.predict_proba(X)  # checks fitting first
        pred = proba.argmax(1)
        unmatched = np.flatnonzero(proba.sum(1) <= 0)
        if unmatched.size:
            model = self.checkpoint_.model
            texts = self._inputs(X)
            logger.warning("%d of %d sampled answers named no class; those rows take the class-set argmax",
                           unmatched.size, len(pred))
            mode, model.predict = model.predict, "constrained"
            try:
                p, _ = infer(model, self.checkpoint_.tokenizer, [texts[i] for i in unmatched],
                             batch_size=self.batch_size_predict)
            finally:
                model.predict = mode
            pred[unmatched] = p.numpy()[:, self.column_order_].argmax(1)
        return self.classes_[pred]

    def transform(self, X) -> np.ndarray:
        """The sentence features ``(N, D)`` the classifier reads (for collapse analysis or other models); ``X`` as
        for :meth:`predict_proba`."""
        from apps.ncal.model import infer

        check_is_fitted(self, "checkpoint_")
        _, feats = infer(self.checkpoint_.model, self.checkpoint_.tokenizer, self._inputs(X),
                         batch_size=self.batch_size_predict)
        return feats.numpy()


def _all_numbers(y) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in y)
