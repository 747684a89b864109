"""Environment helpers: the supported MuJoCo tasks, created lazily through gymnasium."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_ENVS", "make_env", "make_vector_env", "env_family"]

# gymnasium ids this package generates data for and evaluates on (MuJoCo through gymnasium >= 1.0).
SUPPORTED_ENVS = ("Hopper-v5", "HalfCheetah-v5", "Walker2d-v5")


def _gym():
    # Offscreen MuJoCo rendering without a display needs EGL; MuJoCo reads MUJOCO_GL when first imported.
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import gymnasium as gym
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("rl needs gymnasium[mujoco]: pip install 'longctx-suite[rl]'") from e
    return gym


def _load_triton_before_gl() -> None:
    """Load Triton (if installed) before the first offscreen GL context.

    EGL through Mesa's llvmpipe loads the system's libLLVM; Triton's extension carries its own LLVM. Loaded
    in that order, a later ``import triton`` (which torch itself does, e.g. on the first ``torch.optim``
    optimizer after ``torch._dynamo`` comes in) crashes the process with a segmentation fault; loaded the
    other way round both work. A hub that renders an episode and then runs another app relies on this.
    """
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - Triton absent or broken: nothing to protect
        pass


def env_family(env_id: str) -> str:
    """``"Hopper-v5" -> "hopper"`` (the key of the reference-return tables)."""
    if env_id not in SUPPORTED_ENVS:
        raise ValueError(f"unknown environment {env_id!r}; supported: {list(SUPPORTED_ENVS)}")
    return env_id.split("-")[0].lower()


def make_env(env_id: str, *, render_mode: str | None = None, width: int = 320, height: int = 240):
    """One environment. ``render_mode="rgb_array"`` renders offscreen (set ``MUJOCO_GL=egl`` on a headless CPU)."""
    env_family(env_id)
    kw = {"render_mode": render_mode}
    if render_mode == "rgb_array":
        kw.update(width=width, height=height)
        _load_triton_before_gl()
    return _gym().make(env_id, **kw)


def make_vector_env(env_id: str, num_envs: int):
    """``num_envs`` copies stepped together (synchronously, in this process)."""
    env_family(env_id)
    if num_envs <= 0:
        raise ValueError(f"num_envs must be positive, got {num_envs}")
    gym = _gym()
    return gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)])
