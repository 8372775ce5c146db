"""The class coverage table ``traceinspect classify`` prints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    pass


# ----------------------------------------------------------------------------- coverage table


def class_table_rows(kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per (kernel name, class): name, cls, cls2 and evidence (the most common), calls, us, share
    (of all kernel time); sorted by time, largest first."""
    cols = ["name", "cls", "cls2", "evidence", "calls", "us", "share"]
    if not len(kernels) or "cls" not in kernels:
        return pd.DataFrame(columns=cols)
    k = kernels
    total = float(k["dur"].sum()) or 1.0
    g = k.groupby(["name", "cls"], sort=False, dropna=False, observed=True)
    out = g.agg(calls=("dur", "size"), us=("dur", "sum")).reset_index()
    out["cls2"] = g["cls2"].agg(_most_common).to_numpy()  # (one row per class, as every output keys kernels)
    out["evidence"] = g["cls_evidence"].agg(_most_common).to_numpy()
    out["share"] = out["us"] / total
    return out[cols].sort_values("us", ascending=False, kind="stable").reset_index(drop=True)


def _most_common(values: Iterable[str]) -> str:
    c = Counter(v for v in values if isinstance(v, str))
    return c.most_common(1)[0][0] if c else ""
