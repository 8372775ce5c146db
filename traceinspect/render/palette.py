"""One colour per kernel class and per finding severity, shared by every renderer (HTML, Perfetto).

Kept as data so a class added to the classifier gets a stable colour without touching the charts:
classes not listed here get one from ``EXTRA`` picked by a hash of their name.
"""

from __future__ import annotations

import hashlib

# Families share a hue: GEMMs blue, MoE teal, attention and KV writes purple, comm orange, casts and
# quantization red-pink (the usual suspects stand out), small ops green/brown/tan, copies grey.
CLASS_COLORS: dict[str, str] = {
    "attention": "#6a3d9a",
    "kv_write": "#b39ddb",
    "kv_cast": "#d62728",
    "dtype_cast": "#f28e8e",
    "quantize": "#f6c3cf",
    "bf16_gemm": "#1f5fa8",
    "fp8_gemm": "#4b93d1",
    "fp4_gemm": "#9cc7ec",
    "fp32_gemm": "#0b3a6e",
    "conv": "#17becf",
    "moe_gemm": "#137a78",
    "moe_dispatch": "#6cc3b8",
    "comm": "#f08c00",
    "norm": "#5f8a24",
    "rotary": "#a9c95f",
    "activation": "#8c564b",
    "elementwise": "#c4a484",
    "sampling": "#e3c01c",
    "memcpy": "#6e6e6e",
    "memset": "#a5a5a5",
    "other": "#cfcfcf",
}

# Colours for classes this table does not know (stable per name).
EXTRA: tuple[str, ...] = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354",
                          "#756bb1", "#636363", "#e6550d")

# Critical-path parts that are not kernels: waiting in a collective for a late peer, and GPU idle
# waiting for the host to launch.
PATH_COLORS: dict[str, str] = {"comm_wait": "#f4c8a6", "host": "#5b6270"}

IDLE_COLOR = "#ffffff"
IDLE_STROKE = "#9a9a9a"

SEVERITY_COLORS: dict[str, str] = {"critical": "#b3261e", "warning": "#a86400", "info": "#2b6594"}
SEVERITY_ORDER: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}

# Chrome-trace reserved colour names closest to each family (chrome://tracing ignores arbitrary hex).
CHROME_CNAME: dict[str, str] = {
    "attention": "rail_animation", "kv_write": "rail_animation", "kv_cast": "terrible", "bf16_gemm": "thread_state_running",
    "fp8_gemm": "thread_state_running", "fp4_gemm": "thread_state_running", "fp32_gemm": "thread_state_running",
    "conv": "thread_state_running", "moe_gemm": "good",
    "moe_dispatch": "good", "comm": "rail_load", "dtype_cast": "terrible", "quantize": "bad",
    "norm": "olive", "rotary": "olive", "activation": "thread_state_iowait", "elementwise": "generic_work",
    "sampling": "rail_idle", "memcpy": "grey", "memset": "grey", "other": "white",
}


def class_color(cls: str) -> str:
    """The fill colour of a kernel class (stable for classes not in the table)."""
    c = CLASS_COLORS.get(cls)
    if c is not None:
        return c
    h = int(hashlib.sha1(cls.encode("utf-8", "replace")).hexdigest()[:8], 16)
    return EXTRA[h % len(EXTRA)]


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (a #rrggbb colour)."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if (0.299 * r + 0.587 * g + 0.114 * b) > 150 else "#ffffff"


def severity_color(severity: str) -> str:
    return SEVERITY_COLORS.get(severity, "#555555")
