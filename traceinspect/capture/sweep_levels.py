"""One concurrency level of a sweep, as numbers: the levels asked for, the server's batch settings, latency
percentiles over a window, what capped the running batch, the knee of the throughput curve."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from traceinspect.capture.errors import ConfigError
from traceinspect.model.run import EXPERT_KEYS, TOPK_KEYS, ServerInfo
from traceinspect.units import json_num

# server_info keys that change from run to run without being configuration
VOLATILE = frozenset({
    "host", "port", "startup_time", "last_gen_throughput", "memory_usage", "internal_states", "model_info",
    "model_config", "kv_events", "status", "launch_command", "timestamp", "api_key", "admin_api_key",
})


@dataclass(frozen=True)
class SweepSettings:
    """``rules/tables/sweep.yaml``."""

    knee_growth_per_doubling: float = 0.10
    busy_util_pct: float = 80.0
    low_power_share: float = 0.5
    kv_full_usage: float = 0.9
    steady_tolerance: float = 0.1
    sub_windows: int = 10

    @classmethod
    def load(cls, path: str | Path | None = None) -> SweepSettings:
        from traceinspect.resources import settings_document

        where = str(path) if path else "rules/tables/sweep.yaml"
        try:
            doc = settings_document("sweep.yaml", path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: cannot read the sweep settings ({e})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: expected a mapping of settings")
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            if f in doc:
                v = doc[f]
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                    raise ConfigError(f"{where}: {f} must be a positive number, got {v!r}")
                kw[f] = int(v) if f == "sub_windows" else float(v)
        unknown = set(doc) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"{where}: unknown settings {', '.join(sorted(unknown))}")
        return cls(**kw)


def parse_levels(text: str) -> list[int]:
    """``256,512,1024,2048`` -> [256, 512, 1024, 2048] (ascending, no repeats)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise ConfigError(f"--concurrency: {part!r} is not an integer") from None
        if n < 1:
            raise ConfigError(f"--concurrency: {n} must be at least 1")
        out.append(n)
    if not out:
        raise ConfigError("--concurrency: give at least one level, e.g. 256,512,1024")
    return sorted(set(out))


# -- the model and the server's configuration ----------------------------------------------------------

def moe_model(info: dict[str, Any]) -> dict[str, Any]:
    """Experts and top-k of the served model from server_info's model blocks (``model_config``,
    ``model_info``): the run facts the analysis reads too."""
    si = ServerInfo(info)
    experts, e_how = si.model_int(EXPERT_KEYS)
    top_k, k_how = si.model_int(TOPK_KEYS)
    if experts and top_k:
        return {"experts": experts, "top_k": top_k, "source": f"{e_how}, {k_how}", "note": None}
    has_cfg = any(isinstance(info.get(k), dict) for k in ("model_config", "model_info"))
    why = ("unknown: no model config" if not has_cfg or not (experts or top_k)
           else f"unknown: the model config gives {'experts' if experts else 'top-k'} only")
    return {"experts": experts, "top_k": top_k, "source": None, "note": why}


