"""GEMM and memory efficiency from recorded shapes: FLOPs, bytes, achieved TFLOP/s and GB/s and the
share of the device's peak, per kernel call and per (class, shape); per-expert M of MoE GEMMs.

Shapes come from the ``Input Dims`` / ``Input type`` / ``Concrete Inputs`` of the CPU op that
launched a kernel (``record_shapes=True``). CUDA-graph replays have no CPU op: their shapes are
taken from the ops that :mod:`traceinspect.graphs` recovered from a graph-capture trace when one is
given, else reported as unknown. Formulas are in ``docs/metrics.md``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.measure.specs import GpuSpec, resolve_gpu
from traceinspect.tables import combine_codes, factorize_text, per_distinct, text_values

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

GEMM_CLASSES = frozenset({"fp4_gemm", "fp8_gemm", "bf16_gemm", "fp32_gemm", "moe_gemm"})
# an fp32 GEMM on tensor cores computes in tf32: measured against the tf32 peak, not the fp32 (SIMT) one
_TF32_KERNEL = re.compile(r"tf32|s1688gemm(?!_(bf16|f16|h))", re.IGNORECASE)
MOE_PATH = re.compile(r"moe|expert", re.IGNORECASE)

# PyTorch's "Input type" strings -> (dtype key, bytes per stored element)
_DTYPES: dict[str, tuple[str, float]] = {
    "c10::BFloat16": ("bf16", 2), "c10::Half": ("fp16", 2), "float": ("fp32", 4), "double": ("fp64", 8),
    "c10::Float8_e4m3fn": ("fp8", 1), "c10::Float8_e5m2": ("fp8", 1), "c10::Float8_e4m3fnuz": ("fp8", 1),
    "c10::Float8_e5m2fnuz": ("fp8", 1), "c10::Float8_e8m0fnu": ("fp8", 1),
    "c10::Float4_e2m1fn_x2": ("fp4", 1),  # two fp4 values per stored element
    "long int": ("int64", 8), "long": ("int64", 8), "int64_t": ("int64", 8), "int": ("int32", 4),
    "short int": ("int16", 2), "short": ("int16", 2), "signed char": ("int8", 1),
    "unsigned char": ("uint8", 1), "bool": ("bool", 1),
    "c10::complex<float>": ("complex64", 8), "c10::complex<double>": ("complex128", 16),
    "c10::complex<c10::Half>": ("complex32", 4),
}
# c10::ScalarType enum values, as ``Concrete Inputs`` writes an ``out_dtype``/``dtype`` argument
_SCALAR_TYPES: dict[int, str] = {
    0: "unsigned char", 1: "signed char", 2: "short int", 3: "int", 4: "long int", 5: "c10::Half",
    6: "float", 7: "double", 11: "bool", 15: "c10::BFloat16", 23: "c10::Float8_e5m2",
    24: "c10::Float8_e4m3fn", 25: "c10::Float8_e5m2fnuz", 26: "c10::Float8_e4m3fnuz",
    44: "c10::Float8_e8m0fnu", 45: "c10::Float4_e2m1fn_x2",
}
# wider compute dtype wins when the two GEMM operands differ (e.g. bf16 x fp8 weight-only quant)
_RANK = {"fp4": 0, "fp8": 1, "int8": 1, "fp16": 2, "bf16": 2, "fp32": 3, "fp64": 4}
_PEAK_KEY = {"fp4": "fp4", "fp8": "fp8", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "tf32": "tf32"}
_HOST_LINK = re.compile(r"HtoD|DtoH|HtoH|PtoP|Pinned|Pageable", re.IGNORECASE)

CALL_COLUMNS = [
    "rank", "step", "kernel", "name", "cls", "op_name", "kind", "batch", "groups", "m", "n", "k", "dtype",
    "flops", "bytes", "us", "tflops", "gbps", "pct_peak", "pct_bw", "shape_source", "reason", "moe",
    "peak_tflops",
]


def dtype_of(type_str: str | None) -> tuple[str, float] | None:
    """(dtype key, bytes per stored element) of a PyTorch ``Input type`` string, or None."""
    if not type_str:
        return None
    return _DTYPES.get(type_str)


@dataclass(frozen=True)
class Shape:
    """What one op (or one kernel of a fused op) computes, from its recorded shapes."""

    kind: str  # 'gemm' | 'memory'
    dtype: str | None  # compute dtype (gemm) or 'src->dst' (memory)
    flops: float | None = None
    bytes: float | None = None
    batch: int = 1  # bmm batch
    groups: int = 1  # grouped GEMM groups (experts); m is then the total rows over all groups
    m: int | None = None
    n: int | None = None
    k: int | None = None
    note: str = ""


class _NoShape(Exception):
    """The op's recorded shapes do not give a number; the message says why."""


def _prod(xs: list[int]) -> int:
    return int(math.prod(xs)) if xs else 1


def _tensor(dims: list[Any], types: list[Any], i: int) -> tuple[list[int], str, float]:
    if i >= len(dims) or i >= len(types) or not isinstance(dims[i], list) or not dims[i] \
            or not all(isinstance(d, int) for d in dims[i]):
        raise _NoShape(f"argument {i} has no recorded tensor shape")
    dt = dtype_of(types[i])
    if dt is None:
        raise _NoShape(f"argument {i} has unknown dtype {types[i]!r}")
    return dims[i], dt[0], dt[1]


def _compute_dtype(a: str, b: str) -> str:
    return a if _RANK.get(a, 9) >= _RANK.get(b, 9) else b


def _concrete_dtype(concrete: list[Any], i: int) -> tuple[str, float] | None:
    if i < len(concrete):
        v = concrete[i]
        try:
            code = int(v)
        except (TypeError, ValueError):
            return None
        name = _SCALAR_TYPES.get(code)
        return dtype_of(name) if name else None
    return None


