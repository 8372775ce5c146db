"""One Chrome-trace (JSON) file merging all ranks, for Perfetto or chrome://tracing.

Each rank is one process named the way SGLang's profile merger names them (``"[TP00] <pid>"``, with
``-DP01``/``-PP02``/``-EP03`` parts where present, and ``process_sort_index`` = tp*100 + pp*1e4 + ep*1e6 +
dp*1e8), holding its GPU streams, its CPU threads and a ``traceinspect`` lane with the analysed steps.
Every kernel carries its class in ``args``; each finding is an instant event at the kernels it cites
(or, when it cites none, at the start of each analysed step of its ranks), with the finding in ``args``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec
import numpy as np
import pandas as pd

from traceinspect.fileio import atomic_output
from traceinspect.render.palette import CHROME_CNAME
from traceinspect.tables import factorize_text
from traceinspect.version import __version__

try:
    from traceinspect.render import _json_rows as _rows_native
except ImportError:  # built without a C compiler: the events are encoded as Python objects
    _rows_native = None

if TYPE_CHECKING:
    from traceinspect.model import RankInfo
    from traceinspect.model.analysis import Analysis

STEPS_TID = 999_999_999  # the traceinspect lane of each process (steps and findings); no real tid
KIND_CAT = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset"}
MAX_FINDING_MARKS = 64  # step-start marks per finding and rank (findings that cite no kernel)
MAX_KERNEL_MARKS = 256  # kernel marks per finding and rank


def rank_label(info: RankInfo) -> str:
    """The SGLang merger's rank label: ``TP00``, ``TP03-DP01``, ... (TP from the rank when unknown)."""
    parts = [f"TP{(info.tp if info.tp is not None else info.rank):02d}"]
    for name, v in (("DP", info.dp), ("PP", info.pp), ("EP", info.ep)):
        if v is not None:
            parts.append(f"{name}{v:02d}")
    return "-".join(parts)


def sort_index(info: RankInfo) -> int:
    """``process_sort_index`` as SGLang's merger computes it."""
    tp = info.tp if info.tp is not None else info.rank
    return (info.dp or 0) * 100_000_000 + (info.ep or 0) * 1_000_000 + (info.pp or 0) * 10_000 + tp * 100


def _json_arg(s: str) -> Any:
    if not s:
        return None
    try:
        return json.loads(s)
    except ValueError:
        return s


def _cited_names(evidence: Any, names: set[str]) -> list[str]:
    """Kernel names the evidence mentions (any string value equal to a kernel name, or its head when the
    evidence cut a long name short with '…'), in order."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            if v in names:
                hits = [v]
            elif v.endswith("…") and len(v) > 40:
                hits = sorted(n for n in names if n.startswith(v[:-1]))
            else:
                hits = []
            out.extend(h for h in hits if h not in out)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(evidence)
    return out


def _finding_args(f: dict[str, Any]) -> dict[str, Any]:
    return {"rule": f.get("rule"), "severity": f.get("severity"), "title": f.get("title"),
            "message": f.get("message"), "est_saving_us_per_step": f.get("est_saving_us_per_step"),
            "share": f.get("share"), "ranks": f.get("ranks"), "remediation": f.get("remediation"),
            "evidence": f.get("evidence")}


def build_trace(a: Analysis, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The merged Chrome trace as a dict (``traceEvents`` plus metadata)."""
    doc = doc if doc is not None else a.to_json()
    events, pids, gpu_tids = _process_events(a)
    events.extend(_kernel_events(a, pids, gpu_tids))
    for table, cat in _cpu_tables(a):
        events.extend(_cpu_events(table, cat, pids))
    events.extend(_step_events(a, pids))
    events.extend(_finding_events(a, doc, pids, gpu_tids))
    return {"traceEvents": events, **_trace_meta(a, doc)}


