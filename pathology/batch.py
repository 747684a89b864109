"""Batch slide processing: tissue segmentation, patch coordinates and patch features for a folder of slides.

``python -m pathology.batch --slides DIR --out DIR [--task seg|coords|feat|all] [--mpp 0.5]
[--patch-size 256] [--encoder NAME] [--weights PATH] [--encoder-kwargs JSON] [--allow-partial-weights]
[--shard I/N] [--skip-errors] [--overwrite] [--time-limit SECONDS] [--workers K]``

Outputs under ``--out``:
- ``seg/<slide>.png`` thumbnail with the tissue mask (green) and the patch grid (blue), ``seg/<slide>_mask.png``
  the mask itself;
- ``patches/<slide>.h5`` ``coords`` (N, 2) level-0 (x, y), attrs ``patch_size``, ``patch_level``, ``mpp``;
- ``features/<encoder>/<slide>.h5`` ``coords`` + ``features`` (N, D) (CLAM layout);
- ``manifest.csv`` (``manifest_<I>of<N>.csv`` with ``--shard``): one row per slide with its status and the
  fingerprint of its settings;
- ``failures.log``: tracebacks of failed slides; ``locks/``: lock files of slides in progress.

Settings: every output stores the settings it was made with (root attrs ``settings`` (JSON) and
``settings_fingerprint`` of the h5 files; text chunks of the same names in the mask PNG): the slide's µm/px and
the tissue settings (mask), plus ``--mpp``, ``--patch-size``, ``--min-tissue`` (coords), plus the encoder's
identity: name, weights file, ``--encoder-kwargs`` (features). A rerun whose settings differ from an existing
output's refuses before any work and names the differences; ``--overwrite`` redoes those outputs, or choose a new
``--out``. Finished outputs with the same settings are kept.

Every output is written to a temp file and renamed, so a killed run leaves no partial file; a rerun skips
finished outputs and takes over locks whose process is gone (or whose heartbeat stopped, on another host).
The job machinery (shards, locks, manifest, time limit, fingerprints) is :mod:`core.infra.jobs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from core.infra.cli import (UsageError, capped_int, check_memory, fraction, nonempty_path, positive_float, positive_int,
                            run_cli, worker_count)
from core.infra.fileio import check_writable, open_image
from core.infra.device import add_device_options, resolve_device
from core.infra.guard import check_outputs
from core.infra.jobs import (
    Item,
    JobConfig,
    SettingsMismatch,
    add_job_arguments,
    atomic_write,
    batch_parser,
    canonical_settings,
    file_identity,
    job_config_from_args,
    remove_temps,
    run_job,
    settings_fingerprint,
)

logger = logging.getLogger(__name__)

__all__ = ["BatchConfig", "list_slides", "check_weights", "run_batch", "build_parser", "main", "SLIDE_EXTENSIONS"]

SLIDE_EXTENSIONS = (".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif",
                    ".dcm", ".czi", ".png", ".jpg", ".jpeg")
TASKS = ("seg", "coords", "feat", "all")
#: µm per pixel accepted by --mpp and --slide-mpp: scanners give 0.1-1 µm/px at level 0; 100 µm/px is 1/200 of 20x
MIN_MPP, MAX_MPP = 0.01, 100.0
#: the largest --patch-size (pixels at --mpp): encoders read 224-512 px patches
MAX_PATCH_SIZE = 4096


def mpp_arg(text: str) -> float:
    """An argparse type: micrometres per pixel in [:data:`MIN_MPP`, :data:`MAX_MPP`]."""
    value = positive_float(text)
    if not MIN_MPP <= value <= MAX_MPP:
        raise argparse.ArgumentTypeError(f"must be micrometres per pixel in [{MIN_MPP:g}, {MAX_MPP:g}] (scanners give "
                                         f"0.1-1 at level 0), got {value:g}")
    return value


@dataclass(kw_only=True)
class BatchConfig:
    """One batch run."""

    slides: str  # folder of slides (searched non-recursively)
    out: str  # output folder
    task: str = "all"  # seg | coords | feat | all (each task runs its prerequisites)
    mpp: float = 0.5  # target micrometres per pixel of patches (0.5 ≈ 20×)
    patch_size: int = 256  # patch side in pixels at the target mpp
    min_tissue: float = 0.25  # minimum tissue fraction of a kept patch
    slide_mpp: float | None = None  # override of the slides' own µm/px (for files without it)
    encoder: str = "default"  # patch encoder registry name
    weights: str | None = None  # local weights file for the encoder
    encoder_kwargs: dict = field(default_factory=dict)  # constructor keywords of the encoder (part of its settings)
    strict: bool = True  # weights must fill every encoder key (False: load what fits, log what is missing)
    shard: tuple[int, int] = (0, 1)  # (index, count): this process handles slides index, index+count, ...
    skip_errors: bool = False  # record a failed slide and go on (otherwise stop with an error)
    overwrite: bool = False  # redo outputs made with other settings (otherwise refuse before any work)
    time_limit: float | None = None  # seconds per slide, run in a worker process killed past it (None: no limit)
    stale_after: float = 600.0  # a lock whose heartbeat is older than this is taken over (any host)
    workers: int = 0  # DataLoader workers reading tiles while the encoder runs
    batch_size: int = 64  # patches per encoder batch
    device: str | None = None  # encoder device (default: CUDA if present, else CPU)
    progress: bool = True  # tqdm bars

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task ({self.task!r}) must be one of {TASKS}")
        if not self.mpp > 0:
            raise ValueError(f"mpp ({self.mpp}) must be > 0")
        if self.patch_size < 8:
            raise ValueError(f"patch_size ({self.patch_size}) must be >= 8")
        if self.workers < 0:
            raise ValueError(f"workers ({self.workers}) must be >= 0")
        if self.slide_mpp is not None and not self.slide_mpp > 0:
            raise ValueError(f"slide_mpp ({self.slide_mpp}) must be > 0")
        if not isinstance(self.encoder_kwargs, dict):
            raise ValueError(f"encoder_kwargs ({self.encoder_kwargs!r}) must be a dict of constructor keywords")
        try:
            canonical_settings(self.encoder_kwargs)  # JSON values only: they are stored with the features
        except ValueError as e:
            raise ValueError(f"encoder_kwargs ({self.encoder_kwargs!r}) must hold JSON values only: {e}") from None
        self.job_config()  # validates shard, time_limit, stale_after

    @property
    def encoder_tag(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.encoder)

    def job_config(self) -> JobConfig:
        return JobConfig(out=self.out, shard=self.shard, skip_errors=self.skip_errors, overwrite=self.overwrite,
                         time_limit=self.time_limit, stale_after=self.stale_after,
                         heartbeat=min(30.0, self.stale_after / 4), progress=self.progress,
                         desc=f"slides [{self.task}]")


def list_slides(folder: str) -> list[str]:
    """Slide files in ``folder`` (sorted by name), by extension; a link to a missing file is listed (it fails, with
    a manifest row, rather than vanishing)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"slides folder not found: {folder!r}")
    return sorted(
        os.path.join(folder, f) for f in os.listdir(folder)
        if f.lower().endswith(SLIDE_EXTENSIONS) and not f.startswith(".")
        and (os.path.isfile(os.path.join(folder, f)) or os.path.islink(os.path.join(folder, f)))
    )


