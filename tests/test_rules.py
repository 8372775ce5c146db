"""Rule engine: the safe expression evaluator, rule-file loading and its errors, selection
(--only/--disable), the metric namespace contract and the findings JSON shape."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pandas as pd
import pytest

from traceinspect.classify.runfacts import decide as decide_run
from traceinspect.errors import ConfigError, RuleError
from traceinspect.judge import Finding, evaluate, explain, load_rule_file, load_rule_set
from traceinspect.judge import metrics as M
from traceinspect.judge.expr import ExprError, evaluate_explain, parse
from traceinspect.saferegex import RegexError, compile_safe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_IDS = {"kv-full-pool-cast", "small-m-gemm", "comm-wait", "comm-bound", "launch-bound", "host-sync",
               "moe-dispatch-overhead", "rank-straggler", "host-stall"}
FINDING_KEYS = {"rule", "severity", "title", "message", "share", "est_saving_us_per_step", "ranks", "evidence",
                "remediation", "estimate_source", "fixes", "group"}


# ============================================================================= expressions
def ev(src: str, **env):
    return parse(src, lambda n: True).evaluate(env)


@pytest.mark.parametrize("src, env, want", [
    ("a + b * 2", {"a": 1, "b": 3}, 7),
    ("a / b", {"a": 1, "b": 4}, 0.25),
    ("min(a, b) + max(a, b) + abs(-2) + round(2.6)", {"a": 1, "b": 5}, 11),
    ("a >= 0.9 * b and c < 1", {"a": 9, "b": 10, "c": 0.5}, True),
    ("1 < a < 3", {"a": 2}, True),
    ("'fp8' in dt", {"dt": "fp8_e4m3"}, True),
    ("dt in ['fp8_e4m3', 'fp8_e5m2']", {"dt": "fp8_e4m3"}, True),
    ("x if c else y", {"x": 1, "y": 2, "c": False}, 2),
    ("a is None", {"a": None}, True),
    ("a is not None and a > 1", {"a": 2}, True),
    ("not a", {"a": 0}, True),
    ("2 ** 10", {}, 1024),
    ("log(100, 10)", {}, pytest.approx(2.0)),
])
def test_expressions_evaluate(src, env, want) -> None:
    assert ev(src, **env) == want


def test_missing_metric_is_undecided_three_valued() -> None:
    assert ev("a > 1", a=None) is None
    assert ev("a > 1 and b > 1", a=None, b=0) is False  # False and unknown = False
    assert ev("a > 1 or b > 1", a=None, b=2) is True  # True or unknown = True
    assert ev("a > 1 and b > 1", a=None, b=2) is None
    assert ev("min(a, 3)", a=None) is None
    v, why = evaluate_explain(parse("a / b", lambda n: True), {"a": 1, "b": 0})
    assert v is None and "division by zero" in why
    v, why = evaluate_explain(parse("a * 2", lambda n: True), {"a": None})
    assert v is None and "a" in why


@pytest.mark.parametrize("src, reason", [
    ("__import__('os').system('true')", "only"),
    ("a.__class__", "attribute"),
    ("().__class__.__bases__[0].__subclasses__()", "attribute"),
    ("a[0]", "subscript"),
    ("open('/etc/passwd').read()", "only"),
    ("eval('1')", "only"),
    ("exec('x=1')", "only"),
    ("getattr(a, 'b')", "only"),
    ("(lambda: 1)()", "lambda"),
    ("[x for x in a]", "comprehension"),
    ("{'a': 1}", "dict"),
    ("f'{a}'", "f-string"),
    ("(a := 1)", "assignment"),
    ("__builtins__", "reserved"),
    ("_secret", "reserved"),
    ("min", "function"),
    ("min(*a)", "positional"),
    ("max(a, key=b)", "positional"),
    ("b'bytes'", "constant"),
    ("a is 1", "None"),
    ("[1, 2] + a", "list"),
    ("import os", "syntax"),
])
def test_malicious_expressions_rejected_at_load(src, reason) -> None:
    with pytest.raises(ExprError, match=re.compile(reason, re.IGNORECASE)):
        parse(src, lambda n: True)


def test_unknown_name_rejected() -> None:
    with pytest.raises(ExprError, match="unknown metric 'nope'"):
        parse("nope > 1", lambda n: n == "a")


@pytest.mark.timeout(60)  # computing any of these would take hours: the bound is on the work, not the clock
def test_huge_exponent_is_bounded() -> None:
    e = parse("9**9**9", lambda n: True)
    v, why = evaluate_explain(e, {})
    assert v is None and "exponent" in why
    for src in ("a ** 1000", "10 ** 100 * 10 ** 100 * 10 ** 100", "round(5, -10 ** 30)"):
        v, _ = evaluate_explain(parse(src, lambda n: True), {"a": 7})
        assert v is None
    assert ev("1e308 * 10") == float("inf") or ev("1e308 * 10") is None


def test_evaluation_reads_no_clock_and_bounds_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine cannot turn a decided condition undecided: no clock is read while evaluating, and
    the work is bounded by a step count that every valid expression stays within."""
    import ast

    from traceinspect.judge import expr as X

    def no_clock() -> float:
        raise AssertionError("the evaluator read the clock")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    big = parse(" or ".join(["a in [" + ",".join(["1"] * 60) + "]"] * 4), lambda n: True)  # ~250 nodes
    assert len(list(ast.walk(big.tree))) > 240 and evaluate_explain(big, {"a": 2}) == (False, None)
    with pytest.raises(ExprError, match="evaluation steps"):
        X._Evaluator({"a": 1}, steps=10).run(big.tree)


