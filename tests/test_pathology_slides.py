"""Slide pipeline: synthetic slides, Slide reader, tissue mask, patch grid, HDF5, encoders, batch CLI."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("openslide")
tifffile = pytest.importorskip("tifffile")

from pathology.batch import BatchConfig, list_slides, run_batch  # noqa: E402
from pathology.encoders import SmallPatchCNN, build_encoder, load_state_dict_file  # noqa: E402
from pathology.patching import overview_image, patch_grid, read_h5, write_h5  # noqa: E402
from pathology.slide import Slide, SlideError  # noqa: E402
from pathology.synthetic import CLASSES, LAYOUT_SCALE, generate_dataset  # noqa: E402
from pathology.tissue import segment_tissue  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    seed = int(np.random.default_rng().integers(1_000_000))
    specs = generate_dataset(out, n=3, seed=seed, size=1280, mpp=0.5)
    return out, specs


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """A randomly initialised default-format encoder (the real default weights are not needed for the plumbing)."""
    from safetensors.torch import save_file

    p = tmp_path_factory.mktemp("w") / "tiny.safetensors"
    m = SmallPatchCNN(dim=16, widths=(8, 8, 8, 16, 16))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(p),
              metadata={"dim": "16", "input_size": "32", "widths": "8,8,8,16,16"})
    return str(p)


# ---------------------------------------------------------------------------------------------- synthetic


def test_synthetic_tiff_structure(dataset):
    out, specs = dataset
    path = os.path.join(out, specs[0].name + ".tiff")
    with tifffile.TiffFile(path) as tif:
        assert tif.is_bigtiff
        pages = tif.pages
        assert len(pages) >= 2
        p0 = pages[0]
        assert (p0.tilewidth, p0.tilelength) == (256, 256)
        assert p0.compression == tifffile.COMPRESSION.JPEG
        assert p0.subfiletype == 0
        for p in pages[1:]:
            assert p.subfiletype == 1 and p.is_tiled
            assert p.shape[0] < p0.shape[0]
        xres = p0.tags["XResolution"].value
        assert p0.tags["ResolutionUnit"].value == 3  # centimetre
        assert abs(1e4 / (xres[0] / xres[1]) - specs[0].mpp) < 1e-6
    with open(os.path.join(out, "labels.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["slide_id"] for r in rows] == [s.name for s in specs]
    for r, s in zip(rows, specs):
        assert int(r["lesion"]) == s.lesion and int(r["longrange"]) == s.longrange
        assert int(r["longrange"]) == int(r["has_a"]) * int(r["has_b"])
        assert int(r["has_a"]) + int(r["has_b"]) >= 1
        assert float(r["time"]) > 0 and r["event"] in ("0", "1")
        # lesion label <=> lesion pixels in the truth map
        truth = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(os.path.join(out, "truth", s.name + ".png")))
        assert bool((truth == CLASSES["lesion"]).any()) == bool(s.lesion)
        assert bool((truth == CLASSES["pattern_a"]).any()) == s.has_a


def test_longrange_sites_have_equal_pattern_area_and_balanced_labels():
    from pathology.synthetic import _disk, _pad, balanced_labels, render_layout, sample_spec

    rng = np.random.default_rng()
    lesion, sites = balanced_labels(12, np.random.default_rng(int(rng.integers(1_000_000))))
    assert sites.count("AB") == 6 and sites.count("AA") == 3 and sites.count("BB") == 3 and sum(lesion) == 6
    # a larger set extends a smaller one (resumable datasets keep their labels)
    seed = int(rng.integers(1_000_000))
    assert balanced_labels(8, np.random.default_rng(seed)) == tuple(x[:8] for x in balanced_labels(20, np.random.default_rng(seed)))
    for kind in ("AB", "AA", "BB"):
        spec = sample_spec(rng, name="s", width=3072, height=3072, mpp=0.5, sites=kind)
        assert spec.longrange == int(kind == "AB") and spec.has_a == ("A" in kind) and spec.has_b == ("B" in kind)
        _pad(spec)
        classes = render_layout(spec)[0]
        r = 0.07 * max(classes.shape)
        disk = int(_disk((int(4 * r), int(4 * r)), int(2 * r), int(2 * r), r).sum())  # one whole site
        n_a, n_b = int((classes == CLASSES["pattern_a"]).sum()), int((classes == CLASSES["pattern_b"]).sum())
        # two whole sites of the same size in every slide: the label is not in the amount of pattern
        assert n_a + n_b == 2 * disk
        assert (n_a, n_b) == {"AB": (disk, disk), "AA": (2 * disk, 0), "BB": (0, 2 * disk)}[kind]
        ys, xs = np.nonzero(classes >= CLASSES["pattern_a"])
        assert np.hypot(np.ptp(ys), np.ptp(xs)) > 4 * r  # the two sites lie apart
    with pytest.raises(ValueError, match="sites"):
        sample_spec(rng, name="s", width=512, height=512, mpp=0.5, sites="AC")


def test_openslide_reads_synthetic(dataset):
    out, specs = dataset
    s = Slide(os.path.join(out, specs[1].name + ".tiff"))
    assert s.vendor == "generic-tiff"
    assert s.dimensions == (specs[1].width, specs[1].height)
    assert s.level_count >= 2 and s.level_downsamples[1] == pytest.approx(4.0)
    assert s.mpp == pytest.approx(0.5)
    x, y = 300, 200
    region = s.read_region((x, y), 0, (200, 150))
    assert region.shape == (150, 200, 3) and region.dtype == np.uint8
    ref = tifffile.imread(os.path.join(out, specs[1].name + ".tiff"), key=0)[y : y + 150, x : x + 200]
    assert np.abs(region.astype(int) - ref.astype(int)).mean() < 3.0
    th = s.thumbnail(128)
    assert max(th.shape[:2]) == 128
    # outside the slide is white
    assert (s.read_region((s.dimensions[0] - 10, 0), 0, (40, 8))[:, 20:] == 255).all()
    s.close()


def test_slide_bad_inputs(tmp_path, dataset):
    out, specs = dataset
    with pytest.raises(FileNotFoundError):
        Slide(tmp_path / "nope.svs")
    txt = tmp_path / "notes.tiff"
    txt.write_text("this is not an image")
    with pytest.raises(SlideError):
        Slide(txt)
    data = open(os.path.join(out, specs[0].name + ".tiff"), "rb").read()
    trunc = tmp_path / "trunc.tiff"
    trunc.write_bytes(data[: len(data) // 3])
    with pytest.raises(SlideError):
        s = Slide(trunc)
        s.read_region((0, 0), 0, (s.dimensions[0], min(512, s.dimensions[1])))
    other = tmp_path / "notes.xyz"
    other.write_bytes(b"\x00" * 100)
    with pytest.raises(SlideError, match="not a slide"):
        Slide(other)
    # plain PNG without resolution: clear error on mpp, fixed by an override
    from PIL import Image

    png = tmp_path / "plain.png"
    Image.fromarray(np.random.default_rng().integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(png)
    s = Slide(png)
    assert s.dimensions == (80, 64) and not s.has_mpp
    with pytest.raises(ValueError, match="mpp"):
        _ = s.mpp
    assert Slide(png, mpp=0.25).mpp == 0.25
    with pytest.raises(ValueError):
        Slide(png, mpp=-1)


# ---------------------------------------------------------------------------------------------- tissue / grid


def _tissue_against_truth(out, spec):
    """The slide, its tissue mask, the generator's truth map and the mask's IoU with the truth at mask size."""
    from PIL import Image

    s = Slide(os.path.join(out, spec.name + ".tiff"))
    tm = segment_tissue(s)
    truth = np.asarray(Image.open(os.path.join(out, "truth", spec.name + ".png"))) > 0
    truth_rs = np.asarray(Image.fromarray(truth.astype(np.uint8)).resize(tm.mask.shape[::-1], Image.NEAREST)) > 0
    return s, tm, truth, (tm.mask & truth_rs).sum() / max(1, (tm.mask | truth_rs).sum())


def test_tissue_mask_survives_strongly_stained_spots(tmp_path):
    """Seed 841389's slide_002 is pale tissue with a few dark, saturated spots: Otsu on raw saturation put the
    threshold above most of the tissue and the small-object filter then removed the rest (an empty mask)."""
    specs = generate_dataset(tmp_path, n=3, seed=841389, size=1280, mpp=0.5)
    ious = [_tissue_against_truth(tmp_path, spec)[3] for spec in specs]
    assert min(ious) > 0.6, ious


def test_tissue_mask_matches_truth_and_grid(dataset, tmp_path):
    out, specs = dataset
    s, tm, truth, iou = _tissue_against_truth(out, specs[2])
    assert iou > 0.6, iou
    g = patch_grid(s, tm, mpp=1.0, patch_size=64, min_tissue=0.5)
    assert g.patch_size_level0 == 128 and g.coords.shape[1] == 2 and len(g.coords) > 0
    assert (g.coords % 128 == 0).all()
    assert (g.coords[:, 0] + 128 <= s.dimensions[0]).all() and (g.coords[:, 1] + 128 <= s.dimensions[1]).all()
    # kept patches are mostly tissue in the truth map. Measured on 240 slides of this size (seeds 0-79): the share
    # of kept patches whose centre is truth tissue is 0.71-1.00, mean 0.89; 14 slides are at or below 0.8, the
    # bound this test had when Otsu ran on raw saturation (then 0.71-1.00, mean 0.95, 2 slides at or below 0.8).
    # That mask kept fewer border patches but missed tissue: on seeds 0-29 its pixel recall was 0.74 (at worst
    # 0.55) at precision 0.95, against 0.90 and 0.90 now. A further 249 random slides: 0.69-1.00, mean 0.90; one
    # CI run drew a slide at 0.64 (36 kept patches, so one patch moves the share by 0.03), below the 0.65 this
    # bound had: the bound sits at 0.55, above a grid that ignores tissue (every 128-px patch kept: 0.16-0.45,
    # mean 0.33, on 30 random slides).
    cy = (g.coords[:, 1] + 64) // LAYOUT_SCALE
    cx = (g.coords[:, 0] + 64) // LAYOUT_SCALE
    share = truth[np.minimum(cy, truth.shape[0] - 1), np.minimum(cx, truth.shape[1] - 1)].mean()
    assert share > 0.55, (share, specs[2])
    # HDF5 round trip (CLAM layout)
    feats = np.random.default_rng().standard_normal((len(g.coords), 7)).astype(np.float32)
    p = tmp_path / "x.h5"
    write_h5(p, g, feats, encoder="test")
    d = read_h5(p)
    assert np.array_equal(d["coords"], g.coords) and np.allclose(d["features"], feats)
    assert d["attrs"]["patch_size"] == 64 and d["attrs"]["mpp"] == 1.0 and "patch_level" in d["attrs"]
    assert d["attrs"]["encoder"] == "test"
    assert [f for f in os.listdir(tmp_path) if "tmp" in f] == []
    ov = overview_image(tm.thumbnail, tm.downsample, mask=tm.mask, coords=g.coords, patch_size_level0=g.patch_size_level0)
    assert ov.shape == tm.thumbnail.shape
    with pytest.raises(ValueError, match="finer"):
        patch_grid(s, tm, mpp=0.1)


def test_blank_slide_gives_empty_grid(tmp_path):
    from PIL import Image

    rng = np.random.default_rng()
    img = np.clip(240 + rng.normal(0, 2, (600, 700, 3)), 0, 255).astype(np.uint8)
    p = tmp_path / "blank.png"
    Image.fromarray(img).save(p)
    s = Slide(p, mpp=1.0)
    tm = segment_tissue(s)
    assert tm.mask.sum() == 0
    assert patch_grid(s, tm, mpp=1.0, patch_size=64).coords.shape == (0, 2)


# ---------------------------------------------------------------------------------------------- encoders


def test_encoder_registry(tiny_weights, tmp_path):
    enc = build_encoder("default", weights=tiny_weights, device="cpu")
    x = np.random.default_rng().integers(0, 255, (3, 48, 48, 3), dtype=np.uint8)
    f = enc.encode(x)
    assert f.shape == (3, 16) and torch.isfinite(f).all()
    # same weights through a .pt state dict load identically
    sd = load_state_dict_file(tiny_weights)
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, tmp_path / "w.pt")
    sd2 = load_state_dict_file(tmp_path / "w.pt")
    assert set(sd2) == set(sd) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    with pytest.raises(ValueError, match="unknown encoder"):
        build_encoder("resnet50", device="cpu")
    with pytest.raises(FileNotFoundError):
        build_encoder("timm:resnet18", weights=tmp_path / "missing.pt", device="cpu")


def test_timm_encoder_loads_local_weights(tmp_path):
    import timm  # a dependency of the pathology extra: a missing install fails, not skips
    m = timm.create_model("resnet18", pretrained=False, num_classes=0)
    torch.save(m.state_dict(), tmp_path / "r18.pt")
    enc = build_encoder("timm:resnet18", weights=tmp_path / "r18.pt", device="cpu")
    assert enc.encode(np.zeros((1, 64, 64, 3), np.uint8)).shape == (1, 512)


def test_optional_encoders_need_package_or_weights():
    for name, mod in (("timm:resnet18", "timm"), ("open_clip:ViT-B-32", "open_clip")):
        try:
            __import__(mod)
        except ImportError:
            with pytest.raises(ImportError, match="pip install"):
                build_encoder(name, device="cpu")
        else:
            with pytest.raises(ValueError, match="weights"):
                build_encoder(name, device="cpu")


# ---------------------------------------------------------------------------------------------- batch


def _rows(path):
    with open(path) as f:
        return {r["slide_id"]: r for r in csv.DictReader(f)}


def test_batch_all_tasks_errors_and_resume(dataset, tiny_weights, tmp_path):
    from PIL import Image

    src, specs = dataset
    slides = tmp_path / "slides"
    slides.mkdir()
    for s in specs[:2]:
        os.symlink(os.path.join(src, s.name + ".tiff"), slides / (s.name + ".tiff"))
    (slides / "broken.svs").write_bytes(b"II*\x00garbage" * 10)
    Image.fromarray(np.full((300, 300, 3), 242, np.uint8)).save(slides / "blank.png")
    (slides / "labels.csv").write_text("not a slide")
    assert [os.path.basename(p) for p in list_slides(str(slides))] == ["blank.png", "broken.svs"] + [
        s.name + ".tiff" for s in specs[:2]]
    out = tmp_path / "out"
    cfg = BatchConfig(slides=str(slides), out=str(out), mpp=1.0, patch_size=64, weights=tiny_weights,
                      skip_errors=True, slide_mpp=None, progress=False, device="cpu")
    run_batch(cfg)
    rows = _rows(out / "manifest.csv")
    assert rows["broken"]["status"] == "failed" and rows["broken"]["error"]
    assert rows["blank"]["status"] == "failed" and "mpp" in rows["blank"]["error"]  # PNG has no µm/px
    for s in specs[:2]:
        assert rows[s.name]["status"] == "done"
        d = read_h5(out / "features" / "default" / (s.name + ".h5"))
        assert d["features"].shape == (int(rows[s.name]["n_patches"]), 16)
        assert os.path.exists(out / "seg" / (s.name + ".png"))
    assert "broken.svs" in (out / "failures.log").read_text()
    # no stray temp files, no locks left
    assert not [f for _, _, fs in os.walk(out) for f in fs if "tmp" in f]
    assert os.listdir(out / "locks") == []
    # rerun with the slide µm/px override: finished slides untouched, the blank one becomes an empty bag
    f0 = out / "features" / "default" / (specs[0].name + ".h5")
    mtime = os.path.getmtime(f0)
    run_batch(BatchConfig(**{**cfg.__dict__, "slide_mpp": 0.5}))
    assert os.path.getmtime(f0) == mtime
    rows = _rows(out / "manifest.csv")
    assert rows["blank"]["status"] == "empty" and rows["blank"]["n_patches"] == "0"
    assert read_h5(out / "features" / "default" / "blank.h5")["features"].shape == (0, 16)
    # without --skip-errors the first failure stops the run
    with pytest.raises(ValueError, match="micrometres-per-pixel"):
        run_batch(BatchConfig(**{**cfg.__dict__, "skip_errors": False, "out": str(tmp_path / "out2")}))


def test_batch_shards_partition(dataset, tmp_path):
    src, specs = dataset
    seen = []
    for i in range(2):
        out = tmp_path / "o"
        run_batch(BatchConfig(slides=str(src), out=str(out), task="coords", mpp=1.0, patch_size=64, shard=(i, 2),
                              progress=False))
        seen += list(_rows(out / f"manifest_{i}of2.csv"))
    assert sorted(seen) == sorted(s.name for s in specs)
    with pytest.raises(ValueError, match="shard"):
        BatchConfig(slides=str(src), out=str(tmp_path), shard=(2, 2))


def test_batch_rerun_with_other_settings_refuses_or_redoes(dataset, tiny_weights, tmp_path):
    """Settings are stored with every output; a rerun with another --mpp, --patch-size or --weights refuses
    (naming the differences) instead of reusing, and --overwrite redoes only the outputs whose settings differ."""
    import json

    import h5py
    from PIL import Image
    from safetensors.torch import save_file

    from core.infra.cli import run_cli
    from core.infra.jobs import SettingsMismatch, settings_fingerprint
    from pathology.batch import main as batch_main

    src, specs = dataset
    slides = tmp_path / "slides"
    slides.mkdir()
    sid = specs[0].name
    os.symlink(os.path.join(src, sid + ".tiff"), slides / (sid + ".tiff"))
    out = tmp_path / "out"
    cfg = BatchConfig(slides=str(slides), out=str(out), mpp=1.0, patch_size=64, weights=tiny_weights,
                      progress=False, device="cpu")
    run_batch(cfg)
    files = {"mask": out / "seg" / f"{sid}_mask.png", "coords": out / "patches" / f"{sid}.h5",
             "feat": out / "features" / "default" / f"{sid}.h5"}
    with h5py.File(files["feat"], "r") as f:
        stored = json.loads(f.attrs["settings"])
        fp = f.attrs["settings_fingerprint"]
    assert stored["mpp"] == 1 and stored["patch_size"] == 64 and stored["output"] == "features"
    assert stored["slide_mpp"] == pytest.approx(0.5) and "encoder" in stored
    assert fp == settings_fingerprint(stored) == _rows(out / "manifest.csv")[sid]["settings"]
    with h5py.File(files["coords"], "r") as f:
        assert json.loads(f.attrs["settings"])["output"] == "coords"
    assert json.loads(Image.open(files["mask"]).text["settings"])["output"] == "tissue_mask"
    mtimes = {k: os.path.getmtime(p) for k, p in files.items()}

    with pytest.raises(SettingsMismatch, match=r"mpp: 1 -> 2\b.*--overwrite"):
        run_batch(BatchConfig(**{**cfg.__dict__, "mpp": 2.0}))
    assert run_cli(batch_main, ["--slides", str(slides), "--out", str(out), "--mpp", "1.0", "--patch-size", "32",
                                "--weights", tiny_weights, "--no-progress", "--device", "cpu"]) == 2  # refused: bad usage
    other = tmp_path / "other.safetensors"  # other weights of the same format
    m = SmallPatchCNN(dim=16, widths=(8, 8, 8, 16, 16))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(other),
              metadata={"dim": "16", "input_size": "32", "widths": "8,8,8,16,16"})
    with pytest.raises(SettingsMismatch, match=r"1 existing output\(s\).*encoder\.weights\.sha256"):
        run_batch(BatchConfig(**{**cfg.__dict__, "weights": str(other), "task": "feat"}))
    import shutil

    copy = tmp_path / "copied" / "tiny.safetensors"  # the same weights elsewhere: same content, same settings
    copy.parent.mkdir()
    shutil.copy(tiny_weights, copy)
    run_batch(BatchConfig(**{**cfg.__dict__, "weights": str(copy)}))
    assert {k: os.path.getmtime(p) for k, p in files.items()} == mtimes  # nothing was touched
    assert _rows(out / "manifest.csv")[sid]["status"] == "done"  # refusals leave the manifest as it was

    run_batch(BatchConfig(**{**cfg.__dict__, "mpp": 2.0, "overwrite": True}))
    assert os.path.getmtime(files["mask"]) == mtimes["mask"]  # the mask does not depend on --mpp: kept
    d = read_h5(files["feat"])
    assert d["attrs"]["mpp"] == 2.0 and json.loads(d["attrs"]["settings"])["mpp"] == 2
    assert d["features"].shape[0] == d["coords"].shape[0] > 0
    row = _rows(out / "manifest.csv")[sid]
    assert row["status"] == "done" and row["settings"] == d["attrs"]["settings_fingerprint"] != fp

    with pytest.raises(ValueError, match="encoder_kwargs"):
        BatchConfig(slides=str(slides), out=str(out), encoder_kwargs={"f": object()})
    with pytest.raises(SystemExit):
        batch_main(["--slides", str(slides), "--out", str(out), "--encoder-kwargs", "[1]"])


def test_batch_partial_weights_need_the_flag(dataset, tiny_weights, tmp_path):
    """Weights that fill only part of the encoder: refused by default before any slide, loaded with
    --allow-partial-weights."""
    from safetensors.torch import load_file, save_file

    from pathology.batch import main as batch_main

    src, specs = dataset
    slides = tmp_path / "slides"
    slides.mkdir()
    os.symlink(os.path.join(src, specs[1].name + ".tiff"), slides / (specs[1].name + ".tiff"))
    sd = load_file(tiny_weights)
    dropped = sorted(k for k in sd if k.endswith("bias"))[-1]
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in sd.items() if k != dropped}, str(partial),
              metadata={"dim": "16", "input_size": "32", "widths": "8,8,8,16,16"})
    out = tmp_path / "out"
    args = ["--slides", str(slides), "--out", str(out), "--mpp", "1.0", "--patch-size", "64", "--weights",
            str(partial), "--no-progress", "--device", "cpu"]
    with pytest.raises(ValueError, match=rf"partial\.safetensors.*{dropped}"):  # run_cli: one line, exit 2
        batch_main(args)
    assert not (out / "manifest.csv").exists()  # refused before any slide
    assert batch_main(args + ["--allow-partial-weights"]) == 0
    assert read_h5(out / "features" / "default" / (specs[1].name + ".h5"))["features"].shape[1] == 16


@pytest.mark.slow
def test_batch_killed_and_rerun(dataset, tiny_weights, tmp_path):
    """A run killed after its first slide, rerun: finishes the rest, keeps the first, leaves no partial file."""
    src, specs = dataset
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pathology.batch", "--slides", str(src), "--out", str(out), "--mpp", "1.0",
           "--patch-size", "64", "--weights", tiny_weights, "--no-progress", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    first = out / "features" / "default" / (specs[0].name + ".h5")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not first.exists() and proc.poll() is None and time.time() - t0 < 240:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert first.exists()
    mtime = os.path.getmtime(first)
    # a lock file left by the killed process is stale (its pid is gone) and must not block the rerun
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert os.path.getmtime(first) == mtime
    rows = _rows(out / "manifest.csv")
    assert all(rows[s.name]["status"] in ("done", "exists") for s in specs)  # exists: done before the kill
    for s in specs:
        d = read_h5(out / "features" / "default" / (s.name + ".h5"))
        assert d["features"].shape[0] == d["coords"].shape[0] > 0
    assert not [f for _, _, fs in os.walk(out) for f in fs if "tmp" in f or f.endswith(".lock")]


def test_analyze_slide_with_given_models(dataset, tiny_weights, tmp_path):
    """The shared inference function (demo + predict CLI) on a synthetic slide with a fresh tiny Querent."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from core.infra.cli import run_cli
    from pathology import Querent, QuerentConfig
    from pathology.inference import analyze_slide, regions_overlay
    from pathology.predict import main as predict_main

    cfg = QuerentConfig(in_dim=16, dim=16, num_heads=2, region_size=2, topk=1, num_classes=2)
    model = Querent(cfg)
    p = tmp_path / "q.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(p))
    meta = {"model_config": dataclasses.asdict(cfg), "patch_mpp": 1.0, "patch_size": 64, "encoder": "default",
            "class_names": ["neg", "pos"]}
    (tmp_path / "q.json").write_text(json.dumps(meta))
    src, specs = dataset
    path = os.path.join(src, specs[0].name + ".tiff")
    a = analyze_slide(path, model_path=str(p), encoder_weights=tiny_weights, thumb_size=256)
    assert a.n_patches > 0 and len(a.probabilities) == 2 and abs(sum(a.probabilities) - 1) < 1e-5
    assert a.heatmap.shape == a.overview.shape and not np.array_equal(a.heatmap, a.overview)
    assert max(a.overview.shape[:2]) == 256
    i = a.n_patches // 2
    img, text = regions_overlay(a, *((a.coords[i] + a.patch_size_level0 / 2) / a.downsample))
    assert f"patch {i} " in text and img.shape == a.heatmap.shape
    with pytest.raises(FileNotFoundError):
        analyze_slide(path, model_path=str(tmp_path / "missing.safetensors"))
    out = tmp_path / "pred"
    assert run_cli(predict_main, [path, "--out", str(out), "--model", str(tmp_path / "missing.safetensors")]) == 2
    rc = predict_main([path, os.path.join(src, "nope.tiff"), "--out", str(out), "--model", str(p),
                       "--encoder-weights", tiny_weights])
    assert rc == 1  # one slide failed (missing), the other was written
    res = json.loads((out / f"{specs[0].name}.json").read_text())
    assert res["n_patches"] == a.n_patches and set(res["probabilities"]) == {"neg", "pos"}
    assert (out / f"{specs[0].name}_heatmap.png").exists() and (out / f"{specs[0].name}_overview.png").exists()


def test_lesion_label_always_has_lesion_pixels():
    """A small slide whose lesion blobs the pattern sites covered (found by a randomly seeded run) keeps a
    lesion: the label and the truth map must agree."""
    from pathology.synthetic import SlideSpec, render_layout

    spec = SlideSpec(name="slide_001", width=1792, height=1280, mpp=0.5, seed=1949464246, lesion=1, longrange=1,
                     has_a=True, has_b=True, sites="AB")
    classes, _, _ = render_layout(spec)
    assert (classes == CLASSES["lesion"]).any()
    assert (classes == CLASSES["pattern_a"]).any() and (classes == CLASSES["pattern_b"]).any()