def _slide_id(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _encoder_settings(cfg: BatchConfig) -> dict:
    """The encoder's identity, stored with the features: :func:`pathology.encoders.encoder_settings` with the
    weights file named by its content (size and SHA-256 of the whole file), so a copied or moved file matches and
    a changed one does not, wherever its bytes changed."""
    from pathology.encoders import encoder_settings

    s = encoder_settings(cfg.encoder, cfg.weights, cfg.encoder_kwargs or None)
    if isinstance(s.get("weights"), dict) and s["weights"].get("path"):
        s = {**s, "weights": file_identity(s["weights"]["path"])}
    return s


def check_weights(cfg: BatchConfig) -> None:
    """Refuse ``cfg.weights`` before any work: a file that is not readable weights or, for the default encoder (small
    enough to build here), weights of another model, is a ``ValueError`` naming it. Other encoders' weights are read
    (safetensors: the header only); whether they fit the architecture shows when the encoder is built."""
    if cfg.weights is None:
        return
    from core.infra.fileio import open_safetensors
    from pathology.encoders import build_encoder, load_state_dict_file

    if cfg.encoder in ("default", "longctx-small"):
        build_encoder(cfg.encoder, weights=cfg.weights, device="cpu", encoder_kwargs=cfg.encoder_kwargs or None,
                      strict=cfg.strict)
    elif str(cfg.weights).endswith(".safetensors"):
        with open_safetensors(cfg.weights, what=f"weights of the {cfg.encoder} patch encoder"):
            pass
    else:
        load_state_dict_file(cfg.weights)


def _build_encoder(cfg: BatchConfig):
    from pathology.encoders import build_encoder

    return build_encoder(cfg.encoder, weights=cfg.weights, device=cfg.device, encoder_kwargs=cfg.encoder_kwargs or None,
                         strict=cfg.strict)


def _write_png(path: str, img: np.ndarray, settings: dict | None = None) -> None:
    """Save an image as PNG atomically, with its settings as text chunks."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    if settings is not None:
        info.add_text("settings", json.dumps(canonical_settings(settings), sort_keys=True))
        info.add_text("settings_fingerprint", settings_fingerprint(settings))
    with atomic_write(path, ".png") as tmp:
        Image.fromarray(img).save(tmp, pnginfo=info)


class _SlideJob:
    """The per-slide work of a batch run (a :class:`core.infra.jobs.Job`)."""

    key_field = "slide_id"
    extra_fields = ("task", "n_patches", "patches_per_s")

    def __init__(self, cfg: BatchConfig):
        self.cfg = cfg
        self.dirs = {k: os.path.join(cfg.out, k) for k in ("seg", "patches")}
        self.dirs["features"] = os.path.join(cfg.out, "features", cfg.encoder_tag)
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        self._encoder = None
        self._encoder_settings: dict | None = None
        self._slide_mpp: dict[str, float | None] = {}

    def __getstate__(self) -> dict:  # sent to a worker process: the encoder is built there
        return {**self.__dict__, "_encoder": None}

    def paths(self, sid: str) -> dict[str, str]:
        return {
            "seg": os.path.join(self.dirs["seg"], f"{sid}_mask.png"),
            "seg_png": os.path.join(self.dirs["seg"], f"{sid}.png"),
            "coords": os.path.join(self.dirs["patches"], f"{sid}.h5"),
            "feat": os.path.join(self.dirs["features"], f"{sid}.h5"),
        }

    def _stages(self) -> tuple[str, ...]:
        return {"seg": ("seg",), "coords": ("seg", "coords")}.get(self.cfg.task, ("seg", "coords", "feat"))

    def outputs(self, item: Item) -> list[str]:
        p = self.paths(item.key)
        return [p[s] for s in self._stages()]

    def slide_mpp(self, path: str) -> float | None:
        """The µm/px the slide is read at (override or the file's own); None when unknown."""
        if path not in self._slide_mpp:
            from pathology.slide import Slide

            try:
                with Slide(path, mpp=self.cfg.slide_mpp) as slide:
                    self._slide_mpp[path] = float(slide.mpp)
            except Exception:  # noqa: BLE001 - an unreadable slide fails (and is reported) when processed
                self._slide_mpp[path] = None
        return self._slide_mpp[path]

    def settings(self, item: Item) -> dict[str, dict]:
        from pathology.tissue import TissueConfig

        cfg, p, stages = self.cfg, self.paths(item.key), self._stages()
        s = {"seg": {"output": "tissue_mask", "slide_mpp": self.slide_mpp(item.path),
                     "tissue": dataclasses.asdict(TissueConfig())}}
        s["coords"] = {**s["seg"], "output": "coords", "mpp": float(cfg.mpp), "patch_size": int(cfg.patch_size),
                       "min_tissue": float(cfg.min_tissue)}
        if "feat" in stages:
            if self._encoder_settings is None:
                self._encoder_settings = _encoder_settings(cfg)
            s["feat"] = {**s["coords"], "output": "features", "encoder": self._encoder_settings}
        return {p[k]: s[k] for k in stages}

    def stored_settings(self, path: str) -> dict | None:
        try:
            if path.endswith(".png"):
                from PIL import Image

                with Image.open(path) as im:
                    text = im.text.get("settings")  # type: ignore[attr-defined]
            else:
                import h5py

                with h5py.File(path, "r") as f:
                    text = f.attrs.get("settings")
            return json.loads(text) if text else None
        except (OSError, ValueError):
            return None

    def setup(self) -> None:
        """Import the slide stack and build the encoder once in a worker process (outside the per-slide limit)."""
        import pathology.features  # noqa: F401
        import pathology.patching  # noqa: F401
        import pathology.tissue  # noqa: F401

        if "feat" in self._stages():
            self.encoder()

    def encoder(self):
        if self._encoder is None:
            self._encoder = _build_encoder(self.cfg)
        return self._encoder

    def process(self, item: Item) -> dict:
        """Run the configured task (and its prerequisites) on one slide; returns manifest fields."""
        from pathology.patching import grid_from_h5, overview_image, patch_grid, read_h5, write_h5
        from pathology.slide import Slide
        from pathology.tissue import TissueMask, segment_tissue

        cfg, sid, path = self.cfg, item.key, item.path
        out = self.paths(sid)
        remove_temps([out["seg_png"]])  # the overview is no fingerprinted output: the runner does not clear it
        row = {"task": cfg.task}
        with Slide(path, mpp=cfg.slide_mpp) as slide:
            self._slide_mpp[path] = float(slide.mpp)  # fails early and clearly when µm/px is unknown
            wanted = self.settings(item)
            settings = {s: wanted[out[s]] for s in self._stages()}
            W, _h = slide.dimensions
            # seg
            if os.path.exists(out["seg"]):
                with open_image(out["seg"], what="the tissue mask (PNG) an earlier run wrote") as im:
                    mask = np.asarray(im) > 0
                tissue = TissueMask(mask=mask, downsample=W / mask.shape[1], thumbnail=None)  # type: ignore[arg-type]
            else:
                tissue = segment_tissue(slide)
                _write_png(out["seg"], tissue.mask.astype(np.uint8) * 255, settings["seg"])
            # coords (the overview shows the grid: it is redrawn whenever the grid is made)
            stored = read_h5(out["coords"]) if "coords" in settings and os.path.exists(out["coords"]) else None
            if stored is not None and stored.get("tissue_fraction") is not None:  # resumed: the grid as it was made
                grid = grid_from_h5(stored)
            else:
                grid = patch_grid(slide, tissue, mpp=cfg.mpp, patch_size=cfg.patch_size, min_tissue=cfg.min_tissue)
                thumb = tissue.thumbnail if tissue.thumbnail is not None else slide.thumbnail(max(tissue.mask.shape))
                _write_png(out["seg_png"], overview_image(thumb, W / thumb.shape[1], mask=tissue.mask,
                                                          coords=grid.coords,
                                                          patch_size_level0=grid.patch_size_level0))
                if "coords" in settings:
                    write_h5(out["coords"], grid, slide_id=sid, **_settings_attrs(settings["coords"]))
            n = int(grid.coords.shape[0])
            if "feat" not in settings:
                return {**row, "status": "done" if n or cfg.task == "seg" else "empty",
                        "n_patches": "" if cfg.task == "seg" else n}
        # feat (the slide is reopened inside the workers)
        enc = self.encoder()
        from pathology.features import extract_features

        feats, pps = extract_features(path, grid, enc, batch_size=cfg.batch_size, workers=cfg.workers,
                                      mpp=cfg.slide_mpp, progress=cfg.progress)
        write_h5(out["feat"], grid, feats, slide_id=sid, encoder=enc.name, **_settings_attrs(settings["feat"]))
        return {**row, "status": "done" if n else "empty", "n_patches": n, "patches_per_s": round(pps, 1)}


def _settings_attrs(settings: dict) -> dict[str, str]:
    return {"settings": json.dumps(canonical_settings(settings), sort_keys=True),
            "settings_fingerprint": settings_fingerprint(settings)}


def run_batch(cfg: BatchConfig, *, encoder=None) -> list[dict]:
    """Process every slide of this shard; returns the manifest rows (``encoder``: the patch encoder already built
    from ``cfg``, e.g. by :func:`check_encoder`).

    Raises :class:`core.infra.jobs.SettingsMismatch` before any work when existing outputs were made with other settings
    (unless ``cfg.overwrite``), and the first failure unless ``cfg.skip_errors``.
    """
    os.makedirs(cfg.out, exist_ok=True)
    items = [Item(key=_slide_id(p), path=p) for p in list_slides(cfg.slides)]
    job = _SlideJob(cfg)
    job._encoder = encoder
    return list(run_job(job, items, cfg.job_config()).values())


def check_encoder(cfg: BatchConfig):
    """The patch encoder of ``cfg`` built once before any slide (None when the task makes no features): an
    ``--encoder``, ``--encoder-kwargs`` or ``--weights`` it cannot be built from is a ``UsageError`` (exit 2), not a
    failure of every slide."""
    from core.infra.cli import UsageError

    if cfg.task not in ("feat", "all"):
        return None
    try:
        return _build_encoder(cfg)
    except (ImportError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the constructor refuses is a refusal of the options
        kwargs = f" --encoder-kwargs {json.dumps(cfg.encoder_kwargs)}" if cfg.encoder_kwargs else ""
        raise UsageError(f"--encoder {cfg.encoder}{kwargs}: the encoder cannot be built ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]})") from e


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--encoder-kwargs must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"--encoder-kwargs must be a JSON object like '{{\"img_size\": 224}}', "
                                         f"got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = batch_parser("python -m pathology.batch", __doc__)
    p.add_argument("--slides", required=True, help="folder with slide files")
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder")
    p.add_argument("--task", choices=TASKS, default="all", help="what to compute (default all)")
    p.add_argument("--mpp", type=mpp_arg, default=0.5,
                   help="target micrometres per pixel of patches (default 0.5 ≈ 20x)")
    p.add_argument("--patch-size", type=capped_int(MAX_PATCH_SIZE, why="patch side in pixels"), default=256,
                   help="patch side in pixels at --mpp (default 256)")
    p.add_argument("--min-tissue", type=fraction, default=0.25, help="minimum tissue fraction of a patch (default 0.25)")
    p.add_argument("--slide-mpp", type=mpp_arg, default=None, help="µm/px of level 0 for slides whose files lack it")
    p.add_argument("--encoder", default="default", help="patch encoder: default | timm:<name> | open_clip:<name>")
    p.add_argument("--weights", default=None, help="local weights file for the encoder")
    p.add_argument("--encoder-kwargs", type=_json_object, default={}, metavar="JSON",
                   help="constructor keywords of the encoder as a JSON object (e.g. '{\"img_size\": 224}'); stored "
                        "with the features")
    p.add_argument("--allow-partial-weights", action="store_true",
                   help="load weights that fill only part of the encoder (missing keys are logged); default: refuse")
    p.add_argument("--workers", type=worker_count, default=0,
                   help="DataLoader workers reading tiles (default 0; at most 4 per CPU core)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="patches per encoder batch")
    add_device_options(p, dtype=False)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_job_arguments(p, item="slide")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = str(resolve_device(args.device))  # a missing GPU is one line before any work
    check_outputs([("--out", args.out)], inputs=[args.slides, args.weights])
    if args.slide_mpp is not None and args.mpp < args.slide_mpp * 0.95:
        raise UsageError(f"--mpp {args.mpp:g} is finer than --slide-mpp {args.slide_mpp:g}: patches would be upsampled; "
                         "give --mpp >= --slide-mpp")
    check_memory(args.batch_size * args.patch_size**2 * 3 * 4 * 4, what="one batch of patches (pixels, encoder input "
                 "and activations)", options="--batch-size/--patch-size")
    if args.weights is not None and not os.path.isfile(args.weights):
        raise FileNotFoundError(f"--weights {args.weights!r} is not a file; give the local weights of the --encoder")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    job = job_config_from_args(args, args.out)
    # Bad options, a missing slides folder, unreadable --weights (or, for the default encoder, weights of another
    # model) and outputs made with other settings are bad usage or input: one line, exit 2 (run_cli), before any work. A slide that fails stops the run (exit 1) unless --skip-errors.
    cfg = BatchConfig(slides=args.slides, out=args.out, task=args.task, mpp=args.mpp, patch_size=args.patch_size,
                      min_tissue=args.min_tissue, slide_mpp=args.slide_mpp, encoder=args.encoder,
                      weights=args.weights, encoder_kwargs=args.encoder_kwargs,
                      strict=not args.allow_partial_weights, shard=job.shard, skip_errors=job.skip_errors,
                      overwrite=job.overwrite, time_limit=job.time_limit, stale_after=job.stale_after,
                      workers=args.workers, batch_size=args.batch_size, device=device,
                      progress=not args.no_progress)
    list_slides(cfg.slides)
    check_writable(cfg.out, what="--out", folder=True)
    check_weights(cfg)
    encoder = check_encoder(cfg)
    try:
        rows = run_batch(cfg, encoder=encoder)
    except SettingsMismatch:
        raise
    except Exception as e:  # noqa: BLE001
        logger.error("stopped: %s (use --skip-errors to record failures and continue)", e)
        return 1
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    logger.info("finished: %s", ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0 if counts.get("failed", 0) == 0 else 1  # 1: some slides failed (recorded in the manifest)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
