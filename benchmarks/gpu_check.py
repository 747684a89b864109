"""Everything a first GPU run must tell us, in one command (<= 9.5 minutes on one GPU)::

    python -m benchmarks.gpu_check benchmarks/results/gpu_check

Steps, each time-boxed, each result written to ``OUT/gpu_check.json`` (atomically) as soon as it ends; a
step that did not run is recorded as ``skipped`` with the reason, one killed at its box as ``timeout`` with
every case it had finished:

1. ``env``: GPU, compute capability, SMs, memory, driver, CUDA, torch, Triton versions, SDPA backends.
2. ``pytest``: ``pytest -m gpu`` over the test files that hold GPU tests (log and JUnit XML in OUT).
3. ``numerics``: the kernels at their production tiles (not the interpreter's): fp16 and bf16 x head dim 64
   and 128 x causal or not x {odd S, S_q < S_k, S_q > S_k, S_q = 1, GQA 8:1, a fully padded row} and
   block-sparse, forward and backward against fp32 math, NaN checks (four processes, one per dtype x D).
4. ``int64``: dense and block-sparse on 288 x 32 x 2048 x 128 bf16 tensors (2.4e9 elements, past 2**31);
   batches 0, 256 (the first whose base offset passes 2**31) and 287 checked against fp32 math.
5. ``bench``: ``benchmarks.attention_gpu --short``: Triton forward and backward TFLOP/s against SDPA-flash
   and FlexAttention at S = 4K-64K, D = 128, bf16; block-sparse at 10 % density against dense; the targets.
6. ``dispatch``: what ``auto`` chooses for typical shapes (facts from meta tensors, so it runs anywhere),
   whether SDPA really takes its fused kernels where the rule counts on them, forced fallbacks.
7. ``hf_bench``: ``benchmarks.hf_attention`` on CUDA in bf16 at S = 32K and 128K: the ``"longctx"``
   transformers backend against transformers' ``sdpa`` and ``eager`` on a random Qwen2 (prefill time, peak
   memory, last-token logits compared). The bf16 parity tests of the bridge (``tests/test_hf_bridge.py``,
   marked ``gpu``) run in step 2.
8. ``tabular_bench``: ``benchmarks.tabular_vs_official --device cuda``: TabICL here against the official
   ``tabicl`` package on the same random v1-size model, 10K-100K train rows x 100 features, fp32: wall time and
   peak CUDA memory ratios (cases past a third of the box are recorded as timeouts).
9. ``comemo_2b``: ``benchmarks.comemo_real_size --device cuda``: a random CoMemo-2B-shaped released checkpoint
   written, converted (``apps.comemo.convert``), loaded (``CoMemo.from_hf``, bf16), one forward and 16 generated
   tokens on two images of 2x2 tiles: seconds and peak CUDA/host memory per step.
10. ``tabular_amp``: ``benchmarks.tabular_amp --device cuda``: the official pipeline here in bf16 autocast (its
    default on CUDA; also with ``kv_cache``) against fp32 here and the official package with and without its
    autocast, on a random published-size v2 model (4,000 train rows): probabilities within 2e-2 of fp32, argmax
    agreement, fit and predict times. Its GPU test (``tests/test_tabular_official_options.py``) runs in step 2.
11. ``video_realsize``: ``benchmarks.video_realsize --device cuda``: a random InstructBLIP-Video at InstructBLIP
    Flan-T5-XL's published sizes (all 39 vision layers, bf16) streams 1K and 4K frames through the ∞-Video memory:
    peak CUDA memory flat in the length, time per frame (the CPU table ran 1K-16K with a cheap frame encoder).

Steps 2, 3, 4, 6 and 10 check correctness and run concurrently (compiling Triton kernels is CPU-bound and the
GPU work there is small); steps 5, 7, 8, 9 and 11 time and run alone after them, one after the other.
``summary.md`` in OUT holds the tables for the README. On a machine without CUDA, steps 1 and 6 run, the others
are recorded as skipped, and the exit code is 0; on a GPU it is 0 when every step ran and passed, else 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import format_table, read_json, write_json_atomic

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("env", "pytest", "numerics", "int64", "bench", "dispatch", "hf_bench", "tabular_bench", "comemo_2b",
         "tabular_amp", "video_realsize")
GPU_STEPS = ("pytest", "numerics", "int64", "bench", "hf_bench", "tabular_bench", "comemo_2b", "tabular_amp",
             "video_realsize")
TIMING_STEPS = ("bench", "hf_bench", "tabular_bench", "comemo_2b", "video_realsize")
#: Seconds each step may take (``--box STEP=S`` overrides); steps 2-4 and 6 overlap, so the total stays
#: under ``--budget-s`` (default 560 s: 9.5 minutes less process start-up).
DEFAULT_BOXES = {"env": 30.0, "pytest": 200.0, "numerics": 200.0, "int64": 150.0, "bench": 230.0, "dispatch": 120.0,
                 "hf_bench": 100.0, "tabular_bench": 60.0, "comemo_2b": 150.0,
                 "tabular_amp": 120.0, "video_realsize": 60.0}  # fmt: skip
#: Train rows of the tabular_bench step (100 features, 1,000 test rows, the published v1 sizes, fp32).
TABULAR_ROWS = "10000,50000,100000"
NUMERICS_SHARDS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    p.add_argument("out_dir", type=Path, nargs="?", help="folder for gpu_check.json, summary.md and the step logs")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--box", action="append", default=[], metavar="STEP=SECONDS", help="a step's time box")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole command")
    p.add_argument("--child", choices=["numerics", "int64", "dispatch"], help=argparse.SUPPRESS)
    p.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)  # a child's code on the CPU interpreter
    return p


# ---------------------------------------------------------------------------------------------- step 1


def environment() -> dict[str, Any]:
    """Versions and the device (no CUDA call when there is no device)."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}  # fmt: skip
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if not info["cuda_available"]:
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(
        gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count(),
        cudnn=torch.backends.cudnn.version(),
        sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                      "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                      "math": torch.backends.cuda.math_sdp_enabled()},
    )  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=15)  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        info["driver"] = info["nvidia_smi"].split(",")[0].strip() if info["nvidia_smi"] else None
    except (OSError, subprocess.TimeoutExpired) as e:
        info["driver"] = None
        info["nvidia_smi_error"] = str(e)
    return info


