"""Which tokens a trained Decision Mixer routes: per routed layer, the fraction of return, state and action tokens
that run the block, on random training segments of a dataset.

    python -m rl.routing_stats --checkpoint runs/dm-hopper --dataset data/rl/hopper-medium-200000-s0.npz

Three selections are reported: top-k over the segment (what training uses by default), causal prefix top-k
(what ``--train-selection prefix`` trains with) and the auxiliary predictor's causal decision (what evaluation
uses). Right-padded positions are left out of every fraction.
"""

from __future__ import annotations

import argparse
import logging

import torch

from core.infra.cli import capped_int, run_cli, thread_count
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["TOKEN_TYPES", "routing_fractions", "build_parser", "main"]

TOKEN_TYPES = ("return", "state", "action")  # the order of the interleaved tokens of one timestep


@torch.no_grad()
def routing_fractions(model, batch: dict[str, torch.Tensor],
                      modes=("topk", "prefix", "aux")) -> dict[str, list[dict[str, float]]]:
    """``{mode: [per routed layer: {token type: fraction routed}]}`` for one batch from ``SegmentSampler``."""
    if not hasattr(model.config, "routed_layers"):
        raise ValueError(f"{type(model).__name__} has no routed layers; routing statistics need a Decision Mixer")
    bad = [m for m in modes if m not in ("topk", "prefix", "aux")]
    if bad:
        raise ValueError(f"unknown routing modes {bad}; accepted: 'topk', 'prefix', 'aux'")
    model.eval()
    valid_BS = batch["valid"].bool().repeat_interleave(3, dim=1)
    out: dict[str, list[dict[str, float]]] = {}
    for mode in modes:
        _, infos = model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"],
                         valid_BT=batch["valid"], mode=mode)
        layers = []
        for info in infos:
            kept_BS = info.mask & valid_BS
            layers.append({name: float(kept_BS[:, j::3].sum() / valid_BS[:, j::3].sum().clamp_min(1))
                           for j, name in enumerate(TOKEN_TYPES)})
        out[mode] = layers
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.routing_stats", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="DM training directory or shipped DM policy")
    p.add_argument("--dataset", required=True,
                   help=".npz from `python -m rl.generate`, D4RL-style .hdf5/.h5, or minari:/path/to/dataset")
    p.add_argument("--segments", type=capped_int(100_000, why="segments held in one batch"), default=256,
                   help="random training segments")
    p.add_argument("--seed", type=int, default=123, help="seed of the segment sampler")
    p.add_argument("--json", default=None, help="also write the fractions to this JSON file")
    p.add_argument("--threads", type=thread_count, default=1)
    return p


def main(argv=None) -> int:
    from core.infra.fileio import write_json_atomic
    from rl.data import load_dataset
    from rl.evaluate import load_policy
    from rl.train import SegmentSampler

    args = build_parser().parse_args(argv)
    from rl.evaluate import policy_files

    check_outputs([("--json", args.json)], inputs=[args.checkpoint, args.dataset, *policy_files(args.checkpoint)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.segments <= 0:
        raise SystemExit(f"--segments must be positive, got {args.segments}")
    torch.set_num_threads(args.threads)
    model, _ = load_policy(args.checkpoint)
    ds = load_dataset(args.dataset)
    if ds.obs_dim != model.config.state_dim or ds.act_dim != model.config.act_dim:
        raise SystemExit(f"dataset {args.dataset} has obs/act dims {ds.obs_dim}/{ds.act_dim}, the policy expects "
                         f"{model.config.state_dim}/{model.config.act_dim}")
    batch = SegmentSampler(ds, model.config.context, seed=args.seed).sample(args.segments)
    try:
        fr = routing_fractions(model, batch)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for mode, layers in fr.items():
        for i, d in zip(model.config.routed_layers, layers):
            print(f"{mode:6s} layer {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in d.items()))
    if args.json:
        write_json_atomic(args.json, {"checkpoint": str(args.checkpoint), "dataset": str(args.dataset),
                                      "segments": args.segments, "seed": args.seed,
                                      "routed_layers": list(model.config.routed_layers), "fractions": fr})
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
