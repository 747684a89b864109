"""CoMemo training CLI: stages freeze the right parts, exact resume, metrics.jsonl, DDP on 2 CPU processes;
greedy answers agree with the teacher-forced logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apps.comemo.batch import build_batch
from apps.comemo.infer import generate_answer
from apps.comemo.model import CoMemoConfig, CoMemoModel, VisionConfig
from apps.comemo.synthetic import make_sample
from apps.comemo.tokenizer import CoMemoTokenizer
from apps.comemo.train import main, set_stage

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dim", "32", "--depth", "2", "--heads", "2", "--cross-every", "1", "--tile", "16", "--vision-dim", "16",
        "--vision-depth", "1", "--batch-size", "2", "--max-images", "3", "--val-samples", "2", "--no-progress",
        "--device", "cpu"]


def _tiny_model(variant="comemo", vocab=320):
    return CoMemoModel(CoMemoConfig(variant=variant, vocab_size=vocab, dim=32, depth=2, num_heads=2, cross_every=1,
                                    vision=VisionConfig(tile=16, dim=16, depth=1)))


def test_stages_train_the_right_parameters():
    m = _tiny_model()
    s0 = set_stage(m, 0)
    assert s0 and all(n.startswith("decoder.") and not n.startswith("decoder.cross.") for n in s0)
    s1 = set_stage(m, 1)
    assert {n.split(".")[0] for n in s1} == {"projector", "decoder"}
    assert all(n.startswith(("projector.", "decoder.cross.")) for n in s1) and any(n.endswith("attn_gate") for n in s1)
    s2 = set_stage(m, 2)  # the released phase 2: LLM and ViT frozen, gates frozen
    assert not any(n.endswith(("attn_gate", "ff_gate")) for n in s2)
    assert all(n.startswith(("projector.", "decoder.cross.")) for n in s2) and any(n.startswith("projector.") for n in s2)
    assert any(n.startswith("decoder.cross.") for n in s2)
    assert all(not p.requires_grad for n, p in m.named_parameters() if n not in s2)
    frozen = set_stage(m, 3, freeze_gates=True)
    assert not any(n.endswith(("attn_gate", "ff_gate")) for n in frozen) and len(frozen) == len(list(m.parameters())) - 2 * len(m.decoder.cross)
    s3 = set_stage(m, 3)
    assert len(s3) == len(list(m.parameters()))
    with pytest.raises(ValueError, match="unknown stage"):
        set_stage(m, 4)


def test_resume_is_exact_and_stages_chain(tmp_path):
    common = [*TINY, "--variant", "comemo", "--stage", "1", "--steps", "4", "--val-every", "2", "--ckpt-every", "2"]
    assert main([*common, "--out", str(tmp_path / "full")]) == 0
    assert main([*common, "--out", str(tmp_path / "part"), "--max-minutes", "0"]) == 0  # stops before step 1
    part = torch.load(tmp_path / "part" / "last.pt", weights_only=False)
    assert part["step"] == 0
    # two steps, then resume to four
    common2 = [c if c != "4" else "2" for c in common]
    assert main([*common2, "--out", str(tmp_path / "half")]) == 0
    assert main([*common, "--out", str(tmp_path / "half"), "--resume"]) == 0
    a = load_file(tmp_path / "full" / "model.safetensors")
    b = load_file(tmp_path / "half" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in full]
    assert "val_loss" in rows[1] and "gates" in rows[0]
    with pytest.raises(SystemExit, match="exists"):
        main([*common, "--out", str(tmp_path / "full")])
    # stage 2 from stage 1: the gates stay where stage 1 left them
    assert main([*TINY, "--variant", "comemo", "--stage", "2", "--steps", "2", "--out", str(tmp_path / "s2"),
                 "--init-from", str(tmp_path / "full" / "model.safetensors")]) == 0
    c = load_file(tmp_path / "s2" / "model.safetensors")
    gates = [k for k in a if k.endswith(("attn_gate", "ff_gate"))]
    assert gates and all(torch.equal(a[k], c[k]) for k in gates)
    assert torch.equal(a["vision.pos"], c["vision.pos"])  # stage 2 keeps the ViT and the LLM frozen
    assert torch.equal(a["decoder.layers.0.attn.q_proj.weight"], c["decoder.layers.0.attn.q_proj.weight"])
    assert not torch.equal(a["projector.fc1.weight"], c["projector.fc1.weight"])
    assert (tmp_path / "s2" / "tokenizer.json").read_text() == (tmp_path / "full" / "tokenizer.json").read_text()


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown --variant"):
        main([*TINY, "--variant", "llava", "--stage", "1", "--out", str(tmp_path)])


def test_greedy_answer_matches_teacher_forcing(tmp_path):
    main([*TINY, "--variant", "comemo", "--stage", "3", "--steps", "2", "--out", str(tmp_path)])
    tok = CoMemoTokenizer.load(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    m = CoMemoModel.load(tmp_path / "model.safetensors")
    for block in m.decoder.cross.values():  # open the memory path so both paths matter
        block.attn_gate.data.fill_(0.7)
        block.ff_gate.data.fill_(0.3)
    s = make_sample("needle", 3, 5, tile=16)
    res = generate_answer(m, tok, s.images, s.question, max_new_tokens=6)
    assert len(res["tokens"]) >= 1 and res["seconds"] > 0
    # feed prompt + generated tokens at once: each generated token is the argmax after its prefix
    ids = res["tokens"]
    b = build_batch([(s.images, s.question, None)], tok, m.cfg)
    P = b.input_ids.shape[1]
    full = build_batch([(s.images, s.question, tok.decode(ids))], tok, m.cfg)
    assert full.input_ids[0, P:P + len(ids)].tolist() == ids
    with torch.no_grad():
        logits = m(full).logits[0]
    assert logits[P - 1:P - 1 + len(ids)].argmax(-1).tolist() == ids


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "apps.comemo.train",
           *TINY, "--variant", "comemo", "--stage", "1", "--steps", "2", "--val-every", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(out / "last.pt", weights_only=False)
    assert state["step"] == 2 and state["world"] == 2 and state["samples_seen"] == 2 * 2 * 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # only rank 0 writes

