"""Slide models against the size of the bags: the lab-sized cohort (:mod:`benchmarks.pathology_cohort`) at 500 to
8,000 patches per bag, with measurements of why an attention model falls behind.

Every unit of work is one (stage, bags, patches per bag, cohort seed, variant, model): a cohort of the curve's shape
(:data:`benchmarks.pathology_cohort_bench.CURVE`: two 10-patch sites of strength 4 decide the label, two
half-strength decoys) drawn from the seed, cross-validated with :func:`pathology.training.cross_validate` (``--folds``
stratified folds, each fold's training bags giving 20% to a validation split), and one JSON line appended to
``--records``: pooled out-of-fold AUC, per-fold AUC, best epochs, CPU seconds, every bag's out-of-fold probability,
and per fold the diagnostics of :func:`fold_diagnostics` (training-bag AUC against test AUC; the pooling attention's
mass on the planted patches; for Querent, how many of the other planted site's patches the regions chosen by a
planted site's queries hold, on the whole bag and on the patches one training step sees). A rerun skips the units
already recorded (the key holds every setting the result depends on), so a killed run resumes.

Variants (:data:`VARIANTS`) change settings of ``auto`` (``pathology.train``'s defaults for the cohort's size, with
this benchmark's choice of Querent's region side by bag size). Stages:

- ``dev``: development cohorts (seeds :data:`DEV_SEEDS`, never reported as the curve) to choose the defaults;
- ``report``: the curve on fresh cohorts (seeds :data:`REPORT_SEEDS`), every model with the chosen defaults;
- ``summary``: tables (mean over seeds with a 95% t interval; differences paired by cohort) at ``--out``.

    OMP_NUM_THREADS=1 python -m benchmarks.pathology_bagsize --stage dev --bag-sizes 2000 --models querent
    OMP_NUM_THREADS=1 python -m benchmarks.pathology_bagsize --stage report --bags 120 --bag-sizes 2000 8000
    python -m benchmarks.pathology_bagsize --stage summary
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.infra.cli import UsageError, add_run_options, configure_run, positive_int, run_cli

logger = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parent / "results"
RECORDS = RESULTS / "pathology_bagsize_records.jsonl"
MODELS = ("mean", "abmil", "dense", "transmil", "querent")
DEV_SEEDS = (200, 201, 202, 203, 204)
REPORT_SEEDS = (10, 11, 12, 13, 14)

#: Settings changed from ``auto`` (keys of :func:`benchmarks.pathology_cohort_bench.recipe`, plus ``region_size``,
#: ``topk``, ``neighbourhood``, ``optimizer``, ``schedule``, ``pos_encoding``, ``layers_from``). ``max_patches`` 0 =
#: every patch.
VARIANTS: dict[str, dict] = {
    "auto": {},
    "allpatches": dict(max_patches=0),
    "nopos": dict(pos_encoding="none"),
    "allpatches_r4": dict(max_patches=0, region_size=4),
    "allpatches_nopos": dict(max_patches=0, pos_encoding="none"),
    # no Querent layer: embedding + gated attention pooling (ABMIL with Querent's position code); tells whether the
    # region-attention layer is what loses the planted patches
    "depth0": dict(depth=0),
    # depth 0 without the position code: the same layers as ABMIL plus the final LayerNorm, so depth0 - depth0_nopos
    # is what the position code costs or gains
    "depth0_nopos": dict(depth=0, pos_encoding="none"),
    # the layer attends only its own region (no neighbours, no top-k): local context, no bag-wide average
    "local": dict(neighbourhood=0, topk=0),
    # the pooling's gate reads the pre-layer embedding, its values the layer's tokens (QuerentConfig.pool_from)
    # depth 0 without the final LayerNorm: ABMIL plus the position code; depth0 - depth0_nonorm is what the norm costs
    "depth0_nonorm": dict(depth=0, final_norm=False),
    "depth0_nonorm_nopos": dict(depth=0, final_norm=False, pos_encoding="none"),  # = ABMIL's architecture
    "nonorm": dict(final_norm=False),  # the layered model without the final LayerNorm
    # the layer with every patch attending only itself (1×1 regions, no neighbours, no top-k): the layer's per-patch
    # capacity (value/output projections, MLP) without any mixing of patches
    "selfonly": dict(region_size=1, neighbourhood=0, topk=0),
    # the pooling's gate reads the pre-layer embedding without the final LayerNorm (ABMIL's gate plus the position
    # code), its values the layer's raw output
    "embed_gate_nonorm": dict(pool_from="embed_gate", final_norm=False),
    # ... and without the position code: the gate is ABMIL's (depth0_nonorm_nopos is ABMIL exactly)
    "embed_gate_nonorm_nopos": dict(pool_from="embed_gate", final_norm=False, pos_encoding="none"),
    "nonorm_nopos": dict(final_norm=False, pos_encoding="none"),  # the layered model without both
    # the gate reads the layer's raw output, the pooled values are ABMIL's (raw embedding, no position code): the head
    # sees only the pre-layer embedding, the layer can change only which patches are weighted
    "embed_values_nonorm_nopos": dict(pool_from="embed_values", final_norm=False, pos_encoding="none"),
    "embed_gate": dict(pool_from="embed_gate"),
    # the gate reads the layer's tokens, the pooled values are the pre-layer embedding
    "embed_values": dict(pool_from="embed_values"),
    # the layers held back for the first 30 epochs (TrainConfig.layers_from): the depth-0 form trains first, so its
    # pooling can find the planted patches before the layer can fit the bags another way; staged_nonorm_nopos's
    # first stage is ABMIL exactly
    "staged": dict(layers_from=30),
    "staged_nonorm_nopos": dict(final_norm=False, pos_encoding="none", layers_from=30),
    # the first stage is ABMIL's training exactly (the gate reads the pre-layer embedding, no position code, no final
    # norm), ended by its own early stopping; its best weights restored, the layer then trains with its own schedule.
    # _frozen: the embedding and the gate stay as ABMIL left them (the layer and the head train)
    "staged_es": dict(final_norm=False, pos_encoding="none", pool_from="embed_gate", layers_from=80,
                      stage_end="early_stop"),
    "staged_es_frozen": dict(final_norm=False, pos_encoding="none", pool_from="embed_gate", layers_from=80,
                             stage_end="early_stop", freeze_pooling=True),
    # TransMIL's published training: RAdam + Lookahead, lr 2e-4, weight decay 1e-5, width 512 (8 heads, 256
    # Nyström landmarks), batch size 1 with 2 accumulated steps, no schedule, every patch (pathology.optim)
    "transmil_published": dict(optimizer="radam_lookahead", schedule="constant", lr=2e-4, weight_decay=1e-5, dim=512,
                               heads=8, pool_hidden=128, batch_slides=2, max_patches=0, feature_dropout=0.0),
}


#: The variant each model is reported with by bag size (default ``auto``): Querent's large-bag recipe
#: (``pathology.train`` picks it for bags of >= LARGE_BAG patches), chosen on the development cohorts at 2,000 patches
LARGE_BAG = 2000
REPORT_VARIANTS: dict[tuple[str, int], str] = {("querent", 2000): "staged_es_frozen", ("querent", 8000): "staged_es_frozen"}


def report_variant(model: str, bag_size: int) -> str:
    return REPORT_VARIANTS.get((model, bag_size), "auto")


def settings(variant: str, n_bags: int, bag_size: int) -> dict:
    """Every setting of a unit: ``pathology.train``'s recipe for ``n_bags``, Querent's region geometry by bag size,
    then the variant's changes."""
    from benchmarks.pathology_cohort_bench import REGION_SIZE, recipe

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    base = {**recipe("auto", n_bags), "region_size": REGION_SIZE.get(bag_size, 8), "topk": 8, "neighbourhood": 1,
            "optimizer": "adamw", "schedule": "cosine", "pos_encoding": "sincos"}
    return {**base, **VARIANTS[variant]}


