"""GEMM shapes from the model: a Hugging Face ``config.json``, the parallel sizes and each step's batch give
every layer's GEMMs (M, N, K, dtype, weight bytes) as an inference engineer derives them, and the GEMM
kernels of each layer are matched to them in order. This is what stands in for recorded shapes under
CUDA-graph replay without a capture trace (replayed kernels have no CPU op and no shapes).

The families (layer templates of named GEMMs with N / K expressions over config keys) are data:
``rules/tables/architectures.yaml``. The matching, per analysed step of each rank:

1. the step's GEMM-class kernels in launch order; attention computed with plain batched GEMMs (a GEMM,
   a softmax, a GEMM) is set apart as attention, not as weight GEMMs;
2. the last GEMMs are the tail (``lm_head``); the rest split into layers at the attention kernels
   (one group of attention kernels per layer), else into equal chunks when every layer is alike;
3. within a layer, the GEMMs before its attention are the ``pre_attention`` GEMMs, the others the
   ``post_attention`` ones; among those, the routed experts are the kernels of the expert class or the
   run that repeats once per local expert (a per-expert GEMM loop), else the two grouped GEMMs (w13, w2);
4. each group of kernels is matched to its GEMMs in order; a GEMM marked optional is left out where the
   kernel count says the engine fused it away (confidence ``medium``); any other difference in count
   leaves the step unmatched, with the reason.

It belongs to the classify stage because it labels kernels (which model GEMM each kernel runs, and the
expert GEMMs as ``moe_gemm``), as the graph-capture recovery does; the measure stage reads the shapes as it
reads recorded ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.classify.architectures import (
    Architectures,
    GemmSpec,
    _Missing,
    architectures,
    evaluate,
)
from traceinspect.model.classes import GEMM_CLASSES
from traceinspect.model.run import Fact, ModelGemms, RunModel, undecided
from traceinspect.model.shapes import Shape
from traceinspect.resources import lazy_module
from traceinspect.steps import step_rules
from traceinspect.steps.select import select_steps
from traceinspect.tables import set_object_column, text_values

yaml = lazy_module("yaml")

if TYPE_CHECKING:
    from traceinspect.model import TraceSet

SOURCE = "model_config"
ATTENTION_CLASSES = ("attention",)
# bytes per element of a compute dtype (weights and activations)
_EL = {"fp4": 0.5, "fp8": 1.0, "int8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
_CLASS_DTYPE = {"fp4_gemm": "fp4", "fp8_gemm": "fp8", "fp32_gemm": "fp32"}
_TORCH = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


# ----------------------------------------------------------------------------- expressions


# ----------------------------------------------------------------------------- the model's GEMMs


class Gemm(msgspec.Struct, frozen=True):
    """One GEMM of a layer, per rank: N, K (and the batch of a batched GEMM) as this rank runs it."""

    name: str
    n: int
    k: int
    batch: int = 1
    at: str = "post_attention"
    role: str = ""
    optional: bool = False
    alt: str = ""


class Layer(msgspec.Struct, frozen=True):
    moe: bool
    pre: tuple[Gemm, ...]
    post: tuple[Gemm, ...]  # in order; the routed experts' GEMMs (role experts) among them


class Plan(msgspec.Struct, frozen=True):
    """The model's GEMMs per rank (see the module docstring)."""

    family: str
    model_type: str
    source: str
    layers: tuple[Layer, ...]
    tail: tuple[Gemm, ...]
    tp: int
    ep: int
    experts: int | None
    top_k: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    dtype: str  # the activations' (and unquantized weights') dtype
    weight_dtype: str  # the weights' dtype where the config states a quantization

    @property
    def local_experts(self) -> int | None:
        return self.experts // self.ep if self.experts and self.experts % self.ep == 0 else self.experts


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal model, else the config itself."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and ("num_hidden_layers" in tc or "hidden_size" in tc):
        return {**{k: v for k, v in config.items() if k != "text_config"}, **tc}
    return config


