"""One-slide inference: tissue, patches, features, Querent prediction, attention heatmap and chosen regions.

The demo tab and ``python -m pathology.predict`` both call :func:`analyze_slide`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from core.infra.fileio import load_safetensors_model

logger = logging.getLogger(__name__)

__all__ = ["SlideAnalysis", "analyze_slide", "load_slide_model", "FoldEnsemble", "slide_encoder", "regions_overlay",
           "DEFAULT_SLIDE_MODEL", "SAMPLES_DIR", "bundled_samples"]

WEIGHTS_DIR = os.path.join(os.path.dirname(__file__), "weights")
DEFAULT_SLIDE_MODEL = os.path.join(WEIGHTS_DIR, "querent_lesion.safetensors")
SAMPLES_DIR = os.path.join(os.path.dirname(__file__), "samples")


def bundled_samples() -> list[str]:
    """Paths of the sample slides shipped with the package."""
    if not os.path.isdir(SAMPLES_DIR):
        return []
    return sorted(os.path.join(SAMPLES_DIR, f) for f in os.listdir(SAMPLES_DIR) if f.endswith((".tiff", ".tif", ".svs")))


@dataclass
class SlideAnalysis:
    """Everything the demo shows for one slide."""

    slide_id: str
    overview: np.ndarray  # (h, w, 3) thumbnail with tissue mask and patch grid
    heatmap: np.ndarray  # (h, w, 3) thumbnail with the per-patch attention
    probabilities: list[float]  # class probabilities (empty when no tissue)
    class_names: list[str]
    coords: np.ndarray  # (N, 2) level-0 (x, y)
    attention: np.ndarray  # (N,) pooling weights
    patch_size_level0: int
    downsample: float  # level-0 pixels per thumbnail pixel
    thumbnail: np.ndarray  # (h, w, 3) plain thumbnail
    timings: dict = field(default_factory=dict)
    region_of_patch: np.ndarray | None = None  # (N,) region id of each patch
    chosen: np.ndarray | None = None  # (NR, K) region ids each region attended to in the last layer (union over heads)
    region_xy: np.ndarray | None = None  # (NR, 2) region column/row
    region_size: int = 8

    @property
    def n_patches(self) -> int:
        return int(self.coords.shape[0])


def load_slide_model(path: str | None = None):
    """The slide model and its metadata (config, class names) from ``path``: a Querent safetensors file with its
    .json (default: the shipped one), or the output folder of ``pathology.train`` (or its ``<model>_config.json``),
    whose fold models are averaged (:class:`FoldEnsemble`)."""
    return _load_slide_model(path or DEFAULT_SLIDE_MODEL)


@lru_cache(maxsize=4)
def _load_slide_model(path: str):
    from pathology.querent import Querent, QuerentConfig

    if os.path.isdir(path) or path.endswith("_config.json"):
        return _load_fold_ensemble(path)
    meta_path = os.path.splitext(path)[0] + ".json"
    if not os.path.isfile(path) or not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"slide model not found ({path!r} with its {os.path.basename(meta_path)!r}); train it with "
            "`python -m pathology.train_demo`"
        )
    what = "a Querent slide model written by pathology.train_demo (with its .json)"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        model = Querent(QuerentConfig(**meta["model_config"]))
    except (UnicodeDecodeError, KeyError, TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{meta_path} is not a slide model's metadata ({type(err).__name__}: {err}); expected the "
                         f"JSON beside {what}, with 'model_config'") from err
    load_safetensors_model(model, path, what=what)
    return model.eval(), meta


class FoldEnsemble(torch.nn.Module):
    """The fold models of one cross-validation as one slide model: class probabilities averaged (``logits`` are the
    log of the mean probabilities; survival: the mean risk) and attention averaged; Querent's chosen regions
    (``block_index``, ``layout``) are the first fold model's. On development cohorts of 120 slides the average of the
    5 fold models ranked an external cohort better than a fold model alone (docs/experiments/pathology.md)."""

    def __init__(self, members: list[torch.nn.Module]):
        super().__init__()
        self.members = torch.nn.ModuleList(members)

    def forward(self, features_ND, coords_N2=None, *, patch_size_level0=None, return_index=False):
        import dataclasses

        outs = [m(features_ND, coords_N2, patch_size_level0=patch_size_level0, return_index=return_index)
                for m in self.members]
        logits = torch.stack([o.logits.float() for o in outs])  # (K, 1, C)
        logits = logits.mean(0) if logits.shape[-1] == 1 else torch.softmax(logits, -1).mean(0).log()
        return dataclasses.replace(outs[0], logits=logits, attention=torch.stack([o.attention for o in outs]).mean(0),
                                   embedding=torch.stack([o.embedding for o in outs]).mean(0))


def _load_fold_ensemble(path: str):
    """``<model>_fold<k>.safetensors`` beside ``<model>_config.json`` (``path`` is the folder or that file), as
    ``pathology.train`` writes them. The patch settings (``patch_mpp``, ``patch_size``, ``min_tissue``, ``encoder``,
    ``encoder_kwargs``, ``tissue``), which ``pathology.train`` copies from its feature files, are read from the config;
    where a config lacks them (features not made by ``pathology.batch``), ``pathology.batch``'s defaults are assumed
    (and logged)."""
    import dataclasses
    import re

    from pathology.batch import BatchConfig
    from pathology.mil import MODEL_NAMES, build_model
    from pathology.querent import QuerentConfig

    what = "a pathology.train output folder (<model>_config.json beside <model>_fold<k>.safetensors)"
    folder, cfg_file = (path, None) if os.path.isdir(path) else os.path.split(path)
    folder = folder or "."
    found = [f for f in sorted(os.listdir(folder)) if f.endswith("_config.json") and f[:-12] in MODEL_NAMES]
    if cfg_file is None and len(found) > 1:
        raise ValueError(f"{path} holds the configs of several models ({', '.join(found)}); give one of them as "
                         "the model path")
    cfg_file = cfg_file or (found[0] if found else None)
    name = cfg_file[:-12] if cfg_file else None
    folds = sorted((int(m.group(1)), f) for f in os.listdir(folder)
                   if name and (m := re.fullmatch(rf"{re.escape(name)}_fold(\d+)\.safetensors", f)))
    if name is None or not os.path.isfile(os.path.join(folder, cfg_file)) or not folds:
        raise FileNotFoundError(f"no fold models in {path!r}; expected {what}")
    try:
        with open(os.path.join(folder, cfg_file)) as f:
            meta = json.load(f)
        fields = {fl.name for fl in dataclasses.fields(QuerentConfig)}
        cfg = QuerentConfig(**{k: v for k, v in meta.items() if k in fields})
    except (UnicodeDecodeError, TypeError, ValueError, AttributeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{os.path.join(folder, cfg_file)} is not a model config ({type(err).__name__}: {err}); "
                         f"expected {what}") from err
    members = []
    for _, f in folds:
        members.append(build_model(name, cfg))
        load_safetensors_model(members[-1], os.path.join(folder, f), what=what)
    d = {fl.name: fl.default for fl in dataclasses.fields(BatchConfig)}
    patch = {k: meta.get(k, d[b]) for k, b in (("patch_mpp", "mpp"), ("patch_size", "patch_size"),
                                                ("min_tissue", "min_tissue"), ("encoder", "encoder"))}
    patch.update(encoder_kwargs=meta.get("encoder_kwargs") or {}, tissue=meta.get("tissue"))
    assumed = sorted(set(patch) - set(meta) - {"encoder_kwargs", "tissue"})
    if assumed:
        logger.info("%s does not say %s; assumed pathology.batch's defaults %s", cfg_file, ", ".join(assumed),
                    {k: patch[k] for k in assumed})
    classes = meta.get("classes") or [str(i) for i in range(cfg.num_classes)]
    info = {"model_config": dataclasses.asdict(cfg), "model": name, "folds": [f for _, f in folds],
            "class_names": classes, **patch}
    return FoldEnsemble(members).eval(), info


@torch.no_grad()
def analyze_slide(path: str, *, model_path: str | None = None, encoder_name: str | None = None,
                  encoder_weights: str | None = None, slide_mpp: float | None = None, thumb_size: int = 768,
                  workers: int = 0) -> SlideAnalysis:
    """Run the whole pipeline on one slide with the shipped (or given) encoder and Querent model.

    Patches use the target µm/px and size the model was trained with (from its metadata).
    """
    from pathology.features import extract_features
    from pathology.patching import overview_image, patch_grid
    from pathology.slide import Slide
    from pathology.tissue import TissueConfig, segment_tissue

    model, meta = load_slide_model(model_path)
    t = {}
    t0 = time.perf_counter()
    with Slide(path, mpp=slide_mpp) as slide:
        tissue = segment_tissue(slide, TissueConfig(**meta["tissue"]) if meta.get("tissue") else None)
        grid = patch_grid(slide, tissue, mpp=meta["patch_mpp"], patch_size=meta["patch_size"],
                          min_tissue=meta.get("min_tissue", 0.25))
        thumb = slide.thumbnail(thumb_size)
        down = slide.dimensions[0] / thumb.shape[1]
    t["tissue_and_grid_s"] = time.perf_counter() - t0
    overview = overview_image(thumb, down, mask=tissue.mask, coords=grid.coords, patch_size_level0=grid.patch_size_level0)
    names = list(meta.get("class_names", ["0", "1"]))
    sid = os.path.splitext(os.path.basename(path))[0]
    if len(grid.coords) == 0:
        return SlideAnalysis(sid, overview, overview, [], names, grid.coords, np.zeros(0), grid.patch_size_level0,
                             down, thumb, t)
    enc = slide_encoder(meta, encoder_weights, name=encoder_name)
    t0 = time.perf_counter()
    feats, pps = extract_features(path, grid, enc, workers=workers, mpp=slide_mpp)
    t["features_s"] = time.perf_counter() - t0
    t["patches_per_s"] = pps
    t0 = time.perf_counter()
    out = model(torch.from_numpy(feats), torch.from_numpy(grid.coords), patch_size_level0=grid.patch_size_level0,
                return_index=True)
    t["model_s"] = time.perf_counter() - t0
    probs = torch.softmax(out.logits[0].float(), -1).tolist()
    att = out.attention.numpy()
    heat = (att - att.min()) / max(float(att.max() - att.min()), 1e-12)
    heatmap = overview_image(thumb, down, coords=grid.coords, patch_size_level0=grid.patch_size_level0, heat=heat)
    if out.block_index is None or out.layout is None:  # a model without regions (ABMIL, mean pooling, ...)
        return SlideAnalysis(sid, overview, heatmap, probs, names, grid.coords, att, grid.patch_size_level0, down,
                             thumb, t)
    last = out.block_index[-1]  # (H, NR, K)
    return SlideAnalysis(sid, overview, heatmap, probs, names, grid.coords, att, grid.patch_size_level0, down, thumb, t,
                         region_of_patch=out.layout.region_of_patch().numpy(), chosen=last.numpy(),
                         region_xy=out.layout.region_xy.numpy(), region_size=out.layout.region_size)


def slide_encoder(meta: dict, weights: str | None = None, *, name: str | None = None):
    """The patch encoder (on CPU) of a slide model (``meta`` from :func:`load_slide_model`): ``name`` or the one it
    was trained with, from ``weights`` (default: the shipped ones). Weights of another model, or features of another
    size than the slide model reads, are a ``ValueError``."""
    kwargs = (meta.get("encoder_kwargs") or {}) if name is None else {}  # another encoder: its own defaults
    enc = _encoder(name or meta.get("encoder") or "default", weights, json.dumps(kwargs, sort_keys=True))
    want = meta.get("model_config", {}).get("in_dim")
    if want is not None and enc.dim != want:
        raise ValueError(f"the patch encoder {enc.name!r} ({weights or 'shipped weights'}) gives {enc.dim}-d features, "
                         f"the slide model reads {want}-d ones; give the encoder weights it was trained with")
    return enc


@lru_cache(maxsize=2)
def _encoder(name: str, weights: str | None, kwargs_json: str = "{}"):
    from pathology.encoders import build_encoder

    return build_encoder(name, weights=weights, device="cpu", encoder_kwargs=json.loads(kwargs_json) or None)


def regions_overlay(a: SlideAnalysis, x: float, y: float) -> tuple[np.ndarray, str]:
    """Highlight the regions chosen by the patch under thumbnail pixel ``(x, y)``.

    Returns the image (own region yellow, chosen regions cyan) and a text summary.
    """
    from PIL import Image, ImageDraw

    if a.chosen is None or a.n_patches == 0:
        return a.heatmap, "no patches on this slide"
    X0, Y0 = x * a.downsample, y * a.downsample
    centres = a.coords + a.patch_size_level0 / 2
    i = int(np.argmin(((centres - [X0, Y0]) ** 2).sum(1)))
    r = int(a.region_of_patch[i])
    ids = np.unique(a.chosen[:, r][a.chosen[:, r] >= 0])
    img = Image.fromarray(a.heatmap.copy())
    d = ImageDraw.Draw(img)
    origin = a.coords.min(0)
    side = a.region_size * a.patch_size_level0 / a.downsample
    for rid in ids:
        cx, cy = a.region_xy[rid]
        x0 = origin[0] / a.downsample + cx * side
        y0 = origin[1] / a.downsample + cy * side
        d.rectangle([x0, y0, x0 + side, y0 + side], outline=(255, 230, 0) if rid == r else (0, 220, 255), width=2)
    px, py = a.coords[i] / a.downsample
    s = a.patch_size_level0 / a.downsample
    d.rectangle([px, py, px + s, py + s], outline=(255, 0, 0), width=2)
    text = (f"patch {i} at level-0 ({a.coords[i][0]}, {a.coords[i][1]}) lies in region {r}; in the last layer its "
            f"region attended to {len(ids)} of {len(a.region_xy)} regions (union over heads): "
            f"own 3×3 neighbourhood plus the top-k by the min/max upper bound.")
    return np.asarray(img), text
