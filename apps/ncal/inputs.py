"""What an NCAL classifier reads: texts already formatted, or the datasets' own rows, formatted as training did.

A checkpoint's ``ncal.json`` records the data it was trained on (``dataset``) and the PMTD context
(``context``). :func:`row_layout` reads from it the layout a row must have, and :func:`model_inputs` turns what a
user gives into the model's input texts:

- a string is taken as a model input already formatted and passed on unchanged (for a PMTD model: as
  :func:`apps.ncal.data.format_turn` makes it, previous turn and speakers included);
- a dict is one row of the layout the model was trained on, formatted by :func:`apps.ncal.data.format_record`
  with the model's context: for the shipped ``pmtd`` model ``{"dialog_content": ..., "dialog_history": [...]}``,
  for ``tmwpl`` ``{"question": ...}``; a model trained on a user JSONL file reads either layout, by each row's
  text field, as training read the file. Other keys (``id``, ``class``) are ignored;
- a pandas DataFrame is its rows (a cell that is missing, ``NaN`` or ``None``, is a missing field).

A model fitted on texts in memory (:meth:`NCALClassifier.fit`, ``dataset`` ``"user"``) records no row layout and
takes strings only.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from apps.ncal.data import DATASETS, check_texts, format_record

__all__ = ["row_layout", "model_inputs", "accepted"]

#: ``ncal.json`` ``dataset`` of a model fitted on texts in memory (:meth:`NCALClassifier.fit`).
FITTED_ON_TEXTS = "user"


def row_layout(meta: dict) -> str | None:
    """The row layout of a checkpoint's ``ncal.json``: ``"tmwpl"`` / ``"pmtd"`` for a model trained on a shipped
    set, ``"keys"`` for one trained on a JSONL file, None for one fitted on texts (no rows accepted)."""
    dataset = meta.get("dataset")
    if dataset is None or dataset == FITTED_ON_TEXTS:
        return None
    return str(dataset).lower() if str(dataset).lower() in DATASETS else "keys"


def accepted(layout: str | None) -> str:
    """What :func:`model_inputs` accepts for ``layout``, in words (for error messages)."""
    texts = "strings (model inputs already formatted, as apps.ncal.data.format_turn makes dialogue turns)"
    if layout is None:
        return f"{texts} only: this model was fitted on texts and records no row layout"
    rows = {"tmwpl": "TMWPL rows {'question': ...}",
            "pmtd": "PMTD rows {'dialog_content': ..., 'dialog_history': [{'student': ...}, {'teacher': ...}, ...]}",
            "keys": "TMWPL rows {'question': ...} or PMTD rows {'dialog_content': ..., 'dialog_history': [...]}"}
    return f"{texts}, or {rows[layout]} as dicts, a list of them or a pandas DataFrame"


def _is_missing(v) -> bool:
    if v is None:
        return True
    pd = sys.modules.get("pandas")
    return pd is not None and pd.api.types.is_scalar(v) and bool(pd.isna(v))


def model_inputs(X, *, layout: str | None, context: str = "past") -> list[str]:
    """Model input texts from strings, rows (dicts) or a DataFrame of rows, in order (module docs).

    Args:
        X: a list (or other iterable) of strings and/or row dicts, one row dict, or a pandas DataFrame.
        layout: :func:`row_layout` of the model.
        context: the model's PMTD context (``ncal.json`` ``context``).

    Raises:
        ValueError: a row missing a field its layout needs (named, with the row's index and what is accepted), an
            item that is neither a string nor a dict, an empty text, no items.
    """
    pd = sys.modules.get("pandas")
    if isinstance(X, Mapping):
        X = [X]
    elif pd is not None and isinstance(X, pd.DataFrame):
        X = [{k: v for k, v in r.items() if not _is_missing(v)} for r in X.to_dict("records")]
    elif isinstance(X, (str, bytes)):
        return check_texts(X)  # raises: a single string is ambiguous (wrap it in a list)
    items = []
    for i, x in enumerate(X):
        if isinstance(x, Mapping):
            if layout is None:
                raise ValueError(f"row {i}: a dict was given; accepted: {accepted(layout)}")
            try:
                x = format_record(dict(x), layout=layout, context=context, where=f"row {i}")
            except ValueError as err:
                raise ValueError(f"{err}. Accepted: {accepted(layout)}") from None
        elif not isinstance(x, (str, bytes)):
            raise ValueError(f"item {i}: expected a string or a row dict, got {type(x).__name__}; "
                             f"accepted: {accepted(layout)}")
        items.append(x)
    return check_texts(items)
