"""benchmarks.tabular_bench: aggregates against hand computation, the single-class flag, resuming and the settings
guard, on two tiny tables with cheap models; the tuning budget of benchmarks.tabular_peers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import tabular_peers
from benchmarks.tabular_bench import aggregate, main, per_table, score, targets
from tabular.estimator import TabICLClassifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rec(table, model, acc, split=0, single=False):
    return {"table": table, "model": model, "split": split, "accuracy": acc, "balanced_accuracy": acc,
            "roc_auc": acc, "log_loss": 1 - acc, "single_class": single, "seconds": 0.1}


def test_aggregates_match_hand_computation():
    recs = [_rec("a", "A", 0.9), _rec("a", "A", 0.7, split=1), _rec("a", "B", 0.6), _rec("a", "B", 0.6, split=1),
            _rec("a", "C", 0.7), _rec("a", "C", 0.7, split=1),
            _rec("b", "A", 0.5), _rec("b", "B", 0.5), _rec("b", "C", 0.5, single=True)]
    means = per_table(recs)
    assert means["a", "A"]["accuracy"] == pytest.approx(0.8) and means["a", "A"]["splits"] == 2
    assert means["b", "C"]["single_class_splits"] == 1
    agg = aggregate(means, ["A", "B", "C"], ["a", "b"])
    # table a: A 0.8 > C 0.7 > B 0.6 -> ranks 1, 3, 2; normalized 1, 0, 0.5. table b: a three-way tie -> rank 2, norm 1
    assert agg["A"]["mean_rank"] == pytest.approx((1 + 2) / 2)
    assert agg["B"]["mean_rank"] == pytest.approx((3 + 2) / 2)
    assert agg["C"]["mean_rank"] == pytest.approx((2 + 2) / 2)
    assert agg["A"]["normalized_accuracy"] == pytest.approx(1.0)
    assert agg["B"]["normalized_accuracy"] == pytest.approx(0.5)
    assert agg["C"]["normalized_accuracy"] == pytest.approx(0.75)
    assert agg["A"]["mean_accuracy"] == pytest.approx(0.65) and agg["C"]["single_class_tables"] == ["b"]


def test_target_flags_a_single_class_table_only_where_a_peer_does_better():
    recs = [_rec("a", "TabICL", 0.9), _rec("a", "HistGradientBoosting", 0.8), _rec("a", "LogisticRegression", 0.85),
            _rec("b", "TabICL", 0.6, single=True), _rec("b", "HistGradientBoosting", 0.7),
            _rec("b", "LogisticRegression", 0.5),
            _rec("c", "TabICL", 0.6, single=True), _rec("c", "HistGradientBoosting", 0.6),
            _rec("c", "LogisticRegression", 0.6),
            # d: the same three splits, averaged in another order, differ in the last bit; that is not "better"
            *[_rec("d", "TabICL", a, split=i, single=True) for i, a in enumerate((0.95, 0.955, 0.96))],
            *[_rec("d", "kNN", a, split=i) for i, a in enumerate((0.955, 0.96, 0.95))],
            *[_rec("d", m, 0.9) for m in ("HistGradientBoosting", "LogisticRegression")]]
    assert per_table(recs)["d", "kNN"]["accuracy"] > per_table(recs)["d", "TabICL"]["accuracy"]  # by 1e-16
    t = targets(per_table(recs), ["a", "b", "c", "d"])
    assert t["met"]["mean_vs_hgb"] and t["met"]["mean_vs_lr"]
    assert [s["table"] for s in t["single_class_where_peer_better"]] == ["b"]  # c, d: single class, no peer better
    assert not t["met"]["no_single_class_loss"] and "b (0.600 vs HistGradientBoosting 0.700)" in t["lines"][1]


def test_score_metrics_and_single_class():
    y = np.array(["x", "y", "y", "x"])
    s = score(y, np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]]), np.array(["x", "y"]))
    assert s["accuracy"] == 0.75 and s["balanced_accuracy"] == 0.75 and s["roc_auc"] == 1.0
    assert not s["single_class"]
    one = score(y, np.tile([0.6, 0.4], (4, 1)), np.array(["x", "y"]))
    assert one["single_class"] and one["accuracy"] == 0.5 and one["roc_auc"] == 0.5


@pytest.fixture
def counted(monkeypatch):
    """Cheap models only, plus "Majority" (predicts one class); counts fits per model."""
    from sklearn.dummy import DummyClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    calls: dict[str, int] = {}

    def factories(**kw):
        def counting(name, make):
            def f():
                calls[name] = calls.get(name, 0) + 1
                return make()
            return f
        return {"LogReg": counting("LogReg", lambda: make_pipeline(StandardScaler(), LogisticRegression())),
                "Majority": counting("Majority", lambda: DummyClassifier(strategy="most_frequent"))}

    monkeypatch.setattr(tabular_peers, "model_factories", factories)
    return calls


def test_benchmark_runs_resumes_and_never_reuses_other_settings(tmp_path, counted):
    out = tmp_path / "r.json"
    argv = ["--suite", "report", "--tables", "iris", "wine", "--models", "LogReg", "Majority", "--splits", "2",
            "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert counted == {"LogReg": 4, "Majority": 4}  # 2 tables x 2 splits
    assert res["complete_tables"] == ["iris", "wine"] and not res["failures"]
    means = {(r["table"], r["model"]): r for r in res["per_table"]}
    # aggregates by hand from the per-table means
    for model in ("LogReg", "Majority"):
        other = "Majority" if model == "LogReg" else "LogReg"
        ranks = [1.0 if means[t, model]["accuracy"] > means[t, other]["accuracy"] else 2.0 for t in ("iris", "wine")]
        assert res["aggregates"][model]["mean_rank"] == pytest.approx(np.mean(ranks))
        assert res["aggregates"][model]["normalized_accuracy"] == pytest.approx(np.mean([r == 1.0 for r in ranks]))
    assert res["aggregates"]["Majority"]["single_class_tables"] == ["iris", "wine"]
    assert res["aggregates"]["LogReg"]["single_class_tables"] == []
    assert means["iris", "Majority"]["accuracy"] == pytest.approx(1 / 3)  # 10 of each class in each 30-row test split
    assert res["tables"][0]["test_majority_rate"] == pytest.approx(1 / 3)
    assert "0.333†" in out.with_suffix(".md").read_text()

    # the same settings: everything reused
    counted.clear()
    assert main(argv) == 0 and counted == {}
    # a killed run: a record missing is the only one computed
    rec_file = tmp_path / "r_records" / "LogReg.json"
    recs = json.loads(rec_file.read_text())
    del recs["records"]["wine|1"]
    rec_file.write_text(json.dumps(recs))
    assert main(argv) == 0 and counted == {"LogReg": 1}
    # more splits: only the new split runs; other settings (test size, row cap): nothing is reused
    counted.clear()
    assert main([*argv[:-4], "--splits", "3", "--out", str(out)]) == 0 and counted == {"LogReg": 2, "Majority": 2}
    counted.clear()
    assert main([*argv, "--test-size", "0.3"]) == 0 and counted == {"LogReg": 4, "Majority": 4}
    counted.clear()
    assert main([*argv, "--max-rows", "100"]) == 0 and counted == {"LogReg": 4, "Majority": 4}
    # report-only fits nothing and aggregates only what matches
    counted.clear()
    assert main([*argv, "--test-size", "0.25", "--report-only"]) == 0 and counted == {}
    assert json.loads(out.read_text())["complete_tables"] == []


def test_unknown_names_are_refused(tmp_path, counted):
    with pytest.raises(SystemExit, match="unknown table"):
        main(["--suite", "report", "--tables", "ais", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="unknown model"):
        main(["--suite", "report", "--tables", "iris", "--models", "TabPFN", "--out", str(tmp_path / "r.json")])


def test_tuning_budget_is_the_same_draws_and_uses_only_the_training_data():
    a = tabular_peers.sample_configs(tabular_peers.SPACES["XGBoost"], 10, seed=0)
    assert a == tabular_peers.sample_configs(tabular_peers.SPACES["XGBoost"], 10, seed=0) and len(a) == 10
    assert len({json.dumps(c, sort_keys=True) for c in a}) == 10
    for c in a:
        assert 0.02 <= c["learning_rate"] <= 0.3 and 2 <= c["max_depth"] <= 10 and c["n_estimators"] in (100, 200, 400)
    import pandas as pd

    rng = np.random.default_rng(0)
    X = pd.DataFrame({"a": rng.normal(size=90), "b": pd.Categorical(rng.choice(["p", "q", None], size=90))})
    y = np.where(X["a"] > 0, "yes", "no")
    for name in tabular_peers.GBDTS:
        m = tabular_peers.Tuned(name, n_configs=2, folds=3).fit(X, y)
        assert len(m.cv_accuracy_) == 2 and m.best_params_ in tabular_peers.sample_configs(
            tabular_peers.SPACES[name], 2, seed=0)
        assert list(m.classes_) == ["no", "yes"] and m.predict_proba(X).shape == (90, 2)
        assert np.mean(m.classes_[m.predict_proba(X).argmax(1)] == y) > 0.8
    assert tabular_peers.model_settings("CatBoost-tuned", n_configs=10, folds=3, tabicl_n_estimators=None,
                                        checkpoint=None, finetune_steps=0)["n_configs"] == 10


def _run(suite, accs, seconds=1.0, weights="w"):
    """A tabular_bench results dict holding TabICL (and HistGradientBoosting at 0.5) on tables t0, t1, ..."""
    rows = []
    for i, a in enumerate(accs):
        rows.append({"table": f"t{i}", "model": "TabICL", "accuracy": a, "balanced_accuracy": a, "roc_auc": a,
                     "log_loss": 1 - a, "splits": 3, "single_class_splits": 0, "seconds": seconds})
        rows.append({"table": f"t{i}", "model": "HistGradientBoosting", "accuracy": 0.5, "balanced_accuracy": 0.5,
                     "roc_auc": 0.5, "log_loss": 0.5, "splits": 3, "single_class_splits": 0, "seconds": 0.1})
    return {"suite": suite, "per_table": rows, "settings": {"TabICL": {"weights": weights}}}


def test_dev_choice_takes_the_higher_mean_ties_go_to_the_preferred_and_only_dev_counts(tmp_path):
    from benchmarks.tabular_dev_choices import compare, main as choices_main, sign_test

    a, b = _run("dev", [0.8, 0.7, 0.6, 0.9], weights="A"), _run("dev", [0.7, 0.75, 0.5, 0.9], weights="B")
    c = compare({"a": a, "b": b}, reference="a", prefer="b", splits=3)
    assert c["chosen"] == "a" and c["tables"] == ["t0", "t1", "t2", "t3"]
    vs = c["aggregates"]["b"]["vs_reference"]
    assert (vs["wins"], vs["losses"], vs["ties"]) == (1, 2, 1)
    assert vs["mean_difference"] == pytest.approx((-0.1 + 0.05 - 0.1 + 0) / 4)
    assert vs["ci95"][0] <= vs["mean_difference"] <= vs["ci95"][1]
    assert vs["sign_test_p"] == pytest.approx(1.0) and sign_test(6, 0) == pytest.approx(2 / 64)
    assert c["aggregates"]["a"]["mean_rank"] == pytest.approx((1 + 2 + 1 + 1.5) / 4)
    assert c["settings"] == {"a": {"weights": "A"}, "b": {"weights": "B"}}
    assert c["peer_mean_accuracy"]["HistGradientBoosting"] == pytest.approx(0.5)
    # an exact tie goes to the preferred variant
    assert compare({"a": a, "b": _run("dev", [0.8, 0.7, 0.6, 0.9])}, reference="a", prefer="b", splits=3)["chosen"] == "b"
    # a table one variant has not finished is left out of both
    short = _run("dev", [0.1, 0.1, 0.1])
    assert compare({"a": a, "s": short}, reference="a", prefer="s", splits=3)["tables"] == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match="choices are made on 'dev' only"):
        compare({"a": a, "r": _run("report", [0.9] * 4)}, reference="a", prefer="a", splits=3)
    # the CLI keeps choices already written
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "c.json"
    for name in ("one", "two"):
        assert choices_main(["--choice", name, "--variant", f"a={pa}", "--variant", f"b={pb}", "--reference", "a",
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["choices"]) == ["one", "two"] and res["choices"]["two"]["chosen"] == "a"
    assert "Chosen: a" in out.with_suffix(".md").read_text()


def test_tabicl_kwargs_reach_the_estimator_and_the_settings_only_when_given():
    f = tabular_peers.model_factories(tabicl_kwargs={"softmax_temperature": 1.0, "n_estimators": 2})
    clf = f["TabICL"]()
    assert clf.softmax_temperature == 1.0 and clf.n_estimators == 2
    kw = dict(n_configs=10, folds=3, tabicl_n_estimators=None, checkpoint=None, finetune_steps=0)
    assert tabular_peers.model_settings("TabICL", **kw, tabicl_kwargs={"softmax_temperature": 1.0})["kwargs"] == {
        "softmax_temperature": 1.0, "context": "local"}


def test_a_changed_estimator_default_changes_the_record_fingerprint(monkeypatch):
    """Records made with the old default (global context, no kwargs) are not reused by a run of the new default
    (local), and a run that passes the old value explicitly matches them again."""
    kw = dict(n_configs=10, folds=3, tabicl_n_estimators=None, checkpoint=None, finetune_steps=0)
    settings = lambda k=None: tabular_peers.model_settings("TabICL", **kw, tabicl_kwargs=k)  # noqa: E731
    assert TabICLClassifier().context == "local"
    assert settings()["kwargs"] == {"context": "local"} == settings({"context": "local"})["kwargs"]
    assert "kwargs" not in settings({"context": "global"})  # the fingerprint of the records made before the option
    assert settings({"context": "local", "local_context": 256})["kwargs"] == {"context": "local", "local_context": 256}
    monkeypatch.setattr(tabular_peers, "TABICL_RECORDED_DEFAULTS", {"context": "local"})
    assert "kwargs" not in settings()


def test_records_of_a_parallel_run_are_merged_and_reused(tmp_path, counted):
    base = ["--suite", "report", "--models", "LogReg", "--splits", "1"]
    assert main([*base, "--tables", "iris", "--out", str(tmp_path / "a.json")]) == 0
    assert main([*base, "--tables", "wine", "--out", str(tmp_path / "b.json")]) == 0
    counted.clear()
    assert main([*base, "--tables", "iris", "wine", "--out", str(tmp_path / "a.json"), "--merge-records",
                 str(tmp_path / "b_records"), "--report-only"]) == 0
    assert counted == {} and json.loads((tmp_path / "a.json").read_text())["complete_tables"] == ["iris", "wine"]
    assert sorted(json.loads((tmp_path / "a_records" / "LogReg.json").read_text())["records"]) == ["iris|0", "wine|0"]
