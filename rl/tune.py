"""Choose the Decision Mixer's ``capacity_cost_weight`` on held-out trajectories (not on environment returns).

    python -m rl.tune --dataset data/rl/hopper-medium-20000-s1.npz --weights 0,0.001,0.003,0.01 --steps 300 \\
        --out runs/tune-capcost

The dataset's trajectories are split (seeded) into a training and a validation part. Per candidate weight, a
short DM run trains on the training part; then, with the model in evaluation mode (dropout off, the auxiliary
predictor's causal selection, i.e. the path used when acting), the action MSE is measured on fixed segments of
the validation trajectories. The criterion: the lowest validation MSE among the weights whose routed fraction
(mean over the last quarter of training) stays above ``min_capacity + margin`` — a run whose capacity
collapses to the floor is not chosen whatever its loss. Each weight writes ``<out>/w<weight>.json``; the
summary ``<out>/summary.json`` is rewritten after each run over all results present (several processes can
share ``--out`` with different weights; a finished weight is not rerun).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.infra.cli import (capped_int, fraction, nonempty_path, nonnegative_int, open_fraction, positive_float,
                            positive_int, run_cli, thread_count)
from core.infra.guard import check_outputs
from rl.data import OfflineDataset, load_dataset
from rl.models import build_model, config_to_dict
from rl.train import MAX_CONTEXT, SegmentSampler, TrainConfig, Trainer, _model_config, check_train_memory

logger = logging.getLogger(__name__)

__all__ = ["split_trajectories_dataset", "run_weight", "summarize", "build_parser", "main"]


def split_trajectories_dataset(ds: OfflineDataset, val_fraction: float, seed: int) -> tuple[OfflineDataset, OfflineDataset]:
    """(train, validation) datasets made of whole trajectories, chosen with ``seed``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    trajs = ds.trajectories()
    if len(trajs) < 2:
        raise ValueError(f"need at least 2 trajectories to split, the dataset has {len(trajs)}")
    order = np.random.default_rng(seed).permutation(len(trajs))
    n_val = min(len(trajs) - 1, max(1, int(round(val_fraction * len(trajs)))))

    def build(ids) -> OfflineDataset:
        ts = [trajs[i] for i in sorted(ids)]
        ends = [np.arange(t.length) == t.length - 1 for t in ts]
        return OfflineDataset(
            observations=np.concatenate([t.observations for t in ts]),
            actions=np.concatenate([t.actions for t in ts]),
            rewards=np.concatenate([t.rewards for t in ts]),
            terminals=np.concatenate([e & t.terminal for e, t in zip(ends, ts)]),
            timeouts=np.concatenate([e & (not t.terminal) for e, t in zip(ends, ts)]),
            metadata=dict(ds.metadata))

    return build(order[n_val:]), build(order[:n_val])


@torch.no_grad()
def _validate(model, batches: list[dict[str, torch.Tensor]], mode: str) -> tuple[float, float]:
    """(action MSE over valid steps, routed fraction of valid tokens) on fixed batches."""
    model.eval()
    se, n, routed, tokens = 0.0, 0.0, 0.0, 0.0
    for b in batches:
        pred, infos = model(b["states"], b["actions"], b["returns"], b["timesteps"], valid_BT=b["valid"], mode=mode)
        v = b["valid"].unsqueeze(-1).float()
        se += float((F.mse_loss(pred, b["actions"], reduction="none") * v).sum())
        n += float(v.sum()) * pred.shape[-1]
        for i in infos:
            routed += float(i.mask.float().sum())
            tokens += float(b["valid"].sum()) * 3
    return se / n, (routed / tokens if tokens else float("nan"))


