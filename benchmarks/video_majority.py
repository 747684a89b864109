"""The trivial baseline of the ∞-Video benchmark: always give the most frequent answer of each question type.

The majority answers are counted on the development videos (``benchmarks/results/video_bench_dev/*.json``,
another seed), never on the reported ones, then scored on the reported videos with a paired 95% interval of
each method's accuracy minus the baseline's on the same questions::

    python -m benchmarks.video_majority            # reads video_bench_bounded_last.json, writes ..._majority.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.common import write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def majority_answers(dev_files: list[Path]) -> dict[str, str]:
    """Question type -> its most frequent answer over the development videos (ties: first counted)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    seen: set[str] = set()
    for f in dev_files:
        for key, v in json.loads(f.read_text()).get("videos", {}).items():
            if key in seen:  # the same development video scored under other settings
                continue
            seen.add(key)
            for qt, a in zip(v["qtypes"], v["answers"]):
                counts[qt][str(a)] += 1
    return {qt: c.most_common(1)[0][0] for qt, c in counts.items()}


def score(result: dict, majority: dict[str, str]) -> list[dict]:
    """Per length: the baseline's accuracy, and each method minus the baseline on the same questions."""
    rows = []
    lengths = sorted({k.split("/")[0] for k in result["videos"]}, key=int)
    for length in lengths:
        vids = [v for k, v in result["videos"].items() if k.split("/")[0] == length]
        base = [int(str(a) == majority.get(qt)) for v in vids for qt, a in zip(v["qtypes"], v["answers"])]
        rows.append({"frames": int(length), "method": "majority", "questions": len(base),
                     "accuracy": sum(base) / len(base)})
        for m in result["methods"]:
            marks = [x for v in vids for x in v["runs"][m]["marks"]]
            d = [a - b for a, b in zip(marks, base)]
            n = len(d)
            mu = sum(d) / n
            se = math.sqrt(sum((x - mu) ** 2 for x in d) / (n - 1) / n)
            rows.append({"frames": int(length), "method": m, "questions": n, "accuracy": sum(marks) / n,
                         "minus_majority": mu, "ci_lo": mu - 1.96 * se, "ci_hi": mu + 1.96 * se})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.video_majority", description=__doc__.split("\n\n")[0])
    p.add_argument("--result", type=Path, default=RESULTS / "video_bench_bounded_last.json")
    p.add_argument("--dev", type=Path, default=RESULTS / "video_bench_dev")
    p.add_argument("--out", type=Path, default=None, help="default: <result>_majority.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dev_files = sorted(args.dev.glob("*.json"))
    if not dev_files:
        raise FileNotFoundError(f"no development results in {args.dev}")
    majority = majority_answers(dev_files)
    rows = score(json.loads(args.result.read_text()), majority)
    out = args.out or args.result.with_name(args.result.stem + "_majority.json")
    write_json_atomic(out, {"majority_answers": majority, "dev_files": [f.name for f in dev_files],
                            "result": args.result.name, "rows": rows})
    for r in rows:
        extra = (f"  minus majority {100 * r['minus_majority']:+.1f} ({100 * r['ci_lo']:+.1f}, {100 * r['ci_hi']:+.1f})"
                 if "minus_majority" in r else "")
        print(f"{r['frames']:>6} {r['method']:<18} {r['accuracy']:.3f}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