def test_string_arithmetic_refused() -> None:
    v, why = evaluate_explain(parse("s * 100000000", lambda n: True), {"s": "x"})
    assert v is None and "numbers only" in why
    with pytest.raises(ExprError, match="string literal"):
        parse("'" + "x" * 300 + "' == s", lambda n: True)


@pytest.mark.parametrize("src", [
    "(" * 500 + "1" + ")" * 500,
    "-" * 5000 + "1",
    "not " * 2000 + "a",
    "a" + " + a" * 400,
    "x" * 2000,
])
@pytest.mark.timeout(60)
def test_deep_nesting_and_long_input_rejected(src) -> None:
    with pytest.raises(ExprError):
        parse(src, lambda n: True)


def test_evaluation_never_calls_python_eval(monkeypatch) -> None:
    """Parsing builds a syntax tree only (ast.parse); evaluation walks it without eval/exec/compile."""
    import builtins

    e = parse("a * 2 + 1 if a > 0 else min(a, 3)", lambda n: True)

    def boom(*a, **k):
        raise AssertionError("eval/exec/compile called")

    with monkeypatch.context() as m:
        for name in ("eval", "exec", "compile"):
            m.setattr(builtins, name, boom)
        assert e.evaluate({"a": 3}) == 7


# ============================================================================= regexes
@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)*b", r"(\w+)\1", ".*.*.*.*x", "x" * 400, "["])
def test_unsafe_or_invalid_regex_rejected(pattern) -> None:
    with pytest.raises(RegexError):
        compile_safe(pattern)


def test_safe_regex_accepted() -> None:
    assert compile_safe(r"direct_copy_kernel_cuda.*LoadWithCast").search("x direct_copy_kernel_cuda y LoadWithCast")


# ============================================================================= rule files
GOOD = """\
rules:
  - id: my-rule
    title: Casts are slow
    severity: warning
    phase: decode
    select:
      kernels: {class: dtype_cast}
    params: {min_share: 0.1}
    when:
      - "share >= min_share"
    estimate: us_per_step * 0.5
    message: "casts take {share:.1%} ({us_per_step:,.0f} us)"
    why: because
    remediation: do less casting
    references: []
"""


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_user_rule_loads(tmp_path: Path) -> None:
    rules = load_rule_file(write(tmp_path, GOOD))
    assert [r.id for r in rules] == ["my-rule"]
    r = rules[0]
    assert r.select.scope == "kernels" and r.select.classes == ("dtype_cast",)
    assert r.params == {"min_share": 0.1}
    assert r.line == 2 and r.source is not None


def test_scope_is_the_older_name_of_phase(tmp_path: Path) -> None:
    (r,) = load_rule_file(write(tmp_path, GOOD.replace("phase: decode", "scope: prefill")))
    assert r.phase == "prefill"


def _error(tmp_path: Path, text: str) -> RuleError:
    p = write(tmp_path, text)
    with pytest.raises(RuleError) as ei:
        load_rule_file(p)
    return ei.value


@pytest.mark.parametrize("edit, line, reason", [
    (("share >= min_share", "shar >= min_share"), 10, "unknown metric 'shar'.*did you mean 'share'"),
    (("share >= min_share", "wait_share >= 0.5"), 10, "metric of the 'rank' scope"),
    (("estimate: us_per_step * 0.5", "estimate: us_per_step.__class__"), 11, "attribute access"),
    (("estimate: us_per_step * 0.5", "estimate: __import__('os')"), 11, "only .* may be called"),
    (("severity: warning", "severity: high"), 4, "severity must be one of"),
    (("phase: decode", "phase: everything"), 5, "phase must be one of"),
    (("phase: decode", "scope: everything"), 5, "scope must be one of"),
    (("phase: decode", "phase: decode\n    scope: decode"), 6, "give 'phase' only"),
    (("id: my-rule", "id: My_Rule"), 2, "kebab-case"),
    (("{share:.1%}", "{share.real}"), 12, "attribute access"),
    (("{share:.1%}", "{share:>99999}"), 12, "format spec"),
    (("{share:.1%}", "{share!r}"), 12, "conversions"),
    (("class: dtype_cast", "class: nope"), 7, "unknown kernel class 'nope'"),
    (("class: dtype_cast", "name: '(a+)+'"), 7, "nested unbounded"),
    (("    why: because\n", ""), 2, "missing 'why'"),
    (("params: {min_share: 0.1}", "params: {min_share: '0.1'}"), 8, "must be a number"),
    (("params: {min_share: 0.1}", "params: {share: 0.1}"), 8, "has the name of a metric"),
    (("    references: []\n", "    references: []\n    colour: red\n"), 16, "unknown key 'colour'"),
    (("    references: []\n", "    references: []\n    tests: {fires: [/etc/passwd], silent: [x]}\n"), 16,
     "must be a relative path"),
    (("    references: []\n", "    references: []\n    tests: {fires: [../../x], silent: [x]}\n"), 16,
     "must be a relative path"),
])
def test_malformed_rule_names_file_line_reason(tmp_path: Path, edit, line, reason) -> None:
    old, new = edit
    assert old in GOOD
    e = _error(tmp_path, GOOD.replace(old, new))
    assert e.path is not None and e.path.endswith(f"r.yaml:{line}"), e.path
    assert re.search(reason, e.reason), e.reason


def test_rule_files_must_be_regular_and_small(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="not a regular file"):
        load_rule_file(Path("/dev/zero"))
    big = write(tmp_path, "rules: []\n" + "#" * (2 << 20))
    with pytest.raises(RuleError, match="larger than"):
        load_rule_file(big)


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    e = _error(tmp_path, GOOD.replace("    title: Casts are slow", "    title: [unclosed"))
    assert e.path.endswith(":4") or e.path.endswith(":3"), e.path
    assert "invalid YAML" in e.reason


def test_yaml_aliases_and_python_tags_refused(tmp_path: Path) -> None:
    bomb = "a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: &c [*b, *b, *b]\nrules: [*c]\n"
    assert "aliases" in _error(tmp_path, bomb).reason
    e = _error(tmp_path, "rules:\n  - !!python/object/apply:os.system ['true']\n")
    assert "tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed" in e.reason
    assert e.path.endswith("r.yaml:2")


def test_duplicate_ids_and_override(tmp_path: Path) -> None:
    d = tmp_path / "user"
    d.mkdir()
    write(d, GOOD.replace("my-rule", "kv-full-pool-cast"))
    with pytest.raises(RuleError, match="already defined.*override: true"):
        load_rule_set(extra=[d])
    write(d, GOOD.replace("my-rule", "kv-full-pool-cast").replace("    title:", "    override: true\n    title:"))
    rs = load_rule_set(extra=[d])
    r = rs.get("kv-full-pool-cast")
    assert r is not None and not r.shipped and r.title == "Casts are slow"
    assert len(rs) == len(SHIPPED_IDS)


def test_shipped_rules_load_with_fixtures_and_docs() -> None:
    rs = load_rule_set()
    assert set(rs.ids) == SHIPPED_IDS
    for r in rs:
        assert r.tests.get("fires") and r.tests.get("silent"), f"{r.id} lacks fixtures"
        assert r.why.strip() and r.remediation.strip() and r.message.strip()
        doc = ROOT / "docs" / "rules" / f"{r.id}.md"
        assert doc.is_file(), f"missing {doc}"
    # the data tables live in rules/tables/, and every file of rules/ is a rule file
    assert {p.name for p in rs.files} == {p.name for p in (ROOT / "rules").glob("*.yaml")}
    assert (ROOT / "rules" / "tables" / "kernel_classes.yaml").is_file()


def test_rule_docs_are_up_to_date() -> None:
    from traceinspect.judge.docs import rule_markdown

    for r in load_rule_set():
        doc = (ROOT / "docs" / "rules" / f"{r.id}.md").read_text()
        assert doc == rule_markdown(r), f"docs/rules/{r.id}.md is stale: run `traceinspect rules docs`"


def test_only_and_disable() -> None:
    rs = load_rule_set(only=["comm-wait", "kv-full-pool-cast"])
    assert sorted(rs.ids) == ["comm-wait", "kv-full-pool-cast"]
    rs = load_rule_set(disable=["comm-wait"])
    assert "comm-wait" not in rs.ids and len(rs) == len(SHIPPED_IDS) - 1
    with pytest.raises(ConfigError, match="no such rule"):
        load_rule_set(only=["nope"])
    with pytest.raises(ConfigError, match="no such rule"):
        load_rule_set(disable=["nope"])


def test_every_metric_documented() -> None:
    reg = M.registry(None)
    assert {"step_us", "kv_pool_tokens", "kv_pool_bytes_per_layer", "layers", "calls_per_step", "bytes_per_call",
            "dur_cv", "per_expert_m", "pct_peak", "wait_us", "transfer_us", "wait_share", "idle_us_per_step",
            "dtoh_per_step", "sync_calls_per_step", "tiny_kernels_per_step", "cls_comm_share"} <= set(reg)
    for m in reg.values():
        assert m.unit and len(m.definition) > 10, m


# ============================================================================= evaluation on a synthetic analysis
def _analysis(cast_us: float = 900.0, pool: int | None = 1000, with_shapes: bool = True):
    """Two ranks, three steps, four layers: per layer a cast (class kv_cast) and a GEMM."""
    rows, ops = [], []
    for rank in (0, 1):
        for step in range(3):
            t = 10_000.0 * step
            for _layer in range(4):
                op = len(ops)
                ops.append(dict(rank=rank, name="aten::copy_", ts=t, dur=5.0, end=t + 5.0, tid=1, external_id=-1,
                                input_dims=json.dumps([[pool or 10, 64], [pool or 10, 64], []]).encode()
                                if with_shapes else None,
                                input_types=b'["c10::BFloat16", "c10::Float8_e4m3fn", "Scalar"]', concrete=None,
                                parent=-1))
                rows.append(dict(rank=rank, kind="kernel", name="direct_copy_kernel_cuda LoadWithCast", ts=t,
                                 dur=cast_us, cls="kv_cast", op_idx=op if with_shapes else -1))
                t += cast_us + 10
                rows.append(dict(rank=rank, kind="kernel", name="gemm_kernel", ts=t, dur=100.0, cls="bf16_gemm",
                                 op_idx=-1))
                t += 110
    k = pd.DataFrame(rows)
    k["end"] = k["ts"] + k["dur"]
    k["step"] = k["rank"] * 3 + (k["ts"] // 10_000).astype(int)
    k["graph_replay"] = False
    k["op_name"] = np.where(k["op_idx"] >= 0, "aten::copy_", "")
    k["op_path"] = k["op_name"]
    k["correlation"] = np.arange(len(k))
    k["bytes"] = -1.0
    k["stream"] = 7
    k["rt_idx"] = -1
    span = 4 * (cast_us + 10 + 110) - 10
    sel = pd.DataFrame({"rank": [0, 0, 0, 1, 1, 1], "idx": [0, 1, 2] * 2, "phase": "decode", "bs": 8, "toks": -1,
                        "span_us": span, "busy_us": 4 * (cast_us + 100), "idle_us": span - 4 * (cast_us + 100),
                        "kernel_us": 4 * (cast_us + 100), "cpu_start": np.nan, "cpu_end": np.nan,
                        "gpu_start": [0.0, 1e4, 2e4] * 2}, index=range(6))
    si = {"max_total_num_tokens": pool, "kv_cache_dtype": "fp8_e4m3", "model_info": {"num_hidden_layers": 4}}
    trace = NS(ranks=[NS(rank=0, label="TP0", device=None), NS(rank=1, label="TP1", device=None)],
               runtime=pd.DataFrame(columns=["rank", "name", "ts", "dur", "end", "tid", "correlation", "external_id"]),
               cpu_ops=pd.DataFrame(ops), capture_traces={}, kernels=k, warnings=[], server_info=si)
    samples = pd.DataFrame({"step_us": [span] * 3})
    return NS(trace=trace, kernels=k, selected=sel, steps=sel, efficiency=None, collectives=None, n_ranks=2,
              phase="decode", rule_phase="decode", server_info=si, options=NS(gpu=None), steps_per_rank=lambda: 3,
              step_samples=lambda: samples, run_model=decide_run(trace, sel))


def test_kv_rule_fires_with_evidence_and_json_shape() -> None:
    a = _analysis()
    rs = load_rule_set(only=["kv-full-pool-cast"])
    findings = evaluate(a, rs)
    assert len(findings) == 1
    f = findings[0]
    assert isinstance(f, Finding)
    doc = f.to_json()
    assert set(doc) == FINDING_KEYS
    json.dumps(doc, allow_nan=False)
    assert doc["rule"] == "kv-full-pool-cast" and doc["severity"] == "critical"
    # every share is of the step time: 4 casts of 900 us in a 4 * (900 + 120) - 10 us step
    assert doc["share"] == pytest.approx(3600 / 4070, abs=1e-3)
    assert doc["est_saving_us_per_step"] == pytest.approx(3600)
    assert doc["ranks"] == [0, 1]
    ev_ = doc["evidence"]
    assert ev_["calls_per_step"] == 4 and ev_["layers"] == 4 and ev_["rows_per_call"] == 1000
    assert ev_["kv_pool_tokens"] == 1000
    assert "4 cast kernels per step" in doc["message"]


def test_kv_rule_undecided_without_pool_size_says_why() -> None:
    a = _analysis(pool=None)
    rs = load_rule_set(only=["kv-full-pool-cast"])
    assert evaluate(a, rs) == []
    out = explain(a, rs)
    assert [o.status for o in out] == ["undecided"]
    assert "max_total_num_tokens" in " ".join(out[0].reasons)


def test_kv_rule_silent_when_share_small() -> None:
    a = _analysis(cast_us=1.0)
    rs = load_rule_set(only=["kv-full-pool-cast"])
    out = explain(a, rs)
    assert [o.status for o in out] == ["silent"] and "share" in out[0].reasons[0]


def test_rule_scope_skips_other_phases() -> None:
    a = _analysis()
    a.phase = a.rule_phase = "prefill"
    out = explain(a, load_rule_set(only=["kv-full-pool-cast"]))
    assert out[0].status == "skipped"
    a.phase, a.rule_phase = "decode", "training"  # a training run: no decode advice
    out = explain(a, load_rule_set(only=["kv-full-pool-cast"]))
    assert out[0].status == "skipped" and "training steps" in out[0].reasons[0]


def test_findings_sorted_by_saving(tmp_path: Path) -> None:
    d = tmp_path / "user"
    d.mkdir()
    write(d, GOOD.replace("class: dtype_cast", "class: bf16_gemm").replace("share >= min_share", "share >= 0"))
    a = _analysis()
    fs = evaluate(a, load_rule_set(extra=[d], only=["kv-full-pool-cast", "my-rule"]))
    assert [f.rule for f in fs] == ["kv-full-pool-cast", "my-rule"]
    savings = [f.est_saving_us_per_step for f in fs]
    assert savings == sorted(savings, reverse=True)
    assert fs[1].est_saving_us_per_step == pytest.approx(200)  # 4 x 100 us x 0.5


def test_hostile_message_values_are_plain_text(tmp_path: Path) -> None:
    """A kernel name is data: it is cut, never evaluated or formatted further."""
    d = tmp_path / "user"
    d.mkdir()
    write(d, GOOD.replace("class: dtype_cast", "class: kv_cast").replace('"casts take {share:.1%}',
                                                                       '"{name} casts take {share:.1%}'))
    a = _analysis()
    a.kernels.loc[a.kernels["cls"] == "kv_cast", "name"] = "{__import__('os')} <script>" + "x" * 5000
    fs = evaluate(a, load_rule_set(extra=[d], only=["my-rule"]))
    assert len(fs) == 1
    assert fs[0].message.startswith("{__import__('os')} <script>x")
    assert len(fs[0].message) < 400


# ============================================================================= CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traceinspect", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_list_and_show() -> None:
    r = run_cli("rules", "list")
    assert r.returncode == 0
    for rid in SHIPPED_IDS:
        assert rid in r.stdout.replace("\n", "").replace("│", "").replace(" ", "") or rid[:10] in r.stdout
    r = run_cli("rules", "show", "kv-full-pool-cast")
    assert r.returncode == 0
    assert "## Metrics used" in r.stdout and "kv_pool_bytes_per_layer" in r.stdout
    assert "max_total_num_tokens" in r.stdout  # the metric definitions are shown
    r = run_cli("rules", "show", "nope")
    assert r.returncode == 2 and "no rule 'nope'" in r.stderr


def test_cli_malformed_user_rule_exit_2(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("share >= min_share", "share >= min_share and bogus_metric > 1"))
    for args in (("rules", "list", "--rules", str(p)), ("rules", "test", "--rules", str(p), "--no-shipped"),
                 ("rules", "check", str(p))):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{p}:10" in err and "unknown metric 'bogus_metric'" in err


def test_cli_metrics_lists_namespace() -> None:
    r = run_cli("rules", "metrics", "rank")
    assert r.returncode == 0 and "wait_share" in r.stdout and "[rank]" in r.stdout