def _dtypes(cfg: Mapping[str, Any]) -> tuple[str, str]:
    dt = _TORCH.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower(), "bf16")
    q = cfg.get("quantization_config")
    wdt = dt
    if isinstance(q, dict):
        method = str(q.get("quant_method") or "").lower()
        fmt = str(q.get("fmt") or q.get("weight_dtype") or "").lower()
        if "fp8" in method or "fp8" in fmt or "e4m3" in fmt:
            wdt = "fp8"
        elif "fp4" in method or "mxfp4" in method or "nvfp4" in method:
            wdt = "fp4"
    return dt, wdt


def plan(config: Mapping[str, Any], source: str, tp: int = 1, ep: int = 1, pp: int = 1) -> tuple[Plan | None, str]:
    """The model's per-rank GEMMs from its HF config, or (None, why not)."""
    cfg = text_config(config)
    arch = architectures()
    fam = arch.family_of(cfg)
    if fam is None:
        return None, (f"model_type {cfg.get('model_type')!r} / architectures {cfg.get('architectures')!r} of "
                      f"{source} is in no family of rules/tables/architectures.yaml")
    if pp > 1:
        return None, f"pipeline parallelism (pp_size={pp}): which layers a rank runs is not derived"
    env: dict[str, Any] = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, list)) and not isinstance(v, bool)}
    env.update(tp=tp, ep=ep, moe_tp=max(tp // max(ep, 1), 1))
    for key, alts in fam.defaults.items():
        if key in env:
            continue
        for alt in alts if isinstance(alts, list) else [alts]:
            try:
                env[key] = evaluate(alt, env)
                break
            except _Missing:
                continue
    try:
        for key, expr in fam.vars.items():
            env[key] = evaluate(expr, env)
        layers_n = int(evaluate("num_hidden_layers", env))
        experts = int(evaluate(fam.experts, env)) if fam.experts else None
        top_k = int(evaluate(fam.top_k, env)) if fam.top_k else None
        heads = {k: int(evaluate(v, env)) for k, v in fam.attention_heads.items()}
    except _Missing as e:
        return None, f"{source} has no {e.args[0]} (needed by family {fam.id})"
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return None, f"{source}: family {fam.id}: {e}"
    dt, wdt = _dtypes(cfg)
    cache: dict[tuple[bool, str], tuple[Gemm, ...]] = {}
    out_layers = []
    try:
        for layer in range(layers_n):
            env["layer"] = layer
            moe = bool(evaluate(fam.moe_layer, env)) and bool(fam.moe)
            specs = fam.attention + (fam.moe if moe else fam.mlp)
            gemms = _gemms(specs, env, fam.id)
            key = (moe, repr(gemms))
            gemms = cache.setdefault(key, gemms)
            out_layers.append(Layer(moe, tuple(g for g in gemms if g.at == "pre_attention"),
                                    tuple(g for g in gemms if g.at != "pre_attention")))
        tail = _gemms(fam.tail, env, fam.id)
    except _Missing as e:
        return None, f"{source} has no {e.args[0]} (needed by family {fam.id})"
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return None, f"{source}: family {fam.id}: {e}"
    return Plan(fam.id, str(cfg.get("model_type") or ""), source, tuple(out_layers), tail, tp, max(ep, 1), experts,
                top_k, heads.get("heads"), heads.get("kv_heads"), heads.get("head_dim"), dt, wdt), ""


def _gemms(specs: tuple[GemmSpec, ...], env: Mapping[str, Any], fam: str) -> tuple[Gemm, ...]:
    out = []
    tp, moe_tp = int(env["tp"]), int(env["moe_tp"])
    for s in specs:
        if s.when is not None and not evaluate(s.when, env):
            continue
        n, k = int(evaluate(s.n, env)), int(evaluate(s.k, env))
        div_n = {"column": tp, "expert_column": moe_tp}.get(s.parallel, 1)
        div_k = {"row": tp, "expert_row": moe_tp}.get(s.parallel, 1)
        n, k = -(-n // div_n), -(-k // div_k)
        batch = int(evaluate(s.batch, env)) if s.batch is not None else 1
        if n <= 0 or k <= 0 or batch <= 0:
            raise ValueError(f"{s.name}: N={n} K={k} batch={batch} is not a GEMM")
        out.append(Gemm(s.name, n, k, batch, s.at, s.role, s.optional, s.alt))
    return tuple(out)


# ----------------------------------------------------------------------------- kernels -> GEMMs


class _Match(msgspec.Struct):
    """One step's kernels (positions in the step's GEMM list) -> (GEMM, layer); ``confidence``."""

    pairs: list[tuple[int, Gemm, int]]
    confidence: str
    note: str = ""


def _align(kernels: list[int], gemms: tuple[Gemm, ...]) -> tuple[list[tuple[int, Gemm]], bool] | None:
    """Kernels of one group matched to its GEMMs in order: all of them, or leaving out optional GEMMs
    where there are fewer kernels (the second value: whether any was left out); None if the counts
    cannot agree."""
    if len(kernels) == len(gemms):
        return list(zip(kernels, gemms, strict=True)), False
    if len(kernels) > len(gemms):
        return None
    drop = len(gemms) - len(kernels)
    optional = [i for i, g in enumerate(gemms) if g.optional]
    if len(optional) < drop:
        return None
    left = set(optional[len(optional) - drop:]) if drop < len(optional) else set(optional)
    kept = [g for i, g in enumerate(gemms) if i not in left]
    return list(zip(kernels, kept, strict=True)), True


def _expert_run(names: list[str], cls: list[str], local: int | None) -> tuple[int, int] | None:
    """(start, end) of the routed experts' kernels among a layer's post-attention GEMM kernels: those of
    the expert class, else a run that repeats one or two kernel names once per local expert."""
    moe = [i for i, c in enumerate(cls) if c == "moe_gemm"]
    if moe and moe == list(range(moe[0], moe[-1] + 1)):
        return moe[0], moe[-1] + 1
    if local and local >= 2:
        for width in (2, 1):
            size = width * local
            for s in range(0, len(names) - size + 1):
                block = names[s:s + size]
                if all(block[i] == block[i % width] for i in range(size)):
                    return s, s + size
    return None


def _layer(pre: list[int], post: list[int], lay: Layer, names: list[str], cls: list[str],
           local: int | None) -> tuple[list[tuple[int, Gemm]], bool] | str:
    """A layer's kernels matched to its GEMMs, or why not."""
    got = _align(pre, lay.pre)
    if got is None:
        return f"{len(pre)} GEMM kernel(s) before attention, the model has {len(lay.pre)}"
    pairs, dropped = got
    experts = [g for g in lay.post if g.role == "experts"]
    if not experts:
        got = _align(post, lay.post)
        if got is None:
            return f"{len(post)} GEMM kernel(s) after attention, the model has {len(lay.post)}"
        return pairs + got[0], dropped or got[1]
    first = lay.post.index(experts[0])
    before = [g for g in lay.post[:first] if g.role != "experts"]
    after = [g for g in lay.post[first:] if g.role != "experts"]
    run = _expert_run([names[i] for i in post], [cls[i] for i in post], local)
    if run is None:  # grouped expert GEMMs (one kernel per expert GEMM): placed by the count before them
        n_exp = len(post) - len(before) - len(after)
        if n_exp != len(experts):
            return (f"{len(post)} GEMM kernel(s) after attention: no expert kernels found (neither of the "
                    f"expert class nor repeating once per local expert) and the count matches no grouped layout")
        run = (len(before), len(before) + n_exp)
    a, b = run
    head, exp_k, tail = post[:a], post[a:b], post[b:]
    for moved in (False, True):  # shared experts before the routed ones, else after them
        bef = [g for g in before if not (moved and g.alt == "post_experts")]
        aft = [g for g in before if moved and g.alt == "post_experts"] + after
        g1, g2 = _align(head, tuple(bef)), _align(tail, tuple(aft))
        if g1 is not None and g2 is not None:
            break
    else:
        return (f"{len(head)} GEMM kernel(s) between attention and the experts and {len(tail)} after them; "
                f"the model has {len(before)} and {len(after)}")
    n = len(exp_k)
    if n == len(experts):  # grouped: one kernel per expert GEMM
        ex = list(zip(exp_k, experts, strict=True))
    elif local and n == len(experts) * local:
        alternating = len(experts) > 1 and names[exp_k[0]] != names[exp_k[1]]
        ex = [(kk, experts[i % len(experts)] if alternating else experts[i // local]) for i, kk in enumerate(exp_k)]
    else:
        return f"{n} expert GEMM kernel(s) per layer: neither grouped ({len(experts)}) nor one per local expert"
    return pairs + g1[0] + ex + g2[0], dropped or g1[1] or g2[1]


def _attention_pairs(names: list[str], gemm: np.ndarray, arch: Architectures) -> set[int]:
    """Positions of GEMM kernels that compute attention (a GEMM, at most max_between kernels with a
    softmax among them and no top-k / sort, a GEMM)."""
    out: set[int] = set()
    pos = np.flatnonzero(gemm).tolist()
    for a, b in zip(pos[:-1], pos[1:], strict=True):
        between = names[a + 1:b]
        if 0 < len(between) <= arch.max_between and any(arch.softmax.search(x) for x in between) \
                and not any(arch.not_between.search(x) for x in between):
            out.update((a, b))
    return out


def _match_step(names: list[str], cls: list[str], p: Plan, arch: Architectures) -> _Match | str:
    """One step's kernel sequence (names, classes, in launch order) matched to the plan."""
    gemm = np.array([c in GEMM_CLASSES for c in cls], dtype=bool)
    att_gemm = _attention_pairs(names, gemm, arch)
    is_att = np.array([c in ATTENTION_CLASSES for c in cls], dtype=bool)
    for i in att_gemm:
        gemm[i], is_att[i] = False, True
    g_pos = np.flatnonzero(gemm)
    nt = len(p.tail)
    if len(g_pos) < nt + len(p.layers):
        return f"{len(g_pos)} GEMM kernel(s) in the step, fewer than the model's layers"
    tail_pos = g_pos[len(g_pos) - nt:] if nt else g_pos[:0]
    body = g_pos[:len(g_pos) - nt]
    # attention groups: runs of attention kernels with no weight GEMM between them
    anchors: list[int] = []
    last_gemm = -1
    for i in np.flatnonzero(is_att | gemm).tolist():
        if gemm[i]:
            last_gemm = i
        elif not anchors or last_gemm > anchors[-1]:
            anchors.append(i)
    L = len(p.layers)
    layers: list[tuple[list[int], list[int]]] = []
    note = ""
    if len(anchors) == L:
        idx = np.searchsorted(body, anchors)  # GEMMs of the body before each anchor
        n_pre = int(idx[0])
        bounds = [0, *idx.tolist(), len(body)]
        for i in range(L):
            pre = list(range(bounds[i + 1] - n_pre, bounds[i + 1]))
            end = bounds[i + 2] - (n_pre if i + 1 < L else 0)
            post = list(range(bounds[i + 1], end))
            if end < bounds[i + 1]:
                return (f"layer {i}: fewer GEMM kernels after its attention than the {n_pre} that run before "
                        "attention in the next layer")
            layers.append((pre, post))
        note = f"layers split at their attention kernels ({n_pre} GEMM(s) before each)"
    else:
        kinds = {(lay.moe, lay.pre, lay.post) for lay in p.layers}
        if len(kinds) != 1 or len(body) % L:
            return (f"{len(anchors)} attention kernel group(s) for {L} layers, and the step's {len(body)} layer "
                    f"GEMM kernel(s) do not split into {L} alike layers")
        c = len(body) // L
        n_pre = len(p.layers[0].pre)
        for i in range(L):
            layers.append((list(range(i * c, i * c + n_pre)), list(range(i * c + n_pre, (i + 1) * c))))
        note = f"{L} alike layers of {c} GEMM kernel(s) each"
    b_names = [names[i] for i in body]
    b_cls = [cls[i] for i in body]
    local = p.local_experts
    pairs: list[tuple[int, Gemm, int]] = []
    dropped = False
    for li, ((pre, post), lay) in enumerate(zip(layers, p.layers, strict=True)):
        got = _layer(pre, post, lay, b_names, b_cls, local)
        if isinstance(got, str):
            return f"layer {li}: {got}"
        dropped |= got[1]
        pairs += [(int(body[j]), g, li) for j, g in got[0]]
    pairs += [(int(i), g, L) for i, g in zip(tail_pos.tolist(), p.tail, strict=True)]
    if dropped:
        note += "; optional GEMM(s) the engine fused away left out"
    return _Match(pairs, "medium" if dropped else "high", note)


def _shape(g: Gemm, cls: str, tokens: float, p: Plan, loop: bool = False) -> Shape:
    """The Shape of one GEMM kernel (as recorded shapes would give it): a dense GEMM of M = tokens rows; a
    grouped expert GEMM of tokens x top-k rows over the local experts (M per expert = tokens x top-k /
    (experts / ep)); ``loop``: one expert's GEMM of a per-expert loop."""
    if cls in _CLASS_DTYPE:
        dt = _CLASS_DTYPE[cls]
    elif cls == "bf16_gemm":
        dt = p.dtype if p.dtype in ("bf16", "fp16") else "bf16"
    else:
        dt = p.weight_dtype
    w_el = _EL.get(dt, 2.0)
    a_el = w_el if dt in ("fp8", "fp4") else _EL.get(p.dtype, 2.0)
    o_el = _EL.get(p.dtype, 2.0)
    n, k = g.n, g.k
    if g.role == "experts":
        local = p.local_experts or 1
        per_expert = tokens * (p.top_k or 1) * p.ep / p.experts if p.experts else tokens
        if loop:
            return Shape("gemm", dt, 2.0 * per_expert * n * k, per_expert * (k * a_el + n * o_el) + n * k * w_el,
                         m=_num(per_expert), n=n, k=k,
                         note="model config: tokens x top-k / (experts / ep) rows per expert")
        rows = per_expert * local
        # the weights of the experts that receive rows (at most one per row)
        w = min(local, max(math.ceil(rows), 1)) * n * k * w_el
        return Shape("gemm", dt, 2.0 * rows * n * k, rows * (k * a_el + n * o_el) + w, groups=local, m=_num(rows),
                     n=n, k=k, note="model config: tokens x top-k / (experts / ep) rows per expert")
    b = g.batch
    return Shape("gemm", dt, 2.0 * b * tokens * n * k, b * (tokens * (k * a_el + n * o_el) + n * k * w_el),
                 batch=b, m=_num(tokens), n=n, k=k)


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(float(x), 4)


def _marker_requests(names: np.ndarray) -> np.ndarray:
    """Decode requests a step's forward marker names (vLLM's ``execute_..._generation_M(...)``), else -1."""
    rules = step_rules()
    pats = [p for p in rules.forward if "decode" in p.groupindex]
    out = np.full(len(names), -1.0)
    for i, name in enumerate(names.tolist()):
        for p in pats:
            m = p.search(str(name))
            if m:
                out[i] = float(m.group("decode"))
                break
    return out


def _step_tokens(steps: pd.DataFrame, run: RunModel) -> np.ndarray:
    """Tokens each step runs through the GEMMs: SGLang's bs=N (decode) or toks=, vLLM's generation_M of
    its forward marker, else the run facts' batch."""
    toks = steps["toks"].to_numpy(dtype=float) if "toks" in steps else np.full(len(steps), -1.0)
    bs = steps["bs"].to_numpy(dtype=float) if "bs" in steps else np.full(len(steps), -1.0)
    if "name" in steps and (bs < 0).any():
        bs = np.where(bs < 0, _marker_requests(steps["name"].to_numpy(dtype=object)), bs)
    phase = steps["phase"].to_numpy(dtype=object) if "phase" in steps else np.full(len(steps), "decode", dtype=object)
    out = np.where(phase == "decode", np.where(bs > 0, bs, toks), np.where(toks > 0, toks, bs))
    b = run.value("batch")
    return np.where(out > 0, out, float(b) if b else np.nan)


def map_kernels(ts: TraceSet, steps: pd.DataFrame | None, run: RunModel, phase: str = "decode") -> ModelGemms | None:
    """Match the GEMM kernels of the analysed steps to the model's GEMMs (see the module docstring); the
    expert GEMM kernels become ``moe_gemm``. None when there is no model config; otherwise the result
    says what was matched, or why nothing was."""
    if run.config is None:
        return None
    src = run.config_source or SOURCE
    p, why = plan(run.config, src, int(run.value("tp_size") or 1), int(run.value("ep_size") or 1),
                  int(run.value("pp_size") or 1))
    if p is None:
        return ModelGemms(reason=why, source=src)
    res = ModelGemms(family=p.family, source=src, plan=p)
    k = ts.kernels
    if steps is None or not len(steps) or not len(k) or "cls" not in k:
        res.reason = "no analysable steps"
        return res
    sel = select_steps(steps, phase) if {"included", "phase"} <= set(steps.columns) else steps
    if not len(sel):
        res.reason = f"no {phase} steps"
        return res
    tokens = pd.Series(_step_tokens(sel, run), index=sel.index)
    kk = k.loc[k["step"].isin(sel.index).to_numpy() & (k["kind"] == "kernel").to_numpy()
               if "kind" in k else k["step"].isin(sel.index).to_numpy(), ["rank", "step", "ts", "name", "cls"]]
    kk = kk.sort_values(["rank", "step", "ts"], kind="stable")
    arch = architectures()
    names_all, cls_all = text_values(kk["name"]), text_values(kk["cls"])
    step_col = kk["step"].to_numpy()
    cuts = np.flatnonzero(np.diff(step_col)) + 1
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(step_col)]))
    memo: dict[tuple[str, ...], _Match | str] = {}
    rows: list[int] = []
    gemm_of: list[Gemm] = []
    layer_of: list[int] = []
    shapes: list[Shape] = []
    conf: list[str] = []
    shape_memo: dict[tuple[Any, ...], Shape] = {}
    failed: dict[str, int] = {}
    matched = 0
    index = kk.index.to_numpy()
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        names, cls = names_all[a:b].tolist(), cls_all[a:b].tolist()
        key = tuple(n if c in GEMM_CLASSES or c in ATTENTION_CLASSES else ("S" if arch.softmax.search(n) else
                    "T" if arch.not_between.search(n) else "") for n, c in zip(names, cls, strict=True)) + \
            tuple(cls[i] for i in range(len(cls)) if cls[i] in GEMM_CLASSES)
        m = memo.get(key)
        if m is None:
            m = memo[key] = _match_step(names, cls, p, arch)
        if isinstance(m, str):
            failed[m] = failed.get(m, 0) + 1
            continue
        tok = float(tokens.get(step_col[a], np.nan))
        if not np.isfinite(tok) or tok <= 0:
            why = "the step's batch is unknown (no bs=N in its marker, no batch fact)"
            failed[why] = failed.get(why, 0) + 1
            continue
        matched += 1
        n_exp = {}
        for _pos, g, _li in m.pairs:
            if g.role == "experts":
                n_exp[g.name] = n_exp.get(g.name, 0) + 1
        per_layer_loop = dict(n_exp)
        experts_layers = sum(1 for lay in p.layers if lay.moe) or 1
        for pos, g, li in m.pairs:
            c = cls[pos]
            loop = g.role == "experts" and per_layer_loop.get(g.name, 0) > experts_layers
            sk = (g, c, tok, loop)
            s = shape_memo.get(sk)
            if s is None:
                s = shape_memo[sk] = _shape(g, c, tok, p, loop)
            rows.append(int(index[a + pos]))
            gemm_of.append(g)
            layer_of.append(li)
            shapes.append(s)
            conf.append(m.confidence)
        res.notes.add(m.note)
    res.steps_matched = matched
    res.steps_failed = failed
    if rows:
        res.table = pd.DataFrame({
            "gemm": np.array([g.name for g in gemm_of], dtype=object),
            "layer": np.asarray(layer_of, dtype=np.int64),
            "moe": np.array([g.role == "experts" for g in gemm_of], dtype=bool),
            "confidence": np.asarray(conf, dtype=object),
            "shape": np.asarray(shapes + [None], dtype=object)[:-1],
        }, index=pd.Index(rows))
    if not matched:
        res.reason = "; ".join(f"{why} ({n} step(s))" for why, n in sorted(failed.items(), key=lambda kv: -kv[1]))
    _mark_experts(ts, res)
    return res


def _mark_experts(ts: TraceSet, res: ModelGemms) -> None:
    """The kernels matched to the routed experts' GEMMs become ``moe_gemm`` (evidence: the model)."""
    t = res.table
    if t is None or not len(t):
        return
    k = ts.kernels
    rows = t.index[t["moe"].to_numpy(dtype=bool)]
    if not len(rows):
        return
    pos = k.index.get_indexer(rows)
    pos = pos[pos >= 0]
    cls = k["cls"].to_numpy(dtype=object).copy()
    ev = k["cls_evidence"].to_numpy(dtype=object).copy()
    change = np.flatnonzero(cls[pos] != "moe_gemm")
    if not len(change):
        return
    p = pos[change]
    names = t.loc[k.index[p], "gemm"].to_numpy(dtype=object)
    for j, i in enumerate(p.tolist()):
        ev[i] = f"moe_gemm: {names[j]} of the model config's MoE layers ({res.source}); was {cls[i]} by {ev[i]}"
        cls[i] = "moe_gemm"
    set_object_column(k, "cls", cls)
    set_object_column(k, "cls_evidence", ev)


def model_gemms(ts: TraceSet, steps: pd.DataFrame | None, run: RunModel, phase: str = "decode") -> None:
    """Match the kernels to the model config's GEMMs (:func:`map_kernels`) into ``run.gemms`` and say how
    in the run fact ``gemm_shapes``."""
    if run.config is None:
        return
    res = map_kernels(ts, steps, run, phase)
    run.gemms = res
    if res is None:
        return
    t = res.table
    if t is None or not len(t):
        run.facts["gemm_shapes"] = undecided(f"the model config's GEMMs were not matched to the GEMM kernels: "
                                             f"{res.reason}")
        return
    conf = "high" if (t["confidence"] == "high").all() else "medium"
    p = res.plan
    per_layer = ", ".join(sorted({f"{len(lay.pre) + len(lay.post)}" for lay in p.layers}))
    detail = (f"{len(t):,} GEMM kernel(s) of {res.steps_matched} step(s) matched to the {len(p.layers)} layers "
              f"({per_layer} GEMMs each) and {len(p.tail)} tail GEMM(s) of {res.source} (family {p.family}); "
              + "; ".join(sorted(n for n in res.notes if n)))
    if res.steps_failed:
        detail += "; not matched: " + "; ".join(f"{w} ({n} step(s))" for w, n in res.steps_failed.items())
    run.facts["gemm_shapes"] = Fact(SOURCE, SOURCE, conf, detail)
