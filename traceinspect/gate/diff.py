"""``diff``: what changed between two analysis documents (baseline -> candidate): run context, step
time, time per class per step, per-shape GEMM efficiency, and findings added / removed / changed.

Works from the JSON documents only, so a stored baseline JSON and a freshly analysed trace set
compare the same way; a section missing on one side is reported as not comparable, not as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traceinspect.gate.document import (
    batch_value,
    class_samples,
    class_values,
    comm_split,
    finding_classes,
    label,
    num,
    rank_class_samples,
    server_config,
    step_samples,
    step_value,
)
from traceinspect.units import fmt_pct

SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}

# Run facts that must match for the comparison to mean anything (else exit 2 unless allowed).
COMPAT_FIELDS: tuple[tuple[str, str], ...] = (
    ("device", "GPU"), ("tp_size", "TP size"), ("ranks", "rank count"), ("phase", "phase"),
)
# Run facts that are shown when they change (a config bump is what the gate is for).
CONTEXT_FIELDS: tuple[tuple[str, str], ...] = (
    ("model", "model"), ("kv_cache_dtype", "KV cache dtype"), ("attention_backend", "attention backend"),
    ("cuda_graph", "CUDA graph"), ("batch_median", "batch (median)"), ("cuda_runtime_version", "CUDA runtime"),
    ("cuda_driver_version", "CUDA driver"), ("compute_capability", "compute capability"),
    ("tool_version", "traceinspect version"),
)


def _context(doc: dict[str, Any]) -> dict[str, Any]:
    run = doc.get("run") if isinstance(doc.get("run"), dict) else {}
    ctx = dict(run)
    ctx["phase"] = (doc.get("steps") or {}).get("phase")
    ctx["tool_version"] = (doc.get("tool") or {}).get("version")
    return ctx


@dataclass
class MetricDelta:
    """One metric, baseline vs candidate: us per step (larger is slower), or tokens/s (``throughput``:
    larger is faster)."""

    metric: str
    base: float | None
    cand: float | None
    base_samples: list[float] | None = None
    cand_samples: list[float] | None = None
    note: str | None = None  # why a side is missing
    pooled: str | None = None  # how the samples were pooled across ranks, when they were
    unit: str = "us"  # 'us' (per step) | 'tokens/s'

    @property
    def delta(self) -> float | None:
        if self.base is None or self.cand is None:
            return None
        return self.cand - self.base

    @property
    def pct(self) -> float | None:
        """Relative change in percent; None when the baseline is 0 or missing."""
        d = self.delta
        if d is None or not self.base:
            return None
        return 100.0 * d / self.base

    def to_json(self) -> dict[str, Any]:
        r = lambda v: None if v is None else round(v, 3)  # noqa: E731
        out = {"metric": self.metric, "base": r(self.base), "cand": r(self.cand), "delta": r(self.delta),
               "pct": r(self.pct), "n_base_samples": len(self.base_samples or []),
               "n_cand_samples": len(self.cand_samples or [])}
        if self.unit != "us":
            out["unit"] = self.unit
        if self.note:
            out["note"] = self.note
        if self.pooled:
            out["pooled"] = self.pooled
        return out


@dataclass
class Diff:
    """Everything that differs between two analysis documents."""

    base_label: str
    cand_label: str
    context: list[dict[str, Any]]  # field, label, base, cand, same, compat
    step: MetricDelta
    classes: list[MetricDelta]
    classes_note: str | None
    gemm: list[dict[str, Any]]
    gemm_note: str | None
    findings: dict[str, list[dict[str, Any]]]  # added, removed, changed, unchanged
    findings_note: str | None
    base_step_us: float | None = None
    notes: list[str] = field(default_factory=list)
    server_config: list[dict[str, Any]] = field(default_factory=list)  # key, base, cand: the keys that differ
    server_config_note: str | None = None
    comm: dict[str, Any] | None = None  # base / cand: collective wait and transfer per step (comm_split)
    batch: dict[str, float | None] = field(default_factory=dict)  # base / cand: the decode batch (None: unknown)
    throughput: MetricDelta | None = None  # tokens/s, when the batch is known on both sides

    @property
    def batch_changed(self) -> bool:
        """Both batches known, and different: the step time of the two runs does different work."""
        b, c = self.batch.get("base"), self.batch.get("cand")
        return b is not None and c is not None and b != c

    def mismatches(self) -> list[dict[str, Any]]:
        """Compatibility facts that differ (device, TP size, ranks, phase)."""
        return [c for c in self.context if c["compat"] and c["same"] is False]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "traceinspect.diff/1",
            "base": self.base_label,
            "cand": self.cand_label,
            "context": self.context,
            "step": self.step.to_json(),
            "batch": self.batch,
            "throughput": self.throughput.to_json() if self.throughput is not None else None,
            "classes": [c.to_json() for c in self.classes],
            "classes_note": self.classes_note,
            "gemm": self.gemm,
            "gemm_note": self.gemm_note,
            "findings": self.findings,
            "findings_note": self.findings_note,
            "server_config": self.server_config,
            "server_config_note": self.server_config_note,
            "notes": self.notes,
        }


def _compare_context(base: dict[str, Any], cand: dict[str, Any]) -> list[dict[str, Any]]:
    b, c = _context(base), _context(cand)
    rows = []
    for compat, fields in ((True, COMPAT_FIELDS), (False, CONTEXT_FIELDS)):
        for key, name in fields:
            bv, cv = b.get(key), c.get(key)
            same = None if bv is None or cv is None else bv == cv
            rows.append({"field": key, "label": name, "base": bv, "cand": cv, "same": same, "compat": compat})
    return rows


def _classes(base: dict[str, Any], cand: dict[str, Any]) -> tuple[list[MetricDelta], str | None]:
    bv, cv = class_values(base), class_values(cand)
    if bv is None or cv is None:
        side = "baseline" if bv is None else "candidate"
        return [], f"the {side} has no per-class time: classes not compared"
    out = []
    for cls in sorted(set(bv) | set(cv), key=lambda c: -max(bv.get(c, 0.0), cv.get(c, 0.0))):
        rb, rc = rank_class_samples(base, cls), rank_class_samples(cand, cls)
        if rb is not None and rc is not None:  # each rank's steps are samples of the same work
            nb, nc = ((d.get("run") or {}).get("ranks") for d in (base, cand))
            out.append(MetricDelta(f"class.{cls}", bv.get(cls, 0.0), cv.get(cls, 0.0), rb, rc,
                                   pooled=f"per-step samples of every rank pooled ({nb} and {nc} ranks)"))
        else:
            out.append(MetricDelta(f"class.{cls}", bv.get(cls, 0.0), cv.get(cls, 0.0),
                                   class_samples(base, cls), class_samples(cand, cls)))
    return out, None


def _server_config(base: dict[str, Any], cand: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The server-config keys whose values differ between the two runs: keys both runs set first, then keys
    only one run has (``only_one_side``), each group by name."""
    b, c = server_config(base), server_config(cand)
    if b is None or c is None:
        missing = [s for s, x in (("baseline", b), ("candidate", c)) if x is None]
        return [], (f"no server configuration in the {' and '.join(missing)} (no server_info.json beside its "
                    "traces): server config not compared")
    rows = [{"key": k, "base": b.get(k), "cand": c.get(k), "only_one_side": b.get(k) is None or c.get(k) is None}
            for k in sorted(set(b) | set(c)) if b.get(k) != c.get(k)]
    return sorted(rows, key=lambda r: r["only_one_side"]), None


