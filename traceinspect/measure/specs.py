"""GPU spec table (``rules/tables/gpus.yaml``): dense peak TFLOP/s per dtype and memory bandwidth, and the
matching of a trace's device (``deviceProperties`` name / compute capability) to one entry."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from traceinspect.errors import ConfigError
from traceinspect.resources import lazy_module, load_yaml

yaml = lazy_module("yaml")

DTYPES = ("fp4", "fp8", "fp16", "bf16", "tf32", "fp32")


class GpuSpec(msgspec.Struct):
    """One GPU model: dense peak TFLOP/s per dtype and peak memory bandwidth (GB/s)."""

    name: str
    match: list[str] = msgspec.field(default_factory=list)  # regexes against deviceProperties.name
    compute_capability: str | None = None
    peak_tflops: dict[str, float] = msgspec.field(default_factory=dict)
    mem_bw_gbps: float | None = None
    source: str = ""

    def peak(self, dtype: str | None) -> float | None:
        """Dense peak TFLOP/s for ``dtype`` (fp4/fp8/fp16/bf16/tf32/fp32), or None when the table has none."""
        if dtype is None:
            return None
        return self.peak_tflops.get(dtype)

    def matches_name(self, name: str) -> bool:
        return any(re.search(p, name, re.IGNORECASE) for p in self.match)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "compute_capability": self.compute_capability,
                "peak_tflops": dict(self.peak_tflops), "mem_bw_gbps": self.mem_bw_gbps, "source": self.source}


def _default_path() -> Path:
    from traceinspect.resources import tables_dir

    return tables_dir() / "gpus.yaml"


def _parse(doc: Any, path: Path) -> list[GpuSpec]:
    entries = doc.get("gpus") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ConfigError("GPU spec file must hold a list under 'gpus:'", path)
    out = []
    for n, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ConfigError(f"GPU spec entry {n} has no 'name'", path)
        where = f"GPU spec {e['name']!r}"
        match = e.get("match", [])
        if isinstance(match, str):
            match = [match]
        if not isinstance(match, list) or not all(isinstance(m, str) for m in match):
            raise ConfigError(f"{where}: 'match' must be a list of regexes", path)
        for m in match:
            try:
                re.compile(m)
            except re.error as err:
                raise ConfigError(f"{where}: bad regex {m!r}: {err}", path) from None
        peaks = e.get("peak_tflops") or {}
        if not isinstance(peaks, dict):
            raise ConfigError(f"{where}: 'peak_tflops' must map dtype -> TFLOP/s", path)
        clean: dict[str, float] = {}
        for k, v in peaks.items():
            if k not in DTYPES:
                raise ConfigError(f"{where}: unknown dtype {k!r} (known: {', '.join(DTYPES)})", path)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{where}: peak_tflops.{k} must be a positive number", path)
            clean[k] = float(v)
        bw = e.get("mem_bw_gbps")
        if bw is not None and (not isinstance(bw, (int, float)) or isinstance(bw, bool) or bw <= 0):
            raise ConfigError(f"{where}: mem_bw_gbps must be a positive number", path)
        cc = e.get("compute_capability")
        out.append(GpuSpec(name=e["name"], match=match, compute_capability=None if cc is None else str(cc),
                           peak_tflops=clean, mem_bw_gbps=None if bw is None else float(bw),
                           source=str(e.get("source", ""))))
    return out


def load_gpu_specs(path: str | Path | None = None) -> list[GpuSpec]:
    """Read a GPU spec file (default: the shipped ``rules/tables/gpus.yaml``)."""
    p = Path(path) if path is not None else _default_path()
    try:
        doc = load_yaml(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("GPU spec file not found", p) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read GPU spec file: {e}", p) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"GPU spec file is not valid YAML: {' '.join(str(e).split())}", p) from None
    return _parse(doc, p)


_DEFAULT: list[tuple[GpuSpec, ...]] = []  # the shipped table, once read


def default_gpu_specs() -> tuple[GpuSpec, ...]:
    """The shipped spec table, read once per process."""
    if not _DEFAULT:
        _DEFAULT.append(tuple(load_gpu_specs()))
    return _DEFAULT[0]


def _looks_like_path(s: str) -> bool:
    return s.endswith((".yaml", ".yml", ".json")) or "/" in s or "\\" in s or Path(s).is_file()


def match_gpu(name: str | None, compute_capability: str | None = None,
              override: str | Path | None = None) -> GpuSpec | None:
    """The spec entry for a device, or None when it is not in the table (see :func:`resolve_gpu`
    for the reason)."""
    return resolve_gpu(name, compute_capability, override)[0]


def resolve_gpu(name: str | None, compute_capability: str | None = None,
                override: str | Path | None = None) -> tuple[GpuSpec | None, str]:
    """The spec entry for a device and how it was chosen, or None and why none could be.

    ``override`` is a name in the table (case-insensitive) or a path to a YAML spec file; a file
    with a single entry is used as is, one with several is matched against the device like the
    default table.
    """
    specs: list[GpuSpec]
    if override is not None:
        ov = str(override)
        if isinstance(override, Path) or _looks_like_path(ov):
            specs = load_gpu_specs(ov)
            if len(specs) == 1:
                return specs[0], f"from --gpu file {ov}"
            spec, why = _match(specs, name, compute_capability)
            return spec, f"{why} (table {ov})"
        for s in default_gpu_specs():
            if s.name.lower() == ov.lower():
                return s, f"--gpu {ov}"
        names = ", ".join(s.name for s in default_gpu_specs())
        raise ConfigError(f"--gpu {ov!r} is neither a GPU in the spec table ({names}) nor a YAML file")
    return _match(list(default_gpu_specs()), name, compute_capability)


def _match(specs: list[GpuSpec], name: str | None, cc: str | None) -> tuple[GpuSpec | None, str]:
    if name:
        for s in specs:
            if s.matches_name(name):
                if cc and s.compute_capability and cc != s.compute_capability:
                    return s, (f"device name {name!r} (it reports compute capability {cc}, the table "
                               f"{s.compute_capability}: pass --gpu if this is another part)")
                return s, f"device name {name!r}"
    if cc:
        same = [s for s in specs if s.compute_capability == cc]
        if len(same) == 1:
            return same[0], f"compute capability {cc} (device name {name!r} not in the table)"
        if len(same) > 1:
            return None, (f"device {name!r} is not in the GPU table and compute capability {cc} fits "
                          f"{', '.join(s.name for s in same)}: pass --gpu NAME or --gpu FILE.yaml")
    if not name and not cc:
        return None, "the trace has no deviceProperties: pass --gpu NAME or --gpu FILE.yaml"
    return None, (f"device {name!r} (compute capability {cc}) is not in the GPU table: "
                  "pass --gpu NAME or --gpu FILE.yaml")
