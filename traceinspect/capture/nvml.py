"""GPU power, clocks and utilization sampled through NVML while a sweep measures (``pip install
traceinspect[gpu]``: nvidia-ml-py, imported only when a sweep samples).

Which GPUs: the server's, where it runs on this machine. SGLang gives its scheduler processes GPUs
``base_gpu_id``, ``base_gpu_id + gpu_id_step``, ... (one per rank); those are indices as the server sees
them, which are NVML's only when the server was started without ``CUDA_VISIBLE_DEVICES`` remapping them
(``--gpus`` names them otherwise).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from traceinspect.model.run import ServerInfo


def load_nvml() -> tuple[Any, str | None]:
    """(the ``pynvml`` module, initialised) or (None, why not)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "NVML is not available (pip install 'traceinspect[gpu]' for nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None, f"NVML could not start ({type(e).__name__}: {e}): no NVIDIA driver on this machine?"
    return pynvml, None


def server_gpus(info: dict[str, Any], n_ranks: int) -> list[int]:
    """The GPU indices the server's ``n_ranks`` scheduler processes use (``base_gpu_id``, ``gpu_id_step``)."""
    si = ServerInfo(info)
    base = info.get("base_gpu_id")
    base = int(base) if isinstance(base, int) and not isinstance(base, bool) and base >= 0 else 0
    step = si.count("gpu_id_step") or 1
    return [base + i * step for i in range(max(1, n_ranks))]


@dataclass
class GpuSample:
    """Means over a window of one GPU's samples."""

    index: int
    name: str | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    util_pct: float | None
    samples: int


@dataclass
class GpuSampler:
    """Samples the given GPUs every ``interval_s`` on a thread between :meth:`start` and :meth:`stop`."""

    nvml: Any
    indices: list[int]
    interval_s: float = 0.2
    _rows: dict[int, list[tuple[float | None, float | None, float | None, float | None]]] = field(
        default_factory=dict)
    _handles: dict[int, Any] = field(default_factory=dict)
    _names: dict[int, str | None] = field(default_factory=dict)
    _limits: dict[int, float | None] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        n = self.nvml
        for i in self.indices:
            h = n.nvmlDeviceGetHandleByIndex(i)
            self._handles[i] = h
            self._names[i] = _call(lambda h=h: _text(n.nvmlDeviceGetName(h)))
            self._limits[i] = _call(lambda h=h: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)

    def sample_once(self) -> None:
        n = self.nvml
        for i, h in self._handles.items():
            self._rows.setdefault(i, []).append((
                _call(lambda h=h: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                _call(lambda h=h: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))),
                _call(lambda h=h: float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))),
                _call(lambda h=h: float(n.nvmlDeviceGetUtilizationRates(h).gpu)),
            ))

    def start(self) -> None:
        self._rows = {}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="traceinspect-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.sample_once()
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> list[GpuSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        out = []
        for i in self.indices:
            rows = self._rows.get(i, [])
            cols = list(zip(*rows, strict=True)) if rows else [(), (), (), ()]
            out.append(GpuSample(i, self._names.get(i), _mean(cols[0]), self._limits.get(i), _mean(cols[1]),
                                 _mean(cols[2]), _mean(cols[3]), len(rows)))
        return out


def _call(f: Any) -> Any:
    try:
        return f()
    except Exception:  # a field this GPU or driver does not report
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _mean(values: Any) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(samples: list[GpuSample]) -> dict[str, Any]:
    """One level's GPU figures: means over the server's GPUs (power per GPU), and each GPU's."""
    def avg(attr: str) -> float | None:
        return _mean([getattr(s, attr) for s in samples])

    return {
        "power_w": avg("power_w"), "power_limit_w": avg("power_limit_w"), "sm_clock_mhz": avg("sm_clock_mhz"),
        "mem_clock_mhz": avg("mem_clock_mhz"), "gpu_util_pct": avg("util_pct"),
        "gpus": [{"index": s.index, "name": s.name, "power_w": s.power_w, "power_limit_w": s.power_limit_w,
                  "sm_clock_mhz": s.sm_clock_mhz, "mem_clock_mhz": s.mem_clock_mhz, "util_pct": s.util_pct,
                  "samples": s.samples} for s in samples],
    }