@torch.no_grad()
def _agreement(model, batches: list[dict[str, torch.Tensor]], mode: str) -> float:
    """Fraction of valid tokens (all routed layers) on which the auxiliary selection equals ``mode``'s selection."""
    model.eval()
    same, tokens = 0.0, 0.0
    for b in batches:
        args = (b["states"], b["actions"], b["returns"], b["timesteps"])
        _, aux = model(*args, valid_BT=b["valid"], mode="aux")
        _, ref = model(*args, valid_BT=b["valid"], mode=mode)
        v = b["valid"].repeat_interleave(3, 1)
        for x, y in zip(aux, ref):
            same += float(((x.mask == y.mask) & v).sum())
            tokens += float(v.sum())
    return same / tokens if tokens else float("nan")


def run_weight(weight: float, train_ds: OfflineDataset, val_ds: OfflineDataset, *, cfg: TrainConfig,
               overrides: dict, val_batches: int = 8) -> dict:
    """Train a DM with ``capacity_cost_weight=weight`` and measure it on the validation trajectories."""
    from rl.envs import make_env

    env = make_env(train_ds.metadata["env"])
    torch.manual_seed(cfg.seed)
    mcfg = _model_config("dm", train_ds, env, {**overrides, "capacity_cost_weight": weight})
    env.close()
    model = build_model("dm", mcfg)
    model.set_state_normalization(train_ds.observations.mean(0), train_ds.observations.std(0))
    trainer = Trainer(model, cfg, SegmentSampler(train_ds, mcfg.context, seed=cfg.seed))
    val_sampler = SegmentSampler(val_ds, mcfg.context, seed=12_345)
    batches = [val_sampler.sample(cfg.batch_size) for _ in range(val_batches)]
    hist: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    while trainer.step < cfg.steps:
        for k, v in trainer.train_step(trainer.sampler.sample(cfg.batch_size)).items():
            hist.setdefault(k, []).append(v)
    wall = time.perf_counter() - t0
    tail = max(1, cfg.steps // 4)
    val_mse_aux, routed_aux = _validate(model, batches, "aux")
    val_mse_topk, routed_topk = _validate(model, batches, "topk")
    val_mse_prefix, routed_prefix = _validate(model, batches, "prefix")
    train_mode = {"topk": (val_mse_topk, routed_topk), "prefix": (val_mse_prefix, routed_prefix)}[mcfg.train_selection]
    return {
        "capacity_cost_weight": weight, "steps": cfg.steps, "train_wall_s": wall,
        "train_action_mse_last_quarter": float(np.mean(hist["action_mse"][-tail:])),
        "train_routed_fraction_last_quarter": float(np.mean(hist["routed_fraction"][-tail:])),
        "train_routed_fraction_curve": [float(np.mean(hist["routed_fraction"][i:i + tail]))
                                        for i in range(0, cfg.steps, tail)],
        "val_action_mse": val_mse_aux, "val_routed_fraction": routed_aux,
        "val_action_mse_topk": val_mse_topk, "val_routed_fraction_topk": routed_topk,
        "val_action_mse_prefix": val_mse_prefix, "val_routed_fraction_prefix": routed_prefix,
        # train/eval gap: evaluation (auxiliary selection) minus the training selection, same model and segments
        "gap_action_mse": val_mse_aux - train_mode[0], "gap_routed_fraction": routed_aux - train_mode[1],
        "val_aux_agreement": _agreement(model, batches, mcfg.train_selection),
        "model": config_to_dict(mcfg),
    }


def summarize(results: list[dict], min_capacity: float, margin: float) -> dict:
    """Pick the weight: lowest validation MSE among runs whose routed fraction stays above the floor + margin."""
    floor = min_capacity + margin
    ok = [r for r in results if r["train_routed_fraction_last_quarter"] >= floor]
    chosen = min(ok, key=lambda r: r["val_action_mse"]) if ok else None
    rows = sorted(({k: r[k] for k in ("capacity_cost_weight", "val_action_mse", "val_routed_fraction",
                                      "train_action_mse_last_quarter", "train_routed_fraction_last_quarter")}
                   for r in results), key=lambda r: r["capacity_cost_weight"])
    return {"criterion": f"lowest val_action_mse (eval mode, auxiliary selection) among weights whose training "
                         f"routed fraction (last quarter) >= {floor:g} (min_capacity {min_capacity:g} + {margin:g})",
            "chosen_capacity_cost_weight": None if chosen is None else chosen["capacity_cost_weight"],
            "results": rows}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True,
                   help=".npz from `python -m rl.generate`, D4RL-style .hdf5/.h5, or minari:/path/to/dataset")
    p.add_argument("--weights", default="0,0.001,0.003,0.01", help="comma-separated capacity_cost_weight values")
    p.add_argument("--out", type=nonempty_path, required=True, help="output directory (one JSON per weight + summary.json)")
    p.add_argument("--env", default=None, help="environment id, for a dataset whose metadata names none (or another)")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--seed", type=int, default=0, help="seeds the split, the model and the batches")
    p.add_argument("--val-fraction", type=open_fraction, default=0.2, help="fraction of trajectories held out")
    p.add_argument("--val-batches", type=positive_int, default=8, help="fixed validation batches (of --batch-size segments)")
    p.add_argument("--floor-margin", type=fraction, default=0.05, help="routed fraction must stay >= min_capacity + this")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup-steps", type=nonnegative_int, default=100)
    p.add_argument("--context", type=capped_int(MAX_CONTEXT, why="the longest episode of the supported environments"),
                   default=10)
    p.add_argument("--embed-dim", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=1)
    p.add_argument("--routed-layers", default="1,3")
    p.add_argument("--probe-tokens", type=nonnegative_int, default=None, help="DM probe_tokens (default: DMConfig's)")
    p.add_argument("--train-selection", choices=("topk", "prefix"), default=None,
                   help="routing in training (default: DMConfig's, top-k)")
    p.add_argument("--threads", type=thread_count, default=1)
    return p


