"""Deciding the run model: what the analysed run was (layers, KV pool, experts, parallel sizes, batch), each
fact with its value, where it came from and how sure it is. Decided once per analysis, after the
kernels have their name-based classes and before the evidence-based ones; every later stage
(classify's evidence checks, measure, judge, render) reads it from here and nowhere else.

Sources, strongest first:

``user``             ``--layers`` / ``--experts`` / ``--top-k``, or ``[model]`` in ``traceinspect.toml``
``model_config``     the model's HF config.json given with ``--model-config`` (or ``config`` under ``[model]``)
``server_info``      server_info.json as ``traceinspect capture`` saves it: SGLang's ``/server_info``,
                     its ``/model_info`` (``model_info``) and the model's HF config (``model_config``)
``shapes``           recorded tensor shapes of the trace's CPU ops
``capture_trace``    recorded shapes of the CUDA-graph capture trace
``trace_structure``  the kernel sequence itself (a decoder step repeats one block per layer)
``file_names``       the rank files' names (``-TP-r``, ``-PP-p``, ``-EP-e``)
``server_load``      the server's load while profiled, as ``traceinspect capture`` records it in capture.json
                     (running batch, KV tokens in use: :mod:`traceinspect.model.serverload`)
``default``          a documented default (page size 1, PP/EP size 1)

Confidence is ``high`` (stated by the user or the server, or two independent methods agree),
``medium`` (one trace-derived method), ``low`` (a default or a weak trace signal).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.model.run import (
    EXPERT_KEYS,
    HIDDEN_KEYS,
    TOPK_KEYS,
    USER_FLAGS,
    VOCAB_KEYS,
    Fact,
    RunModel,
    ServerInfo,
    model_int,
    undecided,
)
from traceinspect.model.serverload import load_facts
from traceinspect.model.shapes import dims, tensor_bytes
from traceinspect.steps.select import select_steps
from traceinspect.tables import combine_codes, factorize_text, text_isin, text_values

if TYPE_CHECKING:
    from traceinspect.classify.graphs import GraphOps
    from traceinspect.model import TraceSet

ROUTER_TOPK = ("aten::topk",)  # the op whose input is the router's [tokens, experts] logits
ROUTER_GEMMS = {"aten::mm": (1, 1), "aten::matmul": (1, -1), "aten::linear": (1, 0), "aten::addmm": (2, 1)}
# kernel classes that run a fixed number of times in every layer (the layer-count cross-check)
REGULAR_CLASSES = ("attention", "norm", "comm", "rotary", "kv_write")
MIN_LAYERS = 2
MAX_PERIOD_KERNELS = 20_000  # longer steps are not searched for a period (cost grows with the square)
STRUCTURE_STEPS = 3  # steps whose kernel sequence is searched for the layer period


# ----------------------------------------------------------------------------- deciding


def decide(ts: TraceSet, steps: pd.DataFrame | None = None, graph_ops: GraphOps | None = None,
           user: Mapping[str, tuple[int, str]] | None = None, phase: str = "decode") -> RunModel:
    """The run model of a loaded, linked, step-split trace set whose kernels carry their
    name-based ``cls`` (the structure methods read it); ``phase``: the analysed steps (the batch)."""
    si = ServerInfo(ts.server_info)
    user = dict(user or {})
    rm = RunModel()
    f = rm.facts
    sel = _structure_steps(steps)
    given = user.pop("model_config", None)
    if given is not None:  # --model-config, [model] config: wins over the block server_info carries
        rm.config, rm.config_source = dict(given[0]), str(given[1])
    elif isinstance(si.get("model_config"), dict) and si.get("model_config"):
        block = si["model_config"]
        rm.config = dict(block)
        where = block.get("source")
        rm.config_source = "server_info.json model_config" + (f" (from {where})" if isinstance(where, str) else "")
    cfg = {"model_config": rm.config} if rm.config is not None and given is not None else None

    # parallel sizes: server_info, else the rank file names
    for name, attr in (("tp_size", "tp"), ("pp_size", "pp"), ("ep_size", "ep")):
        v = si.count(name)
        if v is not None:
            f[name] = Fact(v, "server_info", "high", f"server_info.{name}={v}")
            continue
        nums = {getattr(r, attr, None) for r in ts.ranks} - {None}
        if nums:
            f[name] = Fact(max(nums) + 1, "file_names", "medium",
                           f"highest -{attr.upper()}-<n> in the rank file names + 1 = {max(nums) + 1}")
        elif name == "tp_size":
            n = len(ts.ranks)
            f[name] = Fact(n, "file_names", "low", f"{n} rank file(s), no TP number in their names")
        else:
            f[name] = Fact(1, "default", "low", f"no {name} in server_info, none in the rank file names")

    # layers: the user, the model config (per pipeline stage), the kernel sequence
    if "layers" in user:
        f["layers"] = Fact(user["layers"][0], "user", "high", user["layers"][1])
    elif cfg is not None and (stage := ServerInfo({**cfg, "pp_size": si.get("pp_size")}).stage_layers())[0]:
        f["layers"] = Fact(stage[0], "model_config", "high", f"{rm.config_source}: {stage[1].split('.', 1)[-1]}")
    else:
        n, how = si.stage_layers()
        if n is not None:
            f["layers"] = Fact(n, "server_info", "high", how)
        else:
            f["layers"] = layers_from_structure(ts.kernels, sel)

    routing: dict[str, Fact] | None = None  # read from the shapes only when a fact needs it
    for name, keys in (("experts", EXPERT_KEYS), ("top_k", TOPK_KEYS), ("hidden_size", HIDDEN_KEYS),
                       ("vocab_size", VOCAB_KEYS)):
        if name in user:
            f[name] = Fact(user[name][0], "user", "high", user[name][1])
            continue
        v, how = model_int(cfg, keys) if cfg is not None else (None, "")
        if v is not None:
            f[name] = Fact(v, "model_config", "high", f"{rm.config_source}: {how.split('.', 1)[-1]}")
            continue
        v, how = si.model_int(keys)
        if v is not None:
            f[name] = Fact(v, "server_info", "high", how)
            continue
        if routing is None and name != "vocab_size":  # the router's shapes say all but the vocabulary
            routing = _routing(ts, steps, graph_ops, f["layers"].value)
        if routing is not None and name in routing:
            f[name] = routing[name]
        else:
            f[name] = undecided(f"no {' / '.join(keys[:3])} in server_info.json (model_info / model_config)"
                                 + (" nor router top-k shapes in the trace" if name in ("experts", "top_k") else "")
                                 + (f"; give it with {USER_FLAGS[name]} or --model-config config.json"
                                    if name in USER_FLAGS else "; give it with --model-config config.json"))

    # the KV pool
    tok = si.count("max_total_num_tokens")
    if tok is not None:
        f["kv_pool_tokens"] = Fact(tok, "server_info", "high", f"server_info.max_total_num_tokens={tok}")
    else:
        pool = _pool_from_shapes(ts, steps, graph_ops, f["layers"].value)
        f["kv_pool_tokens"] = pool if pool is not None else undecided(
            "no server_info.json with max_total_num_tokens (save it with `traceinspect capture`, or pass "
            "--server-info FILE), and no per-layer KV-dtype tensor both indexed and cast in the recorded shapes")
        tok = f["kv_pool_tokens"].value
    page = si.count("page_size")
    f["page_size"] = (Fact(page, "server_info", "high", f"server_info.page_size={page}") if page is not None
                      else Fact(1, "default", "low", "no page_size in server_info: 1 assumed"))
    row = _kv_row(ts, graph_ops, tok, f["page_size"].value)
    kv = si.get("kv_cache_dtype")
    if isinstance(kv, str) and kv and kv != "auto":
        f["kv_cache_dtype"] = Fact(kv, "server_info", "high", f"server_info.kv_cache_dtype={kv}")
    elif isinstance(si.get("dtype"), str) and si.get("dtype") not in ("", "auto") and kv == "auto":
        f["kv_cache_dtype"] = Fact(si["dtype"], "server_info", "high",
                                   f"server_info.kv_cache_dtype=auto: the model dtype, server_info.dtype={si['dtype']}")
    elif row is not None and row[1]:
        f["kv_cache_dtype"] = Fact(row[1], row[2], "medium", f"dtype of the recorded pool tensor {row[3]}")
    else:
        f["kv_cache_dtype"] = undecided("no kv_cache_dtype in server_info and no recorded tensor with the KV "
                                         "pool's row count")
    if row is not None:
        f["kv_row_bytes"] = Fact(row[0], row[2], "medium" if row[2] != "user" else "high",
                                 f"recorded tensor {row[3]} with kv_pool_tokens rows")
    else:
        f["kv_row_bytes"] = undecided(
            "kv_pool_tokens unknown" if tok is None else
            "no recorded tensor has kv_pool_tokens rows (record_shapes off, or CUDA-graph replay without a "
            "capture trace: start SGLang with --enable-profile-cuda-graph)")

    # the batch: step annotations of the analysed steps

    analysed = steps
    if steps is not None and len(steps) and {"included", "phase"} <= set(steps.columns):
        analysed = select_steps(steps, phase)
    bs = analysed["bs"] if analysed is not None and "bs" in analysed else pd.Series(dtype=float)
    bs = bs[bs >= 0]
    f["batch"] = (Fact(float(np.median(bs)), "trace_structure", "high", "median bs=N of the step annotations")
                  if len(bs) else undecided("steps carry no bs=N annotation"))
    rm.warnings += load_facts(f, getattr(ts, "capture", None), si.size("dp_size"))
    _model_facts(rm)
    return rm


NO_MODEL_CONFIG = ("no model config: pass --model-config config.json (the model's Hugging Face config), set "
                   "`config = \"config.json\"` under [model] in traceinspect.toml, or capture with `traceinspect "
                   "capture` on the server's host, which saves it in server_info.json")


def _model_facts(rm: RunModel) -> None:
    """The model config fact and the per-rank attention it gives (heads, KV heads, head dim)."""
    f = rm.facts
    if rm.config is None:
        f["model_config"] = undecided(NO_MODEL_CONFIG)
        return
    from traceinspect.classify.modelshapes import plan

    p, why = plan(rm.config, rm.config_source or "model config", int(rm.value("tp_size") or 1),
                  int(rm.value("ep_size") or 1), int(rm.value("pp_size") or 1))
    src = "user" if not (rm.config_source or "").startswith("server_info") else "server_info"
    if p is None:
        f["model_config"] = Fact(rm.config_source, src, "high", f"{rm.config_source}: its GEMMs are not derived: {why}")
        return
    f["model_config"] = Fact(rm.config_source, src, "high",
                             f"model_type {p.model_type or '?'} (family {p.family} of rules/tables/architectures.yaml), "
                             f"{len(p.layers)} layers, {sum(lay.moe for lay in p.layers)} of them MoE")
    tp = rm.value("tp_size") or 1
    for name, v, what in (("attention_heads", p.heads, "query heads"), ("kv_heads", p.kv_heads, "KV heads"),
                          ("head_dim", p.head_dim, "head dim")):
        if v is not None:
            f[name] = Fact(v, "model_config", "high", f"{what} per rank (tp_size={tp}) from {rm.config_source}")


def _structure_steps(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """The included steps, decode steps only when there are any."""
    if steps is None or not len(steps):
        return None
    s = steps[steps["included"].astype(bool)] if "included" in steps else steps
    if not len(s):
        s = steps
    if "phase" in s and (s["phase"] == "decode").any():
        s = s[s["phase"] == "decode"]
    return s


# ----------------------------------------------------------------------------- KV row from shapes


def _kv_row(ts: TraceSet, graph_ops: GraphOps | None, pool: int | None,
            page: int) -> tuple[int, str | None, str, str] | None:
    """(bytes of one pool row, its dtype, source, the tensor) from the narrowest recorded tensor with
    the KV pool's row count (a cast of the pool widens it; the pool's own storage is the narrowest)."""
    if not pool:
        return None
    frames: list[tuple[str, pd.DataFrame]] = [("shapes", getattr(ts, "cpu_ops", None))]
    if graph_ops is not None:
        frames += [("capture_trace", c.ops) for _, c in sorted(graph_ops.captures.items()) if c.ops is not None]
    needles = [f"[{n}".encode() for n in range(pool, pool + 2 * max(page, 1) + 1)]
    for source, ops in frames:
        if ops is None or not len(ops) or "input_dims" not in ops:
            continue
        dims_col = ops["input_dims"].to_numpy(dtype=object)
        types_col = ops["input_types"].to_numpy(dtype=object) if "input_types" in ops else np.full(len(ops), None)
        # a byte-level prefilter on the distinct dims texts: the pool's row count must appear in it
        d_codes, d_uniq = factorize_text(dims_col)
        hits = [j for j, b in enumerate(d_uniq.tolist())
                if isinstance(b, (bytes, bytearray)) and any(n in b for n in needles)]
        if not hits:
            continue
        best: tuple[int, str | None, str, str] | None = None
        rows = np.flatnonzero(np.isin(d_codes, hits))
        t_codes, _ = factorize_text(types_col[rows])
        # the distinct (dims, types) pairs of those rows, in order of first appearance
        _, first = np.unique(combine_codes(d_codes[rows], t_codes), return_index=True)
        pairs = rows[np.sort(first)]
        for dims_raw, types_raw in zip(dims_col[pairs].tolist(), types_col[pairs].tolist(), strict=True):
            ds, types = dims(dims_raw) or [], dims(types_raw) or []
            for j, d in enumerate(ds):
                if not (isinstance(d, list) and len(d) >= 2 and all(isinstance(x, int) for x in d)):
                    continue
                if not pool <= d[0] <= pool + 2 * max(page, 1):
                    continue
                t = types[j] if j < len(types) and isinstance(types[j], str) else None
                b = tensor_bytes(d[1:], t)
                dt = t.replace("c10::", "").lower() if t else None
                # the narrowest; of equal width, a float dtype over a byte view of the same storage
                if b and (best is None or (b, not (dt or "").startswith("float")) <
                          (best[0], not (best[1] or "").startswith("float"))):
                    best = (b, dt, source, f"{d} {t or '?'}")
        if best is not None:
            return best
    return None


# ----------------------------------------------------------------------------- KV pool from shapes

POOL_INDEXERS = {"aten::index_select": 0, "aten::index": 0, "aten::gather": 0, "aten::take": 0,
                 "aten::index_put_": 0, "aten::index_put": 0, "aten::index_copy_": 0, "aten::index_copy": 0,
                 "aten::scatter_": 0, "aten::scatter": 0}  # op -> the argument that is the indexed tensor
CAST_OPS = ("aten::copy_",)
LOW_BITS = ("float8", "unsigned char", "char", "signed char", "float4")


def _pool_from_shapes(ts: TraceSet, steps: pd.DataFrame | None, graph_ops: GraphOps | None,
                      layers: int | None) -> Fact | None:
    """The KV pool's row count from recorded shapes, without server_info: the largest tensor that is
    indexed or scattered into once per layer or more (a gather of the rows in use, a KV write) and whose
    row shape is that of a dtype cast from an 8-bit dtype (the pool, or the rows gathered from it, cast to
    the compute dtype) that also runs once per layer."""
    for source, frame, forwards in _shape_frames(ts, steps, graph_ops, tuple(POOL_INDEXERS) + CAST_OPS):
        indexed: dict[tuple[int, ...], int] = {}
        cast_rows: dict[tuple[int, ...], int] = {}
        for name, raw, types in zip(frame["name"].tolist(), frame["input_dims"].tolist(),
                                    frame["input_types"].tolist(), strict=True):
            d, t = dims(raw), dims(types) or []
            if not d:
                continue
            if name in CAST_OPS:
                if len(d) < 2 or len(t) < 2 or not isinstance(d[1], list) or len(d[1]) < 2 or t[0] == t[1]:
                    continue
                if isinstance(t[1], str) and t[1].replace("c10::", "").lower().startswith(LOW_BITS):
                    key = tuple(d[1][1:])
                    cast_rows[key] = cast_rows.get(key, 0) + 1
            else:
                a = POOL_INDEXERS[name]
                if a < len(d) and isinstance(d[a], list) and len(d[a]) >= 2 and all(isinstance(x, int) for x in d[a]):
                    key = tuple(d[a])
                    indexed[key] = indexed.get(key, 0) + 1
        need = max(layers or MIN_LAYERS, MIN_LAYERS) * forwards - 0.5
        rows = {r for r, c in cast_rows.items() if c >= need}
        cands = [(shape[0], shape) for shape, c in indexed.items() if c >= need and shape[1:] in rows]
        if not cands:
            continue
        n, shape = max(cands)
        what = "CUDA-graph capture" if source == "capture_trace" else "step"
        return Fact(n, source, "medium",
                    f"rows of {list(shape)}: indexed {indexed[shape] / forwards:g} times per {what} and of the row "
                    f"shape {list(shape[1:])} that 8-bit casts read once per layer (no server_info "
                    "max_total_num_tokens)")
    return None


def op_names(ts: TraceSet) -> tuple[np.ndarray, np.ndarray]:
    """``ts.cpu_ops.name`` as (codes, texts): :meth:`TraceSet.op_names`, or made here for a trace set's
    stand-in that carries only the tables."""
    of = getattr(ts, "op_names", None)
    return of() if of is not None else factorize_text(ts.cpu_ops["name"].to_numpy(dtype=object))


def _named(ts: TraceSet, names: Any) -> np.ndarray:
    """Which of ``ts.cpu_ops`` are named one of ``names`` (tested once per distinct name)."""
    codes, texts = op_names(ts)
    return text_isin(texts, names)[codes]


def _shape_frames(ts: TraceSet, steps: pd.DataFrame | None, graph_ops: GraphOps | None,
                  names: tuple[str, ...]) -> list[tuple[str, pd.DataFrame, float]]:
    """(source, the recorded ops named ``names`` of one forward set, forwards it spans): the eager ops
    inside the analysable steps, then one rank's CUDA-graph capture trace."""
    out: list[tuple[str, pd.DataFrame, float]] = []
    ops = getattr(ts, "cpu_ops", None)
    cols = ["name", "input_dims", "input_types"]
    if ops is not None and len(ops) and set(cols) <= set(ops.columns):
        inside, n = _in_steps(ops[_named(ts, names)], steps)
        if n and len(inside):
            out.append(("shapes", inside[cols], float(n)))
    if graph_ops is not None:
        for _, cap in sorted(graph_ops.captures.items()):
            c = cap.ops
            if c is None or not len(c) or not set(cols) <= set(c.columns):
                continue
            windows = len(set(cap.window.tolist()) - {-1}) if len(cap.window) else 0
            out.append(("capture_trace", c.loc[c["name"].isin(names), cols], float(max(windows, 1))))
            break  # one rank's capture says it
    return out


