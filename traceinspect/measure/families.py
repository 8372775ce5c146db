"""What one kernel family moves: bytes and rows per call, from the efficiency stage's model of the launching
ops' recorded shapes, the memcpy sizes, or (for graph-replayed casts) the dtype-changing copies recorded in
the CUDA-graph capture trace (read by the graph-op recovery, never again here)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.measure.ranks import median as _median
from traceinspect.model.shapes import dims as _dims
from traceinspect.model.shapes import tensor_bytes as _tensor_bytes

if TYPE_CHECKING:
    from traceinspect.classify.graphs import GraphOps

CAST_DST = re.compile(r"direct_copy_kernel_cuda.*?lambda\((?:c10::)?(\w+)\)")


def _first_rows(name: str, dims: list[Any] | None) -> float | None:
    """First dimension of the tensor an op reads (copy_: its source), from its recorded dims."""
    if not dims:
        return None
    arg = 1 if name in ("aten::copy_", "aten::copy") else 0
    cand = [d for d in dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    pick = dims[arg] if arg < len(dims) and isinstance(dims[arg], list) and dims[arg] else \
        (cand[0] if cand else None)
    if pick and all(isinstance(x, int) for x in pick):
        return float(pick[0])
    return None


class FamilyShapes:
    """Bytes and rows per call of kernel families of one analysis, each source read once."""

    def __init__(self, efficiency: Any, cpu_ops: pd.DataFrame, graph_ops: GraphOps | None) -> None:
        self.efficiency = efficiency
        self.cpu_ops = cpu_ops
        self.graph_ops = graph_ops
        self._calls_bytes: pd.DataFrame | None = None
        self._cap_casts: dict[int, list[tuple[tuple[int, ...], str, int]] | None] = {}

    def _capture_parsed(self, rank: int) -> Any:
        """The parsed capture trace of ``rank`` as the graph-op recovery read it (None if it read none)."""
        cap = self.graph_ops.captures.get(rank) if self.graph_ops is not None else None
        return cap.parsed if cap is not None else None

    def _capture_ops(self, rank: int) -> pd.DataFrame | None:
        parsed = self._capture_parsed(rank)
        return parsed.cpu_ops if parsed is not None else None

    def _eff_bytes(self) -> pd.Series:
        """Bytes moved per kernel row (efficiency stage memory/GEMM model), indexed by kernel row."""
        if self._calls_bytes is None:
            calls = getattr(self.efficiency, "calls", None)
            if isinstance(calls, pd.DataFrame) and len(calls) and {"kernel", "bytes"} <= set(calls.columns):
                c = calls[["kernel", "bytes", "shape_source"]].copy()
                c["bytes"] = pd.to_numeric(c["bytes"], errors="coerce")
                c = c[c["bytes"].notna()].drop_duplicates("kernel")
                self._calls_bytes = c.set_index("kernel")
            else:
                self._calls_bytes = pd.DataFrame(columns=["bytes", "shape_source"])
        return self._calls_bytes

    def of(self, g: pd.DataFrame) -> tuple[float | None, float | None, str | None]:
        """(rows_per_call, bytes_per_call, source) of a kernel family."""
        eb = self._eff_bytes()
        hit = eb[eb.index.isin(g.index)]
        nbytes = _median(hit["bytes"]) if len(hit) else None
        source = None
        if len(hit):
            srcs = sorted(set(hit["shape_source"].astype(str)))
            source = {"shapes": "cpu_op", "graph_capture": "capture"}.get(srcs[0], srcs[0]) if len(srcs) == 1 \
                else "+".join(srcs)
        if nbytes is None:
            mem = g[(g["kind"] == "memcpy") & (g["bytes"] >= 0)]
            if len(mem):
                nbytes, source = _median(mem["bytes"]), "memcpy"
        rows = self._read_rows(g)
        if rows is not None and source is None:
            source = "cpu_op"
        if (nbytes is None or rows is None) and bool(g["graph_replay"].mean() > 0.5):
            cap = self._capture_cast_shapes(g)
            if cap is not None:
                if rows is None:
                    rows = cap[0]
                if nbytes is None:
                    nbytes = cap[1]
                source = source or "capture"
        return rows, nbytes, source

    def _capture_casts(self, rank: int) -> list[tuple[tuple[int, ...], str, int]] | None:
        """dtype-changing ``aten::copy_`` ops recorded inside the CUDA-graph capture of one rank:
        (source shape, destination dtype, bytes read + written), in capture order."""
        if rank in self._cap_casts:
            return self._cap_casts[rank]
        out: list[tuple[tuple[int, ...], str, int]] | None = None
        ops = self._capture_ops(rank)
        if ops is not None and len(ops):
            window = self._capture_window(rank)
            sel = ops[ops["name"] == "aten::copy_"]
            if window is not None:
                sel = sel[(sel["ts"] >= window[0]) & (sel["ts"] <= window[1])]
            out = []
            for row in sel.sort_values("ts").itertuples():
                dims, types = _dims(row.input_dims) or [], _dims(row.input_types) or []
                if len(dims) < 2 or len(types) < 2:
                    continue
                dst, src = dims[0], dims[1]
                if not (isinstance(src, list) and src and isinstance(dst, list) and dst):
                    continue
                if types[0] == types[1]:
                    continue
                sb, db = _tensor_bytes(src, types[1]), _tensor_bytes(dst, types[0])
                if sb is None or db is None:
                    continue
                out.append((tuple(src), str(types[0]), sb + db))
        self._cap_casts[rank] = out
        return out

    def _capture_window(self, rank: int) -> tuple[float, float] | None:
        parsed = self._capture_parsed(rank)
        if parsed is None:
            return None
        rt = parsed.runtime
        b = rt.loc[rt["name"] == "cudaStreamBeginCapture", "ts"]
        e = rt.loc[rt["name"] == "cudaStreamEndCapture", "end"]
        if len(b) != 1 or len(e) != 1:
            return None  # several captures (or none) in one file: no single window
        return float(b.iloc[0]), float(e.iloc[0])

    def _capture_cast_shapes(self, g: pd.DataFrame) -> tuple[float, float] | None:
        """Shapes of graph-replayed cast kernels from the capture trace, matched by count: the
        captured dtype-changing copies into the kernel's destination dtype, grouped by source
        shape; a group is the family's when it is the only one with as many members as the family
        has calls per graph replay. None unless that holds on every rank with a capture trace."""
        names = g["name"].unique()
        dsts = {m.group(1) for m in (CAST_DST.search(str(n)) for n in names) if m}
        if len(dsts) != 1:
            return None
        dst = dsts.pop().lower()
        rows, nbytes = [], []
        for rank, rg in g[g["graph_replay"]].groupby("rank"):
            casts = self._capture_casts(int(rank))
            if not casts:
                return None
            replays = rg["correlation"].nunique()
            if replays == 0 or len(rg) % replays:
                return None
            per = len(rg) // replays
            groups: dict[tuple[int, ...], list[int]] = {}
            for shape, dtype, b in casts:
                if dtype.lower().replace("c10::", "") == dst:
                    groups.setdefault(shape, []).append(b)
            hits = [(shape, bs) for shape, bs in groups.items() if len(bs) == per]
            if len(hits) != 1:
                return None
            rows.append(float(hits[0][0][0]))
            nbytes.append(float(np.median(hits[0][1])))
        if not rows:
            return None
        return float(np.median(rows)), float(np.median(nbytes))

    def _read_rows(self, g: pd.DataFrame) -> float | None:
        """Median first dimension of the tensor the launching op reads (copy_: its source)."""
        ops = self.cpu_ops
        idx = g.loc[g["op_idx"] >= 0, "op_idx"].to_numpy()
        if not len(idx) or not len(ops):
            return None
        rows: list[float] = []
        uniq, counts = np.unique(idx, return_counts=True)
        pos = ops.index.get_indexer(uniq)
        names = ops["name"].to_numpy(dtype=object)[pos].tolist()
        dims_raw = ops["input_dims"].to_numpy(dtype=object)[pos].tolist()
        memo: dict[tuple[str, Any], float | None] = {}  # ops recorded with equal shapes decode once
        for name, raw, c in zip(names, dims_raw, counts.tolist(), strict=True):
            key = (name, raw)
            try:
                row = memo[key]
            except KeyError:
                row = memo[key] = _first_rows(str(name), _dims(raw))
            except TypeError:  # an unhashable (already decoded) value
                row = _first_rows(str(name), _dims(raw))
            if row is not None:
                rows.extend([row] * c)
        return _median(rows) if rows else None