def _trace_meta(a: Analysis, doc: dict[str, Any]) -> dict[str, Any]:
    """The merged trace's keys after ``traceEvents``."""
    ts = a.trace
    return {
        "displayTimeUnit": "ms",
        "deviceProperties": [{"name": d.name, "computeCapability": d.compute_capability,
                              "totalGlobalMem": d.total_memory_bytes, "numSms": d.num_sms, "rank": info.rank}
                             for info in ts.ranks for d in info.devices[:1]],
        "otherData": {
            "generator": f"traceinspect {__version__}",
            "schema": doc.get("schema"),
            "sources": [{"rank": f.get("label"), "path": f.get("path"), "sha256": f.get("sha256")}
                        for f in (doc.get("source") or {}).get("files") or []],
            "findings": len(doc.get("findings") or []),
        },
    }


def _cpu_tables(a: Analysis) -> list[tuple[pd.DataFrame, str]]:
    ts = a.trace
    return [(ts.runtime, "cuda_runtime"), (ts.cpu_ops, "cpu_op"), (ts.annotations, "user_annotation")]


def _process_events(a: Analysis) -> tuple[list[dict[str, Any]], dict[int, str], dict[tuple[int, int], int]]:
    """Each rank's process and thread metadata and its GPU annotations; the process name of each rank and
    the thread id of each (rank, GPU stream)."""
    ts = a.trace
    k = ts.kernels
    events: list[dict[str, Any]] = []
    pids: dict[int, str] = {}
    gpu_tids: dict[tuple[int, int], int] = {}
    for info in ts.ranks:
        kr = k[k["rank"] == info.rank]
        dev = kr["device"]
        dev = dev[dev >= 0]
        device = int(dev.mode().iloc[0]) if len(dev) else info.rank
        pid = f"[{rank_label(info)}] {device}"
        pids[info.rank] = pid
        gpu = info.device.name if info.device else "GPU"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": STEPS_TID,
                       "args": {"name": f"{pid} · {gpu}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": STEPS_TID,
                       "args": {"sort_index": sort_index(info)}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_TID,
                       "args": {"name": "traceinspect: analysed steps and findings"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": STEPS_TID,
                       "args": {"sort_index": 0}})
        cpu_tids = set(ts.runtime.loc[ts.runtime["rank"] == info.rank, "tid"].tolist()) | set(
            ts.cpu_ops.loc[ts.cpu_ops["rank"] == info.rank, "tid"].tolist()) | set(
            ts.annotations.loc[ts.annotations["rank"] == info.rank, "tid"].tolist())
        # GPU streams get their own thread ids, clear of the CPU thread ids of this rank
        next_tid = 1
        for s in sorted(kr["stream"].unique().tolist()):
            while next_tid in cpu_tids:
                next_tid += 1
            gpu_tids[(info.rank, int(s))] = next_tid
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": next_tid,
                           "args": {"name": f"GPU {device} stream {int(s)}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": next_tid,
                           "args": {"sort_index": next_tid}})
            next_tid += 1
        gpu_ann_tid = next_tid
        while gpu_ann_tid in cpu_tids:
            gpu_ann_tid += 1
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": gpu_ann_tid,
                       "args": {"name": f"GPU {device} annotations"}})
        for t in sorted(cpu_tids):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": int(t),
                           "args": {"name": f"CPU thread {int(t)}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": int(t),
                           "args": {"sort_index": 1000 + len(events)}})
        ga = ts.gpu_annotations[ts.gpu_annotations["rank"] == info.rank]
        events.extend({"ph": "X", "cat": "gpu_user_annotation", "name": r.name, "pid": pid, "tid": gpu_ann_tid,
                       "ts": r.ts, "dur": r.dur} for r in ga.itertuples())

    return events, pids, gpu_tids


