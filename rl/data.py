"""Offline RL datasets: one ``.npz`` format with D4RL-like keys, a validating loader, trajectories.

``load_dataset`` also reads D4RL-style HDF5 files and local Minari datasets (:mod:`rl.formats`), and
``save_dataset`` writes D4RL-style HDF5 for a ``.hdf5``/``.h5`` name; all pass the same validation.

File layout (``numpy.savez_compressed``; ``N`` transitions, in episode order):

    observations  float32 (N, obs_dim)   observation before the action
    actions       float32 (N, act_dim)
    rewards       float32 (N,)
    terminals     bool    (N,)           the episode ended in a terminal state (no bootstrap)
    timeouts      bool    (N,)           the episode was cut (time limit, or end of collection)
    metadata      str     ()             JSON: env, quality, policy, seed, steps, episode returns, format

Every episode ends on a step with ``terminals | timeouts`` True, including the last one in the file.
``load_dataset`` checks all of it and raises ``ValueError``/``FileNotFoundError`` naming the problem;
``check_env_compat`` checks a dataset against an environment's spaces before any training starts.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "REQUIRED_KEYS",
    "FORMAT_VERSION",
    "OfflineDataset",
    "Trajectory",
    "SAVE_SUFFIXES",
    "check_save_path",
    "save_dataset",
    "load_dataset",
    "validate_arrays",
    "check_env_compat",
    "split_trajectories",
    "holdout_split",
    "from_trajectories",
    "returns_to_go",
    "to_mdp_dataset",
]

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class Trajectory:
    """One episode."""

    observations: np.ndarray  # (T, obs_dim) float32
    actions: np.ndarray  # (T, act_dim) float32
    rewards: np.ndarray  # (T,) float32
    terminal: bool  # ended in a terminal state (False: time limit or end of collection)

    @property
    def length(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def ret(self) -> float:
        return float(self.rewards.sum())


@dataclass(kw_only=True)
class OfflineDataset:
    """A validated dataset in memory (arrays as in the file)."""

    observations: np.ndarray  # (N, obs_dim) float32
    actions: np.ndarray  # (N, act_dim) float32
    rewards: np.ndarray  # (N,) float32
    terminals: np.ndarray  # (N,) bool
    timeouts: np.ndarray  # (N,) bool
    metadata: dict = field(default_factory=dict)  # env, quality, policy, seed, returns, ...

    def __post_init__(self) -> None:
        validate_arrays(self.arrays())

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in REQUIRED_KEYS}

    @property
    def obs_dim(self) -> int:
        return int(self.observations.shape[1])

    @property
    def act_dim(self) -> int:
        return int(self.actions.shape[1])

    def __len__(self) -> int:
        return int(self.rewards.shape[0])

    def trajectories(self) -> list[Trajectory]:
        return split_trajectories(self)

    def episode_returns(self) -> np.ndarray:
        return np.array([t.ret for t in self.trajectories()], dtype=np.float64)


def validate_arrays(arrays: dict[str, np.ndarray], *, source: str = "dataset") -> None:
    """Check keys, ranks, lengths, dtypes' kinds, finiteness and episode ends; ``ValueError`` otherwise."""
    missing = [k for k in REQUIRED_KEYS if k not in arrays]
    if missing:
        raise ValueError(f"{source}: missing keys {missing}; required keys are {list(REQUIRED_KEYS)}, "
                         f"found {sorted(arrays)}")
    obs, act = np.asarray(arrays["observations"]), np.asarray(arrays["actions"])
    if obs.ndim != 2 or act.ndim != 2:
        raise ValueError(f"{source}: observations and actions must be 2-D (N, dim); got shapes "
                         f"{obs.shape} and {act.shape}")
    n = obs.shape[0]
    if n == 0:
        raise ValueError(f"{source}: no transitions (observations has shape {obs.shape})")
    for k in REQUIRED_KEYS:
        a = np.asarray(arrays[k])
        want = (n,) if k in ("rewards", "terminals", "timeouts") else (n, a.shape[-1] if a.ndim == 2 else -1)
        if a.shape[0] != n or a.ndim != len(want):
            raise ValueError(f"{source}: {k} has shape {a.shape}, expected {tuple(d if d != -1 else 'dim' for d in want)}"
                             f" with N={n} (the length of observations)")
        if k in ("terminals", "timeouts"):
            if a.dtype != bool and not np.isin(a, (0, 1)).all():
                raise ValueError(f"{source}: {k} must be boolean (or 0/1), got dtype {a.dtype} with other values")
        else:
            if not np.issubdtype(a.dtype, np.number):
                raise ValueError(f"{source}: {k} must be numeric, got dtype {a.dtype}")
            bad = ~np.isfinite(a)
            if bad.any():
                first = int(np.argwhere(bad)[0][0])
                raise ValueError(f"{source}: {k} contains {int(bad.sum())} NaN/inf values (first at transition "
                                 f"{first}); clean or regenerate the dataset")
    ends = np.asarray(arrays["terminals"]).astype(bool) | np.asarray(arrays["timeouts"]).astype(bool)
    if not ends[-1]:
        raise ValueError(f"{source}: the last transition ends no episode (terminals and timeouts both False at "
                         f"index {n - 1}); every episode must end with terminals or timeouts True")


