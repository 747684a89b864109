"""apps.ncal faces: shipped models (golden outputs, size, cards), data rows as inputs, evaluate/predict CLIs, the
demo's functions, and the benchmark's summary statistics."""

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
    assert card.startswith('---\nlicense: "mit"') and "## Evaluation" in card and "## Limitations" in card
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

    assert main(["--checkpoint", "pmtd", "--data", "pmtd", "--out", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    meta = json.loads((WEIGHTS / "pmtd" / "ncal.json").read_text(encoding="utf-8"))
    assert m["n"] == 320 and m["macro_f1"] == pytest.approx(meta["test"]["macro_f1"], abs=1e-6)
    assert np.array(m["confusion"]).sum() == 320


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


def _shipped_rows(name: str, n_per: int = 1) -> list[dict]:
    """The first ``n_per`` rows of each class of a shipped test split, as the JSONL holds them."""
    from apps.ncal.data import DATA_DIR, resolve_dataset

    per: dict[str, int] = {}
    rows = []
    for line in open(DATA_DIR / resolve_dataset(name).test, encoding="utf-8"):
        r = json.loads(line)
        if per.get(r["class"], 0) < n_per:
            per[r["class"]] = per.get(r["class"], 0) + 1
            rows.append(r)
    return rows


def _formatted(name: str, r: dict) -> str:
    """The model input of a shipped row, written out with format_turn (previous turn + the turn, with speakers)."""
    from apps.ncal.data import format_turn

    if name == "tmwpl":
        return r["question"].strip()
    (prev_who, prev), (who, _) = (next(iter(t.items())) for t in r["dialog_history"][:2])
    return format_turn(r["dialog_content"], speaker=who, previous=prev, previous_speaker=prev_who)


@pytest.mark.parametrize("name", SHIPPED)
def test_rows_predict_as_the_strings_training_made(name):
    from apps.ncal import NCALClassifier

    clf = NCALClassifier.load(name)
    rows = _shipped_rows(name)
    strings = [_formatted(name, r) for r in rows]
    want = clf.predict_proba(strings)
    np.testing.assert_allclose(clf.predict_proba(rows), want, atol=1e-6)
    assert (clf.predict(rows) == clf.predict(strings)).all()
    assert clf.predict(rows[0]).tolist() == clf.predict(strings[:1]).tolist()  # one row alone
    pd = pytest.importorskip("pandas")
    np.testing.assert_allclose(clf.predict_proba(pd.DataFrame(rows)), want, atol=1e-6)
    if name == "pmtd":  # the bare turn is a different input: rows must not be read as their text alone
        assert np.abs(clf.predict_proba([r["dialog_content"] for r in rows]) - want).max() > 1e-3
        with pytest.raises(ValueError, match=r"row 1: missing field 'dialog_history'.*Accepted: strings.*PMTD rows"):
            clf.predict([rows[0], {"dialog_content": rows[1]["dialog_content"]}])
        with pytest.raises(ValueError, match="row 0: missing field 'dialog_content'"):
            clf.predict([{"question": "一加一等于几？"}])
    else:
        with pytest.raises(ValueError, match="row 0: missing field 'question'.*TMWPL rows"):
            clf.predict([{"dialog_content": "好", "dialog_history": []}])


def test_predict_cli_takes_a_jsonl_file_of_rows(tmp_path, capsys):
    from apps.ncal.predict import classify, main

    rows = _shipped_rows("pmtd")[:4]
    del rows[2]["class"]  # unlabelled rows are what one predicts
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert main(["--checkpoint", "pmtd", "--rows", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = classify("pmtd", [_formatted("pmtd", r) for r in rows])
    assert len(out) == 4
    for got, exp in zip(out, want):
        assert got.keys() == exp.keys() and all(abs(got[c] - exp[c]) < 1e-6 for c in got)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0], ensure_ascii=False) + '\n{"dialog_content": "好的。"}\n', encoding="utf-8")
    assert main(["--checkpoint", "pmtd", "--rows", str(bad), "--json"]) == 1  # the good row is still answered
    res = capsys.readouterr()
    assert "bad.jsonl line 2: missing field 'dialog_history'" in res.err and json.loads(res.out)[1] is None
    with pytest.raises(SystemExit):
        main(["--checkpoint", "pmtd", "--rows", str(p), "--speaker", "teacher"])


def test_demo_takes_a_pasted_row():
    from apps.ncal.ui import run_classify

    row = _shipped_rows("pmtd")[0]
    (prev_who, prev), (who, _) = (next(iter(t.items())) for t in row["dialog_history"][:2])
    by_fields, _ = run_classify("pmtd", row["dialog_content"], who, prev, prev_who)
    by_row, status = run_classify("pmtd", json.dumps(row, ensure_ascii=False))
    assert by_row.keys() == by_fields.keys() and all(abs(by_row[c] - by_fields[c]) < 1e-6 for c in by_row)
    assert "data row" in status
    with pytest.raises(ValueError, match="missing field 'dialog_history'"):
        run_classify("pmtd", '{"dialog_content": "好的。"}')
