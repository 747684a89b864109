"""Partially observed tasks: velocities masked out of the observations, in the data and in the environment.

Hopper-v5's 11-dim observation is ``qpos[1:]`` (indices 0..4: torso height and angle, thigh, leg and foot
joint angles) followed by ``qvel`` (indices 5..10: torso x and z velocity, torso angular velocity, the three
joint angular velocities), gymnasium's documented layout. Zeroing 5..10 leaves positions only, so a policy must
infer velocities from its history of observations: a task where which past tokens it attends to matters.

    ds_po = mask_dataset(ds)                          # dataset transform (metadata records the masked dims)
    env = mask_env(make_env("Hopper-v5"))            # the same mask on a live environment
    rollout(model, "Hopper-v5", ..., obs_transform=observation_mask("Hopper-v5"))  # vectorized evaluation

A dataset name ending in ``-po`` (e.g. ``hopper-medium-replay-po``) means this transform of the dataset named
without it (``benchmarks/rl_bench.py``).
"""

from __future__ import annotations

import logging

import numpy as np

from rl.data import OfflineDataset

logger = logging.getLogger(__name__)

__all__ = ["VELOCITY_DIMS", "PO_SUFFIX", "velocity_dims", "observation_mask", "mask_dataset", "mask_env"]

# Zero-based observation indices that are velocities, per environment (gymnasium's -v5 documentation).
VELOCITY_DIMS = {"Hopper-v5": tuple(range(5, 11))}
PO_SUFFIX = "-po"  # dataset-name suffix for the velocity-masked variant


def velocity_dims(env_id: str) -> tuple[int, ...]:
    """The velocity indices of ``env_id``'s observation; ``ValueError`` for an environment without a PO variant."""
    if env_id not in VELOCITY_DIMS:
        raise ValueError(f"no partially observed variant for {env_id!r}; available: {list(VELOCITY_DIMS)}")
    return VELOCITY_DIMS[env_id]


def observation_mask(env_id: str, dims: tuple[int, ...] | None = None):
    """A function ``obs (..., obs_dim) -> copy with dims zeroed`` (default: ``env_id``'s velocity dims)."""
    idx = np.asarray(velocity_dims(env_id) if dims is None else tuple(dims), dtype=np.int64)

    def mask(obs: np.ndarray) -> np.ndarray:
        out = np.array(obs, dtype=np.float32, copy=True)
        out[..., idx] = 0.0
        return out

    return mask


def mask_dataset(ds: OfflineDataset, env_id: str | None = None) -> OfflineDataset:
    """``ds`` with the velocity dims of its environment zeroed (metadata: ``partial_observation``)."""
    env_id = env_id or ds.metadata.get("env")
    dims = velocity_dims(env_id)
    if max(dims) >= ds.obs_dim:
        raise ValueError(f"dataset observations have dim {ds.obs_dim}, too few for {env_id}'s velocity dims {dims}")
    meta = {**ds.metadata, "partial_observation": {"masked_dims": list(dims), "masked": "velocities"}}
    return OfflineDataset(observations=observation_mask(env_id, dims)(ds.observations), actions=ds.actions.copy(),
                          rewards=ds.rewards.copy(), terminals=ds.terminals.copy(), timeouts=ds.timeouts.copy(),
                          metadata=meta)


def mask_env(env, dims: tuple[int, ...] | None = None):
    """``env`` (a gymnasium env) wrapped so that every observation it returns has the velocity dims zeroed."""
    from rl.envs import _gym

    mask = observation_mask(env.spec.id if env.spec is not None else None, dims) if dims is None else \
        observation_mask("", dims)

    class MaskedObservation(_gym().ObservationWrapper):
        def observation(self, observation):
            return mask(observation)

    return MaskedObservation(env)
