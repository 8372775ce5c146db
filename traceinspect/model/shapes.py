"""Decoded op inputs: what one CPU op computes (FLOPs, bytes, GEMM dimensions, dtypes), from its recorded
``Input Dims`` / ``Input type`` / ``Concrete Inputs``, decoded once per distinct value (:class:`ShapeCache`).

The dtype table here (PyTorch's ``Input type`` strings -> dtype key and bytes per stored element) is the one
the stages read recorded dtypes with.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import numpy as np
import pandas as pd

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


def dtype_of(type_str: str | None) -> tuple[str, float] | None:
    """(dtype key, bytes per stored element) of a PyTorch ``Input type`` string, or None."""
    if not type_str:
        return None
    return _DTYPES.get(type_str)


class Shape(msgspec.Struct, frozen=True):
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
        s = msgspec.structs.replace(s, bytes=s.bytes + scale_bytes)
    else:
        s = msgspec.structs.replace(s, note="output dtype not recorded: bytes unknown")
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


def _tensors(dims: list[Any], types: list[Any]) -> list[tuple[list[int], str, float]]:
    """Every tensor argument with a recorded shape and a known dtype: (dims, dtype, bytes per element)."""
    out = []
    for i, d in enumerate(dims):
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d) and i < len(types):
            dt = dtype_of(types[i]) if isinstance(types[i], str) else None
            if dt is not None:
                out.append((d, dt[0], dt[1]))
    return out


def _pointwise(dims, types, concrete) -> tuple[Shape, ...]:
    # a pointwise op reads every tensor argument and writes one of their broadcast shape (an in-place one
    # writes its first argument): a lower bound of the bytes it moves
    ts = _tensors(dims, types)
    if not ts:
        raise _NoShape("no tensor argument with a recorded shape")
    try:
        out = tuple(int(x) for x in np.broadcast_shapes(*(tuple(d) for d, _, _ in ts)))
    except ValueError:
        raise _NoShape("arguments do not broadcast") from None
    read = sum(_prod(d) * e for d, _, e in ts)
    return (Shape("memory", f"{ts[0][1]}->{ts[0][1]}", bytes=read + _prod(list(out)) * ts[0][2]),)


def _reads_all(dims, types, concrete) -> tuple[Shape, ...]:
    # a reduction, or a fused kernel whose arguments are each read or written once (norms, activation-and-
    # multiply): the sum of its tensor arguments, a lower bound of what it moves
    ts = _tensors(dims, types)
    if not ts:
        raise _NoShape("no tensor argument with a recorded shape")
    return (Shape("memory", f"{ts[0][1]}->{ts[0][1]}", bytes=float(sum(_prod(d) * e for d, _, e in ts))),)


_POINTWISE = ("add", "sub", "mul", "div", "pow", "rsqrt", "sqrt", "silu", "gelu", "neg", "exp", "sigmoid", "tanh",
              "relu", "reciprocal", "clamp", "where", "_softmax", "_log_softmax", "add_", "sub_", "mul_", "div_",
              "silu_", "relu_", "clamp_")
_READS_ALL = ("aten::mean", "aten::sum", "aten::amax", "aten::max", "aiter::rmsnorm", "aiter::add_rmsnorm",
              "sgl_kernel::rmsnorm", "sgl_kernel::fused_add_rmsnorm", "sgl_kernel::gemma_rmsnorm",
              "sgl_kernel::silu_and_mul", "sgl_kernel::gelu_and_mul", "sgl_kernel::gelu_tanh_and_mul",
              "_C::rms_norm", "_C::fused_add_rms_norm", "_C::silu_and_mul", "vllm::rms_norm")

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
    **{f"aten::{n}": _pointwise for n in _POINTWISE}, **dict.fromkeys(_READS_ALL, _reads_all),
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


# lower-cased "Input type" strings -> bytes per element (tensor sizes of the run model and the judge)
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "c10::float8_e4m3fn": 1,
    "c10::float8_e5m2": 1, "c10::float8_e4m3fnuz": 1, "c10::float8_e5m2fnuz": 1, "c10::float8_e8m0fnu": 1,
    "unsigned char": 1, "signed char": 1, "char": 1, "short": 2, "int": 4, "long": 8, "long int": 8,
    "bool": 1, "c10::float4_e2m1fn_x2": 1, "c10::complex<float>": 8,
}


def dims(raw: Any) -> list[Any] | None:
    """Decoded recorded dims/types (raw JSON bytes or already decoded), or None."""
    if raw is None:
        return None
    try:
        v = json.loads(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    except (ValueError, TypeError):
        return None
    return v if isinstance(v, list) else None


def tensor_bytes(shape: list[int], dtype: str | None) -> int | None:
    """Bytes of a tensor of ``shape`` and recorded dtype (None for an unknown dtype)."""
    if dtype is None:
        return None
    size = DTYPE_BYTES.get(dtype.lower())
    if size is None:
        return None
    return int(np.prod(shape, dtype=np.float64)) * size


# ----------------------------------------------------------------------------- op rows


def decode_json(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return None


_CAST_SOURCE_ARG = {"aten::copy_": 1, "aten::copy": 1, "aten::to": 0, "aten::_to_copy": 0, "aten::type_as": 0}


def op_tensors(dims: Any, types: Any) -> list[tuple[int, list[int], str]]:
    """(argument index, shape, dtype) of each tensor argument of one op."""
    out: list[tuple[int, list[int], str]] = []
    if not isinstance(dims, list):
        return out
    types = types if isinstance(types, list) else []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) and isinstance(types[i], str) else ""
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            out.append((i, d, t.replace("c10::", "")))
    return out


def _equality_codes(values: np.ndarray) -> np.ndarray | None:
    """Codes (>= 0) of an object array, equal where the values are equal, None its own value; None when a
    value is not hashable or is a missing value other than None (NaN equals nothing, not even NaN)."""
    try:
        codes = pd.factorize(values)[0].astype(np.int64, copy=True)
    except TypeError:
        return None
    na = codes < 0
    if na.any():
        if any(v is not None for v in values[na].tolist()):
            return None
        codes[na] = int(codes.max()) + 1
    return codes


class OpInputs:
    """Decoded recorded shapes of CPU ops (lazily, per op row)."""

    def __init__(self, ops: pd.DataFrame) -> None:
        self.ops = ops
        self.parent = ops["parent"].to_numpy() if "parent" in ops else np.full(len(ops), -1)
        self.dims = ops["input_dims"].to_numpy(dtype=object) if "input_dims" in ops else None
        self.types = ops["input_types"].to_numpy(dtype=object) if "input_types" in ops else None
        self.names = ops["name"].to_numpy(dtype=object)
        self._cache: dict[int, list[tuple[int, list[int], str]]] = {}
        self._decoded: dict[tuple[Any, Any], list[tuple[int, list[int], str]]] = {}

    def tensors(self, i: int) -> list[tuple[int, list[int], str]]:
        if i not in self._cache:
            if self.dims is None:
                self._cache[i] = []
            else:
                key = (self.dims[i], self.types[i] if self.types is not None else None)
                try:
                    hit = self._decoded.get(key)  # ops recorded with equal shapes decode once
                except TypeError:  # not raw JSON bytes: decode as is
                    hit = op_tensors(decode_json(key[0]), decode_json(key[1]))
                if hit is None:
                    hit = self._decoded[key] = op_tensors(decode_json(key[0]), decode_json(key[1]))
                self._cache[i] = hit
        return self._cache[i]

    def chain(self, i: int, depth: int = 3) -> list[int]:
        """The op and up to ``depth`` enclosing ops."""
        out = []
        while i >= 0 and len(out) <= depth:
            out.append(int(i))
            i = int(self.parent[i])
        return out

    def signature_codes(self, ops: np.ndarray, depth: int = 8) -> np.ndarray:
        """One integer per op of ``ops`` (op indices >= 0), equal where the op and up to ``depth`` enclosing
        ops recorded the same (name, raw shapes, raw types), so that every shape test over that chain reads
        them alike; an op whose recorded values are not raw JSON (not hashable) has a code of its own per op
        index. The chains are walked for all ops at once and each op on them is hashed once."""
        ops = np.asarray(ops, dtype=np.int64)
        if not len(ops):
            return np.zeros(0, dtype=np.int64)
        levels = [ops]
        for _ in range(depth):
            cur = levels[-1]
            levels.append(np.where(cur >= 0, self.parent[np.maximum(cur, 0)], -1))
        chain = np.stack(levels, axis=1)  # -1 past the end of a chain
        on_chain, at = np.unique(chain, return_inverse=True)
        at = at.reshape(chain.shape)
        op_code = np.full(len(on_chain), -1, dtype=np.int64)  # -1: past the end of a chain
        live = on_chain >= 0
        op_code[live] = self._op_codes(on_chain[live])
        codes = op_code[at]
        sig = np.zeros(len(ops), dtype=np.int64)
        for c in codes.T + 2:  # one code per distinct row of ``codes``, combined level by level
            sig = pd.factorize(sig * (int(c.max()) + 1) + c)[0].astype(np.int64, copy=False)
        unhashable = (codes == -2).any(axis=1)
        if unhashable.any():
            _, own = np.unique(ops[unhashable], return_inverse=True)
            sig[unhashable] = int(sig.max()) + 1 + own.reshape(-1)
        return sig

    def _op_codes(self, ops: np.ndarray) -> np.ndarray:
        """One code per distinct recorded (name, dims, types) of the ops; -2 where one is not hashable."""
        cols = [self.names[ops], *(v[ops] for v in (self.dims, self.types) if v is not None)]
        key = np.zeros(len(ops), dtype=np.int64)
        for col in cols:
            c = _equality_codes(col)
            if c is None:  # an unhashable value, or a missing one other than None: op by op
                seen: dict[tuple[Any, ...], int] = {}
                out = np.empty(len(ops), dtype=np.int64)
                for n, item in enumerate(zip(*(v.tolist() for v in cols), strict=True)):
                    try:
                        out[n] = seen.setdefault(item, len(seen))
                    except TypeError:
                        out[n] = -2
                return out
            key = pd.factorize(key * (int(c.max(initial=0)) + 1) + c)[0].astype(np.int64, copy=False)
        return key

    def has_shapes(self, i: int) -> bool:
        return any(self.tensors(j) for j in self.chain(i))

    def read(self, i: int) -> list[tuple[list[int], str]]:
        """Tensors op ``i`` reads as a cast source (copy_'s src; else every tensor argument)."""
        name = str(self.names[i])
        arg = _CAST_SOURCE_ARG.get(name)
        return [(s, d) for a, s, d in self.tensors(i) if arg is None or a == arg]

    def written(self, i: int) -> list[tuple[list[int], str]]:
        """The tensor an in-place scatter op writes (its first argument)."""
        return [(s, d) for a, s, d in self.tensors(i) if a == 0]