def model_config(s: dict, in_dim: int):
    """The :class:`pathology.querent.QuerentConfig` of a unit's settings ``s`` (:func:`settings`)."""
    from pathology.querent import QuerentConfig

    return QuerentConfig(in_dim=in_dim, dim=s["dim"], depth=s["depth"], num_heads=s["heads"],
                         pool_hidden=s["pool_hidden"], dropout=s["dropout"], num_classes=2,
                         region_size=s["region_size"], topk=s["topk"], neighbourhood=s["neighbourhood"],
                         pos_encoding=s["pos_encoding"], nystrom_landmarks=s.get("landmarks", 0),
                         pool_from=s.get("pool_from", "tokens"), final_norm=s.get("final_norm", True))


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if len(set(y.tolist())) == 2 else float("nan")


def _selection_recall(model, bag, g=None, max_patches: int | None = None) -> dict | None:
    """For a bag with two strong sites (label 1): the share of the other site's patches inside the regions that the
    regions holding a site's patches attend (neighbourhood + top-k, first layer, mean over heads and both sites),
    and the share of the bag's regions attended. ``max_patches``: on a random subset as a training step sees it."""
    import torch

    if bag.strong != 2:
        return None
    n = bag.features.shape[0]
    keep = np.arange(n)
    if max_patches and n > max_patches:
        keep = np.sort(torch.randperm(n, generator=g)[:max_patches].numpy())
    pos = {int(j): i for i, j in enumerate(keep)}
    site = [[pos[int(j)] for j in idx if int(j) in pos] for _, _, idx in bag.sites[:2]]
    if not site[0] or not site[1]:
        return {"recall": 0.0, "share": float("nan"), "seen": 0.0}
    with torch.no_grad():
        out = model(bag.features[keep], bag.coords[keep], patch_size_level0=bag.patch_size_level0, return_index=True)
    if out.block_index is None:  # no Querent layer (depth 0): nothing selected
        return None
    reg = out.layout.region_of_patch().numpy()
    idx = out.block_index[0].numpy()  # (H, NR, K) region ids, -1 padded
    rec = []
    for a, b in ((0, 1), (1, 0)):
        for h in range(idx.shape[0]):
            seen = set()
            for r in set(reg[site[a]].tolist()):
                seen |= set(idx[h, r][idx[h, r] >= 0].tolist())
            rec.append(np.isin(reg[site[b]], list(seen)).mean())
    share = float(((idx >= 0).sum(-1) / out.layout.num_regions).mean())
    return {"recall": float(np.mean(rec)), "share": share,
            "seen": float((len(site[0]) + len(site[1])) / sum(len(i) for _, _, i in bag.sites[:2]))}