SAVE_SUFFIXES = (".npz", ".hdf5", ".h5")  # what save_dataset writes (HDF5: D4RL layout, see rl.formats)


def check_save_path(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` if :func:`save_dataset` can write it, else ``ValueError`` naming the accepted suffixes."""
    path = Path(path)
    if path.suffix not in SAVE_SUFFIXES:
        raise ValueError(f"cannot write a dataset to {str(path)!r}: the file name must end in one of "
                         f"{', '.join(SAVE_SUFFIXES)} (.npz, or D4RL-style HDF5)")
    return path


def save_dataset(path: str | os.PathLike, ds: OfflineDataset) -> Path:
    """Write ``ds`` atomically to ``path``: ``.npz`` (this module's format) or ``.hdf5``/``.h5`` (D4RL layout)."""
    path = check_save_path(path)
    if path.suffix != ".npz":
        from rl.formats import save_hdf5

        return save_hdf5(path, ds)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(ds.metadata)
    meta.setdefault("format_version", FORMAT_VERSION)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp,
        observations=ds.observations.astype(np.float32), actions=ds.actions.astype(np.float32),
        rewards=ds.rewards.astype(np.float32), terminals=ds.terminals.astype(bool),
        timeouts=ds.timeouts.astype(bool), metadata=np.array(json.dumps(meta)),
    )
    os.replace(tmp, path)
    return path


def load_dataset(path: str | os.PathLike) -> OfflineDataset:
    """Read and validate a dataset: ``.npz`` (written by :func:`save_dataset`, or any npz with the same keys),
    D4RL-style ``.hdf5``/``.h5``, or a local Minari dataset ``minari:/path/to/dataset`` (see :mod:`rl.formats`).
    Every format goes through :func:`validate_arrays`."""
    text = str(path)
    if text.startswith("minari:"):
        from rl.formats import load_minari

        return load_minari(text)
    path = Path(path)
    if path.suffix in (".hdf5", ".h5"):
        from rl.formats import load_hdf5

        return load_hdf5(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {str(path)!r} (make one with `python -m rl.generate`)")
    if path.is_dir():
        if (path / "data" / "main_data.hdf5").exists():
            from rl.formats import load_minari

            return load_minari(path)
        raise ValueError(f"{str(path)!r} is a folder; accepted datasets: a .npz or .hdf5/.h5 file, or a Minari "
                         f"dataset folder given as minari:/path/to/dataset")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r} is not a readable .npz dataset: {e}") from e
    meta = {}
    if "metadata" in arrays:
        try:
            meta = json.loads(str(arrays.pop("metadata")))
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r}: metadata is not valid JSON: {e}") from e
    validate_arrays(arrays, source=str(path))
    return OfflineDataset(
        observations=arrays["observations"].astype(np.float32), actions=arrays["actions"].astype(np.float32),
        rewards=arrays["rewards"].astype(np.float32), terminals=arrays["terminals"].astype(bool),
        timeouts=arrays["timeouts"].astype(bool), metadata=meta,
    )


def check_env_compat(ds: OfflineDataset, observation_space, action_space, *, env_id: str = "env",
                     action_tol: float = 1e-4) -> None:
    """Raise ``ValueError`` if the dataset's shapes or action range do not fit the environment's spaces."""
    obs_shape, act_shape = tuple(observation_space.shape), tuple(action_space.shape)
    if (ds.obs_dim,) != obs_shape:
        raise ValueError(f"dataset observations have dim {ds.obs_dim} but {env_id} observations have shape "
                         f"{obs_shape}; was the dataset made for another environment "
                         f"(metadata env={ds.metadata.get('env')!r})?")
    if (ds.act_dim,) != act_shape:
        raise ValueError(f"dataset actions have dim {ds.act_dim} but {env_id} actions have shape {act_shape} "
                         f"(metadata env={ds.metadata.get('env')!r})")
    low, high = np.asarray(action_space.low), np.asarray(action_space.high)
    out = (ds.actions < low - action_tol) | (ds.actions > high + action_tol)
    if out.any():
        i = int(np.argwhere(out)[0][0])
        raise ValueError(f"dataset actions leave {env_id}'s action bounds [{low.min()}, {high.max()}] "
                         f"({int(out.any(1).sum())} transitions, first at {i}: {ds.actions[i].tolist()})")


def split_trajectories(ds: OfflineDataset) -> list[Trajectory]:
    """Episodes in file order; an episode ends after a step whose ``terminals`` or ``timeouts`` is True."""
    ends = np.flatnonzero(ds.terminals | ds.timeouts)
    trajs, start = [], 0
    for e in ends:
        sl = slice(start, e + 1)
        trajs.append(Trajectory(observations=ds.observations[sl], actions=ds.actions[sl],
                                rewards=ds.rewards[sl], terminal=bool(ds.terminals[e])))
        start = e + 1
    return trajs


def from_trajectories(trajs: list[Trajectory], metadata: dict | None = None) -> OfflineDataset:
    """An ``OfflineDataset`` of the given episodes, in order (a non-terminal episode ends with a timeout)."""
    if not trajs:
        raise ValueError("from_trajectories needs at least one trajectory")
    term = [np.zeros(t.length, bool) for t in trajs]
    tout = [np.zeros(t.length, bool) for t in trajs]
    for t, te, to in zip(trajs, term, tout):
        (te if t.terminal else to)[-1] = True
    return OfflineDataset(observations=np.concatenate([t.observations for t in trajs]),
                          actions=np.concatenate([t.actions for t in trajs]),
                          rewards=np.concatenate([t.rewards for t in trajs]), terminals=np.concatenate(term),
                          timeouts=np.concatenate(tout), metadata=dict(metadata or {}))


def holdout_split(ds: OfflineDataset, fraction: float, seed: int) -> tuple[OfflineDataset, list[Trajectory], list[int]]:
    """Hold out ``round(fraction * episodes)`` whole episodes, drawn with ``numpy.random.default_rng(seed)``.

    Returns ``(train, heldout, heldout_indices)``: the training dataset (the other episodes, in file order, its
    metadata noting the split), the held-out episodes and their sorted indices in ``ds.trajectories()``. At
    least one episode stays in each part when ``fraction > 0``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    trajs = ds.trajectories()
    n_out = 0 if fraction == 0 else min(len(trajs) - 1, max(1, round(fraction * len(trajs))))
    if fraction > 0 and n_out < 1:
        raise ValueError(f"cannot hold out episodes of a dataset with {len(trajs)} episode(s)")
    idx = sorted(int(i) for i in np.random.default_rng(seed).choice(len(trajs), size=n_out, replace=False))
    keep = sorted(set(range(len(trajs))) - set(idx))
    meta = {**ds.metadata, "holdout": {"fraction": fraction, "seed": seed, "indices": idx, "episodes": len(trajs)}}
    if "episode_returns" in meta:
        meta["episode_returns"] = [trajs[i].ret for i in keep]
    return from_trajectories([trajs[i] for i in keep], meta), [trajs[i] for i in idx], idx


def returns_to_go(rewards: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """``rtg[t] = sum_{t' >= t} gamma^(t'-t) r[t']`` for one episode, float32 ``(T,)``."""
    rtg = np.zeros(len(rewards), dtype=np.float64)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        rtg[t] = acc
    return rtg.astype(np.float32)


def to_mdp_dataset(ds: OfflineDataset):
    """Convert to d3rlpy's ``MDPDataset`` (continuous actions)."""
    try:
        from d3rlpy.constants import ActionSpace
        from d3rlpy.dataset import MDPDataset
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("to_mdp_dataset needs d3rlpy: pip install 'longctx-suite[rl]'") from e
    return MDPDataset(
        observations=ds.observations, actions=ds.actions, rewards=ds.rewards.astype(np.float32),
        terminals=ds.terminals.astype(np.float32), timeouts=(ds.timeouts & ~ds.terminals).astype(np.float32),
        action_space=ActionSpace.CONTINUOUS, action_size=ds.act_dim,
    )
