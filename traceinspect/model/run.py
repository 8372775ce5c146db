"""The run model's types and its inputs that are not trace tables: :class:`Fact`, :class:`RunModel`, the facts the
user states (flags, ``[model]`` of ``traceinspect.toml``) and :class:`ServerInfo`, the one reader of
``server_info.json`` (parallel sizes, model-config fields, KV pool). Deciding the facts from a trace is
:mod:`traceinspect.classify.runfacts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from traceinspect.errors import ConfigError
from traceinspect.fileio import read_toml

FACTS = ("layers", "kv_pool_tokens", "kv_cache_dtype", "page_size", "kv_row_bytes", "experts", "top_k",
         "hidden_size", "vocab_size", "tp_size", "pp_size", "ep_size", "batch", "model_config", "attention_heads",
         "kv_heads", "head_dim", "gemm_shapes", "running_requests", "kv_tokens_in_use")
USER_KEYS = {"layers": "layers", "experts": "experts", "top-k": "top_k"}  # traceinspect.toml [model] -> fact
CONFIG_KEY = "config"  # traceinspect.toml [model] config = "path/to/config.json"
USER_FLAGS = {"layers": "--layers", "experts": "--experts", "top_k": "--top-k", "model_config": "--model-config"}
MAX_MODEL_CONFIG_BYTES = 4 << 20
CONFIG_NAME = "traceinspect.toml"

# model-config keys per fact, in the order they are tried (HF config names of the common families)
LAYER_KEYS = ("num_hidden_layers", "n_layers", "num_layers", "n_layer")
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_routed_experts",
               "n_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_topk", "top_k", "num_experts_per_token")
VOCAB_KEYS = ("vocab_size",)
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
MODEL_BLOCKS = ("model_config", "hf_config", "model_info")

# SGLang --kv-cache-dtype / --dtype values and recorded "Input type" strings -> PyTorch dtype names
TORCH_DTYPES = {
    "fp8_e4m3": "Float8_e4m3fn", "fp8_e4m3fn": "Float8_e4m3fn", "float8_e4m3fn": "Float8_e4m3fn",
    "fp8": "Float8_e4m3fn", "fp8_e5m2": "Float8_e5m2", "float8_e5m2": "Float8_e5m2",
    "fp4_e2m1": "Float4_e2m1fn_x2", "float4_e2m1fn_x2": "Float4_e2m1fn_x2", "bfloat16": "BFloat16",
    "bf16": "BFloat16", "float16": "Half", "fp16": "Half", "half": "Half", "float32": "float", "fp32": "float",
    "float": "float",
}


class Fact(msgspec.Struct, frozen=True):
    """One decided value: ``value`` (None when undecided), ``source``, ``confidence`` and ``detail``
    (the exact key or method; when undecided, why)."""

    value: Any
    source: str | None
    confidence: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        v = self.value
        if isinstance(v, (np.integer, np.floating)):
            v = v.item()
        return {"value": v, "source": self.source, "confidence": self.confidence, "detail": self.detail}


UNDECIDED = "none"


def undecided(reason: str) -> Fact:
    return Fact(None, None, UNDECIDED, reason)


class ModelGemms(msgspec.Struct):
    """The GEMM kernels of the analysed steps matched to the GEMMs the model config gives
    (:mod:`traceinspect.classify.modelshapes`): ``table`` indexed by kernel row (``gemm``, ``layer``, ``moe``,
    ``confidence``, ``shape``: a :class:`~traceinspect.model.shapes.Shape`), ``reason`` why nothing was matched."""

    source: str
    family: str | None = None
    plan: Any = None
    table: Any = None
    steps_matched: int = 0
    steps_failed: dict[str, int] = msgspec.field(default_factory=dict)
    reason: str = ""
    notes: set[str] = msgspec.field(default_factory=set)


class RunModel(msgspec.Struct):
    """The facts of one analysis (see the module docstring); ``config``: the model's HF config, where one was
    given or saved (``config_source`` says where), and ``gemms`` the kernels matched to its GEMMs."""

    facts: dict[str, Fact] = msgspec.field(default_factory=dict)
    config: dict[str, Any] | None = None
    config_source: str | None = None
    gemms: ModelGemms | None = None
    warnings: list[str] = msgspec.field(default_factory=list)  # evidence that disagrees (added to the trace set's)

    def value(self, name: str) -> Any:
        f = self.facts.get(name)
        return f.value if f is not None else None

    def source(self, name: str) -> str | None:
        f = self.facts.get(name)
        return f.source if f is not None else None

    def describe(self, name: str) -> str:
        """'source: detail' of a decided fact, or why it is undecided."""
        f = self.facts.get(name)
        if f is None:
            return f"{name}: not decided"
        return f.detail if f.value is None else f"{f.source}: {f.detail}"

    def missing(self, name: str) -> str | None:
        """Why a fact is undecided (None when it has a value)."""
        f = self.facts.get(name)
        if f is None:
            return f"{name} was not decided"
        return f.detail if f.value is None else None

    @property
    def kv_torch_dtype(self) -> str | None:
        """The KV cache dtype as PyTorch's "Input type" writes it, without ``c10::`` (Float8_e4m3fn)."""
        v = self.value("kv_cache_dtype")
        return TORCH_DTYPES.get(str(v).lower().replace("c10::", "")) if v is not None else None

    def to_json(self) -> dict[str, Any]:
        return {name: self.facts[name].to_json() for name in FACTS if name in self.facts}