# ----------------------------------------------------------------------------- MoE routing from shapes


def _concrete_int(raw: Any, i: int) -> int | None:
    c = dims(raw)
    if c is None or i >= len(c):
        return None
    try:
        return int(c[i])
    except (TypeError, ValueError):
        return None


def _routing(ts: TraceSet, steps: pd.DataFrame | None, graph_ops: GraphOps | None,
             layers: int | None) -> dict[str, Fact]:
    """Experts, top-k and hidden size from the router's recorded shapes: an ``aten::topk`` over
    ``[tokens, E]`` with k = K that runs once per layer per forward (eager steps, or one capture of
    the CUDA-graph capture trace); the hidden size is the K of the GEMM whose N is E (the router)."""
    frames: list[tuple[str, pd.DataFrame, float]] = []
    ops = getattr(ts, "cpu_ops", None)
    if ops is not None and len(ops) and "name" in ops:
        inside, n_steps = _in_steps(ops[_named(ts, ROUTER_TOPK)], steps)
        if n_steps:
            frames.append(("shapes", pd.concat([inside, ops[_named(ts, ROUTER_GEMMS)]]), float(n_steps)))
    if graph_ops is not None:
        for _, cap in sorted(graph_ops.captures.items()):
            if cap.ops is None or not len(cap.ops):
                continue
            windows = len(set(cap.window.tolist()) - {-1}) if len(cap.window) else 0
            frames.append(("capture_trace", cap.ops, float(max(windows, 1))))
            break  # one rank's capture says it
    for source, frame, forwards in frames:
        if "name" not in frame or "input_dims" not in frame:
            continue
        topk = frame[frame["name"].isin(ROUTER_TOPK)]
        if not len(topk):
            continue
        groups: dict[tuple[int, int], int] = {}
        # each distinct (dims, concrete) text decoded once, counted as often as it occurs
        for (raw, conc), n in Counter(zip(topk["input_dims"].tolist(), topk["concrete"].tolist()
                                          if "concrete" in topk else [None] * len(topk), strict=True)).items():
            d = dims(raw)
            k = _concrete_int(conc, 1)
            if not d or not isinstance(d[0], list) or len(d[0]) != 2 or k is None:
                continue
            e = d[0][-1]
            if isinstance(e, int) and 1 < k < e:
                groups[(e, k)] = groups.get((e, k), 0) + n
        best = None
        for (e, k), c in sorted(groups.items(), key=lambda kv: -kv[1]):
            per = c / forwards
            if (layers is not None and abs(per - layers) < 0.5) or (layers is None and per >= MIN_LAYERS - 0.5):
                best = (e, k, per)
                break
        if best is None:
            continue
        e, k, per = best
        what = "CUDA-graph capture" if source == "capture_trace" else "step"
        how = (f"aten::topk over [tokens, {e}] with k={k}, {per:.0f} per {what}"
               + (f" = once per layer ({layers} layers)" if layers is not None else ""))
        out = {"experts": Fact(e, source, "medium", how), "top_k": Fact(k, source, "medium", how)}
        hidden = _router_hidden(frame, e)
        if hidden is not None:
            out["hidden_size"] = Fact(hidden[0], source, "medium", hidden[1])
        return out
    return {}