def _kernel_events(a: Analysis, pids: dict[int, str], gpu_tids: dict[tuple[int, int], int]
                   ) -> Iterable[dict[str, Any]]:
    ts = a.trace
    k = ts.kernels
    rt_tid = ts.runtime["tid"].to_numpy()
    rt_ts = ts.runtime["ts"].to_numpy()
    has_cls = "cls" in k.columns
    analysed = set(a.selected.index.tolist())
    for r in k.itertuples(index=False):
        pid = pids[r.rank]
        tid = gpu_tids[(r.rank, int(r.stream))]
        cls = str(r.cls) if has_cls else None
        args: dict[str, Any] = {"device": int(r.device), "stream": int(r.stream)}
        if r.correlation >= 0:
            args["correlation"] = int(r.correlation)
        if r.external_id >= 0:
            args["External id"] = int(r.external_id)
        if r.grid:
            args["grid"] = _json_arg(r.grid)
        if r.block:
            args["block"] = _json_arg(r.block)
        if r.bytes >= 0:
            args["bytes"] = float(r.bytes)
        if cls is not None:
            args["class"] = cls
            if getattr(r, "cls2", ""):
                args["class2"] = str(r.cls2)
            if getattr(r, "cls_evidence", ""):
                args["class_evidence"] = str(r.cls_evidence)
        step = int(getattr(r, "step", -1))
        if step >= 0:
            args["step"] = step
            args["analysed"] = step in analysed
        if getattr(r, "op_name", ""):
            args["op"] = str(r.op_name)
        if getattr(r, "graph_replay", False):
            args["graph_replay"] = True
        ev = {"ph": "X", "cat": KIND_CAT.get(str(r.kind), "kernel"), "name": r.name, "pid": pid, "tid": tid,
              "ts": float(r.ts), "dur": float(r.dur), "args": args}
        if cls is not None and cls in CHROME_CNAME:
            ev["cname"] = CHROME_CNAME[cls]
        yield ev
        # flow arrow from the launching runtime call (as Kineto's ac2g flows)
        rt_idx = int(getattr(r, "rt_idx", -1))
        if rt_idx >= 0 and r.correlation >= 0:
            fid = (int(r.rank) << 40) | int(r.correlation)  # correlation ids repeat across ranks
            yield {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": fid, "pid": pid, "tid": int(rt_tid[rt_idx]),
                   "ts": float(rt_ts[rt_idx])}
            yield {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": fid, "pid": pid, "tid": tid,
                   "ts": float(r.ts), "bp": "e"}


def _cpu_events(table: pd.DataFrame, cat: str, pids: dict[int, str]) -> Iterable[dict[str, Any]]:
    for r in table.itertuples(index=False):
        ev = {"ph": "X", "cat": cat, "name": r.name, "pid": pids[r.rank], "tid": int(r.tid),
              "ts": float(r.ts), "dur": float(r.dur)}
        corr = getattr(r, "correlation", -1)
        ext = getattr(r, "external_id", -1)
        args = {}
        if corr is not None and corr >= 0:
            args["correlation"] = int(corr)
        if ext is not None and ext >= 0:
            args["External id"] = int(ext)
        if args:
            ev["args"] = args
        yield ev


def _step_events(a: Analysis, pids: dict[int, str]) -> Iterable[dict[str, Any]]:
    """The analysed steps as spans on each rank's traceinspect lane (GPU time of the step)."""
    sel = a.selected
    for idx, s in sel.iterrows():
        if not (np.isfinite(s["gpu_start"]) and np.isfinite(s["gpu_end"])):
            continue
        yield {"ph": "X", "cat": "traceinspect", "name": f"analysed {s['phase']} step {int(s['idx'])}",
               "pid": pids[int(s["rank"])], "tid": STEPS_TID, "ts": float(s["gpu_start"]),
               "dur": float(s["gpu_end"] - s["gpu_start"]),
               "args": {"step": int(idx), "span_us": float(s["span_us"]), "busy_us": float(s["busy_us"]),
                        "idle_us": float(s["idle_us"]), "kernels": int(s["n_kernels"]), "bs": int(s["bs"]),
                        "source": str(s["source"]), "name": str(s["name"])}}


