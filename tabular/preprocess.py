"""Turning a user's table (NumPy or pandas, mixed types, missing values) into a float matrix for the model.

Rules (fitted on the train table, applied unchanged at predict time):

* A column is **categorical** if its pandas dtype is object / string / category / bool, or (NumPy object
  arrays) if its values do not all parse as numbers. Categories are ordinal-encoded in order of first
  appearance-sorted value; missing values get their own code, and categories unseen at fit time map to that
  same "missing/unknown" code.
* A **numeric** column keeps its values; ``±inf`` counts as missing (NaN). Missing numeric cells stay NaN and
  the model imputes the train mean. Datetime and timedelta columns are numeric (nanoseconds).
* Missing means None, NaN, NaT or pandas' NA (the nullable ``boolean``, ``string``, ``Int64``, ``Float64`` dtypes).
* Columns that are entirely missing or constant on the train rows carry no information and are dropped.
* With ``onehot_max_levels`` = L >= 3, a categorical column with 3 to L codes on the train rows (its levels, plus the
  missing code when train cells are missing) becomes one 0/1 column per code instead (still flagged categorical);
  a category unseen at fit time is all zeros unless missing cells were seen at fit (then it is the missing
  indicator, as with codes). Binary columns stay one column. 0 (default): codes for every categorical column.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["TablePreprocessor", "to_frame"]


def to_frame(X):
    """A pandas DataFrame view of ``X`` (DataFrame, NumPy array or list of rows); 2-D required."""
    import pandas as pd

    if isinstance(X, pd.DataFrame):
        return X
    if isinstance(X, pd.Series):
        raise ValueError("X must be 2-D (rows x features); got a pandas Series, use X.to_frame() or reshape")
    arr = np.asarray(X, dtype=object) if not isinstance(X, np.ndarray) else X
    if arr.ndim != 2:
        raise ValueError(f"X must be 2-D (rows x features); got an array of shape {arr.shape}")
    return pd.DataFrame(arr)


def _is_categorical_dtype(s) -> bool:
    import pandas as pd

    dt = s.dtype
    return (
        isinstance(dt, pd.CategoricalDtype)
        or pd.api.types.is_bool_dtype(dt)
        or pd.api.types.is_object_dtype(dt)
        or pd.api.types.is_string_dtype(dt)
    )


def _as_numeric(s):
    """Float64 values of a column, or None when some present value is not a number."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(s.dtype):
        return None
    if pd.api.types.is_numeric_dtype(s.dtype):
        return s.to_numpy(dtype=np.float64, na_value=np.nan)
    try:
        vals = pd.to_numeric(s, errors="raise")
    except (ValueError, TypeError):
        return None
    if any(isinstance(v, (bool, np.bool_)) for v in s.dropna().head(50)):
        return None
    return np.asarray(vals, dtype=np.float64)


@dataclass(kw_only=True)
class TablePreprocessor:
    """Fitted column rules; ``fit_transform`` on train, ``transform`` on new rows."""

    onehot_max_levels: int = 0  # categorical columns with 3..this many codes are one-hot encoded (0: never)
    kinds_: list = field(default_factory=list)  # per input column: "num", "cat", "onehot" or "drop"
    categories_: dict = field(default_factory=dict)  # column index -> {value: code}
    onehot_: dict = field(default_factory=dict)  # column index -> codes that get an indicator column

    def __post_init__(self) -> None:
        m = self.onehot_max_levels
        if not (isinstance(m, (int, np.integer)) and not isinstance(m, bool) and (m == 0 or m >= 3)):
            raise ValueError(f"onehot_max_levels must be 0 (never) or an int >= 3 (most codes of a one-hot "
                             f"encoded column), got {m!r}")

    def _column_values(self, s, j: int, *, fitting: bool) -> np.ndarray:
        import pandas as pd

        kind = self.kinds_[j] if not fitting else None
        if fitting:
            num = None if (_is_categorical_dtype(s) and not pd.api.types.is_object_dtype(s.dtype)) else _as_numeric(s)
            kind = "num" if num is not None else "cat"
            if kind == "num":
                v = num.copy()
                v[~np.isfinite(v)] = np.nan
                return v, kind
            present = s[s.notna()]
            uniq = sorted(pd.unique(present), key=lambda x: (str(type(x)), str(x)))
            self.categories_[j] = {val: float(i) for i, val in enumerate(uniq)}
            return self._encode(s, j), kind
        if kind == "num":
            num = _as_numeric(s)
            if num is None:
                raise ValueError(f"column {s.name!r} was numeric at fit time but holds non-numeric values now")
            v = num.copy()
            v[~np.isfinite(v)] = np.nan
            return v, kind
        return self._encode(s, j), kind

    def _encode(self, s, j: int) -> np.ndarray:
        import pandas as pd

        mapping = self.categories_[j]
        unknown = float(len(mapping))  # missing and unseen categories share one extra code
        # pd.isna covers None, NaN, NaT and pandas' NA (nullable boolean / string / Int64 columns), whose
        # comparisons are not booleans.
        return np.array([unknown if pd.isna(v) else mapping.get(v, unknown) for v in s.tolist()], dtype=np.float64)

    def fit_transform(self, X) -> tuple[np.ndarray, np.ndarray]:
        """Fit the rules on the train table; returns ``(values (n, F') float32, is_categorical (F',) bool)``."""
        df = to_frame(X)
        self.kinds_, self.categories_, self.onehot_ = [], {}, {}
        cols, cats = [], []
        for j in range(df.shape[1]):
            self.kinds_.append(None)
            v, kind = self._column_values(df.iloc[:, j], j, fitting=True)
            finite = v[~np.isnan(v)]
            if finite.size == 0 or np.all(finite == finite[0]) and (kind == "num" or np.all(v == v[0])):
                self.kinds_[j] = "drop"
                continue
            codes = np.unique(v) if kind == "cat" and self.onehot_max_levels else ()  # only when one-hot is on
            if 3 <= len(codes) <= self.onehot_max_levels:
                kind, self.onehot_[j] = "onehot", codes
                cols.extend(self._indicators(v, codes))
                cats.extend([True] * len(codes))
            else:
                cols.append(v)
                cats.append(kind == "cat")
            self.kinds_[j] = kind
        n_dropped = sum(k == "drop" for k in self.kinds_)
        if n_dropped:
            logger.info("dropped %d constant or all-missing column(s)", n_dropped)
        return self._stack(cols, len(df)), np.array(cats, dtype=bool)

    def transform(self, X) -> np.ndarray:
        """Apply the fitted rules to new rows; returns ``(n, F')`` float32."""
        df = to_frame(X)
        if df.shape[1] != len(self.kinds_):
            raise ValueError(f"X has {df.shape[1]} columns but the model was fitted on {len(self.kinds_)}")
        cols = []
        for j in range(df.shape[1]):
            if self.kinds_[j] == "onehot":
                cols.extend(self._indicators(self._encode(df.iloc[:, j], j), self.onehot_[j]))
            elif self.kinds_[j] != "drop":
                cols.append(self._column_values(df.iloc[:, j], j, fitting=False)[0])
        return self._stack(cols, len(df))

    @staticmethod
    def _indicators(v: np.ndarray, codes) -> list:
        return [(v == c).astype(np.float64) for c in codes]

    @staticmethod
    def _stack(cols: list, n: int) -> np.ndarray:
        if not cols:  # nothing informative: one constant column keeps shapes valid
            return np.zeros((n, 1), dtype=np.float32)
        return np.stack(cols, axis=1).astype(np.float32)
