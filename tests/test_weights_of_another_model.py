"""Weights of another model (a safetensors file whose keys or shapes do not fit) are one line naming the file and
what was expected, in Python (ValueError) and in the CLIs (``error:`` line, exit 2): video, pathology, tabular; and
``pathology.train_encoder`` never writes into the shipped weights folder unless told to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.infra.cli import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]


def _metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_a_model_that_does_not_fit_names_its_keys_and_what_was_expected(tmp_path):
    from core.infra.fileio import load_safetensors_model, load_state_dict_checked

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(path))
    with pytest.raises(ValueError) as e:
        load_safetensors_model(model, path, what="a two-layer model saved by make_two")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path} does not fit the model")
    assert "missing keys (2) 1.weight, 1.bias" in msg and "unexpected keys (2) 2.bias, 2.weight" in msg
    assert "0.weight [5, 3] (model [4, 3])" in msg and msg.endswith("expected a two-layer model saved by make_two")
    with pytest.raises(ValueError, match=r"other\.pt does not fit the model .*missing keys \(2\)"):
        load_state_dict_checked(model, dict(other.state_dict()), tmp_path / "other.pt", what="x")
    load_state_dict_checked(other, dict(other.state_dict()), path, what="x")  # what fits loads


# -- video -------------------------------------------------------------------------------------------------------


def _foreign_video_weights(tmp_path: Path) -> Path:
    """The shipped video model's config in the header, tensors of another model."""
    path = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.randn(3, 4)}, str(path),
              metadata=_metadata(ROOT / "video" / "weights" / "videoqa_tiny.safetensors"))
    return path


def test_video_refuses_weights_of_another_model(tmp_path, capsys):
    from video.batch import main
    from video.infinite import InfiniteVideo
    from video.train import load_model

    bad = _foreign_video_weights(tmp_path)
    with pytest.raises(ValueError, match=r"other\.safetensors does not fit the model .*unexpected keys \(1\) "
                                         r"encoder\.weight.*expected video QA weights written by video\.train"):
        load_model(bad)
    with pytest.raises(ValueError, match="does not fit the model"):
        InfiniteVideo(bad)
    broken = tmp_path / "broken.safetensors"
    save_file({"w": torch.zeros(1)}, str(broken), metadata={"config": "{not json"})
    with pytest.raises(ValueError, match=r"broken\.safetensors holds no video QA model config"):
        load_model(broken)
    (tmp_path / "videos").mkdir()
    argv = ["--videos", str(tmp_path / "videos"), "--out", str(tmp_path / "out"), "--weights", str(bad)]
    assert run_cli(main, argv) == 2
    assert "other.safetensors does not fit the model" in _one_error(capsys)


# -- pathology ---------------------------------------------------------------------------------------------------


def _foreign_slide_model(tmp_path: Path) -> Path:
    """The shipped slide model's JSON beside the patch encoder's weights (another model)."""
    weights = ROOT / "pathology" / "weights"
    path = tmp_path / "slide.safetensors"
    shutil.copy(weights / "patch_encoder_small.safetensors", path)
    shutil.copy(weights / "querent_lesion.json", tmp_path / "slide.json")
    return path


def test_pathology_slide_model_of_another_model_is_refused(tmp_path, capsys):
    from pathology.inference import load_slide_model
    from pathology.predict import main

    bad = _foreign_slide_model(tmp_path)
    with pytest.raises(ValueError, match=r"slide\.safetensors does not fit the model .*missing keys .*; expected a "
                                         r"Querent slide model written by pathology\.train_demo"):
        load_slide_model(str(bad))
    argv = [str(tmp_path / "no_slide.tiff"), "--out", str(tmp_path / "out"), "--model", str(bad)]
    assert run_cli(main, argv) == 2
    assert "slide.safetensors does not fit the model" in _one_error(capsys)
    (tmp_path / "slide.json").write_text(json.dumps({"class_names": ["a", "b"]}))
    with pytest.raises(ValueError, match=r"slide\.json is not a slide model's metadata \(KeyError"):
        load_slide_model(str(tmp_path / "slide.safetensors"))


def test_pathology_predict_refuses_encoder_weights_of_another_model_before_any_slide(tmp_path, capsys):
    from pathology.predict import main

    other = ROOT / "pathology" / "weights" / "querent_lesion.safetensors"  # a slide model, not a patch encoder
    argv = [str(tmp_path / "no_slide.tiff"), "--out", str(tmp_path / "out"), "--encoder-weights", str(other)]
    assert run_cli(main, argv) == 2
    line = _one_error(capsys)
    assert "querent_lesion.safetensors" in line and "do not fit SmallPatchCNN" in line
    assert not (tmp_path / "out").exists()  # refused before the first slide and any output


@pytest.mark.parametrize("encoder,name,content", [
    ("default", "text.bin", b"not weights\n"),
    ("default", "slide.safetensors", None),  # a readable file of another model
    ("timm:resnet18", "text.safetensors", b"not weights\n"),
    ("timm:resnet18", "text.pth", b"not weights\n"),
])
def test_pathology_batch_checks_weights_before_any_work(tmp_path, capsys, encoder, name, content):
    from pathology.batch import main

    weights = tmp_path / name
    if content is None:
        shutil.copy(ROOT / "pathology" / "weights" / "querent_lesion.safetensors", weights)
    else:
        weights.write_bytes(content)
    (tmp_path / "slides").mkdir()  # no slide to process: the weights are still checked
    argv = ["--slides", str(tmp_path / "slides"), "--out", str(tmp_path / "out"), "--encoder", encoder,
            "--weights", str(weights)]
    assert run_cli(main, argv) == 2
    assert name in _one_error(capsys)


def test_train_encoder_writes_only_where_told():
    from pathology.train_encoder import build_parser

    with pytest.raises(SystemExit) as e:  # no default: a run never replaces the shipped encoder by itself
        build_parser().parse_args([])
    assert e.value.code == 2
    assert build_parser().parse_args(["--out", "runs/enc"]).out == "runs/enc"


# -- tabular -----------------------------------------------------------------------------------------------------


def test_tabular_refuses_weights_of_another_model(tmp_path, capsys):
    from core.infra.fileio import load_safetensors
    from tabular.compare import main
    from tabular.weights_io import load_model

    weights = ROOT / "tabular" / "weights"
    bad = tmp_path / "mixed.safetensors"  # the small model's tensors under the medium model's config
    save_file(load_safetensors(weights / "tabicl_small.safetensors"), str(bad),
              metadata=_metadata(weights / "tabicl_medium.safetensors"))
    with pytest.raises(ValueError, match=r"mixed\.safetensors does not fit the model \(weights of another model: "
                                         r".*expected TabICL weights written by tabular\.pretrain"):
        load_model(bad)
    meta = _metadata(weights / "tabicl_small.safetensors")
    save_file({"w": torch.zeros(1)}, str(bad), metadata={**meta, "config": json.dumps({"no_such_field": 1})})
    with pytest.raises(ValueError, match=r"mixed\.safetensors holds no TabICL config \(TypeError"):
        load_model(bad)
    pt = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "model_config": json.loads(meta["config"])}, pt)
    with pytest.raises(ValueError, match=r"last\.pt does not fit the model .*unexpected keys \(1\) w"):
        load_model(pt)
    save_file(load_safetensors(weights / "tabicl_small.safetensors"), str(bad),
              metadata=_metadata(weights / "tabicl_medium.safetensors"))
    assert run_cli(main, ["--dataset", "iris", "--checkpoint", str(bad)]) == 2
    assert "mixed.safetensors does not fit the model" in _one_error(capsys)