def _finding_events(a: Analysis, doc: dict[str, Any], pids: dict[int, str],
                    gpu_tids: dict[tuple[int, int], int]) -> Iterable[dict[str, Any]]:
    findings = doc.get("findings") or []
    if not findings:
        return
    k = a.kernels
    names = set(k["name"].unique().tolist())
    all_ranks = [info.rank for info in a.trace.ranks]
    rank_of = k["rank"].to_numpy()
    for f in findings:
        label = f"{str(f.get('severity', '')).upper()}: {f.get('title') or f.get('rule')}"
        args = _finding_args(f)
        ranks = f.get("ranks")
        ranks = [r for r in ranks if r in pids] if isinstance(ranks, list) and ranks else all_ranks
        cited = _cited_names(f.get("evidence"), names)
        is_cited = k["name"].isin(cited).to_numpy() if cited else None
        for rank in ranks:
            if is_cited is not None:
                # every launch of a cited kernel in the analysed steps (capped per rank); only those rows
                # are taken from the table
                hit = k.loc[is_cited & (rank_of == rank), ["ts", "stream", "name", "step"]]
                for r in hit.sort_values("ts").head(MAX_KERNEL_MARKS).itertuples(index=False):
                    yield {"ph": "i", "s": "t", "cat": "traceinspect.finding", "name": label, "pid": pids[rank],
                           "tid": gpu_tids[(rank, int(r.stream))], "ts": float(r.ts),
                           "args": dict(args, kernel=r.name, step=int(r.step))}
            else:
                sel = a.selected[a.selected["rank"] == rank].head(MAX_FINDING_MARKS)
                for idx, s in sel.iterrows():
                    if np.isfinite(s["gpu_start"]):
                        yield {"ph": "i", "s": "t", "cat": "traceinspect.finding", "name": label,
                               "pid": pids[rank], "tid": STEPS_TID, "ts": float(s["gpu_start"]),
                               "args": dict(args, step=int(idx))}


def encode(trace: Any) -> bytes:
    """JSON bytes with ``<``, ``>`` and ``&`` written as ``\\u`` escapes (same values; safe to embed or
    to show in any HTML-based viewer)."""
    data = msgspec.json.encode(trace)
    return data.replace(b"<", b"\\u003c").replace(b">", b"\\u003e").replace(b"&", b"\\u0026")


def write_perfetto(a: Analysis, path: str | Path, doc: dict[str, Any] | None = None) -> Path:
    """Write the merged trace to ``path`` (gzipped when the name ends in ``.gz``), atomically. The events
    of the trace's tables are written a block of rows at a time (:func:`trace_pieces`)."""
    doc = doc if doc is not None else a.to_json()
    path = Path(path)
    with atomic_output(path) as raw:
        out: Any = _gzip_writer(raw) if path.name.endswith(".gz") else raw
        for piece in trace_pieces(a, doc):
            out.write(piece)
        if out is not raw:
            out.close()
    return path


def _gzip_writer(raw: BinaryIO) -> Any:
    """A gzip stream over ``raw``: ISA-L's level 2 where isal is installed (about ten times as fast as zlib's
    level 6, the file a fifth to two fifths larger), else zlib's level 1 (about as large)."""
    try:
        from isal import igzip
    except ImportError:
        return gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0)
    return igzip.IGzipFile(fileobj=raw, mode="wb", compresslevel=2, mtime=0)


def trace_pieces(a: Analysis, doc: dict[str, Any]) -> Iterator[bytes]:
    """The merged trace's JSON text in pieces, the same document as ``encode(build_trace(a, doc))``. With
    the native row writer, the kernel and CPU events are written from the tables' columns, a block of
    rows at a time, instead of as one Python object each."""
    if _rows_native is None:
        yield encode(build_trace(a, doc))
        return
    events, pids, gpu_tids = _process_events(a)

    def parts() -> Iterator[bytes]:  # each a run of events, every one led by a comma
        yield _joined(events)
        yield from _kernel_rows(a, pids, gpu_tids)
        for table, cat in _cpu_tables(a):
            yield from _cpu_rows(table, cat, pids)
        yield _joined(list(_step_events(a, pids)))
        yield _joined(list(_finding_events(a, doc, pids, gpu_tids)))

    yield b'{"traceEvents":['
    first = True
    for part in parts():
        if part:
            yield part[1:] if first else part
            first = False
    yield b"]," + encode(_trace_meta(a, doc))[1:]


# ----------------------------------------------------------------------------- the native row writer

CHUNK_ROWS = 100_000  # rows written at a time (a few tens of MB of text)


def _joined(events: list[dict[str, Any]]) -> bytes:
    """``events`` as JSON, each led by a comma."""
    return b"," + encode(events)[1:-1] if events else b""