# ---------------------------------------------------------------------------------------------- jobs


@dataclass(kw_only=True)
class Job:
    """One step (or one shard of it) in its own process, killed with its process group at its box."""

    step: str
    argv: list[str]
    box_s: float
    log: Path
    part: Path | None = None  # the child's incremental record (numerics, int64, dispatch)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("TRITON_INTERPRET", None)  # the production kernels, never the interpreter
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        self.started = time.monotonic()

    def poll(self) -> bool:
        """True once the process has ended (or been killed at its box)."""
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.started > self.box_s:
            self.timed_out = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            return True
        return False

    @property
    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 1)


def _child_job(step: str, out: Path, box: float, shard: str = "0/1") -> Job:
    tag = step if shard == "0/1" else f"{step}_{shard.split('/')[0]}"
    part = out / "parts" / f"{tag}.json"
    if part.exists():
        part.unlink()
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "--child", step, "--part", str(part), "--shard", shard]
    return Job(step=step, argv=argv, box_s=box, log=out / "logs" / f"{tag}.log", part=part)


def gpu_test_files() -> list[str]:
    """Test files that hold ``@pytest.mark.gpu`` tests (collecting only them keeps the step short)."""
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def _pytest_job(out: Path, box: float) -> Job:
    xml = out / "pytest_gpu.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-ra",
            f"--junitxml={xml}", "--timeout", str(int(max(30, box - 10))), *gpu_test_files()]  # fmt: skip
    return Job(step="pytest", argv=argv, box_s=box, log=out / "pytest_gpu.log", extra={"xml": xml})


def _bench_job(out: Path, box: float) -> Job:
    path = out / "attention_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.attention_gpu", "--short", "--out", str(path)]
    return Job(step="bench", argv=argv, box_s=box, log=out / "logs" / "bench.log", extra={"json": path})


def _hf_bench_job(out: Path, box: float) -> Job:
    path = out / "hf_attention_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.hf_attention", "--device", "cuda", "--dtype", "bfloat16", "--sizes",
            "32K,128K", "--quick", "--timeout", str(int(max(10, box - 5))), "--out", str(path)]  # fmt: skip
    return Job(step="hf_bench", argv=argv, box_s=box, log=out / "logs" / "hf_bench.log", extra={"json": path})


def _tabular_bench_job(out: Path, box: float) -> Job:
    path = out / "tabular_vs_official_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.tabular_vs_official", "--device", "cuda", "--arch", "v1", "--rows",
            TABULAR_ROWS, "--repeats", "1", "--timeout", str(int(max(10, box / 3))), "--out", str(path)]  # fmt: skip
    return Job(step="tabular_bench", argv=argv, box_s=box, log=out / "logs" / "tabular_bench.log", extra={"json": path})


