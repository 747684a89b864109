"""CoMemo faces: ``CoMemo.load(...).answer``, the predict CLI, and clear errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from apps.comemo import CoMemo
from apps.comemo.model import CoMemoConfig, CoMemoModel, VisionConfig
from apps.comemo.predict import main as predict_main
from apps.comemo.synthetic import corpus_texts, make_sample
from apps.comemo.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("comemo_run")
    tok = train_tokenizer(corpus_texts(), vocab_size=320)
    torch.manual_seed(0)
    m = CoMemoModel(CoMemoConfig(variant="comemo", vocab_size=tok.vocab_size, dim=32, depth=2, num_heads=2,
                                 cross_every=1, max_images=4, max_context=200, max_pixels=96 * 96,
                                 vision=VisionConfig(tile=16, dim=16, depth=1)))
    m.save(d / "model.safetensors")
    tok.save(d / "tokenizer.json")
    s = make_sample("needle", 2, 3, tile=16)
    for i, a in enumerate(s.images):
        Image.fromarray(a).save(d / f"img{i}.png")
    return d


def test_import_does_no_work():
    code = "import sys, apps.comemo; print('apps.comemo.model' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_default_weights_load_and_answer():
    model = CoMemo.load()  # no path: the shipped default
    assert model.variant == "comemo"
    s = make_sample("needle", 3, 123, tile=model.model.cfg.vision.tile, needle=1)
    assert isinstance(model.answer(s.images, s.question), str)


def test_answer_accepts_paths_pil_and_arrays(run_dir):
    model = CoMemo.load(run_dir)
    assert model.variant == "comemo"
    paths = [run_dir / "img0.png", run_dir / "img1.png"]
    q = "which image shows a digit and what digit is it ?"
    a = model.answer([str(p) for p in paths], q, max_new_tokens=5)
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    assert isinstance(a, str)
    assert model.answer([Image.open(p) for p in paths], q, max_new_tokens=5) == a
    assert model.answer(arrays, q, max_new_tokens=5) == a
    assert model.answer([x.astype(np.float32) / 255 for x in arrays], q, max_new_tokens=5) == a
    assert CoMemo.load(run_dir / "model.safetensors").answer(arrays, q, max_new_tokens=5) == a


def test_bad_inputs_give_clear_errors_and_the_model_still_works(run_dir, tmp_path):
    model = CoMemo.load(run_dir)
    img = np.zeros((16, 16, 3), dtype=np.uint8)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    text = tmp_path / "text.png"
    text.write_text("hello")
    cases = [
        (([str(empty)], "q ?"), "empty"),
        (([str(text)], "q ?"), "not a readable image"),
        (([np.zeros((97, 96, 3), np.uint8)], "q ?"), "above the limit"),
        (([img] * 5, "q ?"), "at most 4"),
        (([img], "describe every image . " * 60), "context holds 200"),
        (([img], "  "), "non-empty"),
        (([img], "what is <image> ?"), "<image>"),
    ]
    for (images, q), msg in cases:
        with pytest.raises(ValueError, match=msg):
            model.answer(images, q)
    assert isinstance(model.answer([img], "q ?", max_new_tokens=2), str)


def test_predict_cli(run_dir, tmp_path, capsys):
    args = ["--weights", str(run_dir), "--question", "which image shows a digit and what digit is it ?",
            "--max-new-tokens", "5", "--images", str(run_dir / "img0.png"), str(run_dir / "img1.png")]
    assert predict_main(args) == 0
    printed = capsys.readouterr().out.strip()
    expected = CoMemo.load(run_dir).answer([str(run_dir / "img0.png"), str(run_dir / "img1.png")],
                                           "which image shows a digit and what digit is it ?", max_new_tokens=5)
    assert printed == expected
    bad = tmp_path / "bad.png"
    bad.write_text("x")
    assert predict_main(["--weights", str(run_dir), "--question", "q ?", "--images", str(bad)]) == 2
    assert "not a readable image" in capsys.readouterr().err
    assert predict_main(["--question", "q ?", "--images", str(bad)]) == 2  # the shipped default, same refusal
    assert "not a readable image" in capsys.readouterr().err