def _distinct(col: pd.Series) -> tuple[np.ndarray, list[Any]]:
    """(codes, values): the column's values as a row of ``itertuples`` gives them are ``values[codes]``."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes = col.cat.codes.to_numpy().astype(np.int64)
        values = [*col.cat.categories.tolist(), np.nan]
        codes[codes < 0] = len(values) - 1
        return codes, values
    codes, uniq = factorize_text(col.to_numpy(dtype=object))
    return codes, uniq.tolist()


def _texts(col: pd.Series, text: Callable[[Any], bytes]) -> tuple[np.ndarray, list[bytes]]:
    """A TEXT operation's (codes, texts): ``text`` of each distinct value of the column."""
    codes, values = _distinct(col)
    return codes, [text(v) for v in values]


def _member(key: str, *, test: Callable[[Any], bool] = bool) -> Callable[[Any], bytes]:
    """The text of an optional member ``,"key":<str(v)>``, empty (left out) where ``test(v)`` is false."""
    lead = b',"' + key.encode() + b'":'
    return lambda v: lead + encode(str(v)) if test(v) else b""


def _ints(col: pd.Series) -> np.ndarray:
    """An integer column as int64, a missing or negative value as -1 (left out by INT_OPT)."""
    v = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    out = np.full(len(v), -1, dtype=np.int64)
    ok = np.isfinite(v) & (v >= 0)
    out[ok] = v[ok].astype(np.int64)
    return out


def _pid_texts(rank: np.ndarray, pids: dict[int, str]) -> tuple[np.ndarray, list[bytes]]:
    ranks, codes = np.unique(rank, return_inverse=True)
    return codes.reshape(-1).astype(np.int64), [b',"pid":' + encode(pids[int(r)]) for r in ranks.tolist()]


def _run(program: tuple[tuple[Any, ...], ...], n: int) -> Iterator[bytes]:
    assert _rows_native is not None
    for start in range(0, n, CHUNK_ROWS):
        yield _rows_native.rows(program, start, min(start + CHUNK_ROWS, n))