def _throughput(base: dict[str, Any], cand: dict[str, Any]) -> MetricDelta | None:
    """Tokens/s (batch x 1e6 / step us) of both runs, per step and at the median step; None when a batch is
    unknown."""
    bb, bc = batch_value(base), batch_value(cand)
    sb, sc = step_value(base), step_value(cand)
    if bb is None or bc is None or not sb or not sc:
        return None
    rate = lambda batch, xs: None if xs is None else [batch * 1e6 / x for x in xs if x > 0] or None  # noqa: E731
    return MetricDelta("throughput", bb * 1e6 / sb, bc * 1e6 / sc, rate(bb, step_samples(base)),
                       rate(bc, step_samples(cand)), unit="tokens/s")


GEMM_KEY = ("cls", "op", "dtype", "m", "n", "k", "batch", "groups")


def _gemm_key(g: dict[str, Any]) -> tuple[Any, ...]:
    key = tuple(g.get(k) for k in GEMM_KEY)
    # rows of unknown shape are one per (class, reason): keep the reason apart
    return key + ((g.get("reason"),) if g.get("m") is None else ())


def _per_step_denominator(doc: dict[str, Any]) -> int:
    """Steps x ranks: GEMM ``us``/``calls`` are totals over all analysed steps of all ranks."""
    steps = int((doc.get("steps") or {}).get("count") or 1)
    ranks = (doc.get("run") or {}).get("ranks")
    return max(steps, 1) * (ranks if isinstance(ranks, int) and ranks > 0 else 1)


