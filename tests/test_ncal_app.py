"""apps.ncal faces: shipped models (golden outputs, size, cards), evaluate/predict CLIs, the demo's functions,
and the benchmark's summary statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = REPO / "apps" / "ncal" / "weights"
SHIPPED = ("tmwpl", "pmtd")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_golden_size_and_card(name):
    from apps.ncal.predict import classify

    folder = WEIGHTS / name
    assert (folder / "model.safetensors").stat().st_size < 20 * 2**20
    card = (WEIGHTS / f"{name}.md").read_text(encoding="utf-8")
    assert card.startswith("---\nlicense: mit") and "## Evaluation" in card and "## Limitations" in card
    golden = json.loads((folder / "golden.json").read_text(encoding="utf-8"))  # regenerate: see its "command"
    probs = classify(name, golden["texts"])
    meta = json.loads((folder / "ncal.json").read_text(encoding="utf-8"))
    got = np.array([[p[c] for c in meta["classes"]] for p in probs])
    np.testing.assert_allclose(got, np.array(golden["probs"]), atol=2e-4)


def test_estimator_loads_shipped_model():
    from apps.ncal import NCALClassifier
    from apps.ncal.data import load_split

    clf = NCALClassifier.load("tmwpl")
    te, classes = load_split("tmwpl", "test")
    assert sorted(clf.classes_.tolist()) == sorted(classes)
    pred = clf.predict([e.text for e in te[:60]])
    acc = float(np.mean(pred == np.array([e.label for e in te[:60]])))
    assert acc > 1 / len(classes) + 0.1  # clearly better than chance
    with pytest.raises(FileNotFoundError, match="shipped model name"):
        NCALClassifier.load("nope")


def test_evaluate_cli_matches_recorded_test_metrics(tmp_path):
    from apps.ncal.evaluate import main

    m = main(["--checkpoint", "pmtd", "--data", "pmtd", "--out", str(tmp_path / "m.json")])
    meta = json.loads((WEIGHTS / "pmtd" / "ncal.json").read_text(encoding="utf-8"))
    assert m["n"] == 320 and m["macro_f1"] == pytest.approx(meta["test"]["macro_f1"], abs=1e-6)
    assert np.array(m["confusion"]).sum() == 320
    assert json.loads((tmp_path / "m.json").read_text())["accuracy"] == m["accuracy"]


def test_evaluate_names_the_bad_line(tmp_path):
    from apps.ncal.evaluate import evaluate_checkpoint

    p = tmp_path / "x.jsonl"
    p.write_text('{"question": "1+1=?", "class": "回忆"}\n{"question": "2+2=?", "class": "猜"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="x.jsonl line 2: label '猜'"):
        evaluate_checkpoint("tmwpl", str(p))


def test_predict_cli_subprocess():
    r = subprocess.run([sys.executable, "-m", "apps.ncal.predict", "--checkpoint", "pmtd", "--text", "你会做这道题吗？",
                        "--speaker", "teacher", "--previous", "老师好。", "--previous-speaker", "student", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 1 and abs(sum(out[0].values()) - 1) < 1e-4 and set(out[0]) >= {"I-Q", "R-RR", "U"}
    bad = subprocess.run([sys.executable, "-m", "apps.ncal.predict", "--checkpoint", "pmtd", "--text", "   "],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "empty or whitespace-only" in bad.stderr


def test_demo_functions():
    pytest.importorskip("matplotlib")
    from apps.ncal.ui import EXAMPLE, collapse_figure, curves_figure, examples_for, run_classify

    picks = examples_for("pmtd")
    assert len(picks) == 8 * 3 and all(p[2]["speaker"] in ("teacher", "student") for p in picks)
    lab, true, f = examples_for(EXAMPLE["model"])[EXAMPLE["pick"]]
    probs, status = run_classify(EXAMPLE["model"], f["text"])
    assert status.startswith("Done") and abs(sum(probs.values()) - 1) < 1e-4
    p2, _ = run_classify("pmtd", picks[0][2]["text"], picks[0][2]["speaker"], picks[0][2]["previous"] or "",
                         picks[0][2]["previous_speaker"])
    assert {k.split(" ")[0] for k in p2} == {"I-Q", "I-H", "R-RR", "R-SR", "R-FR", "F-I", "F-F", "U"}
    assert "分析 (Analyze)" in probs
    with pytest.raises(ValueError, match="empty"):
        run_classify("tmwpl", " ")
    assert len(collapse_figure("tmwpl").axes) == 3  # two matrices + colour bar
    assert len(curves_figure("pmtd").axes) == 2


def test_benchmark_summary_and_paired_interval():
    from benchmarks.ncal_bench import paired_t, summarize, summary_markdown

    recs = []
    for s, (ce, tc) in enumerate([(0.50, 0.56), (0.52, 0.55), (0.48, 0.55)]):
        recs.append({"dataset": "d", "method": "ce", "seed": s, "accuracy": ce, "macro_f1": ce, "recall_tail": 0.1})
        recs.append({"dataset": "d", "method": "tc", "seed": s, "accuracy": tc, "macro_f1": tc, "recall_tail": 0.2})
    recs.append({"dataset": "d", "method": "tc", "seed": 9, "accuracy": 0.9, "macro_f1": 0.9})  # unpaired: ignored
    summ = summarize(recs)
    p = summ["paired_tc_minus_ce"]["d"]
    assert p["seeds"] == [0, 1, 2] and p["mean"] == pytest.approx(5.333333, rel=1e-5)
    lo, hi = p["ci95"]
    # t(0.975, 2) = 4.3027; sd of (6, 3, 7) = 2.0817
    assert lo == pytest.approx(5.3333 - 4.3027 * 2.0817 / 3**0.5, abs=1e-3) and hi > p["mean"]
    ce_row = next(r for r in summ["rows"] if r["method"] == "ce")
    assert ce_row["seeds"] == 3 and ce_row["macro_f1"] == pytest.approx(0.5)
    md = summary_markdown(summ)
    assert "| d | ce | – | 3 | 50.0 ± 2.0" in md and "published tc" in md
    assert paired_t([1.0]) is None


def test_benchmark_summary_keeps_epochs_apart():
    """Runs of another length are their own row and are never paired with runs of the benchmark's length."""
    from benchmarks.ncal_bench import summarize, summary_markdown

    recs = [{"dataset": "d", "method": m, "seed": 0, "epochs": 3, "accuracy": f, "macro_f1": f} for m, f in [("ce", 0.5), ("tc", 0.6)]]
    recs += [{"dataset": "d", "method": "la", "seed": s, "epochs": e, "accuracy": f, "macro_f1": f}
             for s, e, f in [(0, 3, 0.6), (1, 4, 0.7), (2, 4, 0.8)]]
    recs.append({"dataset": "d", "method": "tc", "seed": 1, "epochs": 4, "accuracy": 0.9, "macro_f1": 0.9})
    summ = summarize(recs)
    la = {r["epochs"]: r for r in summ["rows"] if r["method"] == "la"}
    assert la[3]["seeds"] == 1 and la[4]["seeds"] == 2 and la[4]["seed_list"] == [1, 2]
    assert la[4]["macro_f1"] == pytest.approx(0.75)
    assert summ["paired_tc_minus_ce"]["d"]["seeds"] == [0]  # tc seed 1 (4 epochs) has no ce partner
    md = summary_markdown(summ)
    assert "| d | la | 3 | 1 | 60.0 |" in md and "| d | la | 4 | 2 | 75.0 ± 7.1 |" in md