def _router_hidden(frame: pd.DataFrame, experts: int) -> tuple[int, str] | None:
    """K of the most frequent GEMM whose N is the expert count (the router's [tokens, H] x [H, E])."""
    counts: dict[int, int] = {}
    for name, (b_arg, n_axis) in ROUTER_GEMMS.items():
        sub = frame.loc[frame["name"] == name, "input_dims"]
        for raw, c in Counter(sub.tolist()).items():  # each distinct text decoded once
            d = dims(raw)
            if not d or len(d) <= b_arg or not isinstance(d[b_arg], list) or len(d[b_arg]) != 2:
                continue
            b = d[b_arg]
            n, k = (b[0], b[1]) if n_axis == 0 else (b[1], b[0])
            if n == experts and isinstance(k, int) and k > 0:
                counts[k] = counts.get(k, 0) + c
    if not counts:
        return None
    k = max(counts, key=counts.__getitem__)
    return k, f"K of the router GEMM (N = {experts} experts), {counts[k]} call(s)"


def _in_steps(ops: pd.DataFrame, steps: pd.DataFrame | None) -> tuple[pd.DataFrame, int]:
    """The ops that start inside the CPU window of an analysable step, and how many such steps."""
    s = _structure_steps(steps)
    if s is None or not len(ops) or not {"cpu_start", "cpu_end", "rank"} <= set(s.columns) or "rank" not in ops:
        return ops.iloc[:0], 0
    keep = np.zeros(len(ops), dtype=bool)
    o_rank, o_ts = ops["rank"].to_numpy(), ops["ts"].to_numpy(dtype=float)
    for rank, g in s.groupby("rank"):
        mine = np.nonzero(o_rank == rank)[0]
        if g["cpu_start"].isna().any() or g["cpu_end"].isna().any():
            keep[mine] = True  # steps without a CPU window (the whole capture, GPU gaps): every op of the rank
            continue
        g = g.sort_values("cpu_start")
        s0, s1 = g["cpu_start"].to_numpy(dtype=float), g["cpu_end"].to_numpy(dtype=float)
        pos = np.searchsorted(s0, o_ts[mine], side="right") - 1
        ok = (pos >= 0) & (o_ts[mine] <= s1[np.maximum(pos, 0)])
        keep[mine[ok]] = True
    return ops[keep], len(s)