def _planted_separation(model, bag) -> dict | None:
    """How far the strong sites' patches stand out among the bag's patches, before and after the Querent layers:
    ``|mean(planted) - mean(other)|`` over the other patches' root-mean-square spread about their mean, on the
    embedded patches (input of the first layer, position code included) and on the tokens the pooling reads."""
    import torch

    s = bag.strong_patches()
    if not len(s):
        return None
    grab: dict = {}
    hooks = [model.embed.register_forward_hook(lambda m, i, o: grab.__setitem__("embed", o)),
             model.norm.register_forward_hook(lambda m, i, o: grab.__setitem__("tokens", o))]
    try:
        with torch.no_grad():
            model(bag.features, bag.coords, patch_size_level0=bag.patch_size_level0)
    finally:
        for h in hooks:
            h.remove()
    mask = np.zeros(bag.features.shape[0], bool)
    mask[s] = True
    out = {}
    for name, t in grab.items():
        t = t.float().numpy()
        rest = t[~mask]
        spread = float(np.sqrt(((rest - rest.mean(0)) ** 2).sum(1).mean()))
        out[name] = float(np.linalg.norm(t[mask].mean(0) - rest.mean(0)) / max(spread, 1e-12))
    return out


def fold_diagnostics(model_name: str, max_patches: int | None):
    """``on_fold`` for :func:`pathology.training.cross_validate`: what the trained fold model does with the planted
    patches, and whether it fits its training bags better than new ones."""
    import torch

    from pathology.training import predict_outputs

    def run(k: int, model, train_bags: list, test_bags: list) -> dict:
        out: dict = {}
        ptr = torch.softmax(predict_outputs(model, train_bags), -1)[:, 1].numpy()
        out["train_auc"] = _auc(np.array([b.label for b in train_bags]), ptr)
        mass, uniform = [], []
        with torch.no_grad():
            for b in test_bags:
                a = model(b.features, b.coords, patch_size_level0=b.patch_size_level0).attention.numpy()
                s = b.strong_patches()
                mass.append(float(a[s].sum()) if len(s) else float("nan"))
                uniform.append(len(s) / len(a) if len(s) else float("nan"))
        out["strong_mass"] = float(np.nanmean(mass))  # pooling weight on the strong sites' patches
        out["strong_uniform"] = float(np.nanmean(uniform))  # the same for uniform weights
        if model_name == "querent" and model.cfg.depth > 0:
            g = torch.Generator().manual_seed(1000 + k)
            full = [r for b in test_bags if (r := _selection_recall(model, b)) is not None]
            sub = [r for b in test_bags if (r := _selection_recall(model, b, g, max_patches)) is not None]
            out.update(recall=float(np.mean([r["recall"] for r in full])),
                       share=float(np.mean([r["share"] for r in full])),
                       recall_step=float(np.mean([r["recall"] for r in sub])),
                       share_step=float(np.nanmean([r["share"] for r in sub])),
                       planted_seen_step=float(np.mean([r["seen"] for r in sub])))
        if model_name == "querent":
            sep = [r for b in test_bags if (r := _planted_separation(model, b)) is not None]
            out.update(separation_embed=float(np.mean([r["embed"] for r in sep])),
                       separation_tokens=float(np.mean([r["tokens"] for r in sep])))
        return out

    return run


