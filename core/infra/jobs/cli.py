"""The options every batch CLI shares (``--shard``, ``--skip-errors``, ``--overwrite``, ``--time-limit``,
``--stale-after``) and the job configuration made from them."""

from __future__ import annotations

import argparse
import logging
import math

logger = logging.getLogger(__name__)


from core.infra.jobs.runner import JobConfig

# ------------------------------------------------------------------------------------------------- CLI


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N`` (for ``--shard``)."""
    try:
        i, n = (int(v) for v in str(text).strip().split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def batch_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a batch CLI: the first paragraph of its module docstring as description, the rest as epilog."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=head, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_job_arguments(p: argparse.ArgumentParser, *, item: str = "item") -> None:
    """The batch-job options every batch CLI shares: ``--shard``, ``--skip-errors``, ``--overwrite``,
    ``--time-limit``, ``--stale-after``."""
    g = p.add_argument_group("batch job")
    g.add_argument("--shard", type=_shard_arg, default=(0, 1), metavar="I/N",
                   help=f"process {item}s I, I+N, I+2N, ... of the sorted list (0-based; for job arrays)")
    g.add_argument("--skip-errors", action="store_true",
                   help=f"record a failed {item} (error or time limit) in the manifest and go on")
    g.add_argument("--overwrite", action="store_true",
                   help="redo outputs made with other settings. Without it a rerun whose settings differ from those "
                        "stored in the existing outputs refuses before any work and names the differences "
                        "(finished outputs with the same settings are always kept)")
    g.add_argument("--time-limit", type=_seconds_arg, default=None, metavar="SECONDS",
                   help=f"per-{item} time limit: each {item} runs in a worker process that is killed past it and the "
                        f"{item} is recorded as failed (default: no limit, {item}s run in this process)")
    g.add_argument("--stale-after", type=_seconds_arg, default=600.0, metavar="SECONDS",
                   help="a lock (OUT/locks/) whose heartbeat is older than this is taken over, on any host; a lock "
                        "of this host whose process is gone is taken over at once (default 600)")


def job_config_from_args(args: argparse.Namespace, out: str, *, progress: bool = True,
                         desc: str = "items") -> JobConfig:
    """A :class:`JobConfig` from the options of :func:`add_job_arguments`."""
    return JobConfig(out=out, shard=args.shard, skip_errors=args.skip_errors, overwrite=args.overwrite,
                     time_limit=args.time_limit, stale_after=args.stale_after,
                     heartbeat=min(30.0, args.stale_after / 4), progress=progress, desc=desc)
