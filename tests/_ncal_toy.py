"""Toy NCAL data and a tiny random encoder folder, shared by the NCAL tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from apps.ncal.data import Example

CLASSES = ("甲", "乙", "丙")
WORDS = {"甲": "加减乘除", "乙": "面积周长", "丙": "速度时间"}


def toy_examples(n_per=(24, 8, 4), seed=0) -> list[Example]:
    """Three long-tailed classes whose texts draw characters from disjoint sets (so they are learnable)."""
    rng = random.Random(seed)
    out = []
    for c, n in zip(CLASSES, n_per):
        for i in range(n):
            text = "".join(rng.choice(WORDS[c]) for _ in range(rng.randint(3, 12))) + rng.choice("，。？")
            out.append(Example(text=text, label=c, id=f"{c}{i}", line=len(out) + 1))
    rng.shuffle(out)
    return out


def write_tiny_encoder(d: Path, texts: list[str]) -> Path:
    """A tiny randomly initialised encoder folder in ``d``, as ``apps.ncal.pretrain`` writes it."""
    from apps.ncal.encoder import EncoderConfig, TextEncoder
    from apps.ncal.pretrain import save_encoder
    from apps.ncal.tokenizer import CharTokenizer

    tok = CharTokenizer.train(texts, min_freq=1, max_length=24)
    torch.manual_seed(0)
    enc = TextEncoder(EncoderConfig(vocab_size=len(tok), dim=16, num_layers=1, num_heads=2, max_length=24, dropout=0.0))
    save_encoder(d, enc, tok, {"step": 0})
    return d
