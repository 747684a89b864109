"""Character tokenizer for Chinese educational text, built here from the training text (nothing downloaded).

Chinese is written without spaces and most of its meaning sits in single characters, so the vocabulary is the
set of characters seen at least ``min_freq`` times in the train text of both sets (after NFKC normalisation,
which folds full-width digits, letters and punctuation onto their ASCII forms, and lower-casing). Unseen
characters map to ``[UNK]``. Saved as ``tokenizer.json``: ``{"kind": "char", "vocab": [...], "max_length": N}``.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from core.infra.fileio import write_text_atomic

__all__ = ["CharTokenizer", "SPECIALS", "normalize"]

#: Special tokens, in id order.
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def normalize(text: str) -> str:
    """NFKC + lower case + whitespace runs folded to one space (newlines kept: they separate dialogue turns)."""
    t = unicodedata.normalize("NFKC", text).lower()
    lines = [" ".join(line.split()) for line in t.split("\n")]
    return "\n".join(line for line in lines if line)


class CharTokenizer:
    """Character vocabulary with ``[CLS] chars… [SEP]`` encoding, truncation and right padding.

    Args:
        vocab: token strings; the first ``len(SPECIALS)`` must be :data:`SPECIALS`.
        max_length: longest encoding in tokens, specials included (longer texts keep their *end*, where the
            current dialogue turn and a problem's question sit).
    """

    def __init__(self, vocab: Sequence[str], *, max_length: int = 160) -> None:
        vocab = list(vocab)
        if tuple(vocab[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocab must start with {SPECIALS}, got {vocab[:len(SPECIALS)]}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab has duplicate entries")
        if max_length < 3:
            raise ValueError(f"max_length must be at least 3, got {max_length}")
        self.vocab = vocab
        self.max_length = int(max_length)
        self.index = {t: i for i, t in enumerate(vocab)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(len(SPECIALS))

    def __len__(self) -> int:
        return len(self.vocab)

    @classmethod
    def train(cls, texts: Iterable[str], *, min_freq: int = 2, max_size: int = 6000, max_length: int = 160) -> "CharTokenizer":
        """Vocabulary of characters seen ``min_freq`` times or more (at most ``max_size`` tokens, most frequent)."""
        counts = Counter(ch for t in texts for ch in normalize(t))
        chars = sorted((c for c, n in counts.items() if n >= min_freq), key=lambda c: (-counts[c], c))
        return cls(list(SPECIALS) + chars[: max(0, max_size - len(SPECIALS))], max_length=max_length)

    def ids(self, text: str) -> list[int]:
        """Token ids of one text: ``[CLS]`` + characters (the last ``max_length - 2`` of them) + ``[SEP]``."""
        chars = normalize(text)[-(self.max_length - 2):]
        return [self.cls_id] + [self.index.get(c, self.unk_id) for c in chars] + [self.sep_id]

    def batch(self, texts: Sequence[str], *, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """``{"input_ids": (B, S) long, "attention_mask": (B, S) bool (True = real token)}``, padded on the right
        to the longest text of the batch."""
        seqs = [self.ids(t) for t in texts]
        S = max(len(s) for s in seqs)
        ids_BS = torch.full((len(seqs), S), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids_BS[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        ids_BS = ids_BS.to(device) if device is not None else ids_BS
        return {"input_ids": ids_BS, "attention_mask": ids_BS != self.pad_id}

    def to_json(self) -> str:
        return json.dumps({"kind": "char", "max_length": self.max_length, "vocab": self.vocab}, ensure_ascii=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` atomically."""
        return write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:  # a half-written or foreign file
            raise ValueError(f"{path} is not a readable tokenizer file ({err}); expected the tokenizer.json written by "
                             "apps.ncal.train") from None
        if not isinstance(d, dict) or d.get("kind") != "char":
            kind = d.get("kind") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{path}: not a character tokenizer file (kind={kind!r})")
        try:
            return cls(d["vocab"], max_length=int(d["max_length"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: not a character tokenizer file ({type(err).__name__}: {err})") from None
