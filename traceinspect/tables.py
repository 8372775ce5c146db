"""Column helpers shared by the stages: factorizing text columns and building categorical ones.

pandas 3 factorizes an object array of ``str`` by first converting it to its Arrow-backed string type,
which costs ~0.4 us per row; the text columns of a trace (kernel and op names) hold few distinct
values, each usually one shared object, for which a dictionary lookup per row is several times faster.
The text columns the stages add (link: rt_name, op_name, op_path; classify: cls, cls2, cls_evidence)
are categoricals, so that selecting rows of the ~1e6-row kernel table moves integer codes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from traceinspect.saferegex import search

try:  # the same dictionary walk in C (built with the native scanner)
    from traceinspect.load._kineto_scan import factorize as _factorize
except ImportError:  # pragma: no cover - depends on the build
    _factorize = None


def factorize_text(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques) of a column of hashable Python objects (str, bytes, None), codes in order of
    first appearance as :func:`pandas.factorize` numbers them; None is a value of its own here."""
    if isinstance(values, (pd.Series, pd.Index)):
        if values.dtype != object:  # pandas' own string storage factorizes fast (and has no objects yet)
            codes, uniques = pd.factorize(values, use_na_sentinel=False)
            return codes.astype(np.int64, copy=False), np.asarray(uniques, dtype=object)
        values = values.to_numpy(dtype=object)
    arr = values
    if _factorize is not None and isinstance(arr, (np.ndarray, list)):
        items = arr.tolist() if isinstance(arr, np.ndarray) and arr.dtype == object else list(arr)
        buf, uniq = _factorize(items)
        # element by element: tuples must stay elements, not become rows
        return np.frombuffer(buf, dtype=np.int64), np.fromiter(uniq, dtype=object, count=len(uniq))
    seen: dict[Any, int] = {}
    setdefault = seen.setdefault
    codes = np.fromiter((setdefault(v, len(seen)) for v in arr), dtype=np.int64, count=len(arr))
    return codes, np.fromiter(seen, dtype=object, count=len(seen))  # tuples stay elements


def text_values(col: pd.Series) -> np.ndarray:
    """The column as an object array of ``str`` (what ``.astype(str)`` gives), taken from the categories
    of a categorical instead of converting every row; an object column of strings is returned as is."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = np.array([str(c) for c in col.cat.categories] + ["nan"], dtype=object)
        return cats[col.cat.codes.to_numpy()]  # code -1 (missing) -> the last slot, "nan"
    if col.dtype == object and not col.isna().any():  # already Python strings (the loader's columns)
        return col.to_numpy(dtype=object)
    return np.asarray(col.astype(str).to_numpy(dtype=object), dtype=object)


def text_codes(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(codes, texts) with ``texts[codes]`` equal to :func:`text_values` of the column: a categorical's
    own codes (missing: a last slot, "nan", as ``.astype(str)`` writes it), else the texts factorized; a
    test of every row can run once per text."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        texts = np.array([str(c) for c in col.cat.categories] + ["nan"], dtype=object)
        codes = col.cat.codes.to_numpy().astype(np.int64)
        codes[codes < 0] = len(texts) - 1
        return codes, texts
    return factorize_text(text_values(col))


def sorted_text_codes(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes of a text column numbered in the sort order of its texts, and those sorted distinct
    texts: grouping by the codes orders groups as grouping the ``.astype(str)`` column does, without
    building a string per row."""
    codes, raw = text_codes(col)
    labels, inverse = np.unique(raw, return_inverse=True)  # equal texts share one code
    return inverse.reshape(-1)[codes], labels


def unique_text(values: Any) -> list[Any]:
    """Distinct values of a column of hashable Python objects, in order of first appearance (what
    :func:`pandas.unique` gives, without converting the strings first)."""
    arr = values.to_numpy(dtype=object) if isinstance(values, (pd.Series, pd.Index)) else values
    return list(dict.fromkeys(arr.tolist() if isinstance(arr, np.ndarray) else arr))


def combine_codes(*codes: np.ndarray) -> np.ndarray:
    """One code per distinct combination of several integer code columns (each >= 0), numbered in order
    of first appearance: the columns mixed into one integer key (renumbered whenever it could overflow)
    and that key factorized."""
    key = np.zeros(len(codes[0]) if codes else 0, dtype=np.int64)
    top = 0  # the largest key so far
    for c in codes:
        c = np.asarray(c, dtype=np.int64)
        width = int(c.max(initial=0)) + 1
        if (top + 1) * width > 1 << 62:  # renumber before the mixed key could overflow
            key = pd.factorize(key)[0].astype(np.int64, copy=False)
            top = int(key.max(initial=0))
        key = key * width + c
        top = top * width + width - 1
    return pd.factorize(key)[0].astype(np.int64, copy=False)


