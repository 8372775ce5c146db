"""The roofline floor a replayed kernel cannot go below: its FLOPs at the GPU's dense peak for its dtype and
its bytes at the GPU's peak memory bandwidth (``rules/tables/gpus.yaml``), whichever takes longer.

Every what-if that rescales a kernel's work (``gemm-m``, ``batch``) bounds the new time by :func:`floor_us`,
so one place decides what a floor is."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis


def gpu_roofs(a: Analysis) -> tuple[dict[str, float], float | None]:
    """(dense peak TFLOP/s per dtype, peak memory bandwidth in GB/s) of the analysed GPU, from the spec the
    efficiency stage matched (empty / None where the GPU or the figure is not in the table)."""
    eff = a.efficiency
    spec = eff.spec if eff is not None else None
    if spec is None:
        return {}, None
    return dict(spec.peak_tflops), spec.mem_bw_gbps


def floor_us(flops: np.ndarray, nbytes: np.ndarray, peak_tflops: np.ndarray, bw_gbps: float | None) -> np.ndarray:
    """Per kernel: max(FLOPs / peak, bytes / bandwidth) in us; a term whose inputs are unknown (NaN, or no
    figure for the GPU) counts 0, so an unknown floor is 0 (no bound)."""
    fl = np.asarray(flops, dtype=np.float64)
    by = np.asarray(nbytes, dtype=np.float64)
    pk = np.asarray(peak_tflops, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        compute = np.where(np.isfinite(fl) & np.isfinite(pk) & (pk > 0) & (fl > 0), fl / (pk * 1e6), 0.0)
        bw = float(bw_gbps) if bw_gbps is not None and np.isfinite(bw_gbps) and bw_gbps > 0 else np.nan
        memory = np.where(np.isfinite(by) & (by > 0) & np.isfinite(bw), by / (bw * 1e3), 0.0)
    return np.maximum(compute, memory)
