"""Predict one or more slides with the shipped (or a given) Querent model; write heatmaps and a JSON per slide.

``python -m pathology.predict SLIDE [SLIDE ...] --out DIR [--model PATH] [--slide-mpp 0.25]``

``--model`` may be the output folder of ``pathology.train``: its fold models are averaged (class probabilities and
attention; :class:`pathology.inference.FoldEnsemble`).

A slide that cannot be read (missing, corrupt, unsupported) is named on stderr and the others are still predicted
and written; the exit code is then 1 (2 when no slide could be read). ``--out``, ``--model`` and
``--encoder-weights`` are checked before any slide is read.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Sequence

from core.infra.cli import InputTally, UsageError, run_cli, worker_count
from core.infra.guard import check_outputs
from pathology.batch import mpp_arg

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.predict", description=__doc__.split("\n")[0])
    p.add_argument("slides", nargs="+", help="slide files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None,
                   help="Querent safetensors (its .json beside it), or a pathology.train output folder (its fold "
                        "models averaged; several models there: give its <model>_config.json); default: the shipped "
                        "demo model")
    p.add_argument("--slide-mpp", type=mpp_arg, default=None, help="µm/px of level 0 for files that lack it")
    p.add_argument("--encoder-weights", default=None, help="weights file for the model's patch encoder (default: shipped)")
    p.add_argument("--workers", type=worker_count, default=0, help="DataLoader workers reading tiles (at most 4 per core)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    from core.infra.fileio import check_writable, write_json_atomic
    from pathology.batch import SLIDE_EXTENSIONS
    from pathology.inference import analyze_slide, load_slide_model, slide_encoder
    from pathology.patching import save_png

    check_outputs([("--out", args.out)], inputs=[*args.slides, args.model, args.encoder_weights])
    check_writable(args.out, what="--out", folder=True)
    if args.slide_mpp is not None and not args.slide_mpp > 0:
        raise UsageError(f"--slide-mpp must be a positive number of micrometres per pixel, got {args.slide_mpp}")
    if args.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {args.workers}")
    _, meta = load_slide_model(args.model)  # a missing or bad model, or encoder weights, refused before any slide
    slide_encoder(meta, args.encoder_weights)
    os.makedirs(args.out, exist_ok=True)
    tally = InputTally("slide")
    accepted = f"slide files OpenSlide or Pillow reads ({', '.join(SLIDE_EXTENSIONS)})"
    written: dict[str, str] = {}  # slide id -> the input whose outputs carry that name
    for path in tqdm(args.slides, desc="slides", unit="slide"):
        try:
            a = analyze_slide(path, model_path=args.model, encoder_weights=args.encoder_weights,
                              slide_mpp=args.slide_mpp, workers=args.workers)
            if a.slide_id in written:
                raise ValueError(f"its outputs would replace those of {written[a.slide_id]} (same name "
                                 f"{a.slide_id!r}); predict it in another call with another --out")
            save_png(os.path.join(args.out, f"{a.slide_id}_overview.png"), a.overview)
            save_png(os.path.join(args.out, f"{a.slide_id}_heatmap.png"), a.heatmap)
            if not all(math.isfinite(float(v)) for v in a.probabilities):
                raise ValueError(f"the model's probabilities are not finite ({list(a.probabilities)})")
            res = {"slide": path, "n_patches": a.n_patches, "probabilities": dict(zip(a.class_names, a.probabilities)),
                   "timings": a.timings}
            write_json_atomic(os.path.join(args.out, f"{a.slide_id}.json"), res)
        except Exception as err:  # noqa: BLE001 - a bad slide is reported; the others are still predicted
            tally.fail(path, err, accepted=accepted)
            continue
        written[a.slide_id] = path
        tally.ok()
        logger.info("%s: %s", a.slide_id, res["probabilities"] or "no tissue")
    return tally.finish()


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
