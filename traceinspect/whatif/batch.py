"""The decode step at another running batch (``batch`` edit, ``traceinspect whatif --batch``): every
replayed kernel rescaled by what its work depends on, capped by what the server can hold.

- GEMMs (dense and expert): M follows the batch (per-expert M = batch x top-k / experts follows it too),
  their time from the M-efficiency curve of :mod:`.gemm_m`; batched non-expert GEMMs (attention's bmm, one
  per request) follow the active tokens like attention.
- Attention and KV reads (``attention``, ``kv_cast``): the active tokens (batch x context per request):
  a fixed part (the rank's short-kernel time) plus the rest at the kernel's measured rate; a KV cast with
  recorded bytes of at least one layer's pool (a whole-pool cast) is unchanged.
- Per-token kernels (every other class but collectives): with recorded bytes, a kernel already streaming
  (measured bandwidth at least ``stream_min_pct_bw`` of the GPU's peak) scales like a KV read; one below it is
  latency-bound and takes the added bytes at the GPU's peak bandwidth; without recorded bytes a kernel taking
  at least ``stream_min_latency_multiple`` times the fixed part streams, a shorter one keeps its measured time.
  MoE routing kernels without recorded bytes move the step's routing entries (tokens x top-k x
  ``route_entry_bytes``), which keeps them latency-bound at decode batches.
- Collectives, launch gaps, host time: unchanged.

No kernel goes below its roofline floor at the new size (:mod:`.floors`). The target batch is capped by the
KV pool at the observed context per request (``max_total_num_tokens`` / tokens per request) and by
``max_running_requests`` (server_info.json), each named when it binds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.measure.roofline import floor_us, gpu_roofs
from traceinspect.model.classes import GEMM_CLASSES
from traceinspect.model.run import ServerInfo

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis
    from traceinspect.whatif.edit_spec import Edit
    from traceinspect.whatif.model import Model

TOKEN_CLASSES = ("attention", "kv_cast")  # work follows the active tokens (batch x context)
FIXED_CLASSES = ("comm",)  # unchanged (latency floor, transfers of the step's own size not modelled)


class BatchPlan(msgspec.Struct):
    """The batch a ``batch`` edit replays: observed, asked for, allowed, and why."""

    observed: float | None = None
    asked: float | None = None
    target: float | None = None
    tokens_per_request: float | None = None
    caps: list[dict[str, Any]] = msgspec.field(default_factory=list)  # {by, cap, source}
    bound_by: str | None = None
    how: str = ""  # how the target was chosen
    why: str | None = None  # set when the batch cannot be decided

    @property
    def factor(self) -> float | None:
        if self.observed and self.target:
            return self.target / self.observed
        return None

    def to_json(self) -> dict[str, Any]:
        return {"observed": _num(self.observed), "asked": _num(self.asked), "predicted": _num(self.target),
                "factor": _num(self.factor, 4), "tokens_per_request": _num(self.tokens_per_request),
                "caps": [dict(c) for c in self.caps], "capped_by": self.bound_by, "how": self.how,
                "undecided": self.why}


def _num(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), nd)


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def observed_batch(a: Analysis) -> tuple[float | None, str]:
    """The running batch of the analysed steps (their ``bs=N``), or why it is unknown."""
    rm = a.run_model
    v = rm.value("batch")
    if v is None or not v > 0:
        return None, rm.missing("batch") or "the batch of the analysed steps is unknown"
    return float(v), rm.describe("batch")


def server_caps(a: Analysis, observed: float, cache: dict[str, Any] | None = None,
                max_running: float | None = None) -> tuple[list[dict[str, Any]], float | None, list[str]]:
    """What the server can hold: ``kv_pool`` (``max_total_num_tokens`` / tokens per request at the observed
    context) and ``max_running_requests`` (server_info.json, or ``max_running`` as assumed), as
    ``[{by, cap, source}]``; the tokens per request; notes on caps that cannot be decided."""
    from traceinspect.whatif.kvrows import cached_active_kv_rows

    caps: list[dict[str, Any]] = []
    notes: list[str] = []
    pool = a.run_model.value("kv_pool_tokens")
    active, _, why = cached_active_kv_rows(a, cache)
    tpr = active / observed if active and observed else None
    if pool and tpr:
        caps.append({"by": "kv_pool", "cap": float(math.floor(pool / tpr)),
                     "source": f"{_n(pool)}-token KV pool ({a.run_model.describe('kv_pool_tokens')}) / {_n(tpr)} "
                               f"tokens per request ({_n(active)} active KV rows / batch {_n(observed)})"})
    else:
        notes.append("the KV pool's capacity in requests is unknown ("
                     + ("no KV pool size: " + (a.run_model.missing("kv_pool_tokens") or "") if not pool
                        else "tokens per request unknown: " + why) + ")")
    if max_running is not None:
        caps.append({"by": "max_running_requests", "cap": float(max_running),
                     "source": "max_running_requests as assumed (--max-running-requests)"})
    else:
        mrr = ServerInfo(a.trace.server_info).count("max_running_requests")
        if mrr is not None:
            caps.append({"by": "max_running_requests", "cap": float(mrr),
                         "source": f"server_info.max_running_requests={mrr}"})
    return caps, tpr, notes


def plan_batch(a: Analysis, e: Edit, cache: dict[str, Any] | None = None) -> tuple[BatchPlan, list[str]]:
    """The batch edit ``e`` replays (``value``: a batch, or a factor of the observed one when ``e.times``;
    None: the largest batch the server's KV pool holds, else ``max_running_requests`` when above the observed
    batch, else twice the observed batch), and notes."""
    obs, src = observed_batch(a)
    if obs is None:
        return BatchPlan(why=f"the observed batch is unknown ({src})"), []
    caps, tpr, notes = server_caps(a, obs, cache, e.cap)
    plan = BatchPlan(observed=obs, tokens_per_request=tpr, caps=caps)
    by = {c["by"]: c for c in caps}
    if e.value is None:  # the largest the server can hold
        if "kv_pool" in by:
            plan.asked, plan.how = by["kv_pool"]["cap"], "the largest batch the KV pool holds"
            mrr = by.get("max_running_requests")
            if mrr is not None and mrr["cap"] < plan.asked:
                notes.append(f"needs max_running_requests >= {_n(plan.asked)} ({mrr['source']})")
            caps = [c for c in caps if c["by"] == "kv_pool"]
        elif "max_running_requests" in by and by["max_running_requests"]["cap"] > obs:
            plan.asked, plan.how = by["max_running_requests"]["cap"], "max_running_requests (the KV pool's capacity unknown)"
        else:
            plan.asked, plan.how = 2 * obs, "twice the observed batch (no server capacity known)"
    else:
        plan.asked = float(e.value) * obs if e.times else float(e.value)
        plan.how = f"{e.value:g} x the observed batch" if e.times else "as asked"
    if not plan.asked or plan.asked <= 0:
        plan.why = f"batch {plan.asked} is not a running batch"
        return plan, notes
    target = plan.asked
    for c in sorted(caps, key=lambda c: c["cap"]):
        if c["cap"] < target:
            target = c["cap"]
            plan.bound_by = c["by"]
    plan.target = target
    if plan.bound_by is not None:
        c = by[plan.bound_by]
        what = "the KV pool" if plan.bound_by == "kv_pool" else "max_running_requests"
        notes.insert(0, f"batch {_n(plan.asked)} is capped at {_n(target)} by {what} ({c['source']})")
    return plan, notes


def scale_batch(a: Analysis, m: Model, dur: np.ndarray, coll: np.ndarray, plan: BatchPlan,
                settings: Any, floor: np.ndarray | None = None) -> tuple[list[str], list[str]]:
    """Set ``dur`` of every replayed kernel to its time at ``plan``'s batch, never below its roofline floor at
    the new size (:func:`~traceinspect.measure.roofline.floor_us` of its recorded work x F); ``floor`` (per
    op, NaN: unknown), when given, gets the new floors of the kernels it rescales; (notes, undecided)."""
    from traceinspect.whatif.gemm_m import attention_like, m_times, rows_of

    f = plan.factor
    assert f is not None
    notes: list[str] = []
    cls = np.asarray(m.g_cls).astype(str)
    steps = max(len(m.pos) * len(m.ranks), 1)
    _, bw = gpu_roofs(a)
    lat = _latency(m, coll, float(settings.batch_latency_pct))
    new = dur.copy()

    # GEMMs: M x f from the measured M-efficiency curve; attention's bmm by the active tokens
    gemm = np.flatnonzero(np.isin(cls, list(GEMM_CLASSES)) & ~coll)
    token_ops: list[np.ndarray] = [np.flatnonzero(np.isin(cls, list(TOKEN_CLASSES)) & ~coll)]
    if len(gemm):
        c, hit = rows_of(a, m, gemm)
        known = ~np.isnan(hit)
        if (~known).any():
            n = int((~known).sum())
            us = float(dur[gemm[~known]].sum()) / steps
            if c is None or not known.any() or not (c["shape_source"].astype(str) == "model_config").any():
                return [], [f"{n} of {len(gemm)} GEMM kernels ({us:,.0f} us per step) have no recorded shape (M, N, "
                            "K): record shapes (record_shapes=True), keep the CUDA-graph capture trace, or give the "
                            "model config"]
            # the model config shapes every weight GEMM: the GEMMs it leaves out multiply activations by
            # activations (attention's products over the cached tokens), whose work follows the active tokens
            token_ops.append(gemm[~known])
            notes.append(f"{n} GEMM kernel(s) without a shape ({us:,.0f} us per step) are not weight GEMMs of the "
                         "model config: attention's products over the cached tokens, by the active tokens")
            gemm, hit = gemm[known], hit[known]
        assert c is not None
        rows = hit.astype(np.int64)
        att = attention_like(c.iloc[rows], plan.tokens_per_request)
        token_ops.append(gemm[att])
        how = m_times(a, c, gemm[~att], rows[~att], f, new, latency=True, floor=floor)
        notes.append(f"GEMMs at M x {f:.4g}: " + "; ".join(f"{n} call(s) from the {k}" for k, n in how.items())
                     + (f"; {int(att.sum())} batched non-expert GEMM call(s) (attention) by the active tokens"
                        if att.any() else ""))
    # memory-bound kernels with recorded bytes (efficiency calls)
    mem_by, mem_gbps = _memory_rows(a, m)
    routed = _routing_bytes(a, plan, cls, coll, mem_by, mem_gbps, dur, settings)
    if routed is not None:
        n_route, mem_by, mem_gbps = routed
        notes.append(f"{n_route} MoE routing call(s) without recorded bytes move the step's tokens x top-k routing "
                     f"entries ({settings.batch_route_entry_bytes:g} bytes each): latency-bound at any decode batch")
    # a KV cast of the whole pool (at least one layer's pool bytes) follows the pool, not the batch
    pool_bytes = _pool_bytes(a)
    whole = (cls == "kv_cast") & np.isfinite(mem_by) & (mem_by >= 0.9 * pool_bytes if pool_bytes else False)
    if whole.any():
        token_ops[0] = token_ops[0][~whole[token_ops[0]]]
        notes.append(f"{int(whole.sum())} KV cast call(s) read the whole pool ({_per(dur, np.flatnonzero(whole), steps)} "
                     "per step): unchanged, they follow the pool, not the batch")
    blind = np.flatnonzero((cls == "kv_cast") & ~coll & ~np.isfinite(mem_by))
    if len(blind):
        notes.append(f"{len(blind)} KV cast call(s) without recorded bytes ({_per(dur, blind, steps)} per step) are "
                     "taken as casts of the active rows; a cast of the whole pool (kv-full-pool-cast) would not "
                     "follow the batch")
    rest = np.flatnonzero(~np.isin(cls, list(GEMM_CLASSES) + list(TOKEN_CLASSES) + list(FIXED_CLASSES)) & ~coll)
    known_bytes = np.isfinite(mem_by[rest]) & np.isfinite(mem_gbps[rest]) & (bw is not None)
    # a kernel streams when its measured bandwidth reaches stream_min_pct_bw of the peak; without recorded
    # bytes, when it takes at least stream_min_latency_multiple times the rank's short-kernel time
    stream = np.where(known_bytes, mem_gbps[rest] >= float(settings.batch_stream_pct) / 100.0 * float(bw or np.inf),
                      dur[rest] >= float(settings.batch_stream_latency_multiple) * lat[rest])
    token_ops.append(rest[stream])
    lat_ops = rest[~stream & known_bytes]
    kept = rest[~stream & ~known_bytes]
    tok = np.concatenate(token_ops)
    if len(tok):
        t, L = dur[tok], lat[tok]
        new[tok] = np.where(t > L, L + (t - L) * f, t)
    if len(lat_ops) and bw:
        new[lat_ops] = np.maximum(dur[lat_ops] + (f - 1.0) * mem_by[lat_ops] / (float(bw) * 1e3), 0.0)
    # no kernel below its roofline floor at the new size: its work (FLOPs and bytes) x f; the GEMMs that
    # follow M were bounded by m_times
    scaled = np.concatenate([tok, lat_ops])
    # (from the recorded work: a floor capped at the measured time would grow with F past the kernel's time)
    new_floor = _floors(a, m, mem_by, bw)[scaled] * f
    known = np.isfinite(new_floor)
    new[scaled[known]] = np.maximum(new[scaled[known]], new_floor[known])
    if floor is not None:
        floor[scaled] = new_floor
    dur[:] = new
    notes.append(f"{len(tok)} kernel call(s) follow the active tokens or stream ({_per(dur, tok, steps)} per step "
                 f"at the new batch): a fixed part (the rank's {settings.batch_latency_pct:g}th-percentile kernel time, "
                 f"{float(np.median(lat[tok])) if len(tok) else 0:.2f} us) plus the rest x {f:.4g}")
    if len(lat_ops):
        notes.append(f"{len(lat_ops)} latency-bound kernel call(s) with recorded bytes take the added bytes at the "
                     f"GPU's peak bandwidth ({_per(dur, lat_ops, steps)} per step at the new batch)")
    if len(kept):
        notes.append(f"{len(kept)} per-token kernel call(s) without recorded bytes and under "
                     f"{settings.batch_stream_latency_multiple:g} x the fixed part (latency-bound) keep their measured "
                     f"time ({_per(dur, kept, steps)} per step)")
    fixed = np.flatnonzero(np.isin(cls, list(FIXED_CLASSES)) | coll)
    if len(fixed):
        notes.append(f"{len(fixed)} collective call(s) unchanged ({_per(dur, fixed, steps)} per step)")
    return notes, []


def _routing_bytes(a: Analysis, plan: BatchPlan, cls: np.ndarray, coll: np.ndarray, mem_by: np.ndarray,
                   mem_gbps: np.ndarray, dur: np.ndarray, settings: Any) -> tuple[int, np.ndarray, np.ndarray] | None:
    """MoE routing kernels (``moe_dispatch``) without recorded bytes: their bytes are the step's routing
    entries (observed batch x top-k x ``route_entry_bytes``), so they are judged like kernels with recorded
    bytes; (how many, bytes and GB/s per op), or None where top-k or the batch is unknown or none applies."""
    rm = getattr(a, "run_model", None)
    k = rm.value("top_k") if rm is not None else None
    sel = (cls == "moe_dispatch") & ~coll & ~np.isfinite(mem_by) & (dur > 0)
    if not k or not plan.observed or not sel.any():
        return None
    by, gbps = mem_by.copy(), mem_gbps.copy()
    by[sel] = float(plan.observed) * float(k) * float(settings.batch_route_entry_bytes)
    gbps[sel] = by[sel] / dur[sel] / 1e3
    return int(sel.sum()), by, gbps


def _per(dur: np.ndarray, ops: np.ndarray, steps: int) -> str:
    return f"{float(dur[ops].sum()) / steps:,.0f} us"


def _latency(m: Model, coll: np.ndarray, pct: float) -> np.ndarray:
    """Per op: its rank's short-kernel time, the ``pct`` percentile of the rank's measured kernel durations
    (the fixed part of a kernel's time that does not grow with its work)."""
    out = np.zeros(m.n_ops)
    kern = ~coll & (m.g_dur > 0)
    for r in m.ranks:
        sel = m.g_rank == r
        d = m.g_dur[sel & kern]
        out[sel] = float(np.percentile(d, pct)) if len(d) else 0.0
    return out


def _pool_bytes(a: Analysis) -> float | None:
    """One layer's KV pool in bytes (kv_pool_tokens x kv_row_bytes), when both are known."""
    rm = a.run_model
    tok, row = rm.value("kv_pool_tokens"), rm.value("kv_row_bytes")
    return float(tok) * float(row) if tok and row else None


def _floors(a: Analysis, m: Model, mem_by: np.ndarray, bw: float | None) -> np.ndarray:
    """Per op: the roofline floor of its measured work, from its GEMM row (FLOPs and bytes) or its memory-bound
    row (bytes); NaN where neither is recorded."""
    from traceinspect.whatif.gemm_m import rows_of

    out = floor_us(np.full(m.n_ops, np.nan), mem_by, np.full(m.n_ops, np.nan), bw)
    out[~np.isfinite(mem_by)] = np.nan
    c, hit = rows_of(a, m, np.arange(m.n_ops))
    if c is not None:
        g = np.isfinite(hit)
        r = c.iloc[hit[g].astype(np.int64)]
        out[g] = floor_us(r["fl_"].to_numpy(dtype=np.float64), r["by_"].to_numpy(dtype=np.float64),
                          r["peak_"].to_numpy(dtype=np.float64) / 1e6, bw)
    return out


def _memory_rows(a: Analysis, m: Model) -> tuple[np.ndarray, np.ndarray]:
    """Per op: bytes and measured GB/s of its memory-bound call (efficiency calls), NaN where not recorded."""
    eff = a.efficiency
    nan = np.full(m.n_ops, np.nan)
    if eff is None or not len(eff.calls):
        return nan, nan.copy()
    c = eff.calls
    c = c[(c["kind"].to_numpy() == "memory")]
    if not len(c):
        return nan, nan.copy()
    c = c[~c["kernel"].duplicated()]
    by = pd.Series(pd.to_numeric(c["bytes"], errors="coerce").to_numpy(dtype=np.float64), index=c["kernel"].to_numpy())
    gb = pd.Series(pd.to_numeric(c["gbps"], errors="coerce").to_numpy(dtype=np.float64), index=c["kernel"].to_numpy())
    return by.reindex(m.g_kidx).to_numpy(dtype=np.float64), gb.reindex(m.g_kidx).to_numpy(dtype=np.float64)
