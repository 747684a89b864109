"""``core.infra.distributed`` on two CPU processes (gloo): a stop one rank wants is a stop on every rank; ``finish``
tears the group down."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from core.infra.distributed import agreed_stop, finish


def _stop_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results.put((rank, agreed_stop(rank == 1), agreed_stop(False)))
    finish()
    results.put((rank, dist.is_initialized()))


@pytest.mark.slow
def test_max_minutes_stop_is_agreed_by_every_rank():
    """One rank past --max-minutes stops them all (a rank stopping alone would leave the others in an all-reduce)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_stop_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in range(2 * len(procs)))
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, False), (0, True, False), (1, False), (1, True, False)]
    assert all(p.exitcode == 0 for p in procs)


def test_single_process_is_a_pass_through():
    assert agreed_stop(True) is True and agreed_stop(False) is False
    finish()  # no process group: nothing to do
