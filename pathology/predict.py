"""Predict one or more slides with the shipped (or a given) Querent model; write heatmaps and a JSON per slide.

``python -m pathology.predict SLIDE [SLIDE ...] --out DIR [--model PATH] [--slide-mpp 0.25]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.predict", description=__doc__.split("\n")[0])
    p.add_argument("slides", nargs="+", help="slide files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None, help="Querent safetensors (its .json beside it); default: shipped demo model")
    p.add_argument("--slide-mpp", type=float, default=None, help="µm/px of level 0 for files that lack it")
    p.add_argument("--encoder-weights", default=None, help="weights file for the model's patch encoder (default: shipped)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers reading tiles")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    from pathology.inference import analyze_slide, load_slide_model
    from pathology.patching import save_png

    try:
        load_slide_model(args.model)
    except FileNotFoundError as e:
        logger.error("%s", e)
        return 2
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for path in tqdm(args.slides, desc="slides", unit="slide"):
        try:
            a = analyze_slide(path, model_path=args.model, encoder_weights=args.encoder_weights,
                              slide_mpp=args.slide_mpp, workers=args.workers)
        except (ValueError, FileNotFoundError) as e:
            logger.error("%s: %s", path, e)
            failed += 1
            continue
        save_png(os.path.join(args.out, f"{a.slide_id}_overview.png"), a.overview)
        save_png(os.path.join(args.out, f"{a.slide_id}_heatmap.png"), a.heatmap)
        res = {"slide": path, "n_patches": a.n_patches, "probabilities": dict(zip(a.class_names, a.probabilities)),
               "timings": a.timings}
        p = os.path.join(args.out, f"{a.slide_id}.json")
        with open(p + ".tmp", "w") as f:
            json.dump(res, f, indent=2)
        os.replace(p + ".tmp", p)
        logger.info("%s: %s", a.slide_id, res["probabilities"] or "no tissue")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
