"""Tiny "your own model" folders and files for the demo tabs' own-model fields (browser and hub tests): each is what
the tab accepts, of the real architecture or the format the app's training command writes, at a size that loads
and runs in seconds.

``write_own_models(root)`` -> ``{app key: {"model": path, **extra inputs}}``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch


def tabicl_checkpoint(root: Path) -> Path:
    """An official-format TabICL checkpoint (``torch.save({"config", "state_dict"})``) with random weights."""
    from tests.test_tabular_official import official_ckpt

    root.mkdir(parents=True, exist_ok=True)
    return official_ckpt(root, "v2")[1]


def querent_run(root: Path) -> Path:
    """A ``pathology.train`` output folder: Querent fold models on 128-dim features (the shipped encoder's width)."""
    from pathology.train import main
    from tests.test_pathology_train import _write_h5, planted_cohort

    bags = planted_cohort(12, lo=30, hi=50, d=128, patients=6)
    feats = root / "feats" / "h5_files"
    feats.mkdir(parents=True)
    rows = ["slide_id,patient_id,diagnosis"]
    for b in bags:
        _write_h5(feats / f"{b.slide_id}.h5", b.features.numpy(), b.coords.numpy())
        rows.append(f"{b.slide_id},{b.patient_id},{b.label_name}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    out = root / "querent_run"
    rc = main(["--features", str(root / "feats"), "--labels", str(root / "labels.csv"), "--target", "diagnosis",
               "--model", "querent", "--folds", "2", "--epochs", "2", "--min-epochs", "1", "--dim", "16",
               "--heads", "2", "--region-size", "2", "--topk", "2", "--out", str(out), "--no-progress",
               "--device", "cpu"])
    assert rc == 0
    return out


def dm_run(root: Path) -> Path:
    """An ``rl.train`` output folder: a Decision Mixer trained for 2 steps on a synthetic Hopper-shaped dataset."""
    from rl.data import save_dataset
    from rl.train import TrainConfig, train
    from tests.test_rl_train import TINY, _hopper_like

    root.mkdir(parents=True, exist_ok=True)
    path = save_dataset(root / "d.npz", _hopper_like(np.random.default_rng(0)))
    out = root / "dm_run"
    train(TrainConfig(algo="dm", steps=2, seed=0, batch_size=4, log_every=1, eval_episodes=0, checkpoint_every=2,
                      warmup_steps=1), path, out, model_overrides=dict(TINY, routed_layers=(1,)), progress=False)
    return out


def ncal_model(root: Path) -> Path:
    """A copy of the shipped TMWPL model folder, as an ``apps.ncal.train`` run leaves it (ncal.json + weights)."""
    from apps.ncal.estimator import resolve_checkpoint

    out = root / "ncal_model"
    shutil.copytree(resolve_checkpoint("tmwpl"), out)
    return out


def emloc_vlm(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen2-VL folder (model + processor) and a demonstrations CSV of 3 labels (image,label,split)."""
    from PIL import Image

    from tests.test_emloc_hf import tiny_images, tiny_model, tiny_processor

    torch.manual_seed(0)
    tiny_model().save_pretrained(root / "vlm")
    tiny_processor().save_pretrained(root / "vlm")
    rows = ["image,label,split"]
    for c, name in enumerate(["cat", "dog", "bird"]):
        (root / "images" / name).mkdir(parents=True)
        for i, arr in enumerate(tiny_images(4, seed=10 * c, size=56)):
            Image.fromarray(arr).save(root / "images" / name / f"{i}.png")
            rows.append(f"images/{name}/{i}.png,{name},{'train' if i < 3 else 'test'}")
    (root / "demos.csv").write_text("\n".join(rows) + "\n")
    return root / "vlm", root / "demos.csv"


def video_model(root: Path) -> Path:
    """A tiny InstructBLIP-Video folder (model + processor)."""
    from tests.test_video_hf import save_tiny_instructblip_video

    return save_tiny_instructblip_video(root / "instructblip_video")


def comemo_release(root: Path) -> tuple[Path, Path]:
    """The tiny CoMemo release of the parity fixtures, converted (``apps.comemo.convert``), and one 2x2-tiled image."""
    from PIL import Image

    from apps.comemo.convert import convert

    out = root / "comemo_converted"
    convert(Path(__file__).parent / "fixtures" / "comemo" / "release", out)
    img = root / "comemo_image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(img)
    return out, img


def write_own_models(root: Path) -> dict[str, dict[str, str]]:
    """Every app's own-model input under ``root``: ``{key: {"model": ..., extra field elem-id suffix: value}}``."""
    root = Path(root)
    vlm, demos = emloc_vlm(root / "emloc")
    comemo, image = comemo_release(root)
    return {
        "comemo": {"model": str(comemo), "files": str(image), "own-question": "Describe the image."},
        "tabicl": {"model": str(tabicl_checkpoint(root / "tabicl"))},
        "querent": {"model": str(querent_run(root / "querent"))},
        "decision_mixer": {"model": str(dm_run(root / "rl"))},
        "ncal": {"model": str(ncal_model(root)), "text": "小明有3个苹果，又买了5个，现在有几个苹果？"},
        "emloc": {"model": str(vlm), "own-data": str(demos)},
        "infinite_video": {"model": "hf:" + str(video_model(root / "video")), "own-question": "what happens?"},
    }
