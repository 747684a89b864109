"""``apps.ncal.train`` under ``torchrun``: two CPU processes (gloo) on a tiny JSONL the test writes."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("甲", "乙", "丙")
WORDS = {"甲": "加减乘除", "乙": "面积周长", "丙": "速度时间"}


def _write(path: Path, n_per, seed: int) -> int:
    rng = random.Random(seed)
    lines = []
    for c, n in zip(CLASSES, n_per):
        for i in range(n):
            text = "".join(rng.choice(WORDS[c]) for _ in range(rng.randint(3, 10))) + "。"
            lines.append(json.dumps({"id": f"{c}{i}", "question": text, "class": c}, ensure_ascii=False))
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path):
    from apps.ncal.encoder import EncoderConfig, TextEncoder
    from apps.ncal.model import infer, load_checkpoint
    from apps.ncal.pretrain import save_encoder
    from apps.ncal.tokenizer import CharTokenizer

    n_train = _write(tmp_path / "tr.jsonl", (20, 8, 4), seed=0)
    _write(tmp_path / "te.jsonl", (3, 3, 3), seed=1)
    tok = CharTokenizer.train(["".join(WORDS.values()) + "。"], min_freq=1, max_length=16)
    torch.manual_seed(0)
    enc = TextEncoder(EncoderConfig(vocab_size=len(tok), dim=16, num_layers=1, num_heads=2, max_length=16, dropout=0.0))
    save_encoder(tmp_path / "enc", enc, tok, {"step": 0})

    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "apps.ncal.train",
           "--dataset", str(tmp_path / "tr.jsonl"), "--test", str(tmp_path / "te.jsonl"), "--loss", "tc",
           "--encoder", str(tmp_path / "enc"), "--epochs", "2", "--batch-size", "4", "--valid-frac", "0.2",
           "--device", "cpu", "--threads", "1", "--out", str(out), "--log-level", "WARNING"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    n_valid = 4 + 2 + 1  # round(0.2 n) per class, at least 1
    steps_per_epoch = math.ceil(math.ceil((n_train - n_valid) / 4) / 2)  # each process takes every 2nd batch
    state = torch.load(out / "last.pt", weights_only=False, map_location="cpu")
    assert state["step"] == 2 * steps_per_epoch
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]  # only rank 0 writes
    assert all("valid_macro_f1" in r and "test_macro_f1" in r for r in rows)
    meta = json.loads((out / "ncal.json").read_text(encoding="utf-8"))
    assert meta["steps"] == state["step"] and meta["valid_split"]["n_valid"] == n_valid and meta["test"]["n"] == 9
    ck = load_checkpoint(out)
    moved = any(not torch.equal(ck.model.encoder.state_dict()[k], v) for k, v in enc.state_dict().items())
    assert moved  # the averaged gradients were applied
    probs, _ = infer(ck.model, ck.tokenizer, ["加减乘除。", "速度时间。"])
    torch.testing.assert_close(probs.sum(1), torch.ones(2))