def _kernel_rows(a: Analysis, pids: dict[int, str], gpu_tids: dict[tuple[int, int], int]) -> Iterator[bytes]:
    """The kernel events (and their launch flows) of :func:`_kernel_events`, from the columns."""
    J = _rows_native
    assert J is not None
    ts = a.trace
    k = ts.kernels
    n = len(k)
    if not n:
        return
    rank = k["rank"].to_numpy(dtype=np.int64)
    stream = k["stream"].to_numpy(dtype=np.int64)
    pairs, at = np.unique(np.stack([rank, stream]), axis=1, return_inverse=True)
    tid = np.array([gpu_tids[(int(r), int(s))] for r, s in pairs.T.tolist()], dtype=np.int64)[at.reshape(-1)]
    pid = _pid_texts(rank, pids)
    ts_ = np.ascontiguousarray(k["ts"].to_numpy(dtype=float))
    corr = k["correlation"].to_numpy(dtype=np.int64)
    prog: list[tuple[Any, ...]] = [
        (J.LIT, b',{"ph":"X"'),
        (J.TEXT, *_texts(k["kind"], lambda v: b',"cat":' + encode(KIND_CAT.get(str(v), "kernel")))),
        (J.TEXT, *_texts(k["name"], lambda v: b',"name":' + encode(v))),
        (J.TEXT, *pid),
        (J.INT, b',"tid":', tid),
        (J.FLOAT, b',"ts":', ts_),
        (J.FLOAT, b',"dur":', np.ascontiguousarray(k["dur"].to_numpy(dtype=float))),
        (J.INT, b',"args":{"device":', k["device"].to_numpy(dtype=np.int64)),
        (J.INT, b',"stream":', stream),
        (J.INT_OPT, b',"correlation":', corr),
        (J.INT_OPT, b',"External id":', k["external_id"].to_numpy(dtype=np.int64)),
        (J.TEXT, *_texts(k["grid"], lambda v: b',"grid":' + encode(_json_arg(v)) if v else b"")),
        (J.TEXT, *_texts(k["block"], lambda v: b',"block":' + encode(_json_arg(v)) if v else b"")),
        (J.FLOAT_OPT, b',"bytes":', np.ascontiguousarray(k["bytes"].to_numpy(dtype=float))),
    ]
    cls = _distinct(k["cls"]) if "cls" in k.columns else None  # (codes, values), for the class and its colour
    if cls is not None:
        member = _member("class", test=lambda v: True)
        prog.append((J.TEXT, cls[0], [member(v) for v in cls[1]]))
        for col, key in (("cls2", "class2"), ("cls_evidence", "class_evidence")):
            if col in k.columns:
                prog.append((J.TEXT, *_texts(k[col], _member(key))))
    if "step" in k.columns:
        step = k["step"].to_numpy(dtype=np.int64)
        analysed = np.isin(step, a.selected.index.to_numpy()).astype(np.int64)
        prog.append((J.INT_OPT, b',"step":', step))
        prog.append((J.TEXT, np.where(step >= 0, analysed, -1), [b',"analysed":false', b',"analysed":true']))
    if "op_name" in k.columns:
        prog.append((J.TEXT, *_texts(k["op_name"], _member("op"))))
    if "graph_replay" in k.columns:
        prog.append((J.TEXT, k["graph_replay"].to_numpy(dtype=bool).astype(np.int64), [b"", b',"graph_replay":true']))
    prog.append((J.LIT, b"}"))
    if cls is not None:
        prog.append((J.TEXT, cls[0], [b',"cname":' + encode(CHROME_CNAME[str(v)]) if str(v) in CHROME_CNAME else b""
                                      for v in cls[1]]))
    prog.append((J.LIT, b"}"))
    # the flow arrow from the launching runtime call, as :func:`_kernel_events` writes it
    rt_idx = k["rt_idx"].to_numpy(dtype=np.int64) if "rt_idx" in k.columns else np.full(n, -1, dtype=np.int64)
    flow = (rt_idx >= 0) & (corr >= 0)
    if flow.any():
        safe = np.where(flow, rt_idx, 0)
        rt_tid = ts.runtime["tid"].to_numpy(dtype=np.int64)[safe]
        rt_ts = ts.runtime["ts"].to_numpy(dtype=float)[safe]
        fid = (rank << 40) | np.where(flow, corr, 0)
        arrow = [
            (J.INT, b',{"ph":"s","cat":"ac2g","name":"ac2g","id":', fid), (J.TEXT, *pid), (J.INT, b',"tid":', rt_tid),
            (J.FLOAT, b',"ts":', rt_ts),
            (J.INT, b'},{"ph":"f","cat":"ac2g","name":"ac2g","id":', fid), (J.TEXT, *pid), (J.INT, b',"tid":', tid),
            (J.FLOAT, b',"ts":', ts_), (J.LIT, b',"bp":"e"}'),
        ]
        prog += [(J.IF, flow.astype(np.uint8), len(arrow)), *arrow]
    yield from _run(tuple(prog), n)


def _cpu_rows(table: pd.DataFrame, cat: str, pids: dict[int, str]) -> Iterator[bytes]:
    """The events of :func:`_cpu_events`, from the columns."""
    J = _rows_native
    assert J is not None
    n = len(table)
    if not n:
        return
    prog: list[tuple[Any, ...]] = [
        (J.LIT, b',{"ph":"X","cat":' + encode(cat)),
        (J.TEXT, *_texts(table["name"], lambda v: b',"name":' + encode(v))),
        (J.TEXT, *_pid_texts(table["rank"].to_numpy(dtype=np.int64), pids)),
        (J.INT, b',"tid":', table["tid"].to_numpy(dtype=np.int64)),
        (J.FLOAT, b',"ts":', np.ascontiguousarray(table["ts"].to_numpy(dtype=float))),
        (J.FLOAT, b',"dur":', np.ascontiguousarray(table["dur"].to_numpy(dtype=float))),
        (J.GROUP, b',"args":{'),
    ]
    for col, key in (("correlation", "correlation"), ("external_id", "External id")):
        if col in table.columns:
            prog.append((J.INT_OPT, b',"' + key.encode() + b'":', _ints(table[col])))
    prog += [(J.END, b"}"), (J.LIT, b"}")]
    yield from _run(tuple(prog), n)
