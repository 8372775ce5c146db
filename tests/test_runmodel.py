"""The run model: one place per fact, each source winning where it should."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import copy_set, fixture_dir, real_trace

from traceinspect.classify.runfacts import decide, longest_period
from traceinspect.errors import ConfigError
from traceinspect.model.run import user_facts


def run_model(d: Path, **user: int):
    """The run model of a trace set as the pipeline decides it (load, link, steps, graphs, classify)."""
    from traceinspect.classify import classify_kernels, recover_graph_ops
    from traceinspect.link import link
    from traceinspect.load import load_trace_set
    from traceinspect.steps import build_steps

    ts = load_trace_set([str(d)], use_cache=False)
    link(ts)
    steps = build_steps(ts)
    return classify_kernels(ts, steps, graph_ops=recover_graph_ops(ts), user=user_facts(**user))


def _set(tmp: Path, name: str, edit=None, capture: bool = False) -> Path:
    src = fixture_dir(name)
    d = copy_set(src, tmp / name)
    if capture and (src / "graph_capture_profile").is_dir():
        import shutil

        shutil.copytree(src / "graph_capture_profile", d / "graph_capture_profile")
    if edit is not None:
        si = json.loads((d / "server_info.json").read_text())
        edit(si)
        (d / "server_info.json").write_text(json.dumps(si))
    return d


def test_longest_period_finds_the_block_not_a_repetition_inside_it() -> None:
    block = [1, 2, 3, 9, 9, 9, 9, 9, 9, 4, 5]  # an inner run of 9s (an expert loop) inside the layer
    seq = np.array([7, 8] + block * 6 + [6, 6, 0])
    p, reps, start = longest_period(seq)
    assert (p, reps, start) == (len(block), 6, 2)
    assert longest_period(np.arange(20))[1] == 0  # nothing repeats


def test_each_source_wins_where_it_should(tmp_path: Path) -> None:
    name = "kv-full-cast-eager"
    # the model config in server_info.json
    rm = run_model(fixture_dir(name))
    assert (rm.value("layers"), rm.source("layers")) == (4, "server_info")
    assert (rm.value("experts"), rm.source("experts")) == (16, "server_info")
    assert (rm.value("kv_pool_tokens"), rm.source("kv_pool_tokens")) == (524288, "server_info")
    assert (rm.value("kv_row_bytes"), rm.source("kv_row_bytes")) == (576, "shapes")
    assert rm.facts["layers"].confidence == "high" and rm.source("tp_size") == "server_info"
    # the user beats server_info
    rm = run_model(fixture_dir(name), layers=61, experts=256, top_k=8)
    assert (rm.value("layers"), rm.source("layers"), rm.facts["layers"].detail) == (61, "user", "--layers")
    assert (rm.value("experts"), rm.source("experts")) == (256, "user")
    # SGLang's server_info without model_info: recorded shapes and the trace's structure
    d = _set(tmp_path, name, lambda si: si.pop("model_info"))
    rm = run_model(d)
    assert (rm.value("layers"), rm.source("layers")) == (4, "trace_structure")
    assert (rm.value("experts"), rm.source("experts")) == (16, "shapes")
    assert (rm.value("top_k"), rm.source("top_k")) == (8, "shapes")
    assert (rm.value("hidden_size"), rm.source("hidden_size")) == (2048, "shapes")
    # no server_info at all: the pool is the per-layer tensor that is both indexed and cast; TP from the names
    d = copy_set(fixture_dir(name), tmp_path / "bare")
    (d / "server_info.json").unlink()
    rm = run_model(d)
    assert (rm.value("kv_pool_tokens"), rm.source("kv_pool_tokens")) == (524288, "shapes")
    assert (rm.value("kv_row_bytes"), rm.value("kv_cache_dtype")) == (576, "float8_e4m3fn")
    assert (rm.value("tp_size"), rm.source("tp_size")) == (2, "file_names")
    assert (rm.value("page_size"), rm.source("page_size"), rm.facts["page_size"].confidence) == (1, "default", "low")
    # CUDA-graph replay, no capture trace, no server_info: undecided, and it says how to supply it
    d = copy_set(fixture_dir("kv-full-cast-graph"), tmp_path / "bare-graph")
    (d / "server_info.json").unlink()
    rm = run_model(d)
    assert rm.value("kv_pool_tokens") is None and "traceinspect capture" in rm.missing("kv_pool_tokens")
    assert rm.value("kv_row_bytes") is None


def test_capture_trace_shapes_give_the_kv_row_of_graph_sets(tmp_path: Path) -> None:
    d = _set(tmp_path, "kv-full-cast-graph", lambda si: si.pop("model_info"), capture=True)
    rm = run_model(d)
    assert (rm.value("kv_row_bytes"), rm.source("kv_row_bytes")) == (576, "capture_trace")
    (d / "server_info.json").unlink()
    rm = run_model(d)
    assert (rm.value("kv_pool_tokens"), rm.source("kv_pool_tokens")) == (524288, "capture_trace")
    assert rm.source("kv_row_bytes") == "capture_trace"
    assert (rm.value("experts"), rm.source("experts")) == (16, "capture_trace")
    assert (rm.value("layers"), rm.source("layers")) == (4, "trace_structure")


def test_config_file_and_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "traceinspect.toml"
    cfg.write_text("[model]\nlayers = 12\nexperts = 64\ntop-k = 6\n")
    assert user_facts(config=cfg) == {"layers": (12, f"{cfg} [model]"), "experts": (64, f"{cfg} [model]"),
                                      "top_k": (6, f"{cfg} [model]")}
    assert user_facts(layers=7, config=cfg)["layers"] == (7, "--layers")  # a flag beats the file
    assert user_facts(cwd=tmp_path)["experts"][0] == 64  # ./traceinspect.toml is read when present
    cfg.write_text("[model]\nlayers = 0\n")
    with pytest.raises(ConfigError, match="model.layers must be a positive integer"):
        user_facts(config=cfg)
    cfg.write_text("[model]\nlayer = 3\n")
    with pytest.raises(ConfigError, match="unknown key"):
        user_facts(config=cfg)


def test_cli_flags_reach_the_json(tmp_path: Path) -> None:
    from conftest import run_cli

    out = tmp_path / "a.json"
    r = run_cli("analyze", str(fixture_dir("kv-full-cast-eager")), "--layers", "8", "--json", str(out), "-q")
    assert r.returncode == 0, r.stderr
    facts = json.loads(out.read_text())["run"]["facts"]
    assert facts["layers"] == {"value": 8, "source": "user", "confidence": "high", "detail": "--layers"}
    assert set(facts["kv_pool_tokens"]) == {"value", "source", "confidence", "detail"}


def test_layers_from_structure_on_a_real_trace() -> None:
    """HF inference of Qwen1.5-0.5B-Chat (24 decoder layers) on an H100, written by another tool."""
    rm = run_model(real_trace("tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"))
    f = rm.facts["layers"]
    assert (f.value, f.source, f.confidence) == (24, "trace_structure", "high"), f
    assert "checked: attention 24 per step" in f.detail


def test_one_place_per_fact() -> None:
    """The facts are not defined anywhere else: no second layer count, expert-key list or server_info
    reader for them in the stages."""
    root = Path(__file__).resolve().parents[1] / "traceinspect"
    for p in root.rglob("*.py"):
        # the run model: its types and server_info reader, and deciding it
        if p.relative_to(root).as_posix() in ("model/run.py", "classify/runfacts.py") or "capture" in p.parts:
            continue
        text = p.read_text()
        for needle in ('.get("num_hidden_layers"', '.get("max_total_num_tokens"', 'si.get("kv_cache_dtype"',
                       '.get("model_info"', '"n_routed_experts",', "_EXPERT_KEYS", '.get("page_size"'):
            assert needle not in text, (p, needle)


def test_decide_on_a_bare_trace_set() -> None:
    from types import SimpleNamespace as NS

    import pandas as pd

    ts = NS(server_info=None, ranks=[NS(rank=0)], kernels=pd.DataFrame(), cpu_ops=pd.DataFrame())
    rm = decide(ts)
    assert rm.value("layers") is None and "--layers" in rm.missing("layers")
    assert set(rm.to_json()) >= {"layers", "kv_pool_tokens", "kv_cache_dtype", "page_size", "kv_row_bytes",
                                 "experts", "top_k", "tp_size", "pp_size", "ep_size", "batch"}