def _gemm(a_dims: list[int], a_t: str, a_el: float, b_dims: list[int], b_t: str, b_el: float,
          out_el: float | None, batch: int = 1, bias_bytes: float = 0.0, out_numel: int | None = None) -> Shape:
    """A GEMM of a [.., M, K] and b [.., K, N] (dims as recorded; fp4 x2 dims count packed pairs)."""
    m, k = a_dims[-2], a_dims[-1]
    kb, n = b_dims[-2], b_dims[-1]
    if k != kb:
        raise _NoShape(f"inner dimensions differ ({a_dims} x {b_dims})")
    k_logical = 2 * k if a_t == "fp4" else k
    flops = 2.0 * batch * m * n * k_logical
    nbytes = None
    if out_el is not None:
        out_n = out_numel if out_numel is not None else batch * m * n
        nbytes = _prod(a_dims) * a_el + _prod(b_dims) * b_el + out_n * out_el + bias_bytes
    return Shape("gemm", _compute_dtype(a_t, b_t), flops, nbytes, batch=batch, m=m, n=n, k=k_logical)


def _mm(dims, types, concrete) -> tuple[Shape, ...]:
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    if len(a) != 2 or len(b) != 2:
        raise _NoShape(f"mm operands are not 2-D ({a} x {b})")
    return (_gemm(a, at, ae, b, bt, be, ae),)


def _addmm(dims, types, concrete) -> tuple[Shape, ...]:
    a, at, ae = _tensor(dims, types, 1)
    b, bt, be = _tensor(dims, types, 2)
    bias_bytes = 0.0
    if isinstance(dims[0], list) and dims[0] and (dt := dtype_of(types[0])):
        bias_bytes = _prod(dims[0]) * dt[1]
    if len(a) != 2 or len(b) != 2:
        raise _NoShape(f"addmm operands are not 2-D ({a} x {b})")
    return (_gemm(a, at, ae, b, bt, be, ae, bias_bytes=bias_bytes),)


def _bmm(dims, types, concrete) -> tuple[Shape, ...]:
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    if len(a) != 3 or len(b) != 3 or a[0] != b[0]:
        raise _NoShape(f"bmm operands are not [B,M,K] x [B,K,N] ({a} x {b})")
    return (_gemm(a, at, ae, b, bt, be, ae, batch=a[0]),)


def _baddbmm(dims, types, concrete) -> tuple[Shape, ...]:
    a, at, ae = _tensor(dims, types, 1)
    b, bt, be = _tensor(dims, types, 2)
    if len(a) != 3 or len(b) != 3 or a[0] != b[0]:
        raise _NoShape(f"baddbmm operands are not [B,M,K] x [B,K,N] ({a} x {b})")
    bias_bytes = 0.0
    if isinstance(dims[0], list) and dims[0] and (dt := dtype_of(types[0])):
        bias_bytes = _prod(dims[0]) * dt[1]
    return (_gemm(a, at, ae, b, bt, be, ae, batch=a[0], bias_bytes=bias_bytes),)


def _matmul(dims, types, concrete) -> tuple[Shape, ...]:
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    a2 = [1, a[0]] if len(a) == 1 else a
    b2 = [b[0], 1] if len(b) == 1 else b
    if len(b2) == 2:  # [..., M, K] x [K, N]: batch dims fold into M
        flat = [_prod(a2[:-1]), a2[-1]]
        return (_gemm(flat, at, ae, b2, bt, be, ae),)
    batch_a, batch_b = a2[:-2], b2[:-2]
    nd = max(len(batch_a), len(batch_b))
    batch_a = [1] * (nd - len(batch_a)) + batch_a
    batch_b = [1] * (nd - len(batch_b)) + batch_b
    batch = _prod([max(x, y) for x, y in zip(batch_a, batch_b, strict=True)])
    return (_gemm(a2[-2:], at, ae, b2[-2:], bt, be, ae, batch=batch,
                  out_numel=batch * a2[-2] * b2[-1]),)


def _linear(dims, types, concrete) -> tuple[Shape, ...]:
    x, xt, xe = _tensor(dims, types, 0)
    w, wt, we = _tensor(dims, types, 1)
    if len(w) != 2:
        raise _NoShape(f"linear weight is not 2-D ({w})")
    bias_bytes = 0.0
    if len(dims) > 2 and isinstance(dims[2], list) and dims[2] and (dt := dtype_of(types[2])):
        bias_bytes = _prod(dims[2]) * dt[1]
    return (_gemm([_prod(x[:-1]), x[-1]], xt, xe, [w[1], w[0]], wt, we, xe, bias_bytes=bias_bytes),)


def _scaled_mm(dims, types, concrete) -> tuple[Shape, ...]:
    # aten::_scaled_mm(a [M,K], b [K,N], scale_a, scale_b, bias?, scale_result?, out_dtype?, use_fast_accum)
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    if len(a) != 2 or len(b) != 2:
        raise _NoShape(f"_scaled_mm operands are not 2-D ({a} x {b})")
    out = _concrete_dtype(concrete, 6)
    if out is None and len(dims) > 8:  # the out= variant records the output tensor last
        out = dtype_of(types[-1]) if isinstance(dims[-1], list) and dims[-1] else None
    scale_bytes = sum(_prod(d) * 4 for d in dims[2:4] if isinstance(d, list))
    s = _gemm(a, at, ae, b, bt, be, out[1] if out else None)
    if s.bytes is not None:
        s = Shape(**{**s.__dict__, "bytes": s.bytes + scale_bytes})
    else:
        s = Shape(**{**s.__dict__, "note": "output dtype not recorded: bytes unknown"})
    return (s,)