def run_unit(stage: str, n_bags: int, bag_size: int, seed: int, variant: str, model: str, *, folds: int) -> dict:
    import torch

    from benchmarks.pathology_cohort import CohortConfig, make_cohort
    from benchmarks.pathology_cohort_bench import CURVE
    from pathology.training import TrainConfig, cross_validate

    s = settings(variant, n_bags, bag_size)
    bags = make_cohort(n_bags, seed, CohortConfig(**{**CURVE, "bag_size": bag_size}))
    mcfg = model_config(s, int(bags[0].features.shape[1]))
    mp = s["max_patches"] or None
    tc = TrainConfig(epochs=s["epochs"], lr=s["lr"], weight_decay=s["weight_decay"], batch_slides=s["batch_slides"],
                     max_patches=mp, feature_dropout=s["feature_dropout"], monitor=s["monitor"], smooth=s["smooth"],
                     patience=s["patience"], min_epochs=s["min_epochs"], optimizer=s["optimizer"],
                     schedule=s["schedule"], layers_from=s.get("layers_from", 0), stage_end=s.get("stage_end", "fixed"),
                     freeze_pooling=s.get("freeze_pooling", False), seed=0)
    torch.manual_seed(0)
    c0 = time.process_time()
    res = cross_validate(model, mcfg, bags, tc, folds=folds, on_fold=fold_diagnostics(model, mp))
    probs = {row["slide_id"]: row["prob_1"] for row in res["oof"]}
    return {"stage": stage, "n_bags": n_bags, "bag_size": bag_size, "cohort_seed": seed, "variant": variant,
            "model": model, "folds": folds, "settings": s, "pooled_auc": res["pooled"]["auc"],
            "pooled_bacc": res["pooled"]["balanced_accuracy"], "fold_auc": [f["auc"] for f in res["folds"]],
            "best_epochs": [f["best_epoch"] for f in res["folds"]], "epochs_run": [f["epochs_run"] for f in res["folds"]],
            "diagnostics": [f["diagnostics"] for f in res["folds"]],
            "final_train_loss": [f["final_loss"] for f in res["folds"]],
            "warnings": sum(len(f["warnings"]) for f in res["folds"]), "cpu_s": round(time.process_time() - c0, 1),
            "labels": [b.label for b in bags], "probs": [probs[b.slide_id] for b in bags]}


def run_memo(n_bags: int, bag_size: int, seed: int, variant: str, model: str, *, folds: int, epochs: int) -> dict:
    """Does a model memorise? One fold (the first of ``folds``) trained for exactly ``epochs`` epochs (no early
    stopping; the epoch with the best smoothed validation AUC is kept, as ``pathology.train`` does): per epoch the
    training loss and the validation AUC, then the kept model's AUC on its training bags and on the fold's test bags."""
    import dataclasses

    import torch

    from benchmarks.pathology_cohort import CohortConfig, make_cohort
    from benchmarks.pathology_cohort_bench import CURVE
    from pathology.training import (TrainConfig, patient_folds, predict_outputs, train_model, validation_split)

    s = settings(variant, n_bags, bag_size)
    bags = make_cohort(n_bags, seed, CohortConfig(**{**CURVE, "bag_size": bag_size}))
    mcfg = model_config(s, int(bags[0].features.shape[1]))
    tc = TrainConfig(epochs=epochs, lr=s["lr"], weight_decay=s["weight_decay"], batch_slides=s["batch_slides"],
                     max_patches=s["max_patches"] or None, feature_dropout=s["feature_dropout"], monitor=s["monitor"],
                     smooth=s["smooth"], patience=epochs, min_epochs=epochs, optimizer=s["optimizer"],
                     schedule=s["schedule"], layers_from=s.get("layers_from", 0), stage_end=s.get("stage_end", "fixed"),
                     freeze_pooling=s.get("freeze_pooling", False), seed=0)
    tr, te = patient_folds(bags, folds, seed=0)[0]
    tr, va = validation_split(bags, tr, tc.val_fraction, seed=0)
    torch.manual_seed(0)
    c0 = time.process_time()
    m, info = train_model(model, mcfg, [bags[i] for i in tr], tc, val_bags=[bags[i] for i in va])

    def auc(idx):
        p = torch.softmax(predict_outputs(m, [bags[i] for i in idx]), -1)[:, 1].numpy()
        return _auc(np.array([bags[i].label for i in idx]), p)

    return {"stage": "memo", "n_bags": n_bags, "bag_size": bag_size, "cohort_seed": seed, "variant": variant,
            "model": model, "folds": folds, "settings": {**s, "epochs": epochs, "memo_fold": 0},
            "best_epoch": info["best_epoch"], "train_auc": auc(tr), "test_auc": auc(te),
            "history": [{k: r.get(k) for k in ("epoch", "train_loss", "val_loss", "val_auc")} for r in info["history"]],
            "model_config": dataclasses.asdict(mcfg), "cpu_s": round(time.process_time() - c0, 1)}


