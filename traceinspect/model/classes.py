"""The kernel class ids (the ``cls`` column; the class table, ``rules/tables/kernel_classes.yaml``, assigns
them) and the groups of them that stages name."""

from __future__ import annotations

CLASSES: tuple[str, ...] = (
    "fp4_gemm", "fp8_gemm", "bf16_gemm", "fp32_gemm", "conv", "moe_gemm", "moe_dispatch", "attention", "kv_write",
    "kv_cast", "dtype_cast", "comm", "norm", "activation", "rotary", "quantize", "sampling", "memcpy",
    "elementwise", "other",
)
GEMM_CLASSES = frozenset({"fp4_gemm", "fp8_gemm", "bf16_gemm", "fp32_gemm", "moe_gemm"})