def _grouped_mm(dims, types, concrete) -> tuple[Shape, ...]:
    # aten::_grouped_mm(a, b, offs?, bias?, out_dtype?) / aten::_scaled_grouped_mm(a, b, sa, sb, offs?, ...)
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    if len(a) == 2 and len(b) == 3:  # rows of all groups stacked, one [K,N] weight per group
        g = b[0]
        s = _gemm(a, at, ae, b[1:], bt, be, ae, out_numel=a[0] * b[2])
        # the weight of every group is read, not only one
        nbytes = None if s.bytes is None else s.bytes + (g - 1) * _prod(b[1:]) * be
        return (Shape("gemm", s.dtype, s.flops, nbytes, groups=g, m=s.m, n=s.n, k=s.k,
                      note="shapes (mean over experts)"),)
    if len(a) == 3 and len(b) == 3 and a[0] == b[0]:
        return (_gemm(a, at, ae, b, bt, be, ae, batch=a[0]),)
    raise _NoShape(f"grouped GEMM layout {a} x {b} not understood")


def _sgl_fp8_mm(dims, types, concrete) -> tuple[Shape, ...]:
    # sgl_kernel::fp8_scaled_mm / fp8_blockwise_scaled_mm(mat_a [M,K], mat_b [K,N] (column-major), ...)
    a, at, ae = _tensor(dims, types, 0)
    b, bt, be = _tensor(dims, types, 1)
    if len(a) != 2 or len(b) != 2:
        raise _NoShape(f"operands are not 2-D ({a} x {b})")
    bb = b if b[0] == a[1] else [b[1], b[0]]
    return (_gemm(a, at, ae, bb, bt, be, None),)


def _sgl_fp4_mm(dims, types, concrete) -> tuple[Shape, ...]:
    # sgl_kernel::cutlass_scaled_fp4_mm(a [M, K/2] uint8, b [N, K/2] uint8, scale_a, scale_b, alpha, out_dtype)
    a, _, _ = _tensor(dims, types, 0)
    b, _, _ = _tensor(dims, types, 1)
    if len(a) != 2 or len(b) != 2 or a[1] != b[1]:
        raise _NoShape(f"fp4 operands are not [M,K/2] x [N,K/2] ({a} x {b})")
    return (_gemm(a, "fp4", 1, [b[1], b[0]], "fp4", 1, None),)


def _fused_moe(dims, types, concrete) -> tuple[Shape, ...]:
    # SGLang fused MoE ops: (hidden [T,H], w1 [E,2I,H], w2 [E,H,I], topk_weights [T,k], topk_ids [T,k], ...)
    try:
        x, xt, xe = _tensor(dims, types, 0)
        w1, w1t, w1e = _tensor(dims, types, 1)
        w2, w2t, w2e = _tensor(dims, types, 2)
        ids = dims[4] if len(dims) > 4 and isinstance(dims[4], list) else dims[3]
    except _NoShape as e:
        raise _NoShape(f"not the fused-MoE layout [T,H],[E,2I,H],[E,H,I],[T,k]: {e}") from None
    ok = (len(x) == 2 and len(w1) == 3 and len(w2) == 3 and isinstance(ids, list) and len(ids) == 2
          and w1[0] == w2[0] and w1[2] == x[1] == w2[1] and w1[1] == 2 * w2[2] and ids[0] == x[0])
    if not ok:
        raise _NoShape(f"not the fused-MoE layout [T,H],[E,2I,H],[E,H,I],[T,k] ({dims[:5]})")
    t, h = x
    e, two_i, _ = w1
    inter = w2[2]
    rows = t * ids[1]
    dt = _compute_dtype(xt, w1t)
    note = "shapes (mean over experts)"
    up = Shape("gemm", dt, 2.0 * rows * two_i * h, rows * h * xe + _prod(w1) * w1e + rows * two_i * xe,
               groups=e, m=rows, n=two_i, k=h, note=note)
    down = Shape("gemm", _compute_dtype(xt, w2t), 2.0 * rows * h * inter,
                 rows * inter * xe + _prod(w2) * w2e + rows * h * xe, groups=e, m=rows, n=h, k=inter, note=note)
    return (up, down)


def _copy(dims, types, concrete) -> tuple[Shape, ...]:
    # aten::copy_(self=dst, src, non_blocking): reads src, writes dst
    dst, dt_t, dt_e = _tensor(dims, types, 0)
    src, st_t, st_e = _tensor(dims, types, 1)
    return (Shape("memory", f"{st_t}->{dt_t}", bytes=_prod(src) * st_e + _prod(dst) * dt_e),)


def _index_select(dims, types, concrete) -> tuple[Shape, ...]:
    # aten::index_select(self, dim, index): reads the selected rows and the index, writes them
    src, st, se = _tensor(dims, types, 0)
    idx, _, ie = _tensor(dims, types, 2)
    try:
        dim = int(concrete[1]) if len(concrete) > 1 else 0
    except (TypeError, ValueError):
        raise _NoShape("index_select dim not recorded") from None
    dim %= max(len(src), 1)
    out = _prod(src) // max(src[dim], 1) * _prod(idx)
    return (Shape("memory", f"{st}->{st}", bytes=2 * out * se + _prod(idx) * ie),)


def _index_copy(dims, types, concrete) -> tuple[Shape, ...]:
    # aten::index_copy_(self, dim, index, source): reads source and index, writes the rows
    _tensor(dims, types, 0)
    idx, _, ie = _tensor(dims, types, 2)
    srcd, st, se = _tensor(dims, types, 3)
    return (Shape("memory", f"{st}->{st}", bytes=2 * _prod(srcd) * se + _prod(idx) * ie),)


def _fill(dims, types, concrete) -> tuple[Shape, ...]:
    d, t, e = _tensor(dims, types, 0)
    return (Shape("memory", f"->{t}", bytes=_prod(d) * e),)


_GEMM_OPS = {
    "aten::mm": _mm, "aten::addmm": _addmm, "aten::bmm": _bmm, "aten::baddbmm": _baddbmm,
    "aten::matmul": _matmul, "aten::linear": _linear,
    "aten::_scaled_mm": _scaled_mm, "aten::_grouped_mm": _grouped_mm, "aten::_scaled_grouped_mm": _grouped_mm,
    "sgl_kernel::fp8_scaled_mm": _sgl_fp8_mm, "sgl_kernel::fp8_blockwise_scaled_mm": _sgl_fp8_mm,
    "sgl_kernel::cutlass_scaled_fp4_mm": _sgl_fp4_mm,
}
_FUSED_MOE = {"fused_moe", "inplace_fused_experts", "outplace_fused_experts", "fused_experts_impl",
              "fused_experts"}