def _comemo_2b_job(out: Path, box: float) -> Job:
    path = out / "comemo_real_size_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.comemo_real_size", "--size", "2b", "--device", "cuda", "--out", str(path)]
    return Job(step="comemo_2b", argv=argv, box_s=box, log=out / "logs" / "comemo_2b.log", extra={"json": path})


def _video_realsize_job(out: Path, box: float) -> Job:
    path = out / "video_realsize_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.video_realsize", "--device", "cuda", "--vision-layers", "39", "--frames",
            "1K,4K", "--case-timeout", str(int(max(10, box / 2.2))), "--out", str(path)]  # fmt: skip
    return Job(step="video_realsize", argv=argv, box_s=box, log=out / "logs" / "video_realsize.log",
               extra={"json": path})


def _tabular_amp_job(out: Path, box: float) -> Job:
    path = out / "tabular_amp_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.tabular_amp", "--device", "cuda", "--out", str(path)]
    return Job(step="tabular_amp", argv=argv, box_s=box, log=out / "logs" / "tabular_amp.log", extra={"json": path})


def _junit_summary(xml: Path) -> dict[str, Any]:
    """Counts and failing test ids from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    if not xml.exists():
        return {}
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None
    ]  # fmt: skip
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed_tests": failed[:50]}  # fmt: skip


def _log_tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _finish(job: Job, out: Path) -> dict[str, Any]:
    """A finished job's record: status, seconds, what it produced (paths relative to ``out``)."""
    rc = job.proc.returncode
    rec: dict[str, Any] = {"seconds": job.seconds, "box_s": round(job.box_s, 1), "returncode": rc,
                           "log": str(job.log.relative_to(out))}
    if job.step == "pytest":
        rec["tests"] = _junit_summary(job.extra["xml"])
        ok = rc == 0
    elif job.step == "hf_bench":
        data = read_json(job.extra["json"]) or {}
        rec["rows"] = [{k: r.get(k) for k in ("S", "case", "impl", "status", "median_s", "peak_mb", "reason",
                                              "time_ratio_longctx_over_this", "memory_ratio_longctx_over_this",
                                              "max_abs_diff_vs_longctx")} for r in data.get("rows", [])]  # fmt: skip
        ok = rc == 0 and bool(rec["rows"])
    elif job.step == "tabular_bench":
        data = read_json(job.extra["json"]) or {}
        rec["rows"] = data.get("ratios", [])
        ok = rc == 0 and any("time_ratio" in r for r in rec["rows"])
    elif job.step == "comemo_2b":
        data = read_json(job.extra["json"]) or {}
        rec["steps"] = data.get("steps")
        rec.update({k: data.get(k) for k in ("dtype", "parameters", "prompt_tokens", "peak_rss_gb")})
        ok = rc == 0 and bool(data.get("last_logits_finite")) and len(data.get("generated") or []) == 16
    elif job.step == "tabular_amp":
        data = read_json(job.extra["json"]) or {}
        rec["rows"] = data.get("cases", [])
        ok = rc == 0 and bool(rec["rows"]) and bool(data.get("ok"))
    elif job.step == "video_realsize":
        data = read_json(job.extra["json"]) or {}
        rec["rows"] = [{k: c.get(k) for k in ("frames", "status", "cuda_peak_mb", "ms_per_frame_wall", "reason")}
                       for c in data.get("cases", [])]
        ok = rc == 0 and bool(rec["rows"]) and all(r["status"] == "ok" for r in rec["rows"])
    elif job.step == "bench":
        data = read_json(job.extra["json"]) or {}
        rec["targets"] = data.get("targets")
        rec["rows"] = {k: len(data.get(k, [])) for k in ("dense", "block_sparse")}
        ok = rc == 0
    else:
        part = read_json(job.part) or {"cases": []}
        rec.update(part)
        ok = rc == 0 and bool(part.get("cases")) and all(c.get("ok") for c in part["cases"]) and part.get("ok", True)
    if job.timed_out:
        rec["status"] = "timeout"
    elif rc not in (0, 1) and job.step != "pytest":
        rec["status"] = "error"
    else:
        rec["status"] = "ok" if ok else "failed"
    if rec["status"] != "ok":
        rec["log_tail"] = _log_tail(job.log)
    return rec


