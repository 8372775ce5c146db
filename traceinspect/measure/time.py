"""Where GPU time goes: per-class time per rank and per step, and the top kernels."""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceinspect.tables import factorize_text, groups, text_values


def class_step_time(kernels: pd.DataFrame) -> pd.DataFrame:
    """Kernel time and calls per (rank, step, cls) over the given (analysed) kernels."""
    if not len(kernels):
        return pd.DataFrame(columns=["rank", "step", "cls", "us", "calls"])
    g = kernels.groupby(["rank", "step", "cls"], observed=True, sort=True)["dur"]
    return g.agg(us="sum", calls="count").reset_index()


def class_totals(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, cls): us, calls and share of that rank's kernel time (shares sum to 1 per rank)."""
    if not len(kernels):
        return pd.DataFrame(columns=["rank", "cls", "us", "calls", "share"])
    t = kernels.groupby(["rank", "cls"], observed=True)["dur"].agg(us="sum", calls="count").reset_index()
    t["share"] = t["us"] / t.groupby("rank")["us"].transform("sum")
    return t.sort_values(["rank", "us"], ascending=[True, False]).reset_index(drop=True)


def top_kernels(kernels: pd.DataFrame, n: int = 25) -> pd.DataFrame:
    """The kernels with the most time across all analysed ranks and steps, one row per (name, class):
    launches of one name that got different classes (by the evidence of their launching op) are rows of
    their own, as every output lists them."""
    if not len(kernels):
        return pd.DataFrame(columns=["name", "cls", "calls", "us", "mean_us", "share"])
    total = kernels["dur"].sum()
    ncodes, names = factorize_text(kernels["name"])  # grouped on integer codes, then named and sorted
    ccodes, classes = factorize_text(text_values(kernels["cls"]))
    key, first = groups(ncodes, ccodes)
    # one groupby per column: what a named aggregation computes, without its per-call overhead (half the time)
    dur = kernels["dur"].groupby(key, sort=False).agg(["count", "sum", "mean"])
    rows = first[dur.index.to_numpy()]
    t = pd.DataFrame({"name": names[ncodes[rows]], "cls": classes[ccodes[rows]], "calls": dur["count"].to_numpy(),
                      "us": dur["sum"].to_numpy(), "mean_us": dur["mean"].to_numpy()})
    t = t.sort_values(["name", "cls"], kind="stable")
    t["share"] = t["us"] / total if total else 0.0
    return t.sort_values("us", ascending=False, kind="stable").head(n).reset_index(drop=True)


def percentile(values: np.ndarray | pd.Series, q: float) -> float:
    """A percentile that returns NaN (not an error) for no values."""
    arr = np.asarray(values, dtype=np.float64)
    return float(np.percentile(arr, q)) if len(arr) else float("nan")