def server_config(info: dict[str, Any]) -> dict[str, Any]:
    """The server's configuration as flat ``key: scalar`` pairs (top-level server_info, then the first
    ``internal_states`` entry's resolved values), without what changes from run to run."""
    out: dict[str, Any] = {}

    def take(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if k in VOLATILE or k in out:
                continue
            if v is None or isinstance(v, (str, int, float, bool)):
                out[k] = json_num(v) if isinstance(v, float) else v

    take(info)
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        take(states[0])
    return dict(sorted(out.items()))


# -- one level's measurement ---------------------------------------------------------------------------

def percentiles_ms(values_s: np.ndarray) -> dict[str, float | None]:
    if not len(values_s):
        return {"p50": None, "p99": None}
    return {"p50": json_num(float(np.percentile(values_s, 50)) * 1e3, 3),
            "p99": json_num(float(np.percentile(values_s, 99)) * 1e3, 3)}


def window_metrics(rec: dict[str, Any], t0: float, sub_windows: int) -> dict[str, Any]:
    """Throughput and latencies of one window from the recorder's chunks (this client's clock)."""
    t1 = rec["end"]
    dur = max(t1 - t0, 1e-9)
    chunks = np.asarray(rec["chunks"], dtype=np.float64).reshape(-1, 2)
    inside = chunks[(chunks[:, 0] >= t0) & (chunks[:, 0] < t1)]
    tokens = float(inside[:, 1].sum())
    edges = np.linspace(t0, t1, sub_windows + 1)
    per_bin, _ = np.histogram(inside[:, 0], bins=edges, weights=inside[:, 1])
    samples = (per_bin / (dur / sub_windows)).tolist()
    itl = np.asarray(rec["itl_s"], dtype=np.float64).reshape(-1, 2)
    itl_all = np.repeat(itl[:, 0], itl[:, 1].astype(np.int64)) if len(itl) else np.empty(0)
    finished = [t for t in rec["finished"] if t0 <= t < t1]
    return {
        "seconds": json_num(dur, 3),
        "tokens": int(tokens),
        "output_tokens_per_s": json_num(tokens / dur, 2),
        "request_per_s": json_num(len(finished) / dur, 3),
        "requests_finished": len(finished),
        "tpot_ms": percentiles_ms(np.asarray(rec["tpot_s"], dtype=np.float64)),
        "itl_ms": percentiles_ms(itl_all),
        "throughput_samples": [json_num(x, 2) for x in samples],
    }


def cap_of(concurrency: int, running: int, waiting: int, mrr: int | None, usage: float | None,
           settings: SweepSettings) -> str | None:
    """What holds the running batch below the requests in flight: None when nothing does (no request
    waits on the server), else ``max_running_requests``, ``kv_pool`` or ``scheduler`` (requests wait with
    neither limit reached)."""
    if waiting <= 0 and running >= concurrency:
        return None
    if waiting <= 0:
        return None  # the client had fewer requests in flight at the samples; nothing on the server capped them
    if mrr and running >= mrr - max(1, mrr // 100):
        return "max_running_requests"
    if usage is not None and usage >= settings.kv_full_usage:
        return "kv_pool"
    return "scheduler"


def power_note(level: dict[str, Any], settings: SweepSettings) -> str | None:
    """Power well below the board limit while the GPU is busy: small, memory- or latency-bound kernels."""
    p, lim, util = level.get("power_w"), level.get("power_limit_w"), level.get("gpu_util_pct")
    if p is None or not lim or util is None:
        return None
    if util >= settings.busy_util_pct and p <= settings.low_power_share * lim:
        return (f"the GPUs draw {p:.0f} W of their {lim:.0f} W limit ({p / lim:.0%}) while {util:.0f}% busy: "
                "the kernels are small, memory- or latency-bound (compute-bound GEMMs draw near the limit)")
    return None


def knee(levels: list[dict[str, Any]], growth: float) -> dict[str, Any] | None:
    """The lowest level past which output throughput grows less than ``growth`` per doubling of the
    concurrency, and what caps the next level; None while it still grows at the highest level."""
    ok = sorted((lv for lv in levels if lv.get("status") in ("ok", "partial")
                 and (lv.get("output_tokens_per_s") or 0) > 0), key=lambda lv: lv["concurrency"])
    pairs = []
    for a, b in zip(ok, ok[1:], strict=False):
        doublings = math.log2(b["concurrency"] / a["concurrency"])
        g = (b["output_tokens_per_s"] / a["output_tokens_per_s"]) ** (1.0 / doublings) - 1.0
        pairs.append((a, b, g))
    for i, (a, b, g) in enumerate(pairs):
        if all(p[2] < growth for p in pairs[i:]):
            cap = b.get("capped_by")
            what = {"max_running_requests": "max_running_requests (the server runs no more requests at once)",
                    "kv_pool": "the KV pool (no room for more requests' tokens)",
                    "scheduler": "the scheduler (requests queue with neither limit reached)"}.get(
                cap, "compute (the batch grew, but the step time grew with it)")
            return {"concurrency": a["concurrency"], "next": b["concurrency"], "growth_per_doubling": json_num(g, 4),
                    "next_capped_by": cap or "compute",
                    "text": (f"throughput levels off at {a['concurrency']}: {g:+.1%} per doubling to {b['concurrency']}; "
                             f"what caps {b['concurrency']}: {what}")}
    return None


# -- the sweep -----------------------------------------------------------------------------------------

LEVEL_KEYS = ("running_requests", "waiting_requests", "capped_by", "output_tokens_per_s", "request_per_s",
              "tpot_ms", "itl_ms", "server_gen_tokens_per_s", "step_us", "step_between_share", "per_expert_m",
              "power_w", "power_limit_w", "sm_clock_mhz", "mem_clock_mhz", "gpu_util_pct", "gpus", "power_note",
              "classes", "analysis", "capture")


def bare_level(n: int, status: str, error: str | None) -> dict[str, Any]:
    """A level with nothing measured (not run, or failed before its window ended): every key, null."""
    return {"concurrency": n, **dict.fromkeys(LEVEL_KEYS), "status": status, "error": error}
