"""Small pieces every multi-process (``torchrun``) training CLI here needs.

- :func:`setup`: rank, world size and device from ``torchrun``'s environment; initialises the process group
  (NCCL on CUDA, gloo on CPU) when there is more than one rank.
- :func:`agreed_stop`: a stop wanted by one rank (time limit, signal) becomes a stop on every rank, so no rank is
  left alone in the next all-reduce.
- :func:`finish`: on a clean finish, wait for every rank, then tear the process group down. Without the barrier a
  rank that is done first closes its connections while another still validates or saves, and gloo can abort
  (``terminate called without an active exception``). After a failure do not call it: the launcher stops the
  other ranks, and a barrier would wait for a rank that never comes.
"""

from __future__ import annotations

import os

import torch

__all__ = ["setup", "agreed_stop", "finish"]


def setup(device_arg: str | None = None) -> tuple[int, int, torch.device]:
    """``(rank, world, device)``: ``device_arg`` (None or ``"auto"``: CUDA when available; a device this machine
    lacks is a one-line ``UsageError``, :func:`core.infra.device.resolve_device`); under ``torchrun`` each rank
    takes the CUDA device of its ``LOCAL_RANK`` and the process group is initialised."""
    from core.infra.device import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(device_arg)
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def agreed_stop(local: bool, device: torch.device | str = "cpu") -> bool:
    """``local`` on a single process; on several, True on every rank when any rank passes True.

    Every rank must call it at the same point of the loop. ``device`` is where the flag lives (a CUDA device
    under NCCL, which reduces CUDA tensors only).
    """
    dist = _dist()
    if dist is None:
        return bool(local)
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def finish() -> None:
    """Barrier, then ``destroy_process_group``; a no-op when no process group is initialised."""
    dist = _dist()
    if dist is None:
        return
    dist.barrier()
    dist.destroy_process_group()
