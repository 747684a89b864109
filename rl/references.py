"""Reference returns for normalized scores: ``100 * (R - R_random) / (R_expert - R_random)``.

``D4RL_REFERENCES`` are D4RL's constants (``REF_MIN_SCORE`` / ``REF_MAX_SCORE`` of the ``-v2`` MuJoCo tasks:
random-policy and expert returns). The gymnasium ``-v5`` tasks used here have the same dynamics, rewards and
1000-step limit as the ``-v2`` ones up to small fixes, so scores normalized with these constants are
comparable with published D4RL numbers; this package normalizes with them by default.

The returns of this project's own random and behaviour policies on the ``-v5`` tasks are measured by
``python -m rl.generate`` and stored in each dataset's metadata (``episode_returns``) and in the shipped
behaviour-policy cards (``rl/weights/behaviour_<env>.json``); ``rl/README.md`` lists them beside D4RL's.
"""

from __future__ import annotations

from rl.envs import env_family

__all__ = ["D4RL_REFERENCES", "normalized_score", "reference_returns"]

# family -> (random return, expert return), from D4RL (infos.py, REF_MIN_SCORE / REF_MAX_SCORE).
D4RL_REFERENCES: dict[str, tuple[float, float]] = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}


def reference_returns(env_id: str) -> tuple[float, float]:
    """(random, expert) reference returns of ``env_id``."""
    return D4RL_REFERENCES[env_family(env_id)]


def normalized_score(env_id: str, ret):
    """D4RL-normalized score (0 = random policy, 100 = expert); works on floats and numpy arrays."""
    lo, hi = reference_returns(env_id)
    return 100.0 * (ret - lo) / (hi - lo)
