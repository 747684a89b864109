"""Run every CPU benchmark in turn (``make bench``); each writes its JSON under ``benchmarks/results/``.

Each benchmark runs as its own subprocess so one failure is recorded and the next one still runs.
``--quick`` passes ``--quick`` to every script (a smoke run of minutes instead of hours).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

#: name -> extra arguments of its full CPU run. The GPU benchmark (attention_gpu) is not listed: it needs CUDA.
CPU_BENCHMARKS: dict[str, list[str]] = {
    "attention_cpu": ["--threads", "1", "--clock", "cpu"],
    "tabular_bench": [],
    "tabular_scaling": [],
    "pathology_efficiency": [],
    "pathology_accuracy": [],
    "video_bench": [],
    "rl_bench": [],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_cpu", description=__doc__)
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (smoke run)")
    p.add_argument("--only", nargs="+", choices=sorted(CPU_BENCHMARKS), help="run only these benchmarks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    names = args.only or list(CPU_BENCHMARKS)
    status: dict[str, str] = {}
    for name in names:
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *CPU_BENCHMARKS[name]]
        if args.quick:
            cmd.append("--quick")
        logger.info("running %s", " ".join(cmd[1:]))
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        status[name] = f"{'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s"
    print("\nbenchmark                 status")
    for name, s in status.items():
        print(f"{name:<25} {s}")
    return 0 if all(s.startswith("ok") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
