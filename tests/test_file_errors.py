"""A file a library cannot read is refused with its name and the format expected, never a library traceback.

Each reader of ``core.infra.fileio`` turns a 25-byte text file, a truncated file and a missing path into a
``ValueError`` / ``FileNotFoundError`` naming the file and its format; and, end to end, commands given such a file
(as the model, the weights, the memory, the image, the slide, the training state) exit 2 with an ``error:`` line
naming it, and no traceback.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.infra.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
TEXT = b"this is not a weights fi\n"  # 25 bytes
assert len(TEXT) == 25


def _write_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.randn(64, 48), "bias": torch.randn(64)}, str(path))


def _write_torch(path: Path) -> None:
    torch.save({"model": {"w": torch.randn(64, 48)}, "step": 3}, path)


def _write_hdf5(path: Path) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f["observations"] = np.random.default_rng().standard_normal((500, 40))


def _write_png(path: Path) -> None:
    from PIL import Image

    noise = np.random.default_rng().integers(0, 256, (96, 80, 3), dtype=np.uint8)  # incompressible
    Image.fromarray(noise).save(path)


def _load_into_linear(path, *, what):
    from core.infra import fileio

    return fileio.load_safetensors_model(torch.nn.Linear(48, 64), path, what=what)


def _open_safetensors(path, *, what):
    from core.infra import fileio

    with fileio.open_safetensors(path, what=what) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _open_hdf5(path, *, what):
    from core.infra import fileio

    with fileio.open_hdf5(path, what=what) as f:
        return {k: f[k][()] for k in f}


def _open_image(path, *, what):
    from core.infra import fileio

    with fileio.open_image(path, what=what) as im:
        return np.asarray(im)


def _helper(name):
    def call(path, *, what):
        from core.infra import fileio

        return getattr(fileio, name)(path, what=what)
    return call


# (reader, writer of a good file, suffix, the format named in the message)
READERS = {
    "load_safetensors": (_helper("load_safetensors"), _write_safetensors, ".safetensors", "safetensors"),
    "open_safetensors": (_open_safetensors, _write_safetensors, ".safetensors", "safetensors"),
    "load_safetensors_model": (_load_into_linear, _write_safetensors, ".safetensors", "safetensors"),
    "torch_load": (_helper("torch_load"), _write_torch, ".pt", "PyTorch checkpoint"),
    "open_hdf5": (_open_hdf5, _write_hdf5, ".h5", "HDF5"),
    "open_image": (_open_image, _write_png, ".png", "image"),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_reader_names_the_file_and_the_format(name, tmp_path):
    read, write, suffix, fmt = READERS[name]
    what = "the weights written by the test"
    good = tmp_path / f"good{suffix}"
    write(good)
    assert read(good, what=what) is not None  # a good file reads

    text = tmp_path / f"notes{suffix}"
    text.write_bytes(TEXT)
    data = good.read_bytes()
    truncated = tmp_path / f"cut{suffix}"
    truncated.write_bytes(data[: len(data) // 2])
    for bad in (text, truncated):
        with pytest.raises(ValueError) as info:
            read(bad, what=what)
        msg = str(info.value)
        assert str(bad) in msg and f"not a readable {fmt} file" in msg and what in msg, msg
        assert "\n" not in msg

    missing = tmp_path / f"none{suffix}"
    with pytest.raises(FileNotFoundError) as info:
        read(missing, what=what)
    assert str(missing) in str(info.value) and fmt in str(info.value) and what in str(info.value)
    with pytest.raises(ValueError, match=f"is a folder, not a {fmt} file"):
        read(tmp_path, what=what)


def test_safetensors_errors_inside_the_block_and_mismatched_weights_name_the_file(tmp_path):
    from core.infra.fileio import load_safetensors_model, open_safetensors

    path = tmp_path / "w.safetensors"
    _write_safetensors(path)
    with pytest.raises(ValueError, match=r"w\.safetensors is not a readable safetensors file \(.*no_such"):
        with open_safetensors(path, what="weights") as f:
            f.get_tensor("no_such")
    with pytest.raises(ValueError, match=r"w\.safetensors does not fit the model .*expected weights of a 3x3 layer"):
        load_safetensors_model(torch.nn.Linear(3, 3), path, what="weights of a 3x3 layer")
    with pytest.raises(RuntimeError, match="unrelated"):  # the block's own errors pass unchanged
        with open_safetensors(path) as f:
            raise RuntimeError("unrelated")


def test_open_image_refuses_too_many_pixels_before_decoding(tmp_path):
    from core.infra.fileio import open_image

    path = tmp_path / "big.png"
    _write_png(path)
    with pytest.raises(ValueError, match=r"big\.png is a 80x96 image \(7680 pixels\), above the limit of 7000"):
        open_image(path, max_pixels=7000)
    with open_image(path, max_pixels=7680) as im:
        assert im.size == (80, 96)


# -- end to end: one error line naming the file, exit 2, no traceback ----------------------------------------------


def _run(main, argv, capsys, monkeypatch) -> tuple[int, list[str], str]:
    monkeypatch.delenv("LONGCTX_DEBUG", raising=False)
    code = run_cli(main, [str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [s.strip() for s in re.split(r"[\r\n]", err) if s.strip().startswith("error:")]  # between tqdm redraws
    return code, lines, err


def _refused_naming(main, argv, bad: Path, fmt: str, capsys, monkeypatch) -> str:
    """The command exits 2 with exactly one error line, naming ``bad`` and ``fmt``; returns the line."""
    code, lines, err = _run(main, argv, capsys, monkeypatch)
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert str(bad) in lines[0] and fmt in lines[0], lines[0]
    return lines[0]


def _text(path: Path) -> Path:
    path.write_bytes(TEXT)
    return path


def _truncated(src: Path, path: Path) -> Path:
    data = src.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_rl_evaluate_with_a_text_file_as_the_policy(tmp_path, capsys, monkeypatch):
    from rl.evaluate import main, shipped_policies

    card = next(iter(shipped_policies().values())).with_suffix(".json")
    shutil.copy(card, tmp_path / "policy.json")
    bad = _text(tmp_path / "policy.safetensors")
    line = _refused_naming(main, ["--checkpoint", bad, "--episodes", "1"], bad, "safetensors", capsys, monkeypatch)
    assert "header too large" in line and "rl.train" in line


def test_pathology_predict_with_a_text_file_as_the_slide_and_as_the_model(tmp_path, capsys, monkeypatch):
    from pathology.inference import DEFAULT_SLIDE_MODEL
    from pathology.predict import main

    slide = _text(tmp_path / "slide.svs")
    code, lines, err = _run(main, [slide, "--out", tmp_path / "out"], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err, err
    assert any(str(slide) in s and "not a slide" in s for s in lines), err

    shutil.copy(Path(DEFAULT_SLIDE_MODEL).with_suffix(".json"), tmp_path / "model.json")
    model = _text(tmp_path / "model.safetensors")
    _refused_naming(main, [slide, "--out", tmp_path / "out", "--model", model], model, "safetensors", capsys,
                    monkeypatch)


def test_comemo_predict_with_a_text_file_as_the_image_and_as_the_weights(tmp_path, capsys, monkeypatch):
    from apps.comemo.predict import main

    image = _text(tmp_path / "photo.png")
    code, lines, err = _run(main, ["--question", "q ?", "--images", image], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err, err
    assert any(str(image) in s and "image" in s for s in lines), err

    weights = _text(tmp_path / "model.safetensors")
    shutil.copy(ROOT / "apps" / "comemo" / "weights" / "tokenizer.json", tmp_path / "tokenizer.json")
    _refused_naming(main, ["--weights", weights, "--question", "q ?", "--images", image], weights, "safetensors",
                    capsys, monkeypatch)


def test_emloc_predict_with_a_text_file_as_the_memory(tmp_path, capsys, monkeypatch):
    from apps.emloc.cli import predict_main

    image = tmp_path / "query.png"
    _write_png(image)
    memory = _text(tmp_path / "memory.safetensors")
    line = _refused_naming(predict_main, ["--memory", memory, "--images", image], memory, "safetensors", capsys,
                           monkeypatch)
    assert "apps.emloc.compress" in line


def test_emloc_train_resume_from_a_text_file_as_the_state(tmp_path, capsys, monkeypatch):
    from apps.emloc.train import main

    state = _text(tmp_path / "last.pt")
    _refused_naming(main, ["--out", tmp_path, "--resume"], state, "PyTorch checkpoint", capsys, monkeypatch)


def test_tabular_compare_with_truncated_weights(tmp_path, capsys, monkeypatch):
    from tabular.compare import main

    bad = _truncated(ROOT / "tabular" / "weights" / "tabicl_small.safetensors", tmp_path / "tabicl.safetensors")
    _refused_naming(main, ["--dataset", "iris", "--checkpoint", bad], bad, "safetensors", capsys, monkeypatch)


def test_video_batch_with_truncated_weights(tmp_path, capsys, monkeypatch):
    from video.batch import main

    videos = tmp_path / "videos"
    videos.mkdir()
    shutil.copy(ROOT / "video" / "samples" / "synthetic_2048.mp4", videos / "a.mp4")
    bad = _truncated(ROOT / "video" / "weights" / "videoqa_tiny.safetensors", tmp_path / "videoqa.safetensors")
    _refused_naming(main, ["--videos", videos, "--out", tmp_path / "out", "--weights", bad], bad, "safetensors",
                    capsys, monkeypatch)
