"""The model's Hugging Face config fields that the analysis reads (layers, experts, top-k, hidden size,
vocabulary, KV latent sizes), for ``server_info.json``'s ``model_config`` block.

SGLang's ``/server_info`` and ``/model_info`` do not carry them. ``/model_info`` answers of servers that
add config fields are used as they are; otherwise, when the server runs on this machine, the model's
``config.json`` is read from ``model_path`` (a local directory) or from the Hugging Face cache
(``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FIELDS = ("num_hidden_layers", "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts",
          "num_experts_per_tok", "moe_top_k", "moe_topk", "first_k_dense_replace", "hidden_size", "vocab_size",
          "num_attention_heads", "num_key_value_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
          "intermediate_size", "moe_intermediate_size", "model_type", "architectures", "torch_dtype",
          # what rules/tables/architectures.yaml derives the GEMM shapes from
          "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_shared_experts", "moe_layer_freq",
          "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "experts_per_token",
          "quantization_config")
MAX_CONFIG_BYTES = 4 << 20


def pick(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of FIELDS present in a config (and in its ``text_config``, for multimodal models)."""
    out = {k: config[k] for k in FIELDS if k in config and isinstance(config[k], (int, str, list, dict))
           and not isinstance(config[k], bool)}
    tc = config.get("text_config")
    if isinstance(tc, dict):
        sub = pick(tc)
        if sub:
            out["text_config"] = sub
    return out


def _hub_dirs() -> list[Path]:
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def config_path(model_path: str) -> Path | None:
    """The config.json of ``model_path``: in it when it is a directory, else the newest snapshot of a
    ``org/name`` repository in the Hugging Face cache."""
    p = Path(model_path).expanduser()
    if p.is_dir():
        c = p / "config.json"
        return c if c.is_file() else None
    if model_path.count("/") != 1 or model_path.startswith(("/", ".")):
        return None
    repo = "models--" + model_path.replace("/", "--")
    for hub in _hub_dirs():
        snaps = hub / repo / "snapshots"
        if snaps.is_dir():
            cands = sorted(snaps.glob("*/config.json"), key=lambda c: c.stat().st_mtime, reverse=True)
            if cands:
                return cands[0]
    return None


def model_config(server_info: dict[str, Any], model_info: dict[str, Any] | None,
                 local: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(the ``model_config`` block, where it came from) or (None, why not)."""
    fields = pick(model_info or {})
    if "num_hidden_layers" in fields:
        return {**fields, "source": "/model_info"}, None
    model_path = server_info.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        return None, "server_info has no model_path"
    if not local:
        return None, "the server is not on this machine: its model config cannot be read"
    path = config_path(model_path)
    if path is None:
        return None, f"no config.json for {model_path} (not a local directory, not in the Hugging Face cache)"
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None, f"{path} is too large for a model config"
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"cannot read {path}: {e}"
    if not isinstance(cfg, dict):
        return None, f"{path} is not a JSON object"
    fields = pick(cfg)
    return ({**fields, "source": str(path)}, None) if fields else (None, f"{path} has none of the fields read")