_MEMORY_OPS = {
    "aten::copy_": _copy, "aten::index_select": _index_select, "aten::index_copy_": _index_copy,
    "aten::fill_": _fill, "aten::zero_": _fill,
}


def op_handler(name: str) -> tuple[str, Any] | None:
    """('gemm'|'moe'|'memory', decoder) for an op name this module understands, else None."""
    if name in _GEMM_OPS:
        return "gemm", _GEMM_OPS[name]
    if name in _MEMORY_OPS:
        return "memory", _MEMORY_OPS[name]
    if "::" in name and name.rsplit("::", 1)[1] in _FUSED_MOE:
        return "moe", _fused_moe
    return None


_JSON = msgspec.json.Decoder()


def _decode(raw: bytes | None) -> list[Any]:
    if raw is None:
        return []
    try:
        v = _JSON.decode(raw)
    except msgspec.DecodeError:
        return []
    return v if isinstance(v, list) else []


class ShapeCache:
    """Decodes each distinct (op name, dims, types, concrete) once."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[tuple[Shape, ...], str]] = {}

    def get(self, name: str, dims: bytes | None, types: bytes | None,
            concrete: bytes | None) -> tuple[tuple[Shape, ...], str]:
        """(shapes, '') or ((), reason)."""
        key = (name, dims, types, concrete)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        h = op_handler(name)
        if h is None:
            res: tuple[tuple[Shape, ...], str] = ((), f"op {name} has no FLOP/byte model")
        elif dims is None:
            res = ((), f"op {name} has no recorded shapes (record_shapes off?)")
        else:
            try:
                res = (h[1](_decode(dims), _decode(types), _decode(concrete)), "")
            except _NoShape as e:
                res = ((), f"{name}: {e}")
            except (TypeError, ValueError, IndexError, ZeroDivisionError) as e:
                res = ((), f"{name}: shapes not understood ({type(e).__name__})")
        self._cache[key] = res
        return res


# ----------------------------------------------------------------------------- names

_SHORT_INNER = re.compile(r"\b([A-Za-z_]\w*_kernel_cuda|[A-Za-z_]\w*Functor\w*|LoadWithCast)\b")


def short_name(name: str) -> str:
    """A kernel family name: the function name without namespaces, templates and arguments, plus the
    functor that identifies PyTorch's generic elementwise kernels (``direct_copy_kernel_cuda``, ...)."""
    s = name[5:] if name.startswith("void ") else name
    s = s.replace("(anonymous namespace)::", "")
    cut = len(s)
    for ch in "<(":
        i = s.find(ch)
        if 0 <= i < cut:
            cut = i
    head = s[:cut].strip()
    head = head.rsplit("::", 1)[-1] if "::" in head else head
    head = head or s[:60]
    inner = []
    for m in _SHORT_INNER.finditer(s[cut:]):
        w = m.group(1)
        if w not in inner:
            inner.append(w)
        if len(inner) == 2:
            break
    return f"{head}<{','.join(inner)}>" if inner else head


# ----------------------------------------------------------------------------- result

def _r(x: Any, nd: int = 3) -> Any:
    if x is None:
        return None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return None if not np.isfinite(x) else round(float(x), nd)
    return x


@dataclass
class Efficiency:
    """GEMM and memory efficiency of the analysed kernels."""

    calls: pd.DataFrame
    gemm: pd.DataFrame
    memory_bound: pd.DataFrame
    moe: dict[str, Any] = field(default_factory=dict)
    spec: GpuSpec | None = None
    spec_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """The ``gemm``, ``memory_bound``, ``moe`` and ``gpu`` sections of the analysis JSON."""
        gemm = []
        for r in self.gemm.itertuples(index=False):
            gemm.append({
                "cls": r.cls, "op": r.op_name or None, "dtype": r.dtype if isinstance(r.dtype, str) else None,
                "m": _int(r.m), "n": _int(r.n), "k": _int(r.k), "batch": _int(r.batch), "groups": _int(r.groups),
                "calls": int(r.calls), "us": _r(r.us), "mean_us": _r(r.mean_us),
                "gflop": _r(r.flops / 1e9 if r.flops == r.flops else None),
                "tflops": _r(r.tflops), "pct_peak": _r(r.pct_peak, 2), "gbps": _r(r.gbps),
                "shape_source": r.shape_source, "reason": r.reason or None,
            })
        mem = []
        for r in self.memory_bound.itertuples(index=False):
            mem.append({
                "family": r.family, "cls": r.cls, "dtypes": r.dtypes, "calls": int(r.calls),
                "bytes": _r(r.bytes, 0), "us": _r(r.us), "gbps": _r(r.gbps), "pct_bw": _r(r.pct_bw, 2),
                "reason": r.reason or None,
            })
        spec = self.spec
        gpu: dict[str, Any] = ({**spec.to_json(), "matched_by": self.spec_reason} if spec
                               else {"name": None, "reason": self.spec_reason})
        return {"gemm": gemm, "memory_bound": mem, "moe": _json_safe(self.moe), "gpu": gpu}


def _int(x: Any) -> int | None:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return None
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return _r(v, 3)


# ----------------------------------------------------------------------------- measure

def _device(a: Analysis) -> tuple[str | None, str | None, str]:
    devs = {(r.device.name, r.device.compute_capability) for r in a.trace.ranks if r.device is not None}
    if not devs:
        return None, None, ""
    name, cc = sorted(devs, key=lambda d: (d[0] or "", d[1] or ""))[0]
    note = f" (ranks report {len(devs)} different devices; the first is used)" if len(devs) > 1 else ""
    return name, cc, note