# ----------------------------------------------------------------------------- layers from the trace


def longest_period(seq: np.ndarray) -> tuple[int, int, int]:
    """(period p, repetitions, first index) of the longest stretch of ``seq`` that repeats one block of
    p items: for each p, the longest run of i with seq[i] == seq[i + p]; the stretch covers that run
    plus p items. The smallest p reaching the largest coverage wins (a block's multiples cover as
    much; a repetition inside one block covers less). (0, 0, 0) when nothing repeats."""
    n = len(seq)
    best = (0, 0, 0, 0)  # coverage, p, reps, start
    for p in range(1, n // 2 + 1):
        eq = seq[p:] == seq[:-p]
        if not eq.any():
            continue
        padded = np.concatenate(([False], eq, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[0::2], edges[1::2]
        lens = ends - starts
        i = int(np.argmax(lens))
        run = int(lens[i])
        reps = (run + p) // p
        cover = reps * p
        if reps >= 2 and cover > best[0]:
            best = (cover, p, reps, int(starts[i]))
    return best[1], best[2], best[3]


def layers_from_structure(k: pd.DataFrame, steps: pd.DataFrame | None) -> Fact:
    """Layers from the kernel sequence: the period of each step's kernel-name sequence (a decoder step
    is L repetitions of one block), checked against the per-step count of the kernels that run a fixed
    number of times per layer (attention, norms, collectives, rotary, KV writes)."""
    if steps is None or not len(steps) or not len(k) or "step" not in k or "cls" not in k:
        return undecided("no num_hidden_layers in server_info and no analysable steps; give it with --layers")
    ids = steps.index.to_numpy()
    in_steps = k["step"].isin(ids).to_numpy().copy()
    if "kind" in k:
        in_steps &= (k["kind"] == "kernel").to_numpy()
    kk = k.loc[in_steps, ["rank", "step", "ts", "name", "cls"]]
    if not len(kk):
        return undecided("no num_hidden_layers in server_info and no kernels in the steps; give it with --layers")
    rank = int(kk["rank"].min())
    kr = kk[kk["rank"] == rank].sort_values(["step", "ts"], kind="stable")
    names = text_values(kr["name"])
    codes = pd.factorize(names)[0]
    cls_codes = pd.factorize(text_values(kr["cls"]))[0]
    step_col = kr["step"].to_numpy()
    bounds = np.flatnonzero(np.diff(step_col)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(step_col)]))
    # the middle steps of the rank (its first and last are often warm-up or tail)
    order = list(range(len(starts)))
    mid = order[len(order) // 2 - STRUCTURE_STEPS // 2:][:STRUCTURE_STEPS] or order[:STRUCTURE_STEPS]
    results: list[tuple[int, int, float, str]] = []  # reps, period, coverage, token kind
    for si in mid:
        a, b = int(starts[si]), int(ends[si])
        if b - a > MAX_PERIOD_KERNELS or b - a < 2 * MIN_LAYERS:
            continue
        for token, seq in (("kernel names", codes[a:b]), ("kernel classes", cls_codes[a:b])):
            p, reps, _ = longest_period(seq)
            cover = reps * p / (b - a)
            if reps >= MIN_LAYERS and cover >= 0.5:
                results.append((reps, p, cover, token))
                break
    counts = _regular_counts(kr)
    att = counts.get("attention")
    if not results:
        if att is not None and att[1] >= MIN_LAYERS:
            return Fact(att[1], "trace_structure", "low",
                        f"per-step count of attention kernel {att[0][:80]!r} (no repeating block found in the "
                        f"kernel sequence)")
        return undecided("no num_hidden_layers in server_info, the kernel sequence of a step does not repeat "
                          "one block, and no attention kernel runs a fixed number of times per step; give it "
                          "with --layers")
    reps_vals = [r[0] for r in results]
    reps = max(set(reps_vals), key=reps_vals.count)
    p, cover, token = next((r[1], r[2], r[3]) for r in results if r[0] == reps)
    agree = {c: n for c, (nm, n) in counts.items() if n % reps == 0}
    method = (f"kernel sequence of a step repeats a block of {p} {token} {reps} times (covering "
              f"{cover:.0%} of the step's kernels, rank {rank}, {reps_vals.count(reps)}/{len(reps_vals)} steps)")
    if att is not None and att[1] != reps and att[1] > reps and cover < 0.95 and att[1] >= MIN_LAYERS:
        # some layers differ from the repeated block (e.g. dense layers before the MoE ones)
        return Fact(att[1], "trace_structure", "medium",
                    f"per-step count of attention kernel {att[0][:80]!r} = {att[1]}; the {method} covers only "
                    f"the layers built alike")
    if agree:
        check = ", ".join(f"{c} {counts[c][1]} per step ({counts[c][1] // reps} per layer)" for c in sorted(agree))
        return Fact(reps, "trace_structure", "high", f"{method}; checked: {check}")
    return Fact(reps, "trace_structure", "medium", f"{method}; no per-layer kernel count to check it against")


def _regular_counts(kr: pd.DataFrame) -> dict[str, tuple[str, int]]:
    """Per regular class: its most expensive-by-count kernel name and that name's modal calls per step."""
    out: dict[str, tuple[str, int]] = {}
    cls = text_values(kr["cls"])
    for c in REGULAR_CLASSES:
        sub = kr[cls == c]
        if not len(sub):
            continue
        per = sub.groupby(["name", "step"], observed=True).size()
        if not len(per):
            continue
        by_name = per.groupby(level=0, observed=True)
        # the name present in most steps, then with the most calls
        best = max(by_name, key=lambda g: (len(g[1]), int(g[1].sum())))
        name, s = best
        vals = s.to_numpy()
        mode = int(np.bincount(vals).argmax())
        if mode > 0:
            out[c] = (str(name), mode)
    return out
