"""Pretraining: loss goes down, checkpoints resume exactly, 2-process DDP (gloo) runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tabular import pretrain
from tabular.prior import PriorConfig, TablePrior
from tabular.weights_io import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "tiny", "--batch-size", "2", "--max-rows", "48", "--max-features", "4", "--val-tables", "8",
        "--threads", "1", "--no-progress", "--warmup", "2"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def test_training_steps_reduce_loss():
    args = pretrain.build_parser().parse_args(["--config", "tiny", "--lr", "3e-3", "--warmup", "1", "--batch-size", "4"])
    args.max_rows, args.max_features = None, None
    trainer = pretrain.Trainer(args)
    batch = TablePrior(PriorConfig(max_width=16), seed=int(torch.randint(0, 1000, (1,)))).sample(4, 64, 40, n_features=4)
    trainer.prior.sample = trainer.easy_prior.sample = lambda *a, **k: batch  # one fixed batch: its loss must fall

    def loss_now():
        with torch.no_grad():
            logits = trainer.model(batch.X, batch.y[:, : batch.n_train])
            return pretrain.masked_loss(logits, batch.y[:, batch.n_train :], batch.n_classes)[0].item()

    before = loss_now()
    for _ in range(25):
        m = trainer.train_step()
        assert m["grad_norm"] >= 0 and m["lr"] > 0
    assert loss_now() < before - 0.05
    assert trainer.step == 25 and trainer.tables_seen == 100


def test_size_options_cap_or_replace_the_curriculum_bounds():
    def stage(*argv, step=0):
        trainer = pretrain.Trainer(pretrain.build_parser().parse_args(["--config", "tiny", *argv]))
        trainer.step = step
        return trainer.stage()

    plain = stage()
    assert (plain.max_rows, plain.max_features) == (256, 20)
    assert stage("--max-features", "64").max_features == 20  # a cap never raises the stage's bound
    assert stage("--max-features", "8").max_features == 8
    assert stage("--feature-bound", "64").max_features == 64
    assert stage("--feature-bound", "64", "--max-features", "30").max_features == 30
    capped = stage("--max-rows", "100", step=3000)
    assert (capped.min_rows, capped.max_rows, capped.max_features) == (100, 100, 40)


def test_anneal_decays_the_rate_linearly_to_zero():
    args = pretrain.build_parser().parse_args(["--config", "tiny", "--warmup", "10", "--anneal-from", "100",
                                               "--anneal-steps", "50"])
    factor = pretrain.Trainer(args)._lr_factor
    assert factor(4) == 0.5 and factor(99) == 1.0 and factor(100) == 1.0
    assert factor(125) == 0.5 and factor(150) == 0.0 and factor(400) == 0.0
    plain = pretrain.Trainer(pretrain.build_parser().parse_args(["--config", "tiny", "--warmup", "10"]))._lr_factor
    assert plain(125) == 1.0


def test_masked_loss_ignores_absent_classes():
    logits = torch.randn(2, 5, 10)
    y = torch.randint(0, 2, (2, 5))
    n_classes = torch.tensor([2, 2])
    big = logits.clone()
    big[..., 2:] = 50.0  # huge logits for classes the tables do not have
    torch.testing.assert_close(pretrain.masked_loss(logits, y, n_classes)[0], pretrain.masked_loss(big, y, n_classes)[0])


def test_resume_is_exact(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert pretrain.main([*TINY, "--out", str(a), "--steps", "4", "--val-every", "2", "--ckpt-every", "2"]) == 0
    assert pretrain.main([*TINY, "--out", str(b), "--steps", "2", "--val-every", "2", "--ckpt-every", "2"]) == 0
    assert pretrain.main([*TINY, "--out", str(b), "--steps", "4", "--val-every", "2", "--ckpt-every", "2", "--resume"]) == 0
    sa = torch.load(a / "last.pt", weights_only=False)
    sb = torch.load(b / "last.pt", weights_only=False)
    assert sa["step"] == sb["step"] == 4 and sa["tables_seen"] == sb["tables_seen"] == 8
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=0, atol=0)
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "val_loss" in rows[-1]
    # Each invocation is recorded with the step it started from.
    assert [c["from_step"] for c in sb["commands"]] == [0, 2] and "--resume" in sb["commands"][1]["command"]
    assert [c["from_step"] for c in sa["commands"]] == [0]
    assert sb["max_features_seen"] == max(r["features"] for r in rows) == sa["max_features_seen"]
    best = json.loads((b / "best.json").read_text())
    assert best["pretrained_max_features"] == max(r["features"] for r in rows if r["step"] <= best["step"])
    # A checkpoint from before the width was tracked: the resume reads it back from the per-step log.
    old = {k: v for k, v in sb.items() if k != "max_features_seen"}
    torch.save(old, b / "last.pt")
    assert pretrain.main([*TINY, "--out", str(b), "--steps", "5", "--val-every", "5", "--resume"]) == 0
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert torch.load(b / "last.pt", weights_only=False)["max_features_seen"] == max(r["features"] for r in rows)
    model = load_model(b / "best.safetensors")
    assert model.config.embed_dim == 16
    with pytest.raises(SystemExit, match="--resume"):
        pretrain.main([*TINY, "--out", str(a), "--steps", "5"])


def test_init_from_exported_weights_continues_the_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert pretrain.main([*TINY, "--out", str(a), "--steps", "3", "--val-every", "3"]) == 0
    src = load_model(a / "last.safetensors")
    assert src.card["step"] == 3 and src.card["tables_seen"] == 6
    assert pretrain.main([*TINY, "--out", str(b), "--steps", "3", "--init-from", str(a / "last.safetensors")]) == 0
    sb = torch.load(b / "last.pt", weights_only=False)  # already at --steps: no step taken, weights unchanged
    assert sb["step"] == 3 and sb["tables_seen"] == 6 and sb["max_features_seen"] == src.card["pretrained_max_features"]
    for k, v in src.state_dict().items():
        torch.testing.assert_close(sb["model"][k], v, rtol=0, atol=0)
    assert [c["from_step"] for c in sb["commands"]] == [0, 3]
    assert sb["scheduler"]["last_epoch"] == 3  # the rate schedule continues at the run's step
    assert pretrain.main([*TINY, "--out", str(b), "--steps", "5", "--resume"]) == 0
    assert torch.load(b / "last.pt", weights_only=False)["step"] == 5
    with pytest.raises(ValueError, match="not --config"):
        pretrain.main([*TINY, "--config", "small", "--out", str(tmp_path / "c"), "--steps", "4",
                       "--init-from", str(a / "last.safetensors")])
    with pytest.raises(SystemExit, match="--resume"):
        pretrain.main([*TINY, "--out", str(b), "--steps", "6", "--resume", "--init-from", str(a / "last.safetensors")])


def test_init_from_weights_without_the_ridge_readout_adds_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert pretrain.main([*TINY, "--out", str(a), "--steps", "2", "--val-every", "2"]) == 0
    ridge = ["--icl-ridge", "0.1", "1"]
    assert pretrain.main([*TINY, *ridge, "--out", str(b), "--steps", "4", "--init-from",
                          str(a / "last.safetensors")]) == 0
    m = load_model(b / "last.safetensors")
    assert m.config.icl_ridge == (0.1, 1.0) and m.card["step"] == 4
    assert m.icl.ridge_proj.weight.abs().sum() > 0  # the readout trained from its zero start
    src = load_model(a / "last.safetensors")
    assert not src.config.icl_ridge and not hasattr(src.icl, "ridge_proj")
    assert pretrain.main([*TINY, *ridge, "--out", str(b), "--steps", "5", "--resume"]) == 0
    with pytest.raises(ValueError, match=r"\(0.1, 1.0\).*--icl-ridge \(none\)"):  # resuming needs it
        pretrain.main([*TINY, "--out", str(b), "--steps", "6", "--resume"])
    with pytest.raises(ValueError, match="not --config"):  # weights with a readout cannot drop it
        pretrain.main([*TINY, "--out", str(tmp_path / "c"), "--steps", "6", "--init-from", str(b / "last.safetensors")])


def test_init_from_weights_with_one_readout_adds_the_logistic_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ridge, logistic = ["--icl-ridge", "0.3"], ["--icl-logistic", "0.01", "0.1"]
    assert pretrain.main([*TINY, *ridge, "--out", str(a), "--steps", "2", "--val-every", "2"]) == 0
    assert pretrain.main([*TINY, *ridge, *logistic, "--out", str(b), "--steps", "4", "--init-from",
                          str(a / "last.safetensors")]) == 0
    m, src = load_model(b / "last.safetensors"), load_model(a / "last.safetensors")
    assert m.config.icl_logistic == (0.01, 0.1) and m.config.icl_ridge == (0.3,) and m.card["step"] == 4
    assert m.icl.logit_proj.weight.abs().sum() > 0  # trained from its zero start
    assert m.icl.ridge_proj.weight.abs().sum() > 0  # the readout it had keeps training
    assert not src.config.icl_logistic and not hasattr(src.icl, "logit_proj")
    with pytest.raises(ValueError, match=r"--icl-logistic \(none\)"):  # resuming needs the same readouts
        pretrain.main([*TINY, *ridge, "--out", str(b), "--steps", "6", "--resume"])


def test_sigterm_checkpoints_the_current_step_and_resume_drops_later_log_records(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tabular.pretrain", *TINY, "--out", str(out), "--steps", "100000",
           "--val-every", "100000", "--ckpt-every", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "stopping on signal" in err
    state = torch.load(out / "last.pt", weights_only=False)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert state["step"] >= 3 and steps == list(range(1, state["step"] + 1))
    # A stop between checkpoints (a kill) leaves log records past the checkpoint; a resume drops them.
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": state["step"] + 1, "loss": 0.0}) + "\n")
    assert pretrain.main([*TINY, "--out", str(out), "--steps", str(state["step"] + 1), "--resume"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, state["step"] + 2)) and rows[-1]["loss"] > 0


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tabular.pretrain",
           *TINY, "--out", str(out), "--steps", "3", "--val-every", "3", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(out / "last.pt", weights_only=False)
    assert state["step"] == 3 and state["world"] == 2 and state["tables_seen"] == 3 * 2 * 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3  # only rank 0 writes