def user_facts(layers: int | None = None, experts: int | None = None, top_k: int | None = None,
               config: str | Path | None = None, cwd: str | Path | None = None,
               model_config: str | Path | None = None) -> dict[str, tuple[Any, str]]:
    """Facts the user states: flags win over ``[model]`` of ``traceinspect.toml`` (``config``, else
    ./traceinspect.toml when present). Value -> (value, where it was stated); ``model_config`` (the
    ``--model-config`` file, else ``config`` under ``[model]``): (the model's HF config, its path)."""
    out: dict[str, tuple[Any, str]] = {}
    path = Path(config) if config is not None else Path(cwd or ".") / CONFIG_NAME
    if config is not None or path.is_file():
        for name, v in _config_model(path).items():
            if name == "model_config":
                out[name] = (read_model_config(v), str(v))
            else:
                out[name] = (v, f"{path} [model]")
    if model_config is not None:
        out["model_config"] = (read_model_config(model_config), str(model_config))
    for name, v in (("layers", layers), ("experts", experts), ("top_k", top_k)):
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{USER_FLAGS[name]} must be a positive integer, not {v!r}", "command line")
            out[name] = (v, USER_FLAGS[name])
    return out


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A model's Hugging Face ``config.json`` (ConfigError naming the file when it is unusable)."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_MODEL_CONFIG_BYTES:
            raise ConfigError("too large for a model config.json", p)
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the model config: {e.strerror or e}", p) from None
    try:
        doc = msgspec.json.decode(raw.removeprefix(b"\xef\xbb\xbf"))
    except msgspec.DecodeError as e:
        raise ConfigError(f"not a JSON model config: {e}", p) from None
    if not isinstance(doc, dict):
        raise ConfigError("a model config.json must be a JSON object", p)
    if not any(k in doc or k in (doc.get("text_config") or {}) for k in ("num_hidden_layers", "hidden_size")):
        raise ConfigError("not a Hugging Face model config (no num_hidden_layers or hidden_size)", p)
    return doc


def _config_model(path: Path) -> dict[str, Any]:
    data = read_toml(path)
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ConfigError("[model] must be a table", path)
    unknown = sorted(set(model) - set(USER_KEYS) - {CONFIG_KEY})
    if unknown:
        known = ", ".join(sorted([*USER_KEYS, CONFIG_KEY]))
        raise ConfigError(f"unknown key(s) in [model]: {', '.join(unknown)} (known: {known})", path)
    out: dict[str, Any] = {}
    if CONFIG_KEY in model:
        v = model[CONFIG_KEY]
        if not isinstance(v, str) or not v:
            raise ConfigError(f"model.{CONFIG_KEY} must be the path of the model's config.json, not {v!r}", path)
        cfg = Path(v).expanduser()
        out["model_config"] = cfg if cfg.is_absolute() else path.parent / cfg
    for key, name in USER_KEYS.items():
        if key in model:
            v = model[key]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model.{key} must be a positive integer, not {v!r}", path)
            out[name] = v
    return out


def _pos_int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and v > 0 else None


def _blocks(si: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, dict) of the model-config blocks of server_info.json, then server_info itself."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for name in MODEL_BLOCKS:
        b = si.get(name)
        if isinstance(b, dict):
            out.append((name, b))
            tc = b.get("text_config")
            if isinstance(tc, dict):
                out.append((f"{name}.text_config", tc))
    out.append(("server_info", si))
    return out


def model_int(si: Mapping[str, Any] | None, keys: Iterable[str]) -> tuple[int | None, str]:
    """The first positive integer under one of ``keys`` in the model-config blocks of server_info
    (strongest first), and 'block.key=value'."""
    if not si:
        return None, ""
    for name, b in _blocks(si):
        for key in keys:
            v = _pos_int(b.get(key))
            if v is not None:
                return v, f"{name}.{key}={v}"
    return None, ""


class ServerInfo:
    """Typed reads of one ``server_info.json`` (an empty one when there is none): every stage that needs a
    parallel size or a model-config field reads it here."""

    def __init__(self, raw: Mapping[str, Any] | None) -> None:
        self.raw: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}

    def __bool__(self) -> bool:
        return bool(self.raw)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def count(self, key: str) -> int | None:
        """A positive integer at the top level (``tp_size``, ``max_total_num_tokens``, ...), else None."""
        return _pos_int(self.raw.get(key))

    def size(self, key: str, default: int = 1) -> int:
        """A parallel size (``tp_size``, ``dp_size``, ...): the stated positive integer, else ``default``."""
        v = self.count(key)
        return v if v is not None else default

    def model_int(self, keys: Iterable[str]) -> tuple[int | None, str]:
        """See :func:`model_int`."""
        return model_int(self.raw, keys)

    def total_layers(self) -> tuple[int | None, str]:
        """The model's layer count (all pipeline stages) and 'block.key=value'."""
        return model_int(self.raw, LAYER_KEYS)

    def stage_layers(self) -> tuple[int | None, str]:
        """The layers one rank runs: the model's layer count divided by ``pp_size`` where it divides."""
        n, how = self.total_layers()
        pp = self.count("pp_size")
        if n is not None and pp and pp > 1 and n % pp == 0:
            return n // pp, f"{how} / pp_size={pp}"
        return n, how