def measure_efficiency(a: Analysis) -> Efficiency:
    """FLOPs/bytes per GEMM and memory-op call of the analysed kernels, aggregated per shape and per
    kernel family, the per-expert M of MoE GEMMs, and the GPU spec used for the percentages."""
    name, cc, note = _device(a)
    spec, why = resolve_gpu(name, cc, a.options.gpu)
    why += note
    k = a.kernels
    cols = ["rank", "step", "ts", "dur", "name", "cls", "graph_replay", "op_idx", "op_path"]
    src = _op_sources(a, k.loc[k["kind"].eq("kernel").to_numpy(), [c for c in cols if c in k.columns]])
    calls = pd.concat([_calls(src), _copy_events(k)], ignore_index=True) if len(k) else \
        pd.DataFrame(columns=CALL_COLUMNS)
    _rates(calls, spec)
    return Efficiency(calls=calls, gemm=_gemm_table(calls), memory_bound=_memory_table(calls, spec),
                      moe=_moe(a, calls), spec=spec, spec_reason=why)


def _op_sources(a: Analysis, kk: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per kernel: the op instance whose shapes describe it (``inst``, -1 if none) with that op's name,
    path and raw shape args, where they came from (``source``) and, without an op, why (``why``)."""
    n = len(kk)
    ops = a.trace.cpu_ops
    inst = np.full(n, -1, dtype=np.int64)
    source = np.full(n, "", dtype=object)
    why = np.full(n, "", dtype=object)
    op_name = np.full(n, "", dtype=object)
    op_path = np.full(n, "", dtype=object)
    dims = np.full(n, None, dtype=object)
    types = np.full(n, None, dtype=object)
    conc = np.full(n, None, dtype=object)

    replay = kk["graph_replay"].to_numpy(dtype=bool)
    op_idx = kk["op_idx"].to_numpy()
    live = ~replay & (op_idx >= 0)
    if live.any() and len(ops):
        oi = _model_ops(ops, op_idx[live])
        inst[live] = oi
        source[live] = "shapes"
        op_name[live] = ops["name"].to_numpy(dtype=object)[oi]
        op_path[live] = kk["op_path"].to_numpy(dtype=object)[live]
        dims[live] = ops["input_dims"].to_numpy(dtype=object)[oi]
        types[live] = ops["input_types"].to_numpy(dtype=object)[oi]
        conc[live] = ops["concrete"].to_numpy(dtype=object)[oi]
    why[~replay & (op_idx < 0)] = "no CPU op linked to this kernel (no shapes)"

    if replay.any():
        _replay_sources(a, kk, replay, inst, source, why, op_name, op_path, dims, types, conc)
    return {
        "kernel": kk.index.to_numpy(), "rank": kk["rank"].to_numpy(), "step": kk["step"].to_numpy(),
        "ts": kk["ts"].to_numpy(dtype=float), "name": kk["name"].to_numpy(dtype=object),
        "cls": text_values(kk["cls"]), "dur": kk["dur"].to_numpy(dtype=float),
        "inst": inst, "source": source, "why": why, "op_name": op_name, "op_path": op_path, "dims": dims,
        "types": types, "conc": conc,
    }


def _model_ops(ops: pd.DataFrame, idx: np.ndarray, levels: int = 2) -> np.ndarray:
    """The op whose shapes describe a kernel: the launching op, or, when that one has no model (e.g.
    ``aten::gather`` under ``aten::index_select``), the nearest enclosing op that has one."""
    out = idx.copy()
    if not len(ops) or not len(idx):
        return out
    parent = ops["parent"].to_numpy() if "parent" in ops else np.full(len(ops), -1)
    # whether each op has a model: decided once per distinct name (a missing name has none)
    codes, uniq = factorize_text(ops["name"].to_numpy(dtype=object))
    has_model = np.append(np.array([op_handler(n) is not None for n in uniq], dtype=bool), False)[codes]
    sel = np.nonzero(idx >= 0)[0]
    j = idx[sel].astype(np.int64)
    hit = j.copy()
    live = np.ones(len(sel), dtype=bool)
    for _ in range(levels + 1):  # the op itself, then up to ``levels`` enclosing ops
        found = live.copy()
        found[live] = has_model[j[live]]
        hit[found] = j[found]
        live &= ~found
        j = np.where(live, parent[np.maximum(j, 0)], -1)
        live &= j >= 0
    out[sel] = hit
    return out


def _replay_sources(a: Analysis, kk: pd.DataFrame, replay: np.ndarray, inst: np.ndarray, source: np.ndarray,
                    why: np.ndarray, op_name: np.ndarray, op_path: np.ndarray, dims: np.ndarray,
                    types: np.ndarray, conc: np.ndarray) -> None:
    """Fill the op columns of graph-replayed kernels from the ops the graphs stage recovered from the
    capture trace (one op instance per captured op and replay)."""
    from traceinspect.graphs import recover_graph_ops

    g = a.graph_ops if getattr(a, "graph_ops", None) is not None else recover_graph_ops(a.trace)
    pos = np.nonzero(replay)[0]
    rec = g.kernels.reindex(kk.index[pos])
    known = rec["rank"].notna().to_numpy()
    why[pos[~known]] = "CUDA-graph replay: not covered by the graph-capture recovery"
    pos, rec = pos[known], rec[known]
    cop = rec["cap_op"].to_numpy().astype(np.int64)
    why[pos[cop < 0]] = rec["reason"].to_numpy(dtype=object)[cop < 0]
    has = cop >= 0
    if not has.any():
        return
    pos, rec, cop = pos[has], rec[has], cop[has]
    ranks = rec["rank"].to_numpy().astype(np.int64)
    width = max(c.n_ops for c in g.captures.values())
    replays = rec["replay"].to_numpy().astype(np.int64)
    paths = rec["cap_op_path"].to_numpy(dtype=object)
    for rank in np.unique(ranks):
        cap = g.captures[int(rank)]
        sel = ranks == rank
        p = pos[sel]
        c = _model_ops(cap.ops, cop[sel])
        # live op instances are rows of cpu_ops; these sit above them, one per (replay, captured op)
        inst[p] = (1 << 40) + replays[sel] * width + c
        source[p] = "graph_capture"
        op_name[p] = cap.names[c]
        op_path[p] = paths[sel]
        dims[p] = cap.dims[c]
        types[p] = cap.types[c]
        conc[p] = cap.conc[c]


def _calls(col: dict[str, np.ndarray]) -> pd.DataFrame:
    """One row per GEMM / memory op instance (its kernels' time summed), one per GEMM kernel of a fused
    MoE op, and one per GEMM-class kernel whose shapes are unknown."""
    # numpy arrays throughout: pandas string columns are slow to take/gather at 1e5 rows
    n = len(col["inst"])
    if not n:
        return pd.DataFrame(columns=CALL_COLUMNS)
    inst, dur, ts = col["inst"], col["dur"], col["ts"]
    src = col
    has = inst >= 0
    hkind = np.full(n, "", dtype=object)
    shapes = np.full(n, None, dtype=object)
    reason = np.full(n, "", dtype=object)
    if has.any():
        codes, uniq = pd.factorize(inst[has])
        _, first = np.unique(codes, return_index=True)
        fi = np.nonzero(has)[0][first]
        # instances recorded with the same op and shapes (every replay of a captured op, every layer)
        # are modelled once
        parts = [factorize_text(col[c][fi]) for c in ("op_name", "dims", "types", "conc")]
        key_codes = combine_codes(*(c for c, _ in parts))
        _, at = np.unique(key_codes, return_index=True)  # the first call of each distinct key
        keys = [tuple(u[c[i]] for c, u in parts) for i in at.tolist()]
        cache = ShapeCache()
        k_kind = np.full(len(keys), "", dtype=object)
        k_shapes = np.full(len(keys), None, dtype=object)
        k_reason = np.full(len(keys), "", dtype=object)
        for j, (nm, dims, types, conc) in enumerate(keys):
            h = op_handler(nm)
            k_kind[j] = h[0] if h is not None else ""
            k_shapes[j], k_reason[j] = cache.get(nm, dims, types, conc)  # says why when there is no model
        u_kind, u_shapes, u_reason = k_kind[key_codes], k_shapes[key_codes], k_reason[key_codes]
        hkind[has] = u_kind[codes]
        shapes[has] = u_shapes[codes]
        reason[has] = u_reason[codes]
    cls = col["cls"]
    gemm_cls = np.isin(cls, list(GEMM_CLASSES))
    path_moe = {p: bool(MOE_PATH.search(p)) for p in set(col["op_path"])}
    moe = np.fromiter((path_moe[p] for p in col["op_path"]), dtype=bool, count=n) | (cls == "moe_gemm")
    parts = []

    # ops with one model for the whole call: time of all their kernels, the longest one stands for it
    sel = np.isin(hkind, ["gemm", "memory"]) & ((hkind == "memory") | ~np.isin(cls, ["memcpy", "comm"]))
    if sel.any():
        pi = np.nonzero(sel)[0]
        f = pd.DataFrame({"inst": inst[pi], "dur": dur[pi], "pos": pi, "g": gemm_cls[pi], "moe": moe[pi]})
        f = f.sort_values(["inst", "dur"], ascending=[True, False], kind="stable")
        g = f.groupby("inst", sort=False)
        agg = g.agg(pos=("pos", "first"), us=("dur", "sum"), any_gemm=("g", "any"), moe=("moe", "any"))
        pos = agg["pos"].to_numpy()
        keep = (hkind[pos] == "memory") | np.array([bool(x) for x in shapes[pos]], dtype=bool) \
            | agg["any_gemm"].to_numpy()
        pos = pos[keep]
        parts.append(_rows(src, col, pos, [sh[0] if sh else None for sh in shapes[pos]], reason[pos],
                           agg["us"].to_numpy()[keep], agg["moe"].to_numpy()[keep]))

    # fused MoE ops: their GEMM kernels in launch order <-> the op's GEMM shapes in order
    sel = (hkind == "moe") & gemm_cls
    if sel.any():
        pi = np.nonzero(sel)[0]
        pi = pi[np.lexsort((ts[pi], inst[pi]))]
        f = pd.DataFrame({"inst": inst[pi]})
        order = f.groupby("inst", sort=False).cumcount().to_numpy()
        cnt = f.groupby("inst", sort=False)["inst"].transform("size").to_numpy()
        shp, rs = shapes[pi], reason[pi].copy()
        ok = np.array([bool(sh) and len(sh) == c for sh, c in zip(shp, cnt, strict=True)], dtype=bool)
        for j in np.nonzero(~ok & (rs == ""))[0]:
            rs[j] = (f"{col['op_name'][pi[j]]} launched {cnt[j]} GEMM kernels, its shapes describe "
                     f"{len(shp[j]) if shp[j] else 0}: cannot tell which is which")
        parts.append(_rows(src, col, pi, [sh[o] if k else None for sh, o, k in zip(shp, order, ok, strict=True)],
                           rs, dur[pi], np.ones(len(pi), dtype=bool)))

    # GEMM-class kernels no model covers: listed as unknown, with the reason
    sel = gemm_cls & ~np.isin(hkind, ["gemm", "memory", "moe"])
    if sel.any():
        pi = np.nonzero(sel)[0]
        rs = np.where(col["why"][pi] != "", col["why"][pi], reason[pi])
        parts.append(_rows(src, col, pi, [None] * len(pi), rs, dur[pi], moe[pi]))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=CALL_COLUMNS)


def _obj(values: Any) -> pd.Series:
    """A text column kept object: the calls table has a row per GEMM / memory call (~1e6 under graph
    replay) and pandas 3 would convert every string of it to its own string type."""
    return pd.Series(np.asarray(values, dtype=object), dtype=object, copy=False)


def _rows(src: dict[str, np.ndarray], col: dict[str, np.ndarray], pos: np.ndarray, shape: list[Shape | None],
          reason: np.ndarray, us: np.ndarray, moe: np.ndarray) -> pd.DataFrame:
    """Calls rows for the kernels at positions ``pos`` of ``src``, one Shape (or None) each."""
    # calls share few distinct Shape objects (one per op and shapes): read each attribute once per
    # distinct object and spread it with integer codes
    slot: dict[int, int] = {}
    distinct: list[Shape | None] = []
    codes = np.empty(len(shape), dtype=np.int64)
    for i, s in enumerate(shape):
        j = slot.get(id(s))
        if j is None:
            j = slot[id(s)] = len(distinct)
            distinct.append(s)
        codes[i] = j

    def attr(a: str) -> np.ndarray:
        vals = np.empty(len(distinct), dtype=object)
        for j, s in enumerate(distinct):
            vals[j] = getattr(s, a) if s is not None else None
        return vals[codes]

    cls = col["cls"][pos]
    known = np.array([s is not None for s in shape], dtype=bool)
    kind = [s.kind if s is not None else ("gemm" if c in GEMM_CLASSES else "memory")
            for s, c in zip(shape, cls, strict=True)]
    rs = [r or (s.note if s is not None else "") for r, s in zip(reason, shape, strict=True)]
    out = pd.DataFrame({
        "rank": src["rank"][pos], "step": src["step"][pos], "kernel": src["kernel"][pos],
        "name": _obj(col["name"][pos]), "cls": _obj(cls),
        "op_name": _obj(col["op_name"][pos]), "kind": _obj(kind), "batch": attr("batch"), "groups": attr("groups"),
        "m": attr("m"), "n": attr("n"), "k": attr("k"), "dtype": _obj(attr("dtype")), "flops": attr("flops"),
        "bytes": attr("bytes"), "us": np.asarray(us, dtype=float), "tflops": np.nan, "gbps": np.nan,
        "pct_peak": np.nan, "pct_bw": np.nan,
        "shape_source": _obj(np.where(known, col["source"][pos], "unknown")), "reason": _obj(rs),
        "moe": np.asarray(moe, dtype=bool), "peak_tflops": np.nan,
    })
    return out[CALL_COLUMNS]


def _copy_events(k: pd.DataFrame) -> pd.DataFrame:
    """memcpy/memset events: their byte count is in the trace."""
    mc = k[k["kind"].isin(("memcpy", "memset")).to_numpy() & (k["bytes"].to_numpy() >= 0)]
    n = len(mc)
    return pd.DataFrame({
        "rank": mc["rank"].to_numpy(), "step": mc["step"].to_numpy(), "kernel": mc.index.to_numpy(),
        "name": _obj(mc["name"].to_numpy(dtype=object)), "cls": _obj(text_values(mc["cls"])),
        "op_name": _obj(mc["op_name"].to_numpy(dtype=object)), "kind": _obj(["memory"] * n), "batch": [None] * n,
        "groups": [None] * n, "m": [None] * n, "n": [None] * n, "k": [None] * n,
        "dtype": [None] * n, "flops": [None] * n, "bytes": mc["bytes"].to_numpy(dtype=float),
        "us": mc["dur"].to_numpy(dtype=float), "tflops": np.nan, "gbps": np.nan, "pct_peak": np.nan,
        "pct_bw": np.nan, "shape_source": _obj(["shapes"] * n), "reason": _obj([""] * n),
        "moe": np.zeros(n, dtype=bool),
        "peak_tflops": np.nan,
    })[CALL_COLUMNS]


def _rates(calls: pd.DataFrame, spec: GpuSpec | None) -> None:
    if not len(calls):
        return
    us = calls["us"].astype(float).to_numpy()
    fl = pd.to_numeric(calls["flops"], errors="coerce").to_numpy(dtype=float)
    by = pd.to_numeric(calls["bytes"], errors="coerce").to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tf = np.where(us > 0, fl / us / 1e6, np.nan)
        gb = np.where(us > 0, by / us / 1e3, np.nan)
    calls["tflops"] = tf
    calls["gbps"] = gb
    dts = calls["dtype"].to_numpy(dtype=object)
    if (dts == "fp32").any():
        tf32 = (dts == "fp32") & per_distinct(calls["name"], lambda n: bool(_TF32_KERNEL.search(str(n))))
        if tf32.any():
            dts = np.where(tf32, "tf32", dts).astype(object)
            calls["dtype"] = dts
    peaks = {d: _peak(spec, d) for d in set(dts)}
    peak = np.fromiter((peaks[d] for d in dts), dtype=float, count=len(dts))
    calls["peak_tflops"] = peak
    calls["pct_peak"] = np.where(calls["kind"].to_numpy() == "gemm", 100.0 * tf / peak, np.nan)
    bw = spec.mem_bw_gbps if spec and spec.mem_bw_gbps else np.nan
    host = per_distinct(calls["name"], lambda n: _HOST_LINK.search(str(n)))
    calls["pct_bw"] = np.where(host, np.nan, 100.0 * gb / bw)


def _peak(spec: GpuSpec | None, dtype: Any) -> float:
    if spec is None or not isinstance(dtype, str):
        return np.nan
    p = spec.peak(_PEAK_KEY.get(dtype))
    return p if p else np.nan


GEMM_TABLE_COLUMNS = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "groups", "calls", "us", "mean_us",
                      "flops", "tflops", "pct_peak", "gbps", "shape_source", "reason"]


def _gemm_table(calls: pd.DataFrame) -> pd.DataFrame:
    g = calls[calls["kind"] == "gemm"]
    if not len(g):
        return pd.DataFrame(columns=GEMM_TABLE_COLUMNS)
    g = g.copy()
    keys = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "groups", "shape_source"]
    for c in ("m", "n", "k", "batch", "groups"):
        g[c] = pd.to_numeric(g[c], errors="coerce").fillna(-1).astype(np.int64)
    g["dtype"] = g["dtype"].fillna("")
    g["reason"] = g["reason"].fillna("")
    g["flops"] = pd.to_numeric(g["flops"], errors="coerce")
    g["bytes"] = pd.to_numeric(g["bytes"], errors="coerce")
    known = g["shape_source"] != "unknown"
    # unknown shapes: one row per (class, reason)
    g.loc[~known, "op_name"] = g.loc[~known, "op_name"].fillna("")
    agg = g.groupby(keys + ["reason"], sort=False, dropna=False).agg(
        calls=("us", "size"), us=("us", "sum"), flops=("flops", lambda s: s.sum(min_count=len(s))),
        bytes=("bytes", lambda s: s.sum(min_count=len(s))),
        peak=("peak_tflops", "first")).reset_index()
    agg["mean_us"] = agg["us"] / agg["calls"]
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["tflops"] = np.where(agg["us"] > 0, agg["flops"] / agg["us"] / 1e6, np.nan)
        agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
    agg["pct_peak"] = 100.0 * agg["tflops"] / agg["peak"]
    for c in ("m", "n", "k", "batch", "groups"):
        agg[c] = agg[c].astype(object).where(agg[c] >= 0, None)
    agg["dtype"] = agg["dtype"].replace("", None)
    return agg.sort_values("us", ascending=False)[GEMM_TABLE_COLUMNS].reset_index(drop=True)


MEMORY_TABLE_COLUMNS = ["family", "cls", "dtypes", "calls", "bytes", "us", "gbps", "pct_bw", "reason"]


def _memory_table(calls: pd.DataFrame, spec: GpuSpec | None) -> pd.DataFrame:
    mcalls = calls[(calls["kind"] == "memory") & calls["bytes"].notna()]
    if not len(mcalls):
        return pd.DataFrame(columns=MEMORY_TABLE_COLUMNS)
    m = mcalls.copy()
    # a family is one full kernel name: kernels that differ only in template arguments (the dtype a copy
    # casts to, tile sizes) are different kernels and keep their own rows
    m["family"] = m["name"].astype(str)
    m["bytes"] = m["bytes"].astype(float)
    m["host"] = per_distinct(m["name"], lambda n: _HOST_LINK.search(str(n)))
    agg = m.groupby(["family", "cls"], sort=False).agg(
        calls=("us", "size"), bytes=("bytes", "sum"), us=("us", "sum"), host=("host", "any"),
        dtypes=("dtype", lambda s: sorted({x for x in s if isinstance(x, str) and x}))).reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
    bw = spec.mem_bw_gbps if spec and spec.mem_bw_gbps else None
    agg["pct_bw"] = np.where(agg["host"] | (bw is None), np.nan, 100.0 * agg["gbps"] / (bw or 1.0))
    agg["reason"] = np.where(agg["host"], "host link copy: not bounded by device memory bandwidth",
                             "" if bw else "GPU not in the spec table")
    return agg.sort_values("us", ascending=False)[MEMORY_TABLE_COLUMNS].reset_index(drop=True)


# ----------------------------------------------------------------------------- MoE

def _moe(a: Analysis, calls: pd.DataFrame) -> dict[str, Any]:
    rm = a.run_model
    experts, ekey = rm.value("experts"), rm.describe("experts")
    topk, tkey = rm.value("top_k"), rm.describe("top_k")
    sel = a.selected
    toks = sel["toks"].where(sel["toks"] >= 0, sel["bs"]) if "toks" in sel else sel["bs"]
    toks = toks[toks >= 0]
    tokens = float(np.median(toks)) if len(toks) else None
    out: dict[str, Any] = {"experts": experts, "topk": topk, "tokens": tokens,
                           "experts_key": ekey, "topk_key": tkey}
    mc = calls[(calls["kind"] == "gemm") & calls["moe"].astype(bool)] if len(calls) else calls
    known = mc[mc["m"].notna()] if len(mc) else mc
    if len(known):
        m = known["m"].astype(float) / known["groups"].astype(float)
        sources = sorted(set(known["shape_source"]))
        grouped = bool((known["groups"].astype(float) > 1).any())
        dist = m.round(2).value_counts().sort_index()
        out["per_expert_m"] = {
            "value": round(float(m.mean()), 2), "min": round(float(m.min()), 2), "max": round(float(m.max()), 2),
            "source": sources[0] if len(sources) == 1 else "+".join(sources),
            "reason": ("shapes (mean over experts): rows of the grouped GEMM / experts" if grouped else
                       "M of each per-expert GEMM call, from its recorded shapes"
                       + (" (recovered from the graph-capture trace)" if "graph_capture" in sources else "")),
            "calls": len(known), "distribution": {str(k): int(v) for k, v in dist.items()},
        }
        if len(known) < len(mc):
            out["per_expert_m"]["reason"] += f"; {len(mc) - len(known)} MoE GEMM calls without shapes left out"
        return out
    if experts and topk and tokens is not None:
        v = tokens * topk / experts
        out["per_expert_m"] = {
            "value": round(v, 2), "min": None, "max": None, "source": "server_metadata",
            "reason": (f"tokens x top-k / experts = {tokens:g} x {topk} / {experts} (tokens: median bs= of the "
                       f"analysed steps; top-k {tkey}; experts {ekey}; assumes balanced routing)" + (f"; shapes unknown: {mc['reason'].iloc[0]}" if len(mc) else "")),
        }
        return out
    missing = [n for n, v in (("token count (bs= in step names)", tokens), ("experts", experts),
                              ("top-k", topk)) if v is None]
    g = calls[calls["kind"] == "gemm"] if len(calls) else calls
    blind = g[g["shape_source"] == "unknown"] if len(g) else g
    if not len(mc) and not len(blind) and experts is None:
        why = "no MoE GEMM kernels in the analysed steps and no expert count (server_info or --experts)"
    else:
        first = mc if len(mc) else blind
        why = ("could not be decided: no recorded shapes show the expert GEMMs"
               + (f" ({first['reason'].iloc[0]})" if len(first) else "")
               + f" and the server metadata lacks {', '.join(missing)}")
    out["per_expert_m"] = {"value": None, "min": None, "max": None, "source": "unknown", "reason": why}
    return out