def dense_codes(keys: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques) of integer keys in [0, bound), uniques in increasing order and codes 0, 1, ... in
    that order (a table of ``bound`` flags where that is small, else a sort)."""
    if bound > 4 * len(keys) + (1 << 16):
        uniq, inv = np.unique(keys, return_inverse=True)
        return inv.reshape(-1).astype(np.int64, copy=False), uniq
    seen = np.zeros(bound, dtype=bool)
    seen[keys] = True
    rank = np.cumsum(seen) - 1
    return rank[keys], np.nonzero(seen)[0]


def per_distinct(values: Any, test: Callable[[Any], Any]) -> np.ndarray:
    """``bool(test(value))`` for every row of a column, calling ``test`` once per distinct value (a regex
    over ~1e6 kernel names that hold a few hundred distinct ones)."""
    arr = values.to_numpy(dtype=object) if isinstance(values, (pd.Series, pd.Index)) else \
        np.asarray(values, dtype=object)
    codes, uniq = factorize_text(arr)
    hit = np.fromiter((bool(test(v)) for v in uniq), dtype=bool, count=len(uniq))
    return hit[codes]


def string_column(codes: np.ndarray, uniques: np.ndarray) -> pd.Categorical:
    """The column ``uniques[codes]`` as a categorical with the distinct strings sorted: filtering and
    grouping a categorical moves integer codes, not strings (the tables have ~1e6 rows and few
    distinct values per text column), and it sorts as its strings do."""
    uniq = np.asarray(uniques, dtype=object)
    if not len(uniq):
        return pd.Categorical.from_codes(np.zeros(0, dtype=np.int64), categories=pd.Index([], dtype=object))
    text = np.array([str(u) for u in uniq], dtype=object)
    order = np.argsort(text, kind="stable")
    cats = np.unique(text[order])  # equal texts share one category
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[order] = np.searchsorted(cats, text[order])
    return pd.Categorical.from_codes(rank[np.asarray(codes, dtype=np.int64)], categories=pd.Index(cats, dtype=object))


def set_object_column(k: pd.DataFrame, col: str, values: np.ndarray) -> None:
    """Set an object column (pandas 3 would convert an object array of str to its string dtype)."""
    k[col] = pd.Series(values, index=k.index, dtype=object, copy=False)


def name_mask(names: pd.Series, include: Any, exclude: Any) -> np.ndarray:
    """Boolean mask of names (kernel names, op paths) matching ``include`` and not ``exclude`` (compiled
    regexes or None), evaluated once per distinct name."""
    def good(nm: Any) -> bool:
        s = str(nm)
        return bool((include is None or search(include, s)) and not (exclude is not None and search(exclude, s)))

    return per_distinct(names, good)


def in_key_order(key: np.ndarray, ts: np.ndarray) -> bool:
    """Whether the rows are ordered by (``key``, ``ts``): the key never decreases, and the time does not
    within one key (as the loader leaves a rank's rows, or one thread's ops)."""
    if len(key) < 2:
        return True
    if not (key[1:] >= key[:-1]).all():
        return False
    later = ts[1:] >= ts[:-1]
    return bool(later.all() or (later | (key[1:] != key[:-1])).all())


def groups(*codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group (one per distinct combination of the integer code columns, each >= 0, numbered in
    order of first appearance) and the first row of every group: a per-row memo evaluated once per
    group, on the row that would have filled it."""
    key = combine_codes(*codes)
    return key, first_rows(key)


def first_rows(codes: np.ndarray) -> np.ndarray:
    """The first row of each code of a column numbered in order of first appearance (0, 1, ...): where
    the running maximum grows (what ``np.unique(codes, return_index=True)[1]`` gives, without sorting)."""
    codes = np.asarray(codes, dtype=np.int64)
    if not len(codes):
        return np.zeros(0, dtype=np.int64)
    top = np.maximum.accumulate(codes)
    return np.flatnonzero(np.concatenate([[True], top[1:] > top[:-1]]))


def text_isin(values: np.ndarray | pd.Series, options: Any) -> np.ndarray:
    """``np.isin(values, options)`` for an object array of text and a few options (class names): one
    hash-table pass, where numpy compares every row with every option. A long column is numbered
    first (:func:`factorize_text`: its rows are a few objects repeated) and each distinct value tested;
    a Series is tested as its :func:`text_values`, once per distinct text (:func:`text_codes`)."""
    if isinstance(values, pd.Series):
        codes, texts = text_codes(values)
        return text_isin(texts, options)[codes]
    if _factorize is not None and isinstance(values, np.ndarray) and values.dtype == object and len(values) > 4096:
        codes, uniq = factorize_text(values)
        return pd.Series(uniq, dtype=object, copy=False).isin(list(options)).to_numpy(dtype=bool)[codes]
    return pd.Series(values, dtype=object, copy=False).isin(list(options)).to_numpy(dtype=bool, copy=True)


def per_combination(fn: Callable[..., Any], *cols: np.ndarray) -> np.ndarray:
    """``fn(*row)`` for every row of the columns (object arrays of hashable values, or integer codes),
    called once per distinct combination of their values: an evidence text built from a row's class,
    its old evidence and the reason, over thousands of rows that hold a few distinct ones."""
    if not len(cols) or not len(cols[0]):
        return np.zeros(0, dtype=object)
    key, first = groups(*(factorize_text(c)[0] if c.dtype == object else pd.factorize(c)[0] for c in cols))
    return np.fromiter((fn(*(c[i] for c in cols)) for i in first.tolist()), dtype=object, count=len(first))[key]