def main(argv=None) -> None:
    from tqdm.auto import tqdm

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.dataset.removeprefix("minari:")])
    args.algo = "dm"
    check_train_memory(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    try:
        weights = [float(w) for w in args.weights.split(",") if w.strip()]
    except ValueError as e:
        raise SystemExit(f"error: --weights must be comma-separated numbers, got {args.weights!r}") from e
    if not weights or any(w < 0 for w in weights):
        raise SystemExit(f"error: --weights must be non-negative numbers, got {args.weights!r}")
    try:
        ds = load_dataset(args.dataset)
        if args.env is not None:
            ds.metadata["env"] = args.env
        train_ds, val_ds = split_trajectories_dataset(ds, args.val_fraction, args.seed)
        cfg = TrainConfig(algo="dm", steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                          warmup_steps=args.warmup_steps, eval_episodes=0, checkpoint_every=args.steps)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from e
    overrides = {"context": args.context, "embed_dim": args.embed_dim, "num_layers": args.layers,
                 "num_heads": args.heads, "routed_layers": tuple(int(x) for x in args.routed_layers.split(",")),
                 "probe_tokens": args.probe_tokens, "train_selection": args.train_selection}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for w in tqdm(weights, desc="capacity_cost_weight"):
        path = out / f"w{w:g}.json"
        if path.exists():
            continue
        res = run_weight(w, train_ds, val_ds, cfg=cfg, overrides=overrides, val_batches=args.val_batches)
        res.update({"dataset": Path(args.dataset).name, "train_trajectories": len(train_ds.trajectories()),
                    "val_trajectories": len(val_ds.trajectories()), "val_fraction": args.val_fraction})
        _write_json(path, res)
        logger.info("weight %g: val mse %.4f, routed %.3f (train %.3f); train/eval gap: mse %+.4f, routed %+.3f",
                    w, res["val_action_mse"], res["val_routed_fraction"], res["train_routed_fraction_last_quarter"],
                    res["gap_action_mse"], res["gap_routed_fraction"])
    results = [json.loads(p.read_text()) for p in sorted(out.glob("w*.json"))]
    min_cap = results[0]["model"]["min_capacity"]
    summary = summarize(results, min_cap, args.floor_margin)
    _write_json(out / "summary.json", summary)
    logger.info("chosen capacity_cost_weight: %s", summary["chosen_capacity_cost_weight"])


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