def key_of(rec: dict) -> str:
    return json.dumps([rec["stage"], rec["n_bags"], rec["bag_size"], rec["cohort_seed"], rec["variant"], rec["model"],
                       rec["folds"], rec["settings"]], sort_keys=True)


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.pathology_bagsize_summary import plot, summary
    from benchmarks.pathology_cohort_bench import append, read_records

    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_bagsize", description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("dev", "report", "memo", "summary"), required=True)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="default: auto; in the report stage each model's recipe at the bag size (REPORT_VARIANTS)")
    p.add_argument("--bags", nargs="+", type=positive_int, default=[120], help="bags per cohort")
    p.add_argument("--bag-sizes", nargs="+", type=positive_int, default=[2000, 8000], help="patches per bag")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help=f"cohort seeds (default: dev {DEV_SEEDS[:3]}, report {REPORT_SEEDS})")
    p.add_argument("--folds", type=positive_int, default=3)
    p.add_argument("--epochs", type=positive_int, default=25, help="memo: epochs of the one fold (no early stop)")
    p.add_argument("--records", default=str(RECORDS))
    p.add_argument("--out", default=str(RESULTS / "pathology_bagsize.json"))
    add_run_options(p)
    args = p.parse_args(argv)
    configure_run(args)
    if args.stage == "summary":
        table = summary(read_records(args.records, key_of), args.out)
        png = plot(table, os.path.splitext(args.out)[0] + ".png", REPORT_VARIANTS)
        print(json.dumps(table, indent=1)[:20000])
        if png:
            logger.info("report curve -> %s", png)
        return 0
    seeds = args.seeds or (list(REPORT_SEEDS) if args.stage == "report" else list(DEV_SEEDS[:3]))
    clash = set(seeds) & set(DEV_SEEDS if args.stage == "report" else REPORT_SEEDS)
    if clash:
        raise UsageError(f"--seeds {sorted(clash)} are {'development' if args.stage == 'report' else 'report'} seeds; "
                         f"development: {list(DEV_SEEDS)}+, report: {list(REPORT_SEEDS)}")
    for seed in seeds:
        for n in args.bags:
            for size in args.bag_sizes:
                for chosen in args.variants or [None]:
                    for model in args.models:
                        variant = chosen or (report_variant(model, size) if args.stage == "report" else "auto")
                        probe = {"stage": args.stage, "n_bags": n, "bag_size": size, "cohort_seed": seed,
                                 "variant": variant, "model": model, "folds": args.folds,
                                 "settings": settings(variant, n, size)}
                        if args.stage == "memo":
                            probe["settings"] = {**probe["settings"], "epochs": args.epochs, "memo_fold": 0}
                        if key_of(probe) in read_records(args.records, key_of):  # also units another process ran
                            continue
                        if args.stage == "memo":
                            rec = run_memo(n, size, seed, variant, model, folds=args.folds, epochs=args.epochs)
                            append(args.records, rec)
                            logger.info("memo n=%d size=%d seed=%d %s %s: train AUC %.3f test AUC %.3f (best epoch %d)"
                                        ", train loss by epoch %s", n, size, seed, variant, model, rec["train_auc"],
                                        rec["test_auc"], rec["best_epoch"],
                                        [round(h["train_loss"], 3) for h in rec["history"]])
                            continue
                        rec = run_unit(args.stage, n, size, seed, variant, model, folds=args.folds)
                        append(args.records, rec)
                        diag = rec["diagnostics"]
                        logger.info("%s n=%d size=%d seed=%d %s %s: pooled AUC %.3f (folds %s) best %s train AUC %s "
                                    "cpu %.0fs", args.stage, n, size, seed, variant, model, rec["pooled_auc"],
                                    [round(a, 3) for a in rec["fold_auc"]], rec["best_epochs"],
                                    [round(d["train_auc"], 3) for d in diag], rec["cpu_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
