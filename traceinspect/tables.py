"""Column helpers shared by the stages: factorizing text columns and building string columns.

pandas 3 factorizes an object array of ``str`` by first converting it to its Arrow-backed string type,
which costs ~0.4 us per row; the text columns of a trace (kernel and op names) hold few distinct
values, each usually one shared object, for which a dictionary lookup per row is several times faster.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def factorize_text(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques) of a column of hashable Python objects (str, bytes, None), codes in order of
    first appearance as :func:`pandas.factorize` numbers them; None is a value of its own here."""
    if isinstance(values, (pd.Series, pd.Index)):
        if values.dtype != object:  # pandas' own string storage factorizes fast (and has no objects yet)
            codes, uniques = pd.factorize(values, use_na_sentinel=False)
            return codes.astype(np.int64, copy=False), np.asarray(uniques, dtype=object)
        values = values.to_numpy(dtype=object)
    arr = values
    seen: dict[Any, int] = {}
    setdefault = seen.setdefault
    codes = np.fromiter((setdefault(v, len(seen)) for v in arr), dtype=np.int64, count=len(arr))
    uniques = np.empty(len(seen), dtype=object)
    uniques[:] = list(seen)
    return codes, uniques


def unique_text(values: Any) -> list[Any]:
    """Distinct values of a column of hashable Python objects, in order of first appearance (what
    :func:`pandas.unique` gives, without converting the strings first)."""
    arr = values.to_numpy(dtype=object) if isinstance(values, (pd.Series, pd.Index)) else values
    return list(dict.fromkeys(arr.tolist() if isinstance(arr, np.ndarray) else arr))


_INFERS_STR = pd.Series(["x"]).dtype != object


def string_column(codes: np.ndarray, uniques: np.ndarray) -> Any:
    """The column ``uniques[codes]`` in the dtype pandas gives string data (``str`` on pandas 3,
    built from a dictionary instead of one conversion per row; object before)."""
    if _INFERS_STR:
        try:
            import pyarrow as pa

            d = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)),
                                               pa.array(list(uniques), type=pa.large_string()))
            return pd.array(d.dictionary_decode(), dtype="str")
        except Exception:  # noqa: BLE001 - any pyarrow/pandas mismatch: the plain way below
            pass
    out = np.empty(len(codes), dtype=object)
    out[:] = uniques[codes] if len(uniques) else ""
    return out
