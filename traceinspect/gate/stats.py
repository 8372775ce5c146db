"""The gate's noise test: a one-sided Mann-Whitney U test on per-step samples.

H0: a candidate step is no slower than a baseline step; H1: candidate samples are stochastically
larger (slower). With few samples (at most ``EXACT_MAX_PERMUTATIONS`` ways to split the pooled
samples) the p-value is exact: U is computed for every split of the pooled samples, which also
handles ties exactly. Otherwise the normal approximation with tie correction and continuity
correction is used. Fewer than ``MIN_SAMPLES`` samples on either side, or sample sizes whose
smallest attainable p-value is not below alpha (3 vs 3 at alpha 0.05: 1/20): the test cannot decide,
and the threshold and floor alone decide.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_SAMPLES = 3
DEFAULT_ALPHA = 0.05
EXACT_MAX_PERMUTATIONS = 20_000


@dataclass(frozen=True)
class NoiseTest:
    """Outcome of the noise test for one metric."""

    decided: bool  # False: too few samples; the threshold and floor alone decide
    significant: bool | None  # None when not decided
    p_value: float | None
    method: str  # 'mann-whitney-exact' | 'mann-whitney-normal' | 'none'
    n_base: int
    n_cand: int
    alpha: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "test": self.method, "decided": self.decided, "significant": self.significant,
            "p_value": None if self.p_value is None else round(self.p_value, 6),
            "alpha": self.alpha, "n_base": self.n_base, "n_cand": self.n_cand, "reason": self.reason,
        }


def _ranks(pooled: np.ndarray) -> np.ndarray:
    """Average ranks (1-based) of the pooled samples; ties share the mean of their ranks."""
    order = np.argsort(pooled, kind="mergesort")
    sorted_vals = pooled[order]
    ranks = np.empty(len(pooled), dtype=np.float64)
    # boundaries of runs of equal values
    starts = np.flatnonzero(np.r_[True, sorted_vals[1:] != sorted_vals[:-1]])
    ends = np.r_[starts[1:], len(pooled)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # mean of 1-based ranks s+1..e
    return ranks


def _u_statistic(ranks: np.ndarray, cand_idx: np.ndarray, n_cand: int) -> np.ndarray | float:
    """U of the candidate sample from the rank sum(s) of the given candidate index set(s)."""
    return ranks[cand_idx].sum(axis=-1) - n_cand * (n_cand + 1) / 2.0


def mann_whitney_greater(base: np.ndarray, cand: np.ndarray) -> tuple[float, str, float]:
    """One-sided p-value that ``cand`` is stochastically greater than ``base``, the method used, and
    the smallest p-value these sample sizes (and ties) can reach at all."""
    x = np.asarray(base, dtype=np.float64)
    y = np.asarray(cand, dtype=np.float64)
    n1, n2 = len(x), len(y)
    pooled = np.concatenate([x, y])
    ranks = _ranks(pooled)
    u_obs = float(ranks[n1:].sum() - n2 * (n2 + 1) / 2.0)
    n = n1 + n2
    if math.comb(n, n2) <= EXACT_MAX_PERMUTATIONS:
        combos = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(n), n2)),
                             dtype=np.int64).reshape(-1, n2)
        u_all = _u_statistic(ranks, combos, n2)
        p = float(np.mean(u_all >= u_obs - 1e-9))
        return p, "mann-whitney-exact", float(np.mean(u_all >= u_all.max() - 1e-9))
    mu = n1 * n2 / 2.0
    _, counts = np.unique(pooled, return_counts=True)
    tie_term = float(np.sum(counts.astype(np.float64) ** 3 - counts))
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:  # every sample equal: no evidence of a shift
        return 1.0, "mann-whitney-normal", 1.0
    z = (u_obs - mu - 0.5) / math.sqrt(var)
    z_max = (n1 * n2 - mu - 0.5) / math.sqrt(var)
    return _normal_sf(z), "mann-whitney-normal", _normal_sf(z_max)


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


EDGE_STEPS = 2  # the first and last profiled step of each rank are not analysed


def samples_needed(alpha: float = DEFAULT_ALPHA, n_other: int | None = None) -> int:
    """The fewest per-step samples a side needs for the noise test to be able to decide at ``alpha``
    (the smallest attainable one-sided p-value, 1 / C(n1 + n2, n2), below alpha): with ``n_other``
    samples on the other side, or the same number on both sides."""
    for n in range(MIN_SAMPLES, 200):
        other = n if n_other is None else max(n_other, 1)
        if 1.0 / math.comb(n + other, n) < alpha:
            return n
    return 200


def needs_text(alpha: float = DEFAULT_ALPHA) -> str:
    """What the noise test needs, in words: samples per side and the capture that gives them."""
    n = samples_needed(alpha)
    return (f"the noise test needs at least {n} per-step samples on each side at alpha {alpha:g} "
            f"(capture --steps {n + EDGE_STEPS}: the first and last profiled step are not analysed)")


def noise_test(base: list[float] | np.ndarray | None, cand: list[float] | np.ndarray | None,
               alpha: float = DEFAULT_ALPHA) -> NoiseTest:
    """Is the candidate slower than the baseline beyond step-to-step noise?"""
    x = _clean(base)
    y = _clean(cand)
    if len(x) < MIN_SAMPLES or len(y) < MIN_SAMPLES:
        return NoiseTest(False, None, None, "none", len(x), len(y), alpha,
                         f"too few per-step samples to test noise (baseline {len(x)}, candidate {len(y)}); "
                         f"{needs_text(alpha)}: threshold and floor alone decide")
    p, method, p_min = mann_whitney_greater(x, y)
    if p_min >= alpha:
        return NoiseTest(False, None, p, method, len(x), len(y), alpha,
                         f"noise test cannot decide: with n={len(x)}/{len(y)} per-step samples"
                         f"{' and these ties' if len(np.unique(np.r_[x, y])) < len(x) + len(y) else ''} "
                         f"the smallest attainable p-value is {p_min:.3g} >= alpha {alpha:g}; "
                         f"{needs_text(alpha)}: threshold and floor alone decide")
    sig = p < alpha
    verdict = "beyond" if sig else "within"
    return NoiseTest(True, sig, p, method, len(x), len(y), alpha,
                     f"{verdict} step-to-step noise (one-sided Mann-Whitney U, p={p:.3g}, alpha={alpha:g}, "
                     f"n={len(x)}/{len(y)})")


def _clean(values: list[float] | np.ndarray | None) -> np.ndarray:
    if values is None:
        return np.empty(0)
    arr = np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
    return arr[np.isfinite(arr)]
