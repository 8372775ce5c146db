"""The roofline of each kernel with shapes: the time the GPU needs at its peaks, floor = max(FLOPs / dense
peak of the dtype, bytes / memory bandwidth) (``rules/tables/gpus.yaml``), what bounds it (compute,
memory, or latency for a kernel too short to reach either, ``rules/tables/roofline.yaml``) and the share
of that floor the measured time reaches (``pct_roofline`` = floor / measured). One performance model per
op family: GEMMs and memory ops (casts, copies, gathers, fills: bytes in and out) from the efficiency
stage's shape model, attention from :mod:`traceinspect.measure.attention`. A floor is a lower bound: where
a term is unknown (no peak for the dtype), the known one still bounds the time; where the shapes are
unknown there is no floor, never a guessed one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.errors import RuleError

if TYPE_CHECKING:
    from traceinspect.measure.specs import GpuSpec

SETTINGS_FILE = "roofline.yaml"
ROOF_COLUMNS = ("t_compute_us", "t_memory_us", "floor_us", "bound", "pct_roofline")


class RooflineSettings(msgspec.Struct, frozen=True):
    """``rules/tables/roofline.yaml``."""

    latency_us: float = 2.0
    kernel_min_us: float = 0.8


_SETTINGS: list[RooflineSettings] = []


def load_roofline(path: str | None = None) -> RooflineSettings:
    """Read ``rules/tables/roofline.yaml`` (or ``path``); the shipped table once per process."""
    if path is None and _SETTINGS:
        return _SETTINGS[0]
    from traceinspect.resources import settings_document, tables_dir

    try:
        doc = settings_document(SETTINGS_FILE, path)["roofline"]
        s = RooflineSettings(latency_us=float(doc["latency_us"]), kernel_min_us=float(doc["kernel_min_us"]))
        if not (np.isfinite(s.latency_us) and np.isfinite(s.kernel_min_us)) or s.latency_us < 0 or s.kernel_min_us < 0:
            raise ValueError("latency_us and kernel_min_us must be finite numbers >= 0")
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise RuleError(f"unusable roofline settings: {type(e).__name__}: {e}", path or tables_dir() / SETTINGS_FILE) \
            from None
    if path is None:
        _SETTINGS.append(s)
    return s


def _floats(v: Any) -> np.ndarray:
    a = np.asarray(v)
    if a.dtype == object:
        return pd.to_numeric(pd.Series(a), errors="coerce").to_numpy(dtype=float)
    return a.astype(float)


def floors(flops: Any, nbytes: Any, us: Any, peak_tflops: Any, bw_gbps: float | None, compute: Any,
           settings: RooflineSettings | None = None) -> dict[str, np.ndarray]:
    """Per kernel call: compute and memory time at the peaks (us), the floor, the bound and % of roofline.

    ``compute``: whether the call computes (a GEMM or attention: its FLOPs count); a memory op's compute
    term is 0. ``peak_tflops``: the dense peak for each call's dtype (NaN: unknown)."""
    st = settings or load_roofline()
    fl, by, us = _floats(flops), _floats(nbytes), _floats(us)
    peak = _floats(peak_tflops) if np.ndim(peak_tflops) else np.full(len(us), float(peak_tflops))
    comp = np.asarray(compute, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        tc = np.where(comp, np.where(peak > 0, fl / (peak * 1e6), np.nan), 0.0)
        tm = by / (bw_gbps * 1e3) if bw_gbps else np.full(len(us), np.nan)
    tm = np.where(by >= 0, tm, np.nan)
    model = np.fmax(tc, tm)  # NaN only when both are unknown
    # a compute op whose FLOPs are unknown has no floor; one whose peak is unknown keeps the memory term
    model = np.where(comp & ~(fl >= 0), np.nan, model)
    known = np.isfinite(model)
    latency = known & (model < st.latency_us)
    floor = np.where(known, np.fmax(model, np.where(latency, np.fmin(st.kernel_min_us, us), 0.0)), np.nan)
    bound = np.full(len(us), None, dtype=object)
    bound[latency] = "latency"
    decided = known & ~latency & np.isfinite(tc) & np.isfinite(tm)
    bound[decided & (tc >= tm)] = "compute"
    bound[decided & (tc < tm)] = "memory"
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(known & (us > 0), 100.0 * floor / us, np.nan)
    return {"t_compute_us": tc, "t_memory_us": tm, "floor_us": floor, "bound": bound, "pct_roofline": pct}


def apply_to_calls(calls: pd.DataFrame, spec: GpuSpec | None) -> None:
    """Add the roofline columns (:data:`ROOF_COLUMNS`) to the efficiency stage's calls (GEMM: its FLOPs and
    the bytes of weights, activations and output; memory ops: bytes in and out)."""
    if not len(calls):
        for c in ROOF_COLUMNS:
            calls[c] = pd.Series(dtype=object if c == "bound" else float)
        return
    bw = spec.mem_bw_gbps if spec is not None else None
    host = ~np.isfinite(_floats(calls["pct_bw"])) & (calls["kind"].to_numpy() == "memory") & bool(bw)
    out = floors(calls["flops"].to_numpy(), calls["bytes"].to_numpy(), calls["us"].to_numpy(),
                 calls["peak_tflops"].to_numpy(), bw, calls["kind"].to_numpy() == "gemm")
    for c in ROOF_COLUMNS:
        v = out[c]
        if c != "bound":
            v = np.where(host, np.nan, v)  # a host-link copy: PCIe / C2C bounds it, not the device's memory
        else:
            v = v.copy()
            v[host] = None
        calls[c] = v


def weighted_bound(bounds: np.ndarray, weights: np.ndarray) -> str | None:
    """The bound that holds for most of the time (None when undecided calls hold most of it)."""
    if not len(bounds):
        return None
    codes, uniq = pd.factorize(np.asarray(bounds, dtype=object))  # an undecided (None) call: code -1
    w = np.asarray(weights, dtype=np.float64)
    tot = np.bincount(codes + 1, weights=np.where(np.isnan(w), 0.0, w), minlength=len(uniq) + 1).tolist()
    seen = np.bincount(codes + 1, minlength=len(uniq) + 1) > 0
    keys = [None, *uniq.tolist()]
    best = max(((k, t) for k, t, s in zip(keys, tot, seen.tolist(), strict=True) if s),
               key=lambda kv: (kv[1], str(kv[0])))[0]
    return best if isinstance(best, str) else None


def group_roofline(calls: pd.DataFrame, grp: np.ndarray, n: int) -> dict[str, list[Any]]:
    """Per group of calls (``grp``: the group of each call, 0..n-1): floor (the sum; unknown when a call's
    is), bound (the one of most of the time), % of roofline (floor / time), compute and memory time at
    the peaks."""
    us = calls["us"].to_numpy(dtype=float)
    out: dict[str, list[Any]] = {"floor_us": [], "bound": [], "pct_roofline": [], "t_compute_us": [],
                                 "t_memory_us": []}
    if "floor_us" not in calls:
        for v in out.values():
            v.extend([None] * n)
        return out
    fl = calls["floor_us"].to_numpy(dtype=float)
    tc, tm = calls["t_compute_us"].to_numpy(dtype=float), calls["t_memory_us"].to_numpy(dtype=float)
    bd = calls["bound"].to_numpy(dtype=object)
    order = np.argsort(grp, kind="stable")
    cut = np.searchsorted(grp[order], np.arange(n + 1))
    for g in range(n):
        i = order[cut[g]:cut[g + 1]]
        f = fl[i]
        t = float(us[i].sum())
        floor = float(f.sum()) if len(f) and np.isfinite(f).all() else None
        out["floor_us"].append(floor)
        out["pct_roofline"].append(100.0 * floor / t if floor is not None and t > 0 else None)
        out["bound"].append(weighted_bound(bd[i], us[i]) if floor is not None else None)
        out["t_compute_us"].append(float(tc[i].sum()) if len(i) and np.isfinite(tc[i]).all() else None)
        out["t_memory_us"].append(float(tm[i].sum()) if len(i) and np.isfinite(tm[i]).all() else None)
    return out


def kernel_floors(eff: Any) -> pd.Series:
    """Floor (us) per kernel row of the analysis, from the calls with a roofline: a call's floor split over
    its kernel in proportion to time (a call is its op's kernels; the row names its longest one). Kernels
    of attention ops (:attr:`Efficiency.attention_calls`) are included."""
    parts = []
    for c in (getattr(eff, "calls", None), getattr(eff, "attention_calls", None)):
        if isinstance(c, pd.DataFrame) and len(c) and "floor_us" in c:
            f = c.loc[np.isfinite(c["floor_us"].to_numpy(dtype=float)), ["kernel", "floor_us"]]
            parts.append(f)
    if not parts:
        return pd.Series(dtype=float)
    f = pd.concat(parts, ignore_index=True)
    return f.groupby("kernel")["floor_us"].min()


ROOF_ROW = ["floor_us", "bound", "pct_roofline", "intensity", "pct_bw"]


def add_row_roofline(agg: pd.DataFrame, calls: pd.DataFrame, grp: np.ndarray, spec: GpuSpec | None) -> None:
    """The roofline columns of table rows (``grp``: the row of each of ``calls``): floor, bound, % of
    roofline, arithmetic intensity (FLOP per byte) and, where the row has none, % of the memory bandwidth."""
    for c, v in group_roofline(calls, np.asarray(grp), len(agg)).items():
        if c in ("floor_us", "bound", "pct_roofline"):
            agg[c] = pd.Series(v, index=agg.index, dtype=object if c == "bound" else float)
    fl = pd.to_numeric(agg["flops"], errors="coerce").to_numpy(dtype=float) if "flops" in agg else \
        np.zeros(len(agg))
    by = pd.to_numeric(agg["bytes"], errors="coerce").to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["intensity"] = np.where(by > 0, fl / by, np.nan)
        if "pct_bw" not in agg:
            bw = spec.mem_bw_gbps if spec is not None and spec.mem_bw_gbps else np.nan
            us = agg["us"].to_numpy(dtype=float)
            agg["pct_bw"] = np.where(us > 0, 100.0 * by / us / 1e3 / bw, np.nan)


def roof_json(r: Any) -> dict[str, Any]:
    """The roofline fields of one table row in the analysis JSON."""
    from traceinspect.units import json_num

    b = getattr(r, "bound", None)
    return {"floor_us": json_num(getattr(r, "floor_us", None)), "bound": b if isinstance(b, str) else None,
            "pct_roofline": json_num(getattr(r, "pct_roofline", None), 2),
            "intensity": json_num(getattr(r, "intensity", None)), "pct_bw": json_num(getattr(r, "pct_bw", None), 2)}


def class_roofline(kernels: pd.DataFrame, eff: Any, denom: float) -> dict[str, dict[str, Any]]:
    """Per kernel class: the floor per rank per step of its kernels with a floor (``floor_us_per_step``),
    the share of the class's time those kernels take (``roofline_covered_share``) and the % of roofline
    they reach (``pct_roofline``: their floor over their time)."""
    from traceinspect.tables import sorted_text_codes
    from traceinspect.units import json_num

    kf = kernel_floors(eff)
    if not len(kernels):
        return {}
    fl = kf.reindex(kernels.index).to_numpy(dtype=float) if len(kf) else np.full(len(kernels), np.nan)
    dur = kernels["dur"].to_numpy(dtype=float)
    has = np.isfinite(fl)
    codes, labels = sorted_text_codes(kernels["cls"])  # as np.unique of the column's texts orders them
    out: dict[str, dict[str, Any]] = {}
    for j in np.unique(codes).tolist():
        m = codes == j
        tot, cov = float(dur[m].sum()), float(dur[m & has].sum())
        f = float(np.minimum(fl[m & has], dur[m & has]).sum()) if cov > 0 else 0.0
        out[str(labels[j])] = {"floor_us_per_step": json_num(f / denom) if cov > 0 else None,
                               "roofline_covered_share": json_num(cov / tot, 4) if tot > 0 else None,
                               "pct_roofline": json_num(100.0 * f / cov, 2) if cov > 0 else None}
    return out


def gpu_roofs(a: Any) -> tuple[dict[str, float], float | None]:
    """(dense peak TFLOP/s per dtype, peak memory bandwidth in GB/s) of the analysed GPU, from the spec the
    efficiency stage matched (empty / None where the GPU or the figure is not in the table)."""
    eff = a.efficiency
    spec = eff.spec if eff is not None else None
    if spec is None:
        return {}, None
    return dict(spec.peak_tflops), spec.mem_bw_gbps


def floor_us(flops: np.ndarray, nbytes: np.ndarray, peak_tflops: np.ndarray, bw_gbps: float | None) -> np.ndarray:
    """Per rescaled kernel (what-ifs that change a kernel's work: ``gemm-m``, ``batch``): max(FLOPs / peak,
    bytes / bandwidth) in us; a term whose inputs are unknown (NaN, or no figure for the GPU) counts 0, so an
    unknown floor is 0 (no bound)."""
    fl = np.asarray(flops, dtype=np.float64)
    by = np.asarray(nbytes, dtype=np.float64)
    pk = np.asarray(peak_tflops, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        compute = np.where(np.isfinite(fl) & np.isfinite(pk) & (pk > 0) & (fl > 0), fl / (pk * 1e6), 0.0)
        bw = float(bw_gbps) if bw_gbps is not None and np.isfinite(bw_gbps) and bw_gbps > 0 else np.nan
        memory = np.where(np.isfinite(by) & (by > 0) & np.isfinite(bw), by / (bw * 1e3), 0.0)
    return np.maximum(compute, memory)
