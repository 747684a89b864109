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

For the decisive DM-vs-DT experiment (``docs/experiments/rl.md``, "Decisive experiment"):

- Same batches and evaluation seeds: for a seed, every arm trains on the same batch stream (the segment
  sampler is seeded with the run's seed and nothing else draws from it) and is evaluated on the same
  environment seeds ``--eval-seed + i`` (torch seeded with ``--eval-seed`` before each evaluation).
- ``--eval-episodes`` episodes per target return (50 for the decisive run); ``--target-mode data-best`` sets
  the targets to ``--target-factors`` times the best episode return of the training data (``env``: the
  environment's fixed DT targets).
- ``--holdout-frac``: that fraction of each dataset's episodes (drawn with ``--holdout-seed``, the same for every
  arm and seed; the indices are recorded) is never trained on; each model's action MSE on them in evaluation
  mode (DM routing with its causal auxiliary predictor) is reported next to its returns.
- Paired bootstrap (``--bootstrap`` resamples of the seeds both arms finished): 95% intervals of DM − DT (and
  of every other arm − DT, and DM − each DM control and each d3rlpy peer) per dataset and for the mean over
  datasets, for the first target's normalized score and the held-out MSE, in the JSON and the printed tables.
- Control arms for ``--algos``: ``dt-small`` (DT with ``--dt-small-layers`` blocks; ``auto``: the layers
  DM's blocks amount to at its learned routed fraction ``c``, ``round(plain + routed * c)``, so the two
  match in block compute; the CPU-time ratio of the two is in the table to check the match), ``dm-random``
  (DM routing uniformly random tokens at ``--random-capacity``, default DM's learned routed fraction for the
  same dataset and seed) and ``dm-fixed`` (DM with capacity ``--fixed-capacity``, not learned). The arms that
  take DM's learned values run after ``dm``.
- Partially observed Hopper: a dataset name ending in ``-po`` (``hopper-medium-replay-po``) is the dataset
  with the velocity dims zeroed (``rl/partial.py``), evaluated with the same mask on the environment.
- ``--preset reference``: the DM arms train the released code's routed layer (``rl.train --preset``); the
  preset is part of a case's settings (recorded only when not ``project``), so a case or run directory of one
  preset is never reused for the other. ``benchmarks.rl_preset`` pairs the two presets seed by seed.
- Each case stores the settings it ran with; a case in ``--out`` run with other settings is never reused:
  ``--on-mismatch error`` (default) stops naming the differences, ``redo`` reruns it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, read_json, portable_args, read_parts, write_json_atomic

logger = logging.getLogger(__name__)

ENVS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
ALGOS = ("dm", "dt", "d3rlpy-dt", "d3rlpy-iql")  # the default arms
CONTROLS = ("dt-small", "dm-random", "dm-fixed")  # control arms (module docstring)
ALL_ALGOS = ALGOS + CONTROLS
OURS = ("dm", "dt") + CONTROLS  # trained with rl.train
NEEDS_DM = {"dt-small": "dt_small_layers", "dm-random": "random_capacity", "dm-fixed": "fixed_capacity"}
TARGET_MODES = ("env", "data-best")


def parse_behaviour(items: list[str]) -> dict[str, dict]:
    """``--behaviour FAMILY=PATH`` items -> ``{family: {"path", "sha256"}}`` (the hash names the datasets).

    Each file is read and hashed once per process (``case_settings`` asks for every case it compares)."""
    return _parse_behaviour(tuple(items))


@functools.lru_cache(maxsize=8)
def _parse_behaviour(items: tuple[str, ...]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        fam, sep, path = item.partition("=")
        if not sep or fam not in ENVS or not path:
            raise SystemExit(f"--behaviour takes FAMILY=PATH with FAMILY one of {list(ENVS)}, got {item!r}")
        if fam in out:
            raise SystemExit(f"--behaviour names {fam!r} twice")
        if not Path(path).is_file():
            raise SystemExit(f"--behaviour {fam}: {path} is not a file (a behaviour .safetensors from rl.policies)")
        out[fam] = {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    return out


def _behaviour_tag(behaviour: dict | None, fam: str) -> str:
    """File-name tag of a non-default behaviour policy (empty for the shipped one: older files keep their names)."""
    return f"-b{behaviour[fam]['sha256'][:10]}" if behaviour and fam in behaviour else ""


def _dataset_path(data_dir: Path, name: str, steps: int, seed: int, behaviour: dict | None = None) -> Path:
    fam, quality = name.split("-", 1)
    if fam not in ENVS:
        raise ValueError(f"dataset name {name!r} must start with one of {list(ENVS)}")
    path = data_dir / f"{name}-{steps}-s{seed}{_behaviour_tag(behaviour, fam)}.npz"
    if not path.exists():
        from rl.data import save_dataset
        from rl.generate import generate

        policy = behaviour[fam]["path"] if behaviour and fam in behaviour else None
        logger.info("generating %s%s", path, f" with {policy}" if policy else "")
        save_dataset(path, generate(ENVS[fam], quality, steps, seed, policy_path=policy))
    return path


@dataclass(kw_only=True)
class Prepared:
    """A benchmark dataset ready to train on."""

    name: str  # benchmark name, e.g. "hopper-medium-replay-po"
    train_path: Path  # the training split (the whole dataset without held-out episodes)
    env_id: str  # gymnasium id
    heldout: list = field(default_factory=list)  # held-out rl.data.Trajectory's (never trained on)
    heldout_info: dict = field(default_factory=dict)  # fraction, seed, indices, episodes
    targets: list[float] = field(default_factory=list)  # target returns for evaluation
    best_return: float = 0.0  # best episode return of the training split
    obs_transform: object = None  # observation mask for a partially observed task (rl.partial), else None


def _prepare(data_dir: Path, name: str, args) -> Prepared:
    """Generate / mask / split the dataset ``name`` (files under ``data_dir``, reused when present)."""
    from rl.data import holdout_split, load_dataset, save_dataset
    from rl.partial import PO_SUFFIX, mask_dataset, observation_mask
    from rl.train import ENV_DEFAULTS

    po = name.endswith(PO_SUFFIX)
    base = name[: -len(PO_SUFFIX)] if po else name
    behaviour = parse_behaviour(args.behaviour)
    path = _dataset_path(data_dir, base, args.dataset_steps, 0, behaviour)
    fam = base.split("-", 1)[0]
    env_id = ENVS[fam]
    if po:
        po_path = data_dir / f"{name}-{args.dataset_steps}-s0{_behaviour_tag(behaviour, fam)}.npz"
        if not po_path.exists():
            logger.info("masking velocities: %s", po_path)
            save_dataset(po_path, mask_dataset(load_dataset(path), env_id))
        path = po_path
    ds = load_dataset(path)
    heldout, info = [], {}
    if args.holdout_frac > 0:
        train_ds, heldout, idx = holdout_split(ds, args.holdout_frac, args.holdout_seed)
        info = train_ds.metadata["holdout"]
        split_path = data_dir / f"{path.stem}-ho{args.holdout_frac:g}-s{args.holdout_seed}.npz"
        if not split_path.exists():
            save_dataset(split_path, train_ds)
        path, ds = split_path, train_ds
    best = float(ds.episode_returns().max())
    if args.target_mode == "env":
        targets = list(ENV_DEFAULTS[env_id]["targets"])
    else:
        targets = [f * best for f in _floats(args.target_factors, "--target-factors")]
    return Prepared(name=name, train_path=path, env_id=env_id, heldout=heldout, heldout_info=info, targets=targets,
                    best_return=best, obs_transform=observation_mask(env_id) if po else None)


def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"{flag} must be comma-separated numbers, got {text!r}") from e
    if not out:
        raise SystemExit(f"{flag} is empty")
    return out


_COMMON = ("dataset_steps", "eval_episodes", "eval_seed", "target_mode", "target_factors", "holdout_frac",
           "holdout_seed", "context", "batch_size", "lr")
_OURS = ("steps", "warmup", "embed_dim", "heads", "segment_anchor")
_DM = ("dm_layers", "routed_layers", "capacity_cost", "probe_tokens", "train_selection")
_CASE_KEYS = {"dt": _COMMON + _OURS + ("dt_layers",), "dm": _COMMON + _OURS + _DM,
              "dt-small": _COMMON + _OURS + _DM + ("dt_small_layers",),
              "dm-random": _COMMON + _OURS + _DM + ("random_capacity",),
              "dm-fixed": _COMMON + _OURS + _DM + ("fixed_capacity",),
              "d3rlpy-dt": _COMMON + ("steps", "d3rlpy_steps", "dt_layers", "heads", "embed_dim"),
              "d3rlpy-iql": _COMMON + ("steps", "d3rlpy_steps")}


def case_settings(algo: str, args) -> dict:
    """The settings a (dataset, ``algo``, seed) case depends on (stored with it; compared before reuse)."""
    out = {k: getattr(args, k) for k in _CASE_KEYS[algo]}
    if getattr(args, "behaviour", None):  # only when given: cases recorded before the option keep matching
        out["behaviour"] = {fam: b["sha256"] for fam, b in sorted(parse_behaviour(args.behaviour).items())}
    if algo not in ("dt", "d3rlpy-dt", "d3rlpy-iql") and getattr(args, "preset", "project") != "project":
        out["preset"] = args.preset  # likewise only when not the default
    return out


def _settings_diff(saved: dict | None, now: dict) -> dict:
    if saved is None:
        return {"(all)": ("not recorded", "this run's")}
    return {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}


def _routing_overrides(args) -> dict:
    """DM routing options given on the command line (absent: DMConfig's defaults)."""
    out = {}
    if getattr(args, "probe_tokens", None) is not None:
        out["probe_tokens"] = args.probe_tokens
    if getattr(args, "train_selection", None) is not None:
        out["train_selection"] = args.train_selection
    return out


def _dm_value(arg: str, dm_case: dict | None, algo: str, flag: str) -> float | None:
    """``arg`` as a number, or DM's learned routed fraction (``"dm"``/``"auto"``) from ``dm_case``."""
    if arg not in ("dm", "auto"):
        return None
    if dm_case is None or dm_case.get("routed_fraction") is None:
        raise SystemExit(f"{algo} with {flag} {arg} needs the dm case of the same dataset and seed: include dm in "
                         f"--algos (it runs first) or give {flag} a number")
    return float(dm_case["routed_fraction"])


def arm_overrides(algo: str, args, dm_case: dict | None = None) -> tuple[str, dict, dict]:
    """``(train algo, model overrides, what was derived)`` for one of our arms (``dm_case``: DM's result for the
    same dataset and seed, for the arms that take DM's learned capacity)."""
    base = {"context": args.context, "embed_dim": args.embed_dim, "num_heads": args.heads, "dropout": 0.1}
    routed = tuple(int(x) for x in args.routed_layers.split(","))
    derived = {}
    if algo == "dt":
        return "dt", {**base, "num_layers": args.dt_layers}, derived
    if algo == "dt-small":
        c = _dm_value(args.dt_small_layers, dm_case, algo, "--dt-small-layers")
        if c is None:
            layers = int(args.dt_small_layers)
        else:
            layers = max(1, round(args.dm_layers - len(routed) + len(routed) * c))
            derived = {"dm_routed_fraction": c}
        derived["num_layers"] = layers
        return "dt", {**base, "num_layers": layers}, derived
    ov = {**base, "num_layers": args.dm_layers, "routed_layers": routed}
    if args.capacity_cost is not None:
        ov["capacity_cost_weight"] = args.capacity_cost
    ov.update(_routing_overrides(args))
    if algo in ("dm-random", "dm-fixed"):
        flag = "--random-capacity" if algo == "dm-random" else "--fixed-capacity"
        arg = args.random_capacity if algo == "dm-random" else args.fixed_capacity
        c = _dm_value(arg, dm_case, algo, flag)
        cap = float(arg) if c is None else c
        cap = min(1.0, max(0.1, cap))  # DMConfig's capacity bounds
        ov.update(capacity=cap, learn_capacity=False, min_capacity=min(0.1, cap))
        if algo == "dm-random":
            ov["random_routing"] = True
            ov.pop("probe_tokens", None)
        derived["capacity"] = cap
    return "dm", ov, derived


def _eval_policy(model, prep: Prepared, args) -> dict:
    """Returns and normalized scores at each target, held-out action MSE, evaluation CPU seconds."""
    import torch

    from rl.evaluate import evaluate_returns, heldout_action_mse
    from rl.references import normalized_score

    c0 = time.process_time()
    scores, returns = {}, {}
    for tr in prep.targets:
        torch.manual_seed(args.eval_seed)  # the same draws for every arm (random routing)
        rets = evaluate_returns(model, prep.env_id, target_return=tr, episodes=args.eval_episodes,
                                seed=args.eval_seed, obs_transform=prep.obs_transform)
        scores[f"{tr:g}"] = float(normalized_score(prep.env_id, rets).mean())
        returns[f"{tr:g}"] = [float(x) for x in rets]
    res = {"scores": scores, "returns": returns, "score": scores[f"{prep.targets[0]:g}"],
           "targets": prep.targets, "eval_cpu_sec": None, "heldout_mse": None}
    if prep.heldout:
        torch.manual_seed(args.eval_seed)
        res["heldout_mse"] = heldout_action_mse(model, prep.heldout)
    res["eval_cpu_sec"] = time.process_time() - c0
    return res


def _with_defaults(args) -> argparse.Namespace:
    """``args`` with the parser's defaults for options it lacks (a namespace built by hand)."""
    return argparse.Namespace(**{**vars(build_parser().parse_args([])), **vars(args)})


def _run_ours(algo, prep: Prepared | str | Path, seed, args, workdir: Path, dm_case: dict | None = None) -> dict:
    """Train and evaluate one of our arms (``prep``: a prepared dataset, or a dataset file used as it is)."""
    from rl.data import load_dataset
    from rl.evaluate import load_policy
    from rl.train import ENV_DEFAULTS, TrainConfig, train

    args = _with_defaults(args)
    if not isinstance(prep, Prepared):
        env_id = load_dataset(prep).metadata["env"]
        prep = Prepared(name=Path(prep).stem, train_path=Path(prep), env_id=env_id,
                        targets=list(ENV_DEFAULTS[env_id]["targets"]))
    # The directory name carries a hash of the case's settings (but its step count: a longer run continues a
    # shorter one), so a run with other settings never resumes another's checkpoint.
    settings = {k: v for k, v in case_settings(algo, args).items() if k != "steps"}
    tag = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    out = workdir / f"{prep.train_path.stem}-{algo}-s{seed}-{tag}"
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text())["step"] > args.steps:
        raise SystemExit(f"{out} holds a run trained past --steps {args.steps}; remove it or raise --steps")
    train_algo, overrides, derived = arm_overrides(algo, args, dm_case)
    cfg = TrainConfig(algo=train_algo, steps=args.steps, seed=seed, batch_size=args.batch_size, lr=args.lr,
                      warmup_steps=min(args.warmup, args.steps), log_every=max(1, min(100, args.steps // 4)),
                      eval_episodes=0, checkpoint_every=min(1_000, args.steps), segment_anchor=args.segment_anchor,
                      preset=args.preset if train_algo == "dm" else "project")
    # A run killed part-way (a long benchmark spans several sittings) resumes from its last checkpoint; the
    # training records are read back from its metrics log, so they cover the whole run, not only this part.
    train(cfg, prep.train_path, out, model_overrides=overrides, resume=(out / "checkpoint.pt").exists(),
          progress=False)
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    timed = train_recs[1:] or train_recs  # the first period includes start-up
    sec = [r["sec_per_1k_steps"] for r in timed]
    cpu = [r["cpu_sec_per_1k_steps"] for r in timed if "cpu_sec_per_1k_steps" in r]
    model, info = load_policy(out)
    res = {"sec_per_1k_steps": float(np.median(sec)) if sec else None,
           "cpu_sec_per_1k_steps": float(np.median(cpu)) if cpu else None,
           "final_loss": train_recs[-1]["action_mse"] if train_recs else None, "derived": derived,
           "num_params": int(sum(p.numel() for p in model.parameters()))}
    if train_algo == "dm":
        res["routed_fraction"] = float(np.mean([r["routed_fraction"] for r in train_recs[-2:]]))
    res.update(_eval_policy(model, prep, args))
    return res


def paired_bootstrap(diffs: dict[str, np.ndarray], samples: int, seed: int = 0) -> dict:
    """Paired bootstrap of mean differences: ``diffs[dataset]`` holds one difference per seed (both arms, same
    seed). Seeds are resampled with replacement, per dataset independently; the 2.5th and 97.5th percentiles of
    the resampled means give the 95% interval, per dataset and for the mean over datasets."""
    rng = np.random.default_rng(seed)
    out, boots = {}, []
    for name, d in diffs.items():
        d = np.asarray(d, dtype=np.float64)
        b = d[rng.integers(0, len(d), size=(samples, len(d)))].mean(1)
        boots.append(b)
        out[name] = {"mean": float(d.mean()), "lo": float(np.percentile(b, 2.5)), "hi": float(np.percentile(b, 97.5)),
                     "seeds": int(len(d)), "sd": float(d.std(ddof=1)) if len(d) > 1 else None}
    if boots:
        m = np.mean(boots, axis=0)
        sds = [v["sd"] for v in out.values()]
        out["mean over datasets"] = {"mean": float(np.mean([v["mean"] for v in out.values()])),
                                     "lo": float(np.percentile(m, 2.5)), "hi": float(np.percentile(m, 97.5)),
                                     "seeds": int(min(len(d) for d in diffs.values())),
                                     # the SD of one seed's mean-over-datasets difference (datasets independent)
                                     "sd": (float(np.sqrt(np.sum(np.square(sds)))) / len(sds)
                                            if all(sd is not None for sd in sds) else None)}
    return out


def seeds_for_halfwidth(sd: float | None, halfwidth: float) -> int | None:
    """Seeds for a 95% interval of half-width ``halfwidth`` on a mean of per-seed differences with SD ``sd``
    (normal approximation, ``ceil((1.96 sd / halfwidth)^2)``, at least 2); sizes a run from a pilot's spread."""
    if sd is None or halfwidth <= 0:
        return None
    return max(2, math.ceil((1.96 * sd / halfwidth) ** 2))


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
        model = build_model(algo, _model_config(algo, ds, env, ov, args.preset if algo == "dm" else "project"))
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


def _d3rlpy_eval(policy_fn, prep: Prepared, args, target, stateful=None) -> dict:
    from rl.envs import make_env
    from rl.references import normalized_score

    env = make_env(prep.env_id)
    see = prep.obs_transform or (lambda o: o)
    rets = []
    for ep in range(args.eval_episodes):
        obs, _ = env.reset(seed=args.eval_seed + ep)
        if stateful is not None:
            stateful.reset()
        done, ret, rew = False, 0.0, 0.0
        while not done:
            a = policy_fn(see(obs).astype(np.float32), rew)
            obs, rew, term, trunc, _ = env.step(a)
            ret += float(rew)
            done = term or trunc
        rets.append(ret)
    env.close()
    score = float(normalized_score(prep.env_id, np.array(rets)).mean())
    return {"score": score, "scores": {f"{target:g}": score}, "returns": {f"{target:g}": rets}, "targets": [target]}


def _run_d3rlpy(algo, prep: Prepared, seed, args) -> dict:
    import d3rlpy
    import torch

    from rl.data import load_dataset, to_mdp_dataset

    torch.set_num_threads(1)
    ds = load_dataset(prep.train_path)
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
    target = prep.targets[0]
    if algo == "d3rlpy-dt":
        wrapper = obj.as_stateful_wrapper(target_return=target)
        ev = _d3rlpy_eval(lambda o, r: wrapper.predict(o, r), prep, args, target, stateful=wrapper)
    else:
        ev = _d3rlpy_eval(lambda o, r: obj.predict(o[None])[0], prep, args, target)
    return {"sec_per_1k_steps": sec, "cpu_sec_per_1k_steps": cpu, "steps": steps, "heldout_mse": None, **ev}


def build_parser() -> argparse.ArgumentParser:
    from rl.train import SEGMENT_ANCHORS

    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny pipeline check (random Hopper data, 1 seed; cases run with other settings are redone)")
    p.add_argument("--datasets", default="hopper-medium,halfcheetah-medium,walker2d-medium-replay")
    p.add_argument("--dataset-steps", type=int, default=200_000, help="transitions per generated dataset")
    p.add_argument("--behaviour", action="append", default=[], metavar="FAMILY=PATH",
                   help="behaviour policies that generate FAMILY's datasets (e.g. hopper=rl/weights/"
                        "behaviour_hopper_long.safetensors; repeatable; default: the shipped behaviour_<family>); "
                        "dataset files and case settings carry the file's hash")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algos", default=",".join(ALGOS),
                   help=f"comma-separated arms: {', '.join(ALL_ALGOS)} (controls: module docstring)")
    p.add_argument("--steps", type=int, default=20_000, help="gradient steps per run")
    p.add_argument("--d3rlpy-steps", type=int, default=None, help="steps for the d3rlpy peers (default --steps)")
    p.add_argument("--eval-episodes", type=int, default=10, help="episodes per target return (decisive run: 50)")
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
    p.add_argument("--preset", choices=("project", "reference"), default="project",
                   help="DM arms' routed layers: this project's (default) or the released code's (rl.train --preset)")
    p.add_argument("--timing-warmup", type=int, default=500,
                   help="with --timing-steps: untimed steps before the second timed phase (DM at its learned capacity)")
    p.add_argument("--timing-steps", type=int, default=0,
                   help="per dataset, also time DM and DT steps interleaved on the same batches (0: skip)")
    g = p.add_argument_group("decisive experiment (module docstring)")
    g.add_argument("--eval-seed", type=int, default=10_000,
                   help="episode i of every evaluation resets with seed eval_seed + i (the same for every arm)")
    g.add_argument("--target-mode", choices=TARGET_MODES, default="env",
                   help="target returns: the environment's DT targets (env) or --target-factors x the best "
                        "episode return of the training data (data-best)")
    g.add_argument("--target-factors", default="1.0,1.2", help="with --target-mode data-best: comma-separated factors")
    g.add_argument("--holdout-frac", type=float, default=0.1,
                   help="fraction of each dataset's episodes held out (never trained on) for the held-out action "
                        "MSE (0: none)")
    g.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out episodes' draw (same for all arms)")
    g.add_argument("--dt-small-layers", default="auto",
                   help="dt-small's blocks: a number, or auto = round(DM's plain + routed blocks x its learned routed "
                        "fraction, same dataset and seed)")
    g.add_argument("--random-capacity", default="dm",
                   help="dm-random's routed fraction: a number, or dm = DM's learned one (same dataset and seed)")
    g.add_argument("--fixed-capacity", default="dm",
                   help="dm-fixed's capacity (not learned): a number, or dm = DM's learned routed fraction")
    g.add_argument("--bootstrap", type=int, default=10_000, help="paired bootstrap resamples (0: no intervals)")
    g.add_argument("--sizing-halfwidth", type=float, default=2.5,
                   help="the table's last column: seeds for a 95%% interval of this half-width on the score difference "
                        "(2.5: half the +5 target)")
    g.add_argument("--on-mismatch", choices=("error", "redo"), default="error",
                   help="a case in --out run with other settings: stop (error) or rerun it (redo)")
    p.add_argument("--merge", default="",
                   help="comma-separated result JSONs (same settings, e.g. algos run in parallel processes) whose "
                        "cases are merged into --out before the table")
    p.add_argument("--report-only", action="store_true",
                   help="table and intervals from the cases found (--out, --merge); run no missing case")
    p.add_argument("--data-dir", default="data/rl")
    p.add_argument("--work-dir", default="runs/rl_bench")
    p.add_argument("--out", default="benchmarks/results/rl_bench.json")
    return p


def _order(algos: list[str]) -> list[str]:
    """``dm`` before the arms that take its learned capacity."""
    return sorted(algos, key=lambda a: 0 if a == "dm" else 1)


def _pairs(algos: list[str]) -> list[tuple[str, str]]:
    out = [(a, "dt") for a in algos if a != "dt" and "dt" in algos]
    out += [("dm", c) for c in algos if c in ("dm-random", "dm-fixed", "d3rlpy-dt", "d3rlpy-iql") and "dm" in algos]
    return out


def _bootstrap_tables(results: dict, names: list[str], algos: list[str], seeds: list[int], args, matching) -> dict:
    """Per (A, B) pair and metric, the paired bootstrap of A − B over the seeds both finished."""
    out = {}
    for a, b in _pairs(algos):
        for metric in ("score", "heldout_mse"):
            diffs = {}
            for name in names:
                d = []
                for s in seeds:
                    ca, cb = matching(f"{name}/{a}/{s}", a), matching(f"{name}/{b}/{s}", b)
                    if ca and cb and ca.get(metric) is not None and cb.get(metric) is not None:
                        d.append(ca[metric] - cb[metric])
                if d:
                    diffs[name] = np.array(d)
            if diffs:
                out[f"{a} - {b}/{metric}"] = paired_bootstrap(diffs, args.bootstrap)
    return out


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
        args.on_mismatch = "redo"  # a pipeline check: cases of an older quick run are rerun, not refused
        if args.out == build_parser().get_default("out"):
            args.out = "benchmarks/results/rl_bench_quick.json"
        args.work_dir = args.work_dir + "_quick"
    algos = _order([a for a in args.algos.split(",") if a])
    bad = [a for a in algos if a not in ALL_ALGOS]
    if bad:
        raise SystemExit(f"unknown algos {bad}; accepted: {list(ALL_ALGOS)}")
    if not 0.0 <= args.holdout_frac < 1.0:
        raise SystemExit(f"--holdout-frac must be in [0, 1), got {args.holdout_frac}")
    if args.eval_episodes <= 0:
        raise SystemExit(f"--eval-episodes must be positive, got {args.eval_episodes}")
    if args.target_mode == "data-best":
        _floats(args.target_factors, "--target-factors")
    for algo, flag in NEEDS_DM.items():
        v = getattr(args, flag)
        if v not in ("dm", "auto"):
            try:
                float(v)
            except ValueError:
                raise SystemExit(f"--{flag.replace('_', '-')} must be a number or 'dm'/'auto', got {v!r}") from None
    parse_behaviour(args.behaviour)  # a bad --behaviour stops the run before any work
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in args.datasets.split(",") if n]
    data_dir, work = Path(args.data_dir), Path(args.work_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    results = read_json(args.out) or {"env": env_info(), "settings": {}, "cases": {}}
    results["settings"] = portable_args(args)

    def matching(key: str, algo: str) -> dict | None:
        """The case ``key`` if it ran with this run's settings."""
        c = results["cases"].get(key)
        return c if c is not None and c.get("settings") == case_settings(algo, args) else None

    for got in read_parts([m for m in args.merge.split(",") if m]):
        for key, res in got.get("cases", {}).items():
            algo = key.split("/")[1]
            if key not in results["cases"] or (algo in _CASE_KEYS and matching(key, algo) is None
                                                 and res.get("settings") == case_settings(algo, args)):
                results["cases"][key] = res
        for key, res in got.get("timing", {}).items():
            results.setdefault("timing", {}).setdefault(key, res)
    datasets = {}
    for name in names:
        prep = datasets[name] = _prepare(data_dir, name, args)
        results.setdefault("datasets", {})[name] = {
            "env": prep.env_id, "train_file": prep.train_path.name, "best_return": prep.best_return,
            "targets": prep.targets, "holdout": prep.heldout_info, "partial_observation": prep.obs_transform is not None}
        if args.timing_steps and name not in results.get("timing", {}):
            logger.info("timing dm vs dt on %s", name)
            results.setdefault("timing", {})[name] = _timing(prep.train_path, args)
            write_json_atomic(args.out, results)
        for algo in algos:
            for seed in seeds:
                key = f"{name}/{algo}/{seed}"
                now = case_settings(algo, args)
                if key in results["cases"]:
                    saved = results["cases"][key].get("settings")
                    if saved == now:
                        continue
                    diff = _settings_diff(saved, now)
                    if args.on_mismatch == "error":
                        raise SystemExit(f"case {key} in {args.out} was run with other settings (saved, now): {diff}; "
                                         f"pass --on-mismatch redo to rerun it, or write to another --out")
                    logger.warning("rerunning %s: its settings differ (saved, now): %s", key, diff)
                if args.report_only:
                    logger.info("not run (--report-only): %s", key)
                    continue
                logger.info("running %s", key)
                if algo in OURS:
                    res = _run_ours(algo, prep, seed, args, work, dm_case=matching(f"{name}/dm/{seed}", "dm"))
                else:
                    res = _run_d3rlpy(algo, prep, seed, args)
                res["settings"] = now
                results["cases"][key] = res
                write_json_atomic(args.out, results)
    rows = []
    for name in names:
        dt_cpu = None
        for algo in algos:
            cs = [matching(f"{name}/{algo}/{s}", algo) for s in seeds]
            cs = [c for c in cs if c]
            if not cs:
                continue
            sc = np.array([c["score"] for c in cs])
            cpu = [c["cpu_sec_per_1k_steps"] for c in cs if c.get("cpu_sec_per_1k_steps") is not None]
            cpu_t = float(np.mean(cpu)) if len(cpu) == len(cs) else None
            mse = [c["heldout_mse"] for c in cs if c.get("heldout_mse") is not None]
            if algo == "dt":
                dt_cpu = cpu_t
            routed = [c["routed_fraction"] for c in cs if c.get("routed_fraction") is not None]
            layers = sorted({c.get("derived", {}).get("num_layers") for c in cs} - {None})
            rows.append({"dataset": name, "algo": algo + (f" ({'/'.join(map(str, layers))}L)" if layers else ""),
                         "_algo": algo, "score": f"{sc.mean():.1f} ± {sc.std():.1f}", "seeds": len(cs),
                         "held-out MSE": f"{np.mean(mse):.4f} ± {np.std(mse):.4f}" if len(mse) == len(cs) else None,
                         "s/1K steps": float(np.mean([c["sec_per_1k_steps"] for c in cs])),
                         "CPU s/1K steps": cpu_t,
                         "routed": f"{np.mean(routed):.2f}" if routed else "-"})
        for r in rows:
            if r["dataset"] == name and r["_algo"] != "dt" and dt_cpu and r["CPU s/1K steps"]:
                r["CPU time vs dt"] = r["CPU s/1K steps"] / dt_cpu
    table = format_table(rows, ["dataset", "algo", "score", "seeds", "held-out MSE", "s/1K steps", "CPU s/1K steps",
                                "CPU time vs dt", "routed"])
    if args.bootstrap > 0:
        boot = _bootstrap_tables(results, names, algos, seeds, args, matching)
        results["bootstrap"] = {"samples": args.bootstrap, "unit": "seed (paired: same seed, batches and episodes)",
                                "intervals": boot}
        brows = []
        for pair_metric, per in boot.items():
            pair, metric = pair_metric.split("/")
            for name, v in per.items():
                n = seeds_for_halfwidth(v.get("sd"), args.sizing_halfwidth) if metric == "score" else None
                brows.append({"difference": pair, "metric": metric, "dataset": name, "mean": v["mean"],
                              "95% interval": f"[{v['lo']:.3g}, {v['hi']:.3g}]", "seeds": v["seeds"],
                              "SD per seed": "-" if v.get("sd") is None else f"{v['sd']:.3g}",
                              f"seeds for ±{args.sizing_halfwidth:g}": "-" if n is None else n})
        if brows:
            table += ("\n\nPaired bootstrap over seeds (score: normalized, first target; held-out MSE: lower is "
                      "better; the last column sizes a run: seeds for a 95% interval of that half-width on the "
                      "score, from this run's spread):\n\n"
                      + format_table(brows, ["difference", "metric", "dataset", "mean", "95% interval", "seeds",
                                             "SD per seed", f"seeds for ±{args.sizing_halfwidth:g}"]))
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