def _merge_shards(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the numerics shards: cases joined, the worst status, the longest time."""
    order = ["error", "timeout", "failed", "ok"]
    merged = {"status": min((r["status"] for r in records), key=order.index),
              "seconds": max(r["seconds"] for r in records), "cases": [c for r in records for c in r.get("cases", [])],
              "shards": [{k: v for k, v in r.items() if k != "cases"} for r in records]}  # fmt: skip
    return merged


# ---------------------------------------------------------------------------------------------- summary


def summarize(report: dict[str, Any]) -> str:
    """Markdown: one line per step, then the targets (from the bench step) when there are any."""
    lines = []
    for name in STEPS:
        rec = report["steps"].get(name, {})
        status = rec.get("status", "–")
        what = rec.get("reason", "")
        if name == "env" and status == "ok":
            e = rec["result"]
            what = (f"{e.get('gpu', 'no GPU')}, driver {e.get('driver')}, CUDA {e.get('cuda_runtime')}, "
                    f"torch {e.get('torch')}, triton {e.get('triton')}")  # fmt: skip
        elif name == "pytest" and rec.get("tests"):
            t = rec["tests"]
            what = f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
        elif name in ("numerics", "int64", "dispatch") and "cases" in rec:
            cases = rec["cases"]
            what = f"{sum(bool(c.get('ok')) for c in cases)} of {len(cases)} cases ok"
            if name == "dispatch":
                fb = rec.get("fallbacks", [])
                what += f"; fallbacks: {', '.join(str(f.get('ok', f.get('status'))) for f in fb)}"
        elif name == "bench" and rec.get("targets"):
            t = rec["targets"]
            what = "; ".join(f"{k} {v}" for k, v in t.items() if not isinstance(v, (dict, list)))
        elif name == "hf_bench" and rec.get("rows"):
            what = f"{sum(r.get('status') == 'ok' for r in rec['rows'])} of {len(rec['rows'])} cases ran"
        elif name == "tabular_bench" and rec.get("rows"):
            what = "; ".join(f"{r['rows']} rows: time x{r.get('time_ratio')}, CUDA memory x{r.get('peak_cuda_ratio')}"
                             for r in rec["rows"])
        elif name == "comemo_2b" and rec.get("steps"):
            what = "; ".join(f"{k} {v['seconds']} s, CUDA {v.get('peak_cuda_gb')} GB" for k, v in rec["steps"].items())
        elif name == "tabular_amp" and rec.get("rows"):
            what = "; ".join(f"{r['case']}: max |p - fp32| {r.get('max_abs_diff_vs_here_fp32', float('nan')):.1e}, "
                             f"predict {r.get('predict_s')} s" for r in rec["rows"])
        elif name == "video_realsize" and rec.get("rows"):
            what = "; ".join(f"{r['frames']} frames: {r.get('cuda_peak_mb')} MB CUDA peak, {r.get('ms_per_frame_wall')} "
                             f"ms/frame" for r in rec["rows"])
        lines.append({"step": name, "status": status, "seconds": rec.get("seconds"), "result": what})
    text = format_table(lines, ["step", "status", "seconds", "result"])
    targets = report["steps"].get("bench", {}).get("targets") or {}
    if targets.get("table"):
        text += "\n\n" + format_table(targets["table"], list(targets["table"][0]))
    hf_rows = report["steps"].get("hf_bench", {}).get("rows") or []
    if hf_rows:
        text += "\n\n" + format_table(hf_rows, ["S", "case", "impl", "status", "median_s", "peak_mb",
                                                "time_ratio_longctx_over_this", "memory_ratio_longctx_over_this",
                                                "max_abs_diff_vs_longctx", "reason"])  # fmt: skip
    return text


# ---------------------------------------------------------------------------------------------- main


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _run_child(args) -> int:
    from benchmarks.gpu_check_steps import CHILD_STEPS, PartRecord

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    record = PartRecord(args.part)
    record.save()
    try:
        if args.child == "numerics":
            shard, n = (int(x) for x in args.shard.split("/"))
            CHILD_STEPS["numerics"](record, shard=shard, n_shards=n, dry=args.dry_run)
        elif args.child == "int64":
            CHILD_STEPS["int64"](record, dry=args.dry_run)
        else:
            CHILD_STEPS[args.child](record)
    except Exception as e:  # recorded; the parent reads the part file
        logger.exception("step %s failed", args.child)
        record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        record["ok"] = False
        record.save()
        return 2
    record.save()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _run_child(args)
    if args.out_dir is None:
        build_parser().error("the output folder is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise SystemExit(f"unknown steps {bad}; choose from {list(STEPS)}")
    boxes = dict(DEFAULT_BOXES)
    for item in args.box:
        name, _, sec = item.partition("=")
        if name not in STEPS:
            raise SystemExit(f"--box {item!r}: unknown step {name!r}; choose from {list(STEPS)}")
        try:
            boxes[name] = float(sec)
        except ValueError:
            raise SystemExit(f"--box {item!r}: seconds must be a number") from None
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    report: dict[str, Any] = {"command": "python -m benchmarks.gpu_check " + " ".join(argv or sys.argv[1:]),
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "budget_s": args.budget_s, "steps": {}, "skipped": []}  # fmt: skip

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        report["skipped"] = [n for n, r in report["steps"].items() if r.get("status") == "skipped"]
        write_json_atomic(path, report)

    def skip(name: str, reason: str) -> None:
        report["steps"][name] = {"status": "skipped", "reason": reason}

    for name in STEPS:
        if name not in steps:
            skip(name, "not selected (--steps)")
    # Step 1, in this process.
    t0 = time.monotonic()
    try:
        env = environment()
        report["steps"]["env"] = {"status": "ok", "seconds": round(time.monotonic() - t0, 1), "result": env}
    except Exception as e:
        env = {"cuda_available": False}
        report["steps"]["env"] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    if "env" not in steps:  # still needed to know whether there is a GPU; recorded but marked
        report["steps"]["env"]["note"] = "run anyway: the other steps depend on it"
    save()
    cuda = bool(env.get("cuda_available"))
    if not cuda:
        print("gpu_check: no CUDA device on this machine; steps pytest, numerics, int64, bench, hf_bench, "
              "tabular_bench, comemo_2b, tabular_amp and video_realsize need one "
              "(recorded as skipped); running env and dispatch only.")  # fmt: skip
        for name in GPU_STEPS:
            if name in steps:
                skip(name, "no CUDA device")
        save()

    # Phase A: the correctness steps, concurrently.
    bench_reserve = sum(boxes[n] for n in TIMING_STEPS if cuda and n in steps)
    jobs: list[Job] = []
    for name in ("pytest", "numerics", "int64", "dispatch", "tabular_amp"):
        if name not in steps or report["steps"].get(name, {}).get("status") == "skipped":
            continue
        remaining = deadline - time.monotonic() - bench_reserve
        if remaining < 1:
            skip(name, f"no time left in the {args.budget_s:.0f} s budget")
            continue
        box = min(boxes[name], remaining)
        if name == "pytest":
            jobs.append(_pytest_job(out, box))
        elif name == "numerics":
            jobs += [_child_job("numerics", out, box, f"{i}/{NUMERICS_SHARDS}") for i in range(NUMERICS_SHARDS)]
        elif name == "tabular_amp":
            jobs.append(_tabular_amp_job(out, box))
        else:
            jobs.append(_child_job(name, out, box))
    for job in jobs:
        job.start()
        report["steps"][job.step] = {"status": "running"}
    save()
    shard_records: list[dict[str, Any]] = []
    pending = list(jobs)
    bar = tqdm(total=len(jobs), desc="gpu_check: correctness steps", unit="job", file=sys.stderr)
    while pending:
        time.sleep(0.2)
        for job in [j for j in pending if j.poll()]:
            pending.remove(job)
            bar.update(1)
            rec = _finish(job, out)
            logger.info("step %s: %s in %.1f s", job.step, rec["status"], job.seconds)
            if job.step == "numerics":
                shard_records.append(rec)
                if len(shard_records) == NUMERICS_SHARDS:
                    rec = _merge_shards(shard_records)
                else:
                    continue
            report["steps"][job.step] = rec
            save()
    bar.close()

    # Phase B: timings, alone on the GPU, one after the other.
    for name, make in (("bench", _bench_job), ("hf_bench", _hf_bench_job), ("tabular_bench", _tabular_bench_job),
                       ("comemo_2b", _comemo_2b_job), ("video_realsize", _video_realsize_job)):
        if not (cuda and name in steps):
            continue
        box = min(boxes[name], deadline - time.monotonic())
        if box < 1:
            skip(name, f"no time left in the {args.budget_s:.0f} s budget")
            continue
        job = make(out, box)
        job.start()
        while not job.poll():
            time.sleep(0.5)
        report["steps"][name] = _finish(job, out)
        save()
    report["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary = summarize(report)
    _write_text_atomic(out / "summary.md", summary + "\n")
    save()
    print(summary)
    print(f"\nwrote {path}")
    if not cuda:
        return 0
    return 0 if all(report["steps"][n].get("status") == "ok" for n in steps if n in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
