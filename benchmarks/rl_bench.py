"""Decision Mixer vs Decision Transformer vs d3rlpy's DT and IQL on the same offline datasets.

    python -m benchmarks.rl_bench --quick          # pipeline check: tiny runs on a small random Hopper dataset
    python -m benchmarks.rl_bench --datasets hopper-medium,halfcheetah-medium,walker2d-medium-replay \\
        --seeds 0,1,2 --steps 20000 --eval-episodes 10

Per (dataset, algorithm, seed) it trains on one CPU thread, evaluates D4RL-normalized scores
(``100 (R - R_random) / (R_expert - R_random)``, D4RL's constants, see ``rl/references.py``) at the dataset's
target returns, and records wall and CPU seconds per 1K training steps (training only: sampling + forward +
backward + optimizer, evaluation excluded; the CPU seconds of the run's one-thread process depend much less
than wall seconds on what else runs on the machine, though cache and core sharing still move them by ~10%) and, for the Decision Mixer, the fraction of tokens routed through the routed
layers. Datasets are generated with ``python -m rl.generate`` when missing (medium / medium-replay need the
shipped behaviour policies). Results accumulate in a JSON file: a finished case is not rerun.
The table reports mean ± std over seeds and, per dataset, the DM/DT ratio of CPU seconds per 1K steps
(over the whole run, so at the capacity DM learns, not only at its initial 0.5). ``--timing-steps N`` adds the
fairer speed comparison: DM and DT training steps interleaved on the same batches in one process, at
initialization and again after ``--timing-warmup`` steps. ``--merge A.json,B.json`` folds in the cases of runs split over
parallel processes (same settings, different ``--algos`` / ``--seeds`` / ``--out``) before the table is made.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, read_json, portable_args, read_parts, write_json_atomic

logger = logging.getLogger(__name__)

ENVS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
ALGOS = ("dm", "dt", "d3rlpy-dt", "d3rlpy-iql")


def _dataset_path(data_dir: Path, name: str, steps: int, seed: int) -> Path:
    fam, quality = name.split("-", 1)
    if fam not in ENVS:
        raise ValueError(f"dataset name {name!r} must start with one of {list(ENVS)}")
    path = data_dir / f"{name}-{steps}-s{seed}.npz"
    if not path.exists():
        from rl.data import save_dataset
        from rl.generate import generate

        logger.info("generating %s", path)
        save_dataset(path, generate(ENVS[fam], quality, steps, seed))
    return path


def _routing_overrides(args) -> dict:
    """DM routing options given on the command line (absent: DMConfig's defaults)."""
    out = {}
    if getattr(args, "probe_tokens", None) is not None:
        out["probe_tokens"] = args.probe_tokens
    if getattr(args, "train_selection", None) is not None:
        out["train_selection"] = args.train_selection
    return out


def _run_ours(algo, path, seed, args, workdir: Path) -> dict:
    from rl.evaluate import load_policy, evaluate_returns
    from rl.references import normalized_score
    from rl.train import ENV_DEFAULTS, TrainConfig, train

    out = workdir / f"{path.stem}-{algo}-s{seed}"
    overrides = {"context": args.context, "embed_dim": args.embed_dim, "num_heads": args.heads, "dropout": 0.1,
                 "num_layers": args.dm_layers if algo == "dm" else args.dt_layers}
    if algo == "dm":
        overrides["routed_layers"] = tuple(int(x) for x in args.routed_layers.split(","))
        if args.capacity_cost is not None:
            overrides["capacity_cost_weight"] = args.capacity_cost
        overrides.update(_routing_overrides(args))
    cfg = TrainConfig(algo=algo, steps=args.steps, seed=seed, batch_size=args.batch_size, lr=args.lr,
                      warmup_steps=min(args.warmup, args.steps), log_every=max(1, min(100, args.steps // 4)),
                      eval_episodes=0, checkpoint_every=min(1_000, args.steps), segment_anchor=args.segment_anchor)
    # A run killed part-way (a long benchmark spans several sittings) resumes from its last checkpoint; the
    # training records are read back from its metrics log, so they cover the whole run, not only this part.
    train(cfg, path, out, model_overrides=overrides, resume=(out / "checkpoint.pt").exists(), progress=False)
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    timed = train_recs[1:] or train_recs  # the first period includes start-up
    sec = [r["sec_per_1k_steps"] for r in timed]
    cpu = [r["cpu_sec_per_1k_steps"] for r in timed if "cpu_sec_per_1k_steps" in r]
    model, info = load_policy(out)
    env_id = info["env"]
    res = {"sec_per_1k_steps": float(np.median(sec)) if sec else None,
           "cpu_sec_per_1k_steps": float(np.median(cpu)) if cpu else None,
           "final_loss": train_recs[-1]["action_mse"] if train_recs else None}
    if algo == "dm":
        res["routed_fraction"] = float(np.mean([r["routed_fraction"] for r in train_recs[-2:]]))
    scores = {}
    for tr in ENV_DEFAULTS[env_id]["targets"]:
        rets = evaluate_returns(model, env_id, target_return=tr, episodes=args.eval_episodes, seed=10_000)
        scores[f"{tr:g}"] = float(normalized_score(env_id, rets).mean())
    res["scores"] = scores
    res["score"] = scores[f"{ENV_DEFAULTS[env_id]['targets'][0]:g}"]
    return res


def _timing(path, args) -> dict:
    """DM and DT training steps interleaved on the same batches in one process (same load for both).

    Per iteration one batch is sampled and each model runs one full training step on it (forward, backward,
    clipping, AdamW); CPU seconds per step (one thread) are compared as medians. DT is built with
    ``--dt-layers`` and, if that differs, also with ``--dm-layers`` (the same depth as DM). Two phases:
    ``init`` times the first ``--timing-steps`` steps (DM routes its initial capacity, 0.5); then both models
    keep training on shared batches, untimed, until ``--timing-warmup`` steps, and ``trained`` times
    ``--timing-steps`` more (DM at the capacity it has learned by then, as for most of a run).
    """
    import torch

    from rl.data import load_dataset
    from rl.envs import make_env
    from rl.models import build_model
    from rl.train import SegmentSampler, TrainConfig, Trainer, _model_config

    ds = load_dataset(path)
    env = make_env(ds.metadata["env"])
    base = {"context": args.context, "embed_dim": args.embed_dim, "num_heads": args.heads, "dropout": 0.1}
    cases = {"dm": ("dm", {**base, "num_layers": args.dm_layers,
                           "routed_layers": tuple(int(x) for x in args.routed_layers.split(","))}),
             f"dt-{args.dt_layers}L": ("dt", {**base, "num_layers": args.dt_layers})}
    if args.dm_layers != args.dt_layers:
        cases[f"dt-{args.dm_layers}L"] = ("dt", {**base, "num_layers": args.dm_layers})
    if args.capacity_cost is not None:
        cases["dm"][1]["capacity_cost_weight"] = args.capacity_cost
    cases["dm"][1].update(_routing_overrides(args))
    total = max(args.timing_warmup, args.timing_steps) + args.timing_steps
    trainers = {}
    for name, (algo, ov) in cases.items():
        torch.manual_seed(0)
        model = build_model(algo, _model_config(algo, ds, env, ov))
        model.set_state_normalization(ds.observations.mean(0), ds.observations.std(0))
        trainers[name] = Trainer(model, TrainConfig(algo=algo, steps=total, lr=args.lr,
                                                    warmup_steps=min(args.warmup, total)), SegmentSampler(ds, args.context, seed=0))
    env.close()
    sampler = SegmentSampler(ds, args.context, seed=1)

    def run(steps: int, timed: bool) -> tuple[dict[str, list[float]], list[float]]:
        times: dict[str, list[float]] = {n: [] for n in trainers}
        routed = []
        for _ in range(steps):
            batch = sampler.sample(args.batch_size)
            for name, tr in trainers.items():
                c0 = time.process_time()
                m = tr.train_step(batch)
                if timed:
                    times[name].append(time.process_time() - c0)
                if name == "dm":
                    routed.append(m["routed_fraction"])
        return times, routed

    res = {"steps": args.timing_steps, "warmup_steps": args.timing_warmup, "batch_size": args.batch_size,
           "clock": "CPU seconds of this process (one thread)"}
    skip = min(5, args.timing_steps // 5)  # first steps: allocator warm-up
    for phase in ("init", "trained"):
        if phase == "trained":
            if args.timing_warmup <= 0:
                break
            run(max(0, args.timing_warmup - args.timing_steps), timed=False)
        times, routed = run(args.timing_steps, timed=True)
        med = {n: float(np.median(v[skip:])) * 1000.0 for n, v in times.items()}
        res[phase] = {"ms_per_step_median": med, "dm_routed_fraction": float(np.mean(routed)),
                      "ratio_dm_over_dt": {n: med["dm"] / med[n] for n in med if n != "dm"}}
    return res


def _d3rlpy_eval(policy_fn, env_id, episodes, stateful=None):
    from rl.envs import make_env
    from rl.references import normalized_score

    env = make_env(env_id)
    rets = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=10_000 + ep)
        if stateful is not None:
            stateful.reset()
        done, ret, rew = False, 0.0, 0.0
        while not done:
            a = policy_fn(obs.astype(np.float32), rew)
            obs, rew, term, trunc, _ = env.step(a)
            ret += float(rew)
            done = term or trunc
        rets.append(ret)
    env.close()
    return float(normalized_score(env_id, np.array(rets)).mean())


def _run_d3rlpy(algo, path, seed, args) -> dict:
    import d3rlpy
    import torch

    from rl.data import load_dataset, to_mdp_dataset
    from rl.train import ENV_DEFAULTS

    torch.set_num_threads(1)
    ds = load_dataset(path)
    env_id = ds.metadata["env"]
    mdp = to_mdp_dataset(ds)
    d3rlpy.seed(seed)
    steps = args.d3rlpy_steps or args.steps
    if algo == "d3rlpy-dt":
        obj = d3rlpy.algos.DecisionTransformerConfig(
            batch_size=args.batch_size, context_size=args.context, max_timestep=1000, num_layers=args.dt_layers,
            num_heads=args.heads, learning_rate=args.lr,
            encoder_factory=d3rlpy.models.encoders.VectorEncoderFactory(hidden_units=[args.embed_dim]),
            observation_scaler=d3rlpy.preprocessing.StandardObservationScaler(),
            reward_scaler=d3rlpy.preprocessing.MultiplyRewardScaler(1e-3),
        ).create(device="cpu:0")
    else:
        obj = d3rlpy.algos.IQLConfig(batch_size=args.batch_size * 4,
                                     observation_scaler=d3rlpy.preprocessing.StandardObservationScaler()
                                     ).create(device="cpu:0")
    t0, c0 = time.perf_counter(), time.process_time()
    obj.fit(mdp, n_steps=steps, n_steps_per_epoch=steps, show_progress=False, save_interval=10**9,
            experiment_name=f"bench-{algo}", with_timestamp=False, logger_adapter=d3rlpy.logging.NoopAdapterFactory())
    sec = (time.perf_counter() - t0) * 1000.0 / steps
    cpu = (time.process_time() - c0) * 1000.0 / steps
    target = ENV_DEFAULTS[env_id]["targets"][0]
    if algo == "d3rlpy-dt":
        wrapper = obj.as_stateful_wrapper(target_return=target)
        score = _d3rlpy_eval(lambda o, r: wrapper.predict(o, r), env_id, args.eval_episodes, stateful=wrapper)
    else:
        score = _d3rlpy_eval(lambda o, r: obj.predict(o[None])[0], env_id, args.eval_episodes)
    return {"sec_per_1k_steps": sec, "cpu_sec_per_1k_steps": cpu, "score": score, "steps": steps}


def build_parser() -> argparse.ArgumentParser:
    from rl.train import SEGMENT_ANCHORS

    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny pipeline check (random Hopper data, 1 seed)")
    p.add_argument("--datasets", default="hopper-medium,halfcheetah-medium,walker2d-medium-replay")
    p.add_argument("--dataset-steps", type=int, default=200_000, help="transitions per generated dataset")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--steps", type=int, default=20_000, help="gradient steps per run")
    p.add_argument("--d3rlpy-steps", type=int, default=None, help="steps for the d3rlpy peers (default --steps)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--context", type=int, default=20)
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dt-layers", type=int, default=3)
    p.add_argument("--dm-layers", type=int, default=6)
    p.add_argument("--routed-layers", default="1,3,5")
    p.add_argument("--segment-anchor", choices=SEGMENT_ANCHORS, default="start",
                   help="our models' training segments start (DT's sampling) or end (d3rlpy's) at a uniform step")
    p.add_argument("--capacity-cost", type=float, default=None,
                   help="DM capacity_cost_weight (default: DMConfig's); choose it with `python -m rl.tune`")
    p.add_argument("--probe-tokens", type=int, default=None,
                   help="DM probe_tokens (default: DMConfig's, 4; results recorded before the option used 0)")
    p.add_argument("--train-selection", choices=("topk", "prefix"), default=None,
                   help="DM routing in training (default: DMConfig's, top-k over the segment)")
    p.add_argument("--timing-warmup", type=int, default=500,
                   help="with --timing-steps: untimed steps before the second timed phase (DM at its learned capacity)")
    p.add_argument("--timing-steps", type=int, default=0,
                   help="per dataset, also time DM and DT steps interleaved on the same batches (0: skip)")
    p.add_argument("--merge", default="",
                   help="comma-separated result JSONs (same settings, e.g. algos run in parallel processes) whose "
                        "cases are merged into --out before the table")
    p.add_argument("--data-dir", default="data/rl")
    p.add_argument("--work-dir", default="runs/rl_bench")
    p.add_argument("--out", default="benchmarks/results/rl_bench.json")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    torch.set_num_threads(1)
    if args.quick:
        args.datasets, args.dataset_steps, args.seeds = "hopper-random", 5000, "0"
        args.steps, args.d3rlpy_steps, args.eval_episodes = 60, 10, 2
        args.embed_dim, args.context, args.dm_layers, args.dt_layers, args.routed_layers = 32, 10, 4, 2, "1,3"
        args.warmup, args.batch_size, args.timing_steps = 10, 16, min(args.timing_steps, 10)
        args.timing_warmup = min(args.timing_warmup, 20)
        if args.out == build_parser().get_default("out"):
            args.out = "benchmarks/results/rl_bench_quick.json"
        args.work_dir = args.work_dir + "_quick"
    algos = [a for a in args.algos.split(",") if a]
    bad = [a for a in algos if a not in ALGOS]
    if bad:
        raise SystemExit(f"unknown algos {bad}; accepted: {list(ALGOS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    data_dir, work = Path(args.data_dir), Path(args.work_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    results = read_json(args.out) or {"env": env_info(), "settings": {}, "cases": {}}
    results["settings"] = portable_args(args)
    for got in read_parts([m for m in args.merge.split(",") if m]):
        for key, res in got.get("cases", {}).items():
            results["cases"].setdefault(key, res)
        for key, res in got.get("timing", {}).items():
            results.setdefault("timing", {}).setdefault(key, res)
    for name in args.datasets.split(","):
        path = _dataset_path(data_dir, name, args.dataset_steps, 0)
        if args.timing_steps and name not in results.get("timing", {}):
            logger.info("timing dm vs dt on %s", name)
            results.setdefault("timing", {})[name] = _timing(path, args)
            write_json_atomic(args.out, results)
        for algo in algos:
            for seed in seeds:
                key = f"{name}/{algo}/{seed}"
                if key in results["cases"]:
                    continue
                logger.info("running %s", key)
                res = _run_ours(algo, path, seed, args, work) if algo in ("dm", "dt") else _run_d3rlpy(algo, path, seed, args)
                results["cases"][key] = res
                write_json_atomic(args.out, results)
    rows = []
    for name in args.datasets.split(","):
        dt_cpu = None
        for algo in algos:
            cs = [results["cases"].get(f"{name}/{algo}/{s}") for s in seeds]
            cs = [c for c in cs if c]
            if not cs:
                continue
            sc = np.array([c["score"] for c in cs])
            cpu = [c["cpu_sec_per_1k_steps"] for c in cs if c.get("cpu_sec_per_1k_steps") is not None]
            cpu_t = float(np.mean(cpu)) if len(cpu) == len(cs) else None
            if algo == "dt":
                dt_cpu = cpu_t
            rows.append({"dataset": name, "algo": algo, "score": f"{sc.mean():.1f} ± {sc.std():.1f}",
                         "seeds": len(cs), "s/1K steps": float(np.mean([c["sec_per_1k_steps"] for c in cs])),
                         "CPU s/1K steps": cpu_t,
                         "routed": (f"{np.mean([c['routed_fraction'] for c in cs]):.2f}" if algo == "dm" else "-")})
        for r in rows:
            if r["dataset"] == name and r["algo"] == "dm" and dt_cpu and r["CPU s/1K steps"]:
                r["CPU time vs dt"] = r["CPU s/1K steps"] / dt_cpu
    table = format_table(rows, ["dataset", "algo", "score", "seeds", "s/1K steps", "CPU s/1K steps", "CPU time vs dt",
                                "routed"])
    trows = []
    for name, t in results.get("timing", {}).items():
        for phase in ("init", "trained"):
            if phase not in t:
                continue
            ph = t[phase]
            for n, ms in ph["ms_per_step_median"].items():
                trows.append({"dataset": name, "phase": phase, "model": n, "CPU ms/step (median)": ms,
                              "dm / this": (f"{ph['ms_per_step_median']['dm'] / ms:.2f}" if n != "dm" else "-"),
                              "routed": f"{ph['dm_routed_fraction']:.2f}" if n == "dm" else "-"})
    if trows:
        table += "\n\nInterleaved step timing (same batches, same process):\n\n" + format_table(
            trows, ["dataset", "phase", "model", "CPU ms/step (median)", "dm / this", "routed"])
    results["table"] = table
    write_json_atomic(args.out, results)
    print(table)


if __name__ == "__main__":
    main()
