"""benchmarks.tabular_learning_curve: nested stratified subsets, resuming without refitting, the reserved suite and
bad arguments refused, variants passed to the estimator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import tabular_bench, tabular_learning_curve as lc

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_subsets_are_nested_stratified_and_keep_every_class():
    rng = np.random.default_rng(0)
    y = rng.choice(["a", "b", "c", "rare"], p=[0.6, 0.3, 0.095, 0.005], size=2000)
    y[:3] = "rare"
    sizes = [8, 64, 512, None]
    subs = lc.nested_subsets(y, sizes, seed=1)
    assert len(subs[None]) == len(y) and len(subs[512]) == 512 and len(subs[8]) == 8
    for small, big in [(8, 64), (64, 512), (512, None)]:
        assert set(subs[small]) <= set(subs[big])
    assert set(y[subs[8]]) == {"a", "b", "c", "rare"}  # every class, even at 8 rows
    for c in ("a", "b", "c"):  # proportions within a row or two of the table's
        expected = 512 * np.mean(y == c)
        assert abs(np.sum(y[subs[512]] == c) - expected) <= 2.5
    # another seed, another subset; the same seed, the same subset
    assert not np.array_equal(lc.nested_subsets(y, [64], seed=2)[64], subs[64])
    assert np.array_equal(lc.nested_subsets(y, [64], seed=1)[64], subs[64])


def test_arguments_are_checked():
    assert lc.parse_sizes("256, 1024,all") == [256, 1024, None]
    with pytest.raises(SystemExit, match="row counts or 'all'"):
        lc.parse_sizes("256,many")
    with pytest.raises(SystemExit, match="at least 8"):
        lc.parse_sizes("4")
    assert lc.parse_variant('ctx={"max_context": 1024}') == ("ctx", {"max_context": 1024})
    with pytest.raises(SystemExit, match="NAME=JSON"):
        lc.parse_variant('{"max_context": 1024}')
    with pytest.raises(SystemExit, match="object"):
        lc.parse_variant("ctx=[1]")
    with pytest.raises(SystemExit):  # the reserved tables are kept out of every diagnosis
        lc.main(["--suite", "reserved", "--tables", "ais", "--out", "x.json"])


def test_runs_resumes_and_reports(tmp_path, monkeypatch):
    calls = []
    real = tabular_bench.run_one

    def counting(make, X, y, tr, te, classes):
        calls.append(len(tr))
        return real(make, X, y, tr, te, classes)

    monkeypatch.setattr(tabular_bench, "run_one", counting)
    out = tmp_path / "c.json"
    argv = ["--tables", "crabs", "--sizes", "32,64,10000,all", "--splits", "2", "--models", "LogisticRegression",
            "kNN", "--reference", "LogisticRegression", "--out", str(out)]
    assert lc.main(argv) == 0
    # 10000 rows is more than the 160-row split: measured once, as 'all'
    assert sorted(calls) == sorted([32, 32, 64, 64, 160, 160] * 2)
    res = json.loads(out.read_text())
    means = {(m["table"], m["model"], m["size"]): m for m in res["summary"]["means"]}
    assert set(res["summary"]["size_labels"]) == {"32", "64", "all"}
    assert means["crabs", "kNN", "all"]["splits"] == 2
    gap = {(g["model"], g["size"]): g["mean_gap"] for g in res["summary"]["gaps_to_reference"]}
    assert gap["kNN", "64"] == pytest.approx(means["crabs", "kNN", "64"]["accuracy"]
                                             - means["crabs", "LogisticRegression", "64"]["accuracy"])
    assert "## crabs" in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()
    # rerun: nothing refitted; another test size: everything refitted
    calls.clear()
    assert lc.main(argv) == 0 and calls == []
    assert lc.main([*argv, "--test-size", "0.25"]) == 0 and len(calls) == 12


def test_variants_reach_the_estimator_at_the_full_size_only(tmp_path, monkeypatch):
    from benchmarks import tabular_peers

    seen = []
    real = tabular_peers.model_factories

    def factories(**kw):
        out = real(**{k: v for k, v in kw.items() if k != "tabicl_kwargs"})
        if kw.get("tabicl_kwargs"):
            seen.append(kw["tabicl_kwargs"])
            out["TabICL"] = out["LogisticRegression"]  # cheap stand-in; the kwargs are what is checked
        return out

    monkeypatch.setattr(tabular_peers, "model_factories", factories)
    out = tmp_path / "v.json"
    assert lc.main(["--tables", "crabs", "--sizes", "32,all", "--splits", "1", "--models", "LogisticRegression",
                    "--variant", 'ctx64={"max_context": 64}', "--reference", "LogisticRegression",
                    "--out", str(out)]) == 0
    assert seen == [{"max_context": 64}]
    res = json.loads(out.read_text())
    sizes = {m["size"] for m in res["summary"]["means"] if m["model"] == "ctx64"}
    assert sizes == {"all"} and res["settings"]["ctx64"]["kwargs"] == {"context": "local", "max_context": 64}  # + the changed default
    with pytest.raises(SystemExit, match="is not a file"):
        lc.main(["--tables", "crabs", "--models", "kNN", "--variant", 'w={"checkpoint": "no/such.safetensors"}',
                 "--out", str(out)])
    with pytest.raises(SystemExit, match="clash"):
        lc.main(["--tables", "crabs", "--models", "kNN", "--variant", 'kNN={"max_context": 64}', "--out",
                 str(out)])
