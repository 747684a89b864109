"""Offline datasets users already have: D4RL-style HDF5 files and Minari datasets, read from a local path.

D4RL HDF5 (``.hdf5`` / ``.h5``): top-level datasets ``observations (N, obs_dim)``, ``actions (N, act_dim)``,
``rewards (N,)``, ``terminals (N,)``, ``timeouts (N,)``; optional ``next_observations`` and ``infos/*`` are
not needed and not read. The file attribute ``metadata`` (a JSON string, written by :func:`save_hdf5`) holds this
project's metadata; a file from elsewhere has none, and its environment is taken from a string attribute
``env`` or ``env_id`` if present (else ``rl.train --env`` names it). A file whose last step is neither terminal
nor timeout (D4RL files may stop mid-episode) has that step marked as a timeout, with a warning.

Minari (``minari:/path/to/dataset``): a dataset folder (as ``minari.create_dataset_from_buffers`` or a
``DataCollector`` writes it under ``MINARI_DATASETS_PATH``) holding ``data/metadata.json`` and
``data/main_data.hdf5`` with one group ``episode_<id>`` per episode: ``observations (T + 1, obs_dim)`` (the
last one follows the last action and is dropped), ``actions (T, act_dim)``, ``rewards``, ``terminations``,
``truncations`` ``(T,)``. Episodes are read in id order; the environment id comes from ``env_spec`` in the
metadata. Only Box observation and action spaces and the ``hdf5`` data format are read (Minari's ``arrow`` format
needs pyarrow, which is not a dependency here). An episode whose last step is neither terminated nor truncated
(collection stopped mid-episode) is marked as a timeout, with a warning.

Both readers close such a cut episode through one function, :func:`close_cut_episode`, and record how many they
closed in the metadata (``episodes_marked_timeout``); then both end in ``rl.data.validate_arrays``: the same
checks and errors as the ``.npz`` format.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np

from core.infra.fileio import open_hdf5
from rl.data import REQUIRED_KEYS, FORMAT_VERSION, OfflineDataset, validate_arrays

logger = logging.getLogger(__name__)

__all__ = ["HDF5_SUFFIXES", "MINARI_PREFIX", "close_cut_episode", "load_hdf5", "save_hdf5", "load_minari"]

HDF5_SUFFIXES = (".hdf5", ".h5")
MINARI_PREFIX = "minari:"
_EPISODE = re.compile(r"^episode_(\d+)$")


def _h5py():
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("reading or writing HDF5 datasets needs h5py: pip install 'longctx-suite[rl]'") from e
    return h5py


def close_cut_episode(terminals: np.ndarray, timeouts: np.ndarray, *, source: str) -> tuple[np.ndarray, bool]:
    """Mark the last step as a timeout if it ends no episode (the data stops mid-episode).

    Args:
        terminals: ``(N,)`` terminal flags (bool or 0/1) of a file, or of one Minari episode.
        timeouts: ``(N,)`` timeout flags, the same.
        source: the file (and episode) named in the warning.

    Returns:
        ``(timeouts, cut)``: a copy with ``timeouts[-1]`` set and ``cut=True`` when the last step was neither
        terminal nor timeout (one ``logging`` warning names ``source`` and the cut episode's steps); otherwise
        ``timeouts`` itself and ``False``. Arrays that are not two equal-length non-empty numeric vectors are
        returned unchanged, for ``rl.data.validate_arrays`` to refuse with its own error.
    """
    term, tout = np.asarray(terminals), np.asarray(timeouts)
    flags = all(a.dtype == bool or np.issubdtype(a.dtype, np.number) for a in (term, tout))
    if not flags or term.ndim != 1 or term.shape != tout.shape or term.size == 0:
        return timeouts, False
    ends = term.astype(bool) | tout.astype(bool)
    if ends[-1]:
        return timeouts, False
    earlier = np.flatnonzero(ends)
    steps = int(term.size - (earlier[-1] + 1 if earlier.size else 0))
    logger.warning("%s: an episode of %d steps ends with neither a terminal nor a timeout (the data stops "
                   "mid-episode); its last step is marked as a timeout", source, steps)
    tout = tout.copy()
    tout[-1] = True
    return tout, True


def _dataset(arrays: dict[str, np.ndarray], meta: dict, source: str) -> OfflineDataset:
    validate_arrays(arrays, source=source)
    return OfflineDataset(
        observations=np.asarray(arrays["observations"], dtype=np.float32),
        actions=np.asarray(arrays["actions"], dtype=np.float32),
        rewards=np.asarray(arrays["rewards"], dtype=np.float32),
        terminals=np.asarray(arrays["terminals"]).astype(bool), timeouts=np.asarray(arrays["timeouts"]).astype(bool),
        metadata=meta,
    )


def load_hdf5(path: str | os.PathLike) -> OfflineDataset:
    """Read and validate a D4RL-style HDF5 dataset (module docstring)."""
    h5py = _h5py()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {str(path)!r}")
    f = open_hdf5(path, what=f"a D4RL-style dataset (top-level datasets {', '.join(REQUIRED_KEYS)})")
    with f:
        found = sorted(f.keys())
        missing = [k for k in REQUIRED_KEYS if k not in f]
        if missing:
            raise ValueError(f"{str(path)!r}: missing keys {missing}; a D4RL-style HDF5 dataset needs top-level "
                             f"datasets {list(REQUIRED_KEYS)}, found {found}")
        not_arrays = [k for k in REQUIRED_KEYS if not isinstance(f[k], h5py.Dataset)]
        if not_arrays:
            raise ValueError(f"{str(path)!r}: {not_arrays} must be datasets (arrays), found groups")
        arrays = {k: f[k][()] for k in REQUIRED_KEYS}
        meta: dict = {}
        raw = f.attrs.get("metadata")
        if raw is not None:
            try:
                meta = json.loads(raw if isinstance(raw, str) else bytes(raw).decode())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{str(path)!r}: the metadata attribute is not valid JSON: {e}") from e
        for key in ("env", "env_id"):
            if "env" not in meta and isinstance(f.attrs.get(key), str):
                meta["env"] = f.attrs[key]
    meta.setdefault("source_format", "d4rl-hdf5")
    arrays["timeouts"], cut = close_cut_episode(arrays["terminals"], arrays["timeouts"], source=str(path))
    if cut:
        meta["episodes_marked_timeout"] = 1
    return _dataset(arrays, meta, str(path))


def save_hdf5(path: str | os.PathLike, ds: OfflineDataset) -> Path:
    """Write ``ds`` atomically as a D4RL-style HDF5 file (``.hdf5`` or ``.h5``); metadata as a JSON attribute."""
    h5py = _h5py()
    path = Path(path)
    if path.suffix not in HDF5_SUFFIXES:
        raise ValueError(f"HDF5 dataset files end in {' or '.join(HDF5_SUFFIXES)}, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(ds.metadata)
    meta.setdefault("format_version", FORMAT_VERSION)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("observations", data=ds.observations.astype(np.float32), compression="gzip")
            f.create_dataset("actions", data=ds.actions.astype(np.float32), compression="gzip")
            f.create_dataset("rewards", data=ds.rewards.astype(np.float32), compression="gzip")
            f.create_dataset("terminals", data=ds.terminals.astype(bool))
            f.create_dataset("timeouts", data=ds.timeouts.astype(bool))
            f.attrs["metadata"] = json.dumps(meta)
            if meta.get("env"):
                f.attrs["env"] = str(meta["env"])
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _minari_data_dir(spec: str | os.PathLike) -> Path:
    text = str(spec)
    root = Path(text[len(MINARI_PREFIX):] if text.startswith(MINARI_PREFIX) else text)
    for cand in (root / "data", root):
        if (cand / "main_data.hdf5").exists():
            return cand
    if not root.exists():
        raise FileNotFoundError(f"Minari dataset folder not found: {str(root)!r}")
    raise FileNotFoundError(f"{str(root)!r} is not a Minari dataset folder: expected data/main_data.hdf5 in it "
                            f"(Minari's arrow format is not read here; create the dataset with data_format='hdf5')")


def load_minari(spec: str | os.PathLike) -> OfflineDataset:
    """Read and validate a local Minari dataset (``minari:/path/to/dataset``; module docstring)."""
    h5py = _h5py()
    data = _minari_data_dir(spec)
    source = f"{MINARI_PREFIX}{data.parent if data.name == 'data' else data}"
    info: dict = {}
    if (data / "metadata.json").exists():
        try:
            info = json.loads((data / "metadata.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: data/metadata.json is not valid JSON: {e}") from e
    fmt = info.get("data_format", "hdf5")
    if fmt != "hdf5":
        raise ValueError(f"{source}: data_format {fmt!r} is not read here; accepted: 'hdf5'")
    f = open_hdf5(data / "main_data.hdf5", what=f"the episodes of the Minari dataset {source} (episode_<id> groups)")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in REQUIRED_KEYS}
    cut = 0
    with f:
        names = [n for n in f.keys() if _EPISODE.match(n)]
        if not names:
            raise ValueError(f"{source}: no episode_<id> groups in main_data.hdf5 (found {sorted(f.keys())[:10]})")
        names.sort(key=lambda n: int(_EPISODE.match(n).group(1)))
        expected = info.get("total_episodes")
        if expected is not None and int(expected) != len(names):
            raise ValueError(f"{source}: metadata.json says {expected} episodes, main_data.hdf5 holds {len(names)}")
        for name in names:
            ep = f[name]
            need = ("observations", "actions", "rewards", "terminations", "truncations")
            missing = [k for k in need if k not in ep]
            if missing:
                raise ValueError(f"{source}: {name} lacks {missing}; a Minari episode holds {list(need)}")
            groups = [k for k in ("observations", "actions") if not isinstance(ep[k], h5py.Dataset)]
            if groups:
                raise ValueError(f"{source}: {name}/{groups[0]} is a group (a Dict or Tuple space); only Box "
                                 f"observation and action spaces are read")
            act, rew = ep["actions"][()], ep["rewards"][()]
            term, trunc = ep["terminations"][()].astype(bool), ep["truncations"][()].astype(bool)
            obs = ep["observations"][()]
            T = rew.shape[0]
            if T == 0:
                continue
            if obs.shape[0] not in (T, T + 1) or act.shape[0] != T or term.shape != (T,) or trunc.shape != (T,):
                raise ValueError(f"{source}: {name} has {T} rewards but observations {obs.shape}, actions "
                                 f"{act.shape}, terminations {term.shape}, truncations {trunc.shape} (expected "
                                 f"T + 1 observations and T of the rest)")
            trunc, was_cut = close_cut_episode(term, trunc, source=f"{source} ({name})")
            cut += was_cut
            parts["observations"].append(obs[:T].reshape(T, -1) if obs.ndim == 1 else obs[:T])
            parts["actions"].append(act.reshape(T, -1) if act.ndim == 1 else act)
            parts["rewards"].append(rew.reshape(T))
            parts["terminals"].append(term)
            parts["timeouts"].append(trunc)
    if not parts["rewards"]:
        raise ValueError(f"{source}: every episode is empty (no steps)")
    try:
        arrays = {k: np.concatenate(v) for k, v in parts.items()}
    except ValueError as e:
        raise ValueError(f"{source}: episodes disagree in observation or action size: {e}") from e
    meta = {"source_format": "minari", "dataset_id": info.get("dataset_id"), "minari_version": info.get("minari_version"),
            "algorithm_name": info.get("algorithm_name"), "episodes_marked_timeout": cut}
    try:
        env_id = json.loads(info["env_spec"])["id"] if info.get("env_spec") else None
    except (json.JSONDecodeError, KeyError, TypeError):
        env_id = None
    if env_id:
        meta["env"] = env_id
    return _dataset(arrays, meta, source)