def _gemm(base: dict[str, Any], cand: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    bg, cg = base.get("gemm"), cand.get("gemm")
    if not isinstance(bg, list) or not isinstance(cg, list):
        missing = [s for s, g in (("baseline", bg), ("candidate", cg)) if not isinstance(g, list)]
        return [], f"no GEMM efficiency in the {' and '.join(missing)}: GEMM shapes not compared"
    den_b, den_c = _per_step_denominator(base), _per_step_denominator(cand)
    bmap: dict[tuple[Any, ...], dict[str, Any]] = {}
    cmap: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rows, into in ((bg, bmap), (cg, cmap)):
        for g in rows:
            if isinstance(g, dict):
                into.setdefault(_gemm_key(g), g)
    out = []
    for key in list(bmap) + [k for k in cmap if k not in bmap]:
        b, c = bmap.get(key, {}), cmap.get(key, {})
        one = b or c
        bt, ct = num(b.get("tflops")), num(c.get("tflops"))
        out.append({
            **{k: one.get(k) for k in GEMM_KEY},
            "shape_known": one.get("m") is not None,
            "reason": one.get("reason"),
            "status": "added" if not b else "removed" if not c else "both",
            "base_tflops": bt, "cand_tflops": ct,
            "tflops_pct": round(100.0 * (ct - bt) / bt, 2) if bt and ct is not None else None,
            "base_pct_peak": num(b.get("pct_peak")), "cand_pct_peak": num(c.get("pct_peak")),
            "base_calls_per_step": _per(b.get("calls"), den_b), "cand_calls_per_step": _per(c.get("calls"), den_c),
            "base_us_per_step": _per(b.get("us"), den_b), "cand_us_per_step": _per(c.get("us"), den_c),
        })
    # largest efficiency drop first, then shapes without a rate (added, removed, unknown shape)
    out.sort(key=lambda r: (r["tflops_pct"] is None, r["tflops_pct"] if r["tflops_pct"] is not None else 0.0))
    return out, None


def _per(v: Any, n: int) -> float | None:
    x = num(v)
    return None if x is None else round(x / n, 3)


def severity_rank(sev: Any) -> int | None:
    """Order of a severity (info < warning < critical); None if unknown."""
    return SEVERITY_ORDER.get(str(sev).lower()) if sev is not None else None


def _brief(f: dict[str, Any]) -> dict[str, Any]:
    return {**{k: f.get(k) for k in ("rule", "severity", "title", "message", "share", "est_saving_us_per_step",
                                     "ranks", "remediation")}, "classes": finding_classes(f)}


def match_findings(base: list[dict[str, Any]], cand: list[dict[str, Any]]
                   ) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Pair findings of the same rule (same title first, then in order); return (pairs, added, removed)."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    left = list(base)
    added = []
    for f in cand:
        same_rule = [b for b in left if b.get("rule") == f.get("rule")]
        hit = next((b for b in same_rule if b.get("title") == f.get("title")), same_rule[0] if same_rule else None)
        if hit is None:
            added.append(f)
        else:
            left.remove(hit)
            pairs.append((hit, f))
    return pairs, added, left


def _findings(base: dict[str, Any], cand: dict[str, Any], disabled: set[str]
              ) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    bf, cf = base.get("findings"), cand.get("findings")
    if not isinstance(bf, list) or not isinstance(cf, list):
        missing = [s for s, f in (("baseline", bf), ("candidate", cf)) if not isinstance(f, list)]
        return {"added": [], "removed": [], "changed": [], "unchanged": []}, \
            f"no findings section in the {' and '.join(missing)}: findings not compared"
    keep = lambda fs: [f for f in fs if isinstance(f, dict) and f.get("rule") not in disabled]  # noqa: E731
    pairs, added, removed = match_findings(keep(bf), keep(cf))
    changed, unchanged = [], []
    for b, c in pairs:
        what = []
        if b.get("severity") != c.get("severity"):
            what.append(f"severity {b.get('severity')} -> {c.get('severity')}")
        bs, cs = num(b.get("share")), num(c.get("share"))
        if bs is not None and cs is not None and abs(cs - bs) >= 0.01:
            what.append(f"saving {fmt_pct(bs)} -> {fmt_pct(cs)} of the step time")
        if sorted(b.get("ranks") or []) != sorted(c.get("ranks") or []):
            what.append(f"ranks {b.get('ranks')} -> {c.get('ranks')}")
        row = {"rule": c.get("rule"), "base": _brief(b), "cand": _brief(c), "changes": what}
        (changed if what else unchanged).append(row)
    return {"added": [_brief(f) for f in added], "removed": [_brief(f) for f in removed],
            "changed": changed, "unchanged": unchanged}, None


def diff_documents(base: dict[str, Any], cand: dict[str, Any], disabled_rules: set[str] | None = None) -> Diff:
    """Compare two ``traceinspect.analysis/1`` documents (baseline -> candidate)."""
    classes, classes_note = _classes(base, cand)
    gemm, gemm_note = _gemm(base, cand)
    findings, findings_note = _findings(base, cand, set(disabled_rules or ()))
    config, config_note = _server_config(base, cand)
    notes = []
    for side, doc in (("baseline", base), ("candidate", cand)):
        if step_samples(doc) is None:
            notes.append(f"the {side} has no per-step samples: noise cannot be tested")
    return Diff(
        base_label=label(base), cand_label=label(cand),
        context=_compare_context(base, cand),
        step=MetricDelta("step", step_value(base), step_value(cand), step_samples(base), step_samples(cand)),
        classes=classes, classes_note=classes_note, gemm=gemm, gemm_note=gemm_note,
        findings=findings, findings_note=findings_note, base_step_us=step_value(base), notes=notes,
        server_config=config, server_config_note=config_note,
        comm={"base": comm_split(base), "cand": comm_split(cand)},
        batch={"base": batch_value(base), "cand": batch_value(cand)}, throughput=_throughput(base, cand),
    )
