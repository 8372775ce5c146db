"""diff and gate: thresholds, floor, noise test, findings, mismatches, outputs, config, CLI, and the
done-when cases on the GPU fixtures (trace sets and stored JSON baselines)."""

from __future__ import annotations

import copy
import gzip
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from traceinspect.cli import main
from traceinspect.errors import ConfigError, TraceInputError
from traceinspect.gate import (
    Gate,
    diff_documents,
    load_document,
    merge_thresholds,
    noise_test,
    parse_floor,
    parse_threshold,
)
from traceinspect.gate.config import find_config, load_config
from traceinspect.gate.outputs import (
    append_step_summary,
    gate_markdown,
    gh_escape_data,
    gh_escape_property,
    github_annotations,
    junit_xml,
    md_escape,
)
from traceinspect.gate.stats import mann_whitney_greater
from traceinspect.gate.thresholds import thresholds_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


# ------------------------------------------------------------------------------------------- helpers
def make_doc(step: float = 1000.0, classes: dict[str, float] | None = None, n: int = 6, noise: float = 0.005,
             seed: int = 0, findings: list[dict[str, Any]] | None = None, gemm: list[dict[str, Any]] | None = None,
             device: str = "NVIDIA H200", tp: int = 2, phase: str = "decode") -> dict[str, Any]:
    """A synthetic ``traceinspect.analysis/1`` document with per-step samples."""
    classes = {"bf16_gemm": 500.0, "attention": 300.0, "kv_cast": 2.0} if classes is None else classes
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        samples.append({"step_us": step * (1 + rng.normal(0, noise)),
                        "classes": {c: v * (1 + rng.normal(0, noise)) for c, v in classes.items()}})
    doc: dict[str, Any] = {
        "schema": "traceinspect.analysis/1",
        "tool": {"name": "traceinspect", "version": "0.1.0"},
        "source": {"paths": [f"synthetic-{seed}"]},
        "run": {"model": "m", "tp_size": tp, "ranks": tp, "device": device, "kv_cache_dtype": "fp8_e4m3",
                "cuda_graph": False},
        "steps": {"phase": phase, "count": n, "median_us": float(np.median([s["step_us"] for s in samples])),
                  "samples": samples},
        "classes": {c: {"us_per_step": float(np.mean([s["classes"][c] for s in samples])), "share": 0.1}
                    for c in classes},
        "findings": findings or [],
    }
    if gemm is not None:
        doc["gemm"] = gemm
    return doc


def finding(rule: str, severity: str = "critical", title: str | None = None) -> dict[str, Any]:
    return {"rule": rule, "severity": severity, "title": title or f"{rule} fired", "message": "m", "share": 0.2,
            "est_saving_us_per_step": 100.0, "ranks": [0, 1], "evidence": {}, "remediation": "fix it"}


def check(result, cid: str):
    hits = [c for c in result.checks if c.id == cid]
    assert hits, f"no check {cid}: {[c.id for c in result.checks]}"
    return hits[0]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
        raise SystemExit(0)  # main returns normally only if the command did not exit
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


# ---------------------------------------------------------------------------------------- thresholds
@pytest.mark.parametrize("expr,metric,kind,value", [
    ("step:5%", "step", "pct", 5.0),
    ("class.kv_cast:10%", "class.kv_cast", "pct", 10.0),
    ("class.*:15%", "class.*", "pct", 15.0),
    ("step:200us", "step", "abs", 200.0),
    ("step:0.2ms", "step", "abs", 200.0),
    ("step:1s", "step", "abs", 1e6),
    ("class.comm: 2.5 %", "class.comm", "pct", 2.5),
    ("class.comm:off", "class.comm", "off", 0.0),
])
def test_parse_threshold(expr: str, metric: str, kind: str, value: float) -> None:
    t = parse_threshold(expr)
    assert (t.metric, t.kind) == (metric, kind)
    assert t.value == pytest.approx(value)


@pytest.mark.parametrize("expr,needle", [
    ("step", "METRIC:LIMIT"),
    ("step:5", "no unit"),
    ("steps:5%", "unknown metric"),
    ("class.:5%", "unknown metric"),
    ("step:-5%", "cannot read"),
    ("step:5 parsecs", "cannot read"),
])
def test_parse_threshold_errors(expr: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_threshold(expr)


def test_threshold_layers_and_wildcards() -> None:
    defaults = [parse_threshold(e) for e in ("step:5%", "class.*:10%")]
    config = [parse_threshold(e) for e in ("step:3%", "step:100us", "class.kv_cast:1%")]
    cli = [parse_threshold(e) for e in ("step:8%", "class.comm:off")]
    merged = merge_thresholds(defaults, config, cli)
    assert [t.expr for t in thresholds_for("step", merged)] == ["step:8%"]  # CLI replaced config's two
    assert [t.expr for t in thresholds_for("class.kv_cast", merged)] == ["class.kv_cast:1%"]
    assert [t.expr for t in thresholds_for("class.attention", merged)] == ["class.*:10%"]
    assert thresholds_for("class.comm", merged) == []  # off also hides class.*


def test_floor_parsing() -> None:
    assert parse_floor("10us").us(None) == 10.0
    assert parse_floor("0.1ms").us(None) == pytest.approx(100.0)
    assert parse_floor("0.5%").us(20_000.0) == pytest.approx(100.0)
    assert parse_floor(0).us(1000.0) == 0.0
    with pytest.raises(ConfigError):
        parse_floor("ten")


# ------------------------------------------------------------------------------------------- noise
def test_noise_test_clear_shift_is_significant() -> None:
    rng = np.random.default_rng(1)
    base = 1000 + rng.normal(0, 5, 8)
    cand = 1100 + rng.normal(0, 5, 8)
    r = noise_test(base, cand)
    assert r.decided and r.significant and r.p_value < 0.01
    assert r.method == "mann-whitney-exact"
    # an improvement is not a regression
    assert not noise_test(cand, base).significant


def test_noise_test_same_distribution_is_not_significant() -> None:
    rng = np.random.default_rng(2)
    r = noise_test(1000 + rng.normal(0, 20, 40), 1000 + rng.normal(0, 20, 40))
    assert r.decided and not r.significant
    assert r.method == "mann-whitney-normal"


def test_noise_test_too_few_samples_cannot_decide() -> None:
    r = noise_test([1.0, 2.0], [5.0, 6.0, 7.0])
    assert not r.decided and r.significant is None and "too few" in r.reason
    # 3 vs 3: the smallest attainable one-sided p is 1/20 = 0.05, not below alpha 0.05
    r = noise_test([1.0, 2.0, 3.0], [7.0, 8.0, 9.0])
    assert not r.decided and "smallest attainable" in r.reason
    assert noise_test([1.0, 2.0, 3.0], [7.0, 8.0, 9.0], alpha=0.1).significant
    assert not noise_test(None, [1.0, 2.0, 3.0]).decided


def test_mann_whitney_exact_and_normal_known_values() -> None:
    # 4 vs 4 completely separated: exact one-sided p = 1 / C(8, 4) = 1/70
    p, method, p_min = mann_whitney_greater(np.array([1.0, 2, 3, 4]), np.array([5.0, 6, 7, 8]))
    assert method == "mann-whitney-exact" and p == pytest.approx(1 / 70) and p_min == pytest.approx(1 / 70)
    # ties: both samples identical -> p = 1 (no evidence of a shift)
    p, _, _ = mann_whitney_greater(np.array([3.0] * 12), np.array([3.0] * 12))
    assert p == pytest.approx(1.0)


def test_mann_whitney_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n1, n2 in ((5, 6), (7, 7), (12, 15), (30, 25)):
        x = rng.normal(0, 1, n1).round(1)  # rounding makes ties
        y = rng.normal(0.7, 1, n2).round(1)
        p, method, _ = mann_whitney_greater(x, y)
        if method == "mann-whitney-exact":
            ref = stats.permutation_test((y, x), lambda a, b: stats.mannwhitneyu(a, b).statistic,
                                         alternative="greater", permutation_type="independent",
                                         n_resamples=np.inf).pvalue
        else:
            ref = stats.mannwhitneyu(y, x, alternative="greater", method="asymptotic").pvalue
        assert p == pytest.approx(ref, rel=1e-6), (n1, n2, method)


# ------------------------------------------------------------------------------------- gate checks
def test_gate_identical_passes() -> None:
    d = make_doc()
    r = Gate().run(d, copy.deepcopy(d))
    assert r.exit_code == 0, r.verdict()
    assert r.verdict().startswith("PASS")


def test_gate_class_regression_fails_with_reason() -> None:
    base = make_doc(seed=1)
    cand = make_doc(classes={"bf16_gemm": 500.0, "attention": 300.0, "kv_cast": 400.0}, step=1400.0, seed=2)
    r = Gate().run(base, cand)
    assert r.exit_code == 1
    kv = check(r, "class.kv_cast")
    assert kv.status == "fail" and "Mann-Whitney" in kv.message and "class.*:10%" in kv.data["exceeded"]
    assert check(r, "step").status == "fail"
    assert check(r, "class.bf16_gemm").status == "pass"
    assert any("class.kv_cast" in x for x in r.reasons())


def test_floor_keeps_tiny_class_change_from_failing() -> None:
    base = make_doc(classes={"bf16_gemm": 500.0, "norm": 2.0}, noise=0.001, seed=1)
    cand = make_doc(classes={"bf16_gemm": 500.0, "norm": 3.0}, noise=0.001, seed=2)  # +50%, +1 us
    r = Gate().run(base, cand)
    norm = check(r, "class.norm")
    assert norm.status == "pass" and "floor" in norm.message
    assert r.exit_code == 0
    # with no floor the same change is a (significant) regression: it explains, and fails only with a
    # threshold written for that class (the step did not regress)
    r0 = Gate(floor="0us").run(base, cand)
    assert check(r0, "class.norm").status == "warn" and check(r0, "class.norm").data["regressed"]
    assert r0.exit_code == 0 and r0.verdict().startswith("PASS")
    r1 = Gate(["class.norm:10%"], floor="0us").run(base, cand)
    assert check(r1, "class.norm").status == "fail" and r1.exit_code == 1
    assert "class.norm regressed" in r1.verdict() and "you set class.norm:10%" in r1.verdict()
    # a floor relative to the baseline step: 0.5% of 1000 us = 5 us > 1 us
    assert check(Gate(floor="0.5%").run(base, cand), "class.norm").status == "pass"


def test_noise_keeps_noisy_change_from_failing() -> None:
    # +6% median step but step-to-step noise of 20%: within noise
    base = make_doc(step=1000.0, noise=0.2, n=8, seed=5)
    cand = copy.deepcopy(base)
    for s in cand["steps"]["samples"]:
        s["step_us"] *= 1.06
    cand["steps"]["median_us"] *= 1.06
    r = Gate(["class.*:off"]).run(base, cand)
    st = check(r, "step")
    assert st.status == "pass" and "within step-to-step noise" in st.message, st.message
    assert st.data["noise"]["decided"] and st.data["noise"]["p_value"] > 0.05


def test_without_samples_threshold_and_floor_decide() -> None:
    base, cand = make_doc(seed=1), make_doc(step=1200.0, seed=2)
    for d in (base, cand):
        del d["steps"]["samples"]
    r = Gate().run(base, cand)
    st = check(r, "step")
    assert st.status == "fail" and "threshold and floor alone decide" in st.message
    assert r.exit_code == 1


def test_absolute_threshold() -> None:
    base, cand = make_doc(step=10_000.0, seed=1), make_doc(step=10_300.0, seed=2)  # +3%, +300 us
    assert check(Gate().run(base, cand), "step").status == "pass"  # under step:5%
    r = Gate(["step:200us"]).run(base, cand)
    assert check(r, "step").status == "fail" and r.exit_code == 1
    assert check(Gate(["step:500us"]).run(base, cand), "step").status == "pass"


def test_new_class_counts_as_regression() -> None:
    base = make_doc(classes={"bf16_gemm": 500.0}, seed=1)
    cand = make_doc(classes={"bf16_gemm": 500.0, "kv_cast": 300.0}, step=1300.0, seed=2)
    kv = check(Gate().run(base, cand), "class.kv_cast")
    assert kv.status == "fail" and "new" in kv.message


def test_findings_fail_on_levels() -> None:
    base = make_doc(seed=1, findings=[finding("old-rule", "warning")])
    cand = copy.deepcopy(base)
    cand["findings"] = [finding("old-rule", "warning"), finding("kv-full-pool-cast", "critical"),
                        finding("small-note", "info")]
    r = Gate().run(base, cand)  # default --fail-on warning
    assert r.exit_code == 1
    assert check(r, "finding.kv-full-pool-cast").status == "fail"
    assert check(r, "finding.small-note").status == "warn"
    assert check(r, "finding.old-rule").status == "pass"  # already in the baseline
    assert Gate(fail_on="critical").run(base, cand).exit_code == 1
    assert Gate(fail_on="never").run(base, cand).exit_code == 0
    assert check(Gate(fail_on="info").run(base, cand), "finding.small-note").status == "fail"
    assert Gate(disabled_rules=["kv-full-pool-cast"]).run(base, cand).exit_code == 0


def test_finding_escalation_and_removal() -> None:
    base = make_doc(seed=1, findings=[finding("r1", "info"), finding("gone", "critical")])
    cand = copy.deepcopy(base)
    cand["findings"] = [finding("r1", "critical")]
    r = Gate().run(base, cand)
    assert check(r, "finding.r1").status == "fail" and "escalated" in check(r, "finding.r1").message
    assert check(r, "finding.gone").status == "pass" and "resolved" in check(r, "finding.gone").message
    d = diff_documents(base, cand)
    assert [f["rule"] for f in d.findings["removed"]] == ["gone"]
    assert d.findings["changed"][0]["changes"] == ["severity info -> critical"]


@pytest.mark.parametrize("field,value", [("device", "NVIDIA H100 80GB HBM3"), ("tp", 4), ("phase", "prefill")])
def test_mismatch_is_unusable_unless_allowed(field: str, value: Any) -> None:
    base = make_doc(seed=1)
    cand = make_doc(seed=2, **{field: value})
    r = Gate().run(base, cand)
    assert r.exit_code == 2 and "--allow-mismatch" in r.verdict()
    r = Gate(allow_mismatch=True).run(base, cand)
    assert r.exit_code == 0 and any(c.status == "warn" and c.kind == "compat" for c in r.checks)


def test_diff_when_a_side_lacks_sections() -> None:
    gemm = [{"m": 256, "n": 2048, "k": 512, "dtype": "bf16", "calls": 16, "us": 160.0, "tflops": 200.0,
             "pct_peak": 20.0}]
    base = make_doc(seed=1, gemm=gemm)
    cand = make_doc(seed=2)
    del cand["classes"]
    del cand["findings"]
    d = diff_documents(base, cand)
    assert d.gemm == [] and "candidate" in d.gemm_note
    assert d.classes == [] and "candidate" in d.classes_note
    assert "candidate" in d.findings_note
    r = Gate().run(base, cand)
    assert r.exit_code == 0
    assert {c.id for c in r.checks if c.status == "warn"} >= {"class.*", "findings"}
    json.dumps(r.to_json(), allow_nan=False)
    # both sides with GEMMs: matched per shape
    cand2 = make_doc(seed=2, gemm=[dict(gemm[0], tflops=150.0, pct_peak=15.0),
                                   {"m": 8, "n": 64, "k": 2048, "dtype": "bf16", "calls": 4, "us": 10.0,
                                    "tflops": 1.0, "pct_peak": 0.1}])
    d2 = diff_documents(base, cand2)
    rows = {(g["m"], g["status"]): g for g in d2.gemm}
    assert rows[(256, "both")]["tflops_pct"] == pytest.approx(-25.0)
    assert (8, "added") in rows


# -------------------------------------------------------------------------------------- documents
def test_load_document_rejects_bad_json(tmp_path: Path) -> None:
    good = make_doc()
    (tmp_path / "trunc.json").write_text(json.dumps(good)[:200])
    with pytest.raises(TraceInputError, match="corrupt or truncated"):
        load_document(tmp_path / "trunc.json")
    with pytest.raises(TraceInputError, match="unsupported schema version"):
        load_document(write_json(tmp_path / "v2.json", dict(good, schema="traceinspect.analysis/2")))
    with pytest.raises(TraceInputError, match="unsupported schema"):
        load_document(write_json(tmp_path / "other.json", dict(good, schema="someone.else/1")))
    no_steps = copy.deepcopy(good)
    no_steps["steps"]["count"] = 0
    with pytest.raises(TraceInputError, match="no analysed"):
        load_document(write_json(tmp_path / "nosteps.json", no_steps))
    with pytest.raises(TraceInputError, match="no such file"):
        load_document(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(TraceInputError):
        load_document(tmp_path / "empty.json")
    doc = load_document(write_json(tmp_path / "ok.json", good))
    assert doc["steps"]["count"] == good["steps"]["count"]
    with gzip.open(tmp_path / "ok.json.gz", "wt") as f:
        json.dump(good, f)
    assert load_document(tmp_path / "ok.json.gz")["schema"] == "traceinspect.analysis/1"


# ----------------------------------------------------------------------------------------- outputs
NASTY = 'evil<rule>&"x"\x01,:%\n::error::'


def _nasty_result():
    base = make_doc(seed=1)
    cand = make_doc(seed=2, classes={"bf16_gemm": 500.0, "attention": 300.0, "kv_cast": 400.0}, step=1400.0,
                    findings=[finding(NASTY, "critical", title="cast <b>pool</b> | 100% & more")])
    return Gate().run(base, cand)


def test_junit_is_valid_and_escaped() -> None:
    r = _nasty_result()
    root = ET.fromstring(junit_xml(r).encode())
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(r.checks)
    fails = [c for c in cases if c.find("failure") is not None]
    assert len(fails) == sum(c.status == "fail" for c in r.checks) == int(suite.get("failures"))
    names = {c.get("name") for c in fails}
    assert "class.kv_cast" in names
    nasty = [c for c in cases if c.get("name").startswith("finding.evil")]
    assert nasty and "<rule>&" in nasty[0].get("name")  # round-trips as text, not markup
    assert "<b>pool</b>" in nasty[0].find("failure").get("message")


def test_junit_for_unusable_input() -> None:
    from traceinspect.gate import GateResult

    r = GateResult.from_error("x.json: corrupt or truncated JSON")
    root = ET.fromstring(junit_xml(r).encode())
    assert root.find("testsuite").get("errors") == "1"
    assert root.find("testsuite/testcase/error") is not None


def test_github_annotations_format_and_escaping() -> None:
    assert gh_escape_data("50% done\r\nnext") == "50%25 done%0D%0Anext"
    assert gh_escape_property("a:b,c%") == "a%3Ab%2Cc%25"
    lines = github_annotations(_nasty_result())
    pattern = re.compile(r"^::(error|warning|notice) title=[^:,\r\n]*::[^\r\n]*$")
    assert lines and all(pattern.match(x) for x in lines), lines
    assert any(x.startswith("::error title=traceinspect gate%3A class.kv_cast::regressed") for x in lines)
    evil = [x for x in lines if "evil" in x]
    assert evil and "\n" not in evil[0] and "%0A%3A%3Aerror%3A%3A" in evil[0]
    passing = github_annotations(Gate().run(make_doc(), make_doc()))
    assert passing[-1].startswith("::notice title=traceinspect gate::PASS")


def test_markdown_escapes_and_step_summary(tmp_path: Path) -> None:
    assert md_escape("a|b <i>x</i> *y*") == r"a\|b &lt;i&gt;x&lt;/i&gt; \*y\*"
    md = gate_markdown(_nasty_result())
    assert "<b>" not in md and "&lt;b&gt;pool&lt;/b&gt;" in md
    rows = [line for line in md.splitlines() if line.startswith("|") and "evil" in line]
    assert len(rows) == 2 and "\x01" not in md
    assert len(re.findall(r"(?<!\\)\|", rows[0])) == 4  # checks table: 3 columns; the title's '|' is escaped
    assert len(re.findall(r"(?<!\\)\|", rows[1])) == 5  # findings table: 4 columns
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    assert append_step_summary(md, {"GITHUB_STEP_SUMMARY": str(summary)}) == summary
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "traceinspect gate" in text
    assert append_step_summary(md, {}) is None


# ------------------------------------------------------------------------------------------ config
def test_config_file(tmp_path: Path) -> None:
    p = tmp_path / "traceinspect.toml"
    p.write_text('[gate]\nmax-regression = ["step:3%", "class.kv_cast:1%"]\nfloor = "5us"\nalpha = 0.1\n'
                 'fail-on = "critical"\nallow-mismatch = true\n\n[rules]\ndisable = ["small-m-gemm"]\n\n'
                 '[report]\nanything = 1\n')
    cfg = load_config(p)
    assert [t.expr for t in cfg.thresholds] == ["step:3%", "class.kv_cast:1%"]
    assert cfg.floor.us(None) == 5.0 and cfg.alpha == 0.1 and cfg.fail_on == "critical"
    assert cfg.allow_mismatch is True and cfg.disable == ["small-m-gemm"]
    assert find_config(None, cwd=tmp_path).path == p
    assert find_config(None, no_config=True, cwd=tmp_path).path is None
    assert find_config(None, cwd=tmp_path / "elsewhere").path is None
    for bad, needle in (('[gate]\nmax-regresion = ["step:5%"]\n', "unknown key"),
                        ('[gate]\nmax-regression = ["step:5"]\n', "no unit"),
                        ('[gate]\nfail-on = "sometimes"\n', "fail-on"),
                        ('[gate]\nalpha = 2\n', "alpha"),
                        ("[gate\n", "invalid TOML")):
        p.write_text(bad)
        with pytest.raises(ConfigError, match=needle):
            load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        find_config(tmp_path / "nope.toml")


# --------------------------------------------------------------------------------------------- CLI
@pytest.fixture()
def json_pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    base = make_doc(seed=1)
    bad = make_doc(seed=2, classes={"bf16_gemm": 500.0, "attention": 300.0, "kv_cast": 400.0}, step=1400.0,
                   findings=[finding("kv-full-pool-cast")])
    return write_json(tmp_path / "base.json", base), write_json(tmp_path / "same.json", make_doc(seed=1)), \
        write_json(tmp_path / "bad.json", bad)


def test_cli_gate_exit_codes_and_outputs(json_pair, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    base, same, bad = json_pair
    code, out, _ = run_cli(["gate", str(base), str(same)], capsys)
    assert code == 0 and "PASS" in out
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out, _ = run_cli(["gate", str(base), str(bad), "--junit", "out/j.xml", "--markdown", "out/g.md",
                            "--json", "out/g.json", "--github"], capsys)
    assert code == 1
    assert "class.kv_cast" in out and "kv-full-pool-cast" in out and out.rstrip().splitlines()[-1].startswith("FAIL")
    assert "::error title=traceinspect gate%3A class.kv_cast::" in out
    g = json.loads((tmp_path / "out/g.json").read_text())
    assert g["exit_code"] == 1 and g["schema"] == "traceinspect.gate/1"
    ET.parse(tmp_path / "out/j.xml")
    assert "traceinspect gate" in summary.read_text() and (tmp_path / "out/g.md").is_file()
    # the same regression passes when its class and step thresholds are switched off on the CLI
    code, out, _ = run_cli(["gate", str(base), str(bad), "-r", "class.*:off", "-r", "step:off",
                            "--fail-on", "never"], capsys)
    assert code == 0, out


def test_cli_gate_unusable_input(json_pair, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    base, _, _ = json_pair
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(base.read_text()[:-40])
    code, out, err = run_cli(["gate", str(base), str(corrupt), "--junit", "j.xml"], capsys)
    assert code == 2 and "corrupt or truncated JSON" in err
    assert ET.parse(tmp_path / "j.xml").getroot().find("testsuite").get("errors") == "1"
    code, _, err = run_cli(["gate", str(base), str(tmp_path / "missing")], capsys)
    assert code == 2 and "no such file" in err
    h100 = write_json(tmp_path / "h100.json", make_doc(seed=3, device="NVIDIA H100 80GB HBM3"))
    code, _, err = run_cli(["gate", str(base), str(h100)], capsys)
    assert code == 2 and "GPU differs" in err
    code, _, _ = run_cli(["gate", str(base), str(h100), "--allow-mismatch"], capsys)
    assert code == 0
    code, _, err = run_cli(["gate", str(base), str(base), "-r", "step:5"], capsys)
    assert code == 2 and "no unit" in err


def test_cli_config_and_override(json_pair, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    base, _, bad = json_pair
    (tmp_path / "traceinspect.toml").write_text(
        '[gate]\nmax-regression = ["class.*:off", "step:off"]\n[rules]\ndisable = ["kv-full-pool-cast"]\n')
    code, out, _ = run_cli(["gate", str(base), str(bad)], capsys)
    assert code == 0, out  # the config switched everything that fails off
    code, out, _ = run_cli(["gate", str(base), str(bad), "-r", "class.kv_cast:10%"], capsys)
    assert code == 1 and "class.kv_cast" in out  # the CLI flag overrides the config for that metric
    code, out, _ = run_cli(["gate", str(base), str(bad), "--no-config"], capsys)
    assert code == 1


def test_cli_diff(json_pair, tmp_path: Path, capsys) -> None:
    base, _, bad = json_pair
    code, out, _ = run_cli(["diff", str(base), str(bad), "--json", str(tmp_path / "d.json"),
                            "--markdown", str(tmp_path / "d.md")], capsys)
    assert code == 0
    assert "kv_cast" in out and "+ critical kv-full-pool-cast" in out
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["schema"] == "traceinspect.diff/1"
    assert [f["rule"] for f in d["findings"]["added"]] == ["kv-full-pool-cast"]
    assert "GPU time per step by class" in (tmp_path / "d.md").read_text()


# ----------------------------------------------------------------------------- done-when: fixtures
GATHER, FULL = "kv-gather-cast-eager", "kv-full-cast-eager"


def _fixture(name: str) -> Path:
    d = FIXTURES / name
    if not d.is_dir() or not any(d.glob("*.trace.json*")):
        pytest.skip(f"fixture {name} is not present")
    return d


@pytest.fixture(scope="module")
def fixture_json(tmp_path_factory: pytest.TempPathFactory):
    """Analyse each fixture once (seconds each) and keep its analysis JSON."""
    from traceinspect.pipeline import Options, analyze

    out = tmp_path_factory.mktemp("baselines")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            doc = analyze(_fixture(name), Options(command="test")).to_json()
            cache[name] = write_json(out / f"{name}.json", doc)
        return cache[name]

    return get


def fixture_pairs() -> list[tuple[str, str]]:
    """Every before/after fixture pair: the ``pairs`` of each manifest, and the TP2 sets kv-full-cast-* ->
    kv-gather-cast-*."""
    pairs: list[tuple[str, str]] = []
    for manifest in sorted(FIXTURES.glob("*/manifest.json")):
        for p in json.loads(manifest.read_text()).get("pairs") or []:
            b, a = (x.get("set") if isinstance(x, dict) else x for x in (p.get("before"), p.get("after")))
            if b and a and (b, a) not in pairs:
                pairs.append((b, a))
    for full in sorted(FIXTURES.glob("kv-full-cast-*")):
        pairs.append((full.name, full.name.replace("kv-full-cast-", "kv-gather-cast-")))
    return pairs


PAIRS = fixture_pairs()


def _speed(doc: dict[str, Any], per_token: bool) -> float:
    """Larger is faster: tokens/s where the batches differ, else minus the median step."""
    step = doc["steps"]["median_us"]
    return doc["run"]["batch_median"] * 1e6 / step if per_token else -step


def _exact_p_greater(x: list[float], y: list[float]) -> float:
    """One-sided exact Mann-Whitney p-value that ``y`` is stochastically greater than ``x``, by enumeration."""
    import itertools

    pooled = list(x) + list(y)
    n, k = len(pooled), len(y)

    def u(idx: tuple[int, ...]) -> float:
        ys = [pooled[i] for i in idx]
        xs = [pooled[i] for i in range(n) if i not in idx]
        return sum((a > b) + 0.5 * (a == b) for a in ys for b in xs)

    obs = u(tuple(range(len(x), n)))
    splits = list(itertools.combinations(range(n), k))
    return sum(u(c) >= obs - 1e-9 for c in splits) / len(splits)


def _outputs_agree(code: int, out: str, tmp: Path) -> None:
    """The printed verdict (last line), the exit code and the JSON, JUnit, Markdown and GitHub outputs agree."""
    verdict = out.rstrip().splitlines()[-1]
    word = {0: "PASS:", 1: "FAIL:", 2: "ERROR"}[code]
    assert verdict.startswith(word), (code, verdict)
    g = json.loads((tmp / "g.json").read_text())
    assert (g["exit_code"], g["verdict"]) == (code, verdict)
    suite = ET.parse(tmp / "j.xml").getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"] == verdict and props["exit_code"] == str(code)
    assert (int(suite.get("failures")) > 0) == (code == 1)
    md = (tmp / "g.md").read_text()
    assert md.startswith(f"## traceinspect gate: {({0: '✅ PASS', 1: '❌ FAIL', 2: '⛔ ERROR'})[code]}")
    assert md_escape(verdict) in md
    level = "notice" if code == 0 else "error"
    assert f"::{level} title=traceinspect gate::{gh_escape_data(verdict)}" in out


@pytest.mark.parametrize("before,after", PAIRS, ids=[f"{b}->{a}" for b, a in PAIRS])
def test_fixture_pair_fix_passes_and_its_reverse_fails(before: str, after: str, fixture_json, tmp_path: Path,
                                                       capsys) -> None:
    """The faster side of every pair (the lower step time, or the higher tokens/s where the batches differ)
    passes against the slower one; the reverse fails, beyond step-to-step noise, naming the class that grew most."""
    docs = {n: json.loads(fixture_json(n).read_text()) for n in (before, after)}
    batches = {n: d["run"]["batch_median"] for n, d in docs.items()}
    per_token = None not in batches.values() and batches[before] != batches[after]
    slow, fast = sorted((before, after), key=lambda n: _speed(docs[n], per_token))
    gain = 100 * (_speed(docs[fast], per_token) - _speed(docs[slow], per_token)) / abs(_speed(docs[slow], per_token))
    assert gain >= 5, (slow, fast, gain)  # every pair changes its speed by 5% or more
    args = ["--no-config", "--github", "--json", str(tmp_path / "g.json"), "--junit", str(tmp_path / "j.xml"),
            "--markdown", str(tmp_path / "g.md")]

    code, out, err = run_cli(["gate", str(fixture_json(slow)), str(fixture_json(fast)), *args], capsys)
    assert code == 0, out + err
    _outputs_agree(code, out, tmp_path)
    if per_token:
        assert f"at batch {batches[slow]:g} -> {batches[fast]:g}" in out and "tokens/s is the verdict" in out

    # the reverse: a regression of the verdict metric, failing where the samples show it beyond noise
    code, out, err = run_cli(["gate", str(fixture_json(fast)), str(fixture_json(slow)), *args], capsys)
    _outputs_agree(code, out, tmp_path)
    steps = {n: [s["step_us"] for s in docs[n]["steps"]["samples"]] for n in (slow, fast)}
    if per_token:  # tokens/s samples: the fast side's rate above the slow side's
        p = _exact_p_greater([batches[slow] * 1e6 / x for x in steps[slow]],
                             [batches[fast] * 1e6 / x for x in steps[fast]])
    else:
        p = _exact_p_greater(steps[fast], steps[slow])
    verdict = out.rstrip().splitlines()[-1]
    if p >= 0.05:
        assert code == 0 and "within step-to-step noise" in out, (p, out)
        return
    assert code == 1, out + err
    scale = {n: (batches[n] if per_token else 1.0) for n in (slow, fast)}
    grew = {c: docs[slow]["classes"].get(c, {}).get("us_per_step", 0.0) / scale[slow]
            - docs[fast]["classes"].get(c, {}).get("us_per_step", 0.0) / scale[fast]
            for c in set(docs[slow]["classes"]) | set(docs[fast]["classes"])}
    top = max(grew, key=lambda c: grew[c])
    assert grew[top] > 0
    assert f"grew most {'per token' if per_token else 'per step'}: class.{top} " in verdict, (top, verdict)
    assert ("tokens/s fell" if per_token else "step regressed") in verdict


def test_readme_pair_through_the_entry_point() -> None:
    """``traceinspect gate`` on the README's before/after traces: the fix passes with exit 0, the reverse fails
    with exit 1, and the printed verdict says the same."""
    import subprocess
    import sys

    full, gather = (str(_fixture(n)) for n in ("kv-full-cast-graph", "kv-gather-cast-graph"))
    outs = []
    for args, code, word in (((full, gather), 0, "PASS:"), ((gather, full), 1, "FAIL:")):
        proc = subprocess.run([sys.executable, "-m", "traceinspect", "gate", *args, "--no-config"],
                              capture_output=True, text=True, timeout=300, cwd=FIXTURES.parent)
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert proc.stdout.rstrip().splitlines()[-1].startswith(word), proc.stdout
        outs.append(proc.stdout)
    # the collective wait that grew on the fix explains, and does not fail it
    assert "  WARN   late-rank.TP1: TP1 arrives late" in outs[0] and "not failing" in outs[0], outs[0]


def test_not_comparable_shows_why_and_caps_the_keys(fixture_json, tmp_path: Path, capsys) -> None:
    base, cand = fixture_json("kv-gather-cast-graph"), fixture_json("tp1-l6-gather-graph")
    code, out, err = run_cli(["gate", str(base), str(cand), "--no-config", "--markdown", str(tmp_path / "g.md"),
                              "--json", str(tmp_path / "g.json"), "--junit", str(tmp_path / "j.xml"), "--github"],
                             capsys)
    assert code == 2 and "TP size differs: baseline 2, candidate 1" in err
    _outputs_agree(code, out, tmp_path)
    md = (tmp_path / "g.md").read_text()
    assert "✅" not in md and "❌" not in md and "more (the JSON output lists them all)" in md
    assert md.count("\n| ") <= 2 + 2 + 10 + 2  # the error checks and 10 keys, with their headers
    annotations = [x for x in out.splitlines() if x.startswith("::")]
    assert annotations and all(x.startswith("::error") for x in annotations)
    lines = [x for x in out.rstrip().splitlines() if not x.startswith("::")]
    assert not any(x.lstrip().startswith(("PASS", "FAIL")) for x in lines), out
    assert lines[-1].startswith("ERROR (not comparable): TP size differs") and "--allow-mismatch" in lines[-1]
    b, c = (json.loads(p.read_text())["server_config"] for p in (base, cand))
    differ = [k for k in set(b) | set(c) if b.get(k) != c.get(k)]
    assert len(differ) > 10
    keys = [x for x in lines if x.startswith("    ") and ": " in x and not x.lstrip().startswith("and ")]
    assert len(keys) == 10, out
    assert f"    and {len(differ) - 10} more" in out and f"server config: {len(differ)} key(s) differ" in out
    assert len(lines) <= 16, out
    # allowed: compared, with the keys still capped
    code, out, _ = run_cli(["gate", str(base), str(cand), "--no-config", "--allow-mismatch"], capsys)
    assert code in (0, 1) and f"and {len(differ) - 10} more" in out


def test_server_config_keys_capped_in_a_passing_run(tmp_path: Path, capsys) -> None:
    base, cand = make_doc(seed=1), make_doc(seed=1)
    base["server_config"] = {f"key{i:02d}": i for i in range(25)}
    cand["server_config"] = {f"key{i:02d}": i + 1 for i in range(25)} | {"only_here": True}
    code, out, _ = run_cli(["gate", str(write_json(tmp_path / "b.json", base)),
                            str(write_json(tmp_path / "c.json", cand)), "--no-config"], capsys)
    assert code == 0 and out.rstrip().splitlines()[-1].startswith("PASS")
    assert "server config: 26 key(s) differ (25 set in both runs, 1 in one run only)" in out
    assert "key00: 0 -> 1" in out and "key10" not in out and "only_here" not in out
    assert "and 16 more" in out


def test_diff_all_counts_only_what_changed(fixture_json, tmp_path: Path, capsys) -> None:
    base, cand = fixture_json("kv-full-cast-graph"), fixture_json("kv-gather-cast-graph")
    code, out, _ = run_cli(["diff", str(base), str(cand), "--all", "--json", str(tmp_path / "d.json")], capsys)
    assert code == 0
    rows = json.loads((tmp_path / "d.json").read_text())["gemm"]
    changed = sum(r["status"] != "both" or (r["tflops_pct"] is not None and abs(r["tflops_pct"]) >= 5) for r in rows)
    assert f"GEMM shapes: {len(rows)} compared, {changed} changed by >= 5% or added/removed" in out
    assert changed < len(rows)  # the graph pair's GEMMs moved by a few percent at most


def test_new_finding_on_a_fix(capsys) -> None:
    """A new finding does not fail a candidate whose step improved by 5% or more unless its class grew."""
    fix = {"fixes": [{"edits": [{"select": {"class": "kv_cast"}}]}]}
    base = make_doc(step=2000.0, classes={"bf16_gemm": 500.0, "kv_cast": 1000.0}, seed=1)
    cand = make_doc(step=1000.0, classes={"bf16_gemm": 500.0, "kv_cast": 50.0}, seed=2,
                    findings=[finding("kv-full-pool-cast", "critical") | fix])
    r = Gate().run(base, cand)
    f = check(r, "finding.kv-full-pool-cast")
    assert r.exit_code == 0 and f.status == "warn", r.verdict()
    assert "the step time improved by 50" in f.message and "kv_cast did not grow" in f.message
    # the same finding, its class grown: fails, although the step improved
    grown = make_doc(step=1000.0, classes={"bf16_gemm": 100.0, "kv_cast": 1500.0}, seed=2,
                     findings=[finding("kv-full-pool-cast", "critical") | fix])
    r = Gate().run(base, grown)
    assert r.exit_code == 1 and check(r, "finding.kv-full-pool-cast").status == "fail"
    assert "new critical finding kv-full-pool-cast" in r.verdict()
    # a step that did not improve by 5%: the new finding fails as before
    flat = make_doc(step=1960.0, classes={"bf16_gemm": 500.0, "kv_cast": 50.0}, seed=2,
                    findings=[finding("kv-full-pool-cast", "critical") | fix])
    assert check(Gate().run(base, flat), "finding.kv-full-pool-cast").status == "fail"


def test_batch_change_is_judged_by_tokens_per_second() -> None:
    base, cand = make_doc(step=2700.0, seed=1), make_doc(step=4600.0, seed=2)
    base["run"]["batch_median"], cand["run"]["batch_median"] = 16.0, 256.0
    r = Gate().run(base, cand)
    assert r.exit_code == 0 and check(r, "step").status == "pass" and check(r, "throughput").status == "pass"
    assert "tokens/s is the verdict" in check(r, "step").message
    rate = [d["run"]["batch_median"] * 1e6 / d["steps"]["median_us"] for d in (base, cand)]
    assert r.verdict().startswith(f"PASS: tokens/s {rate[0]:,.0f} -> {rate[1]:,.0f} ("), r.verdict()
    # a step threshold the user wrote still gates the step time
    assert Gate(["step:5%"]).run(base, cand).exit_code == 1
    # the same batch: tokens/s follows the step
    same = make_doc(step=2700.0 * 1.3, seed=2)
    base["run"]["batch_median"] = same["run"]["batch_median"] = 64.0
    r = Gate().run(base, same)
    assert r.exit_code == 1 and check(r, "throughput").status == "fail" and check(r, "step").status == "fail"
    with pytest.raises(ConfigError, match="percentage"):
        parse_threshold("throughput:100us")


@pytest.mark.parametrize("form", ["traces", "json"])
def test_fixture_against_itself_passes(form: str, fixture_json, capsys) -> None:
    path = str(_fixture(FULL)) if form == "traces" else str(fixture_json(FULL))
    code, out, err = run_cli(["gate", path, path, "--no-config"], capsys)
    assert code == 0 and "PASS" in out, out + err


def test_fixture_json_baseline_against_traces(fixture_json, capsys) -> None:
    code, out, err = run_cli(["gate", str(fixture_json(GATHER)), str(_fixture(GATHER)), "--no-config"], capsys)
    assert code == 0, out + err
    gather, full = "kv-gather-cast-graph", "kv-full-cast-graph"
    code, out, err = run_cli(["gate", str(fixture_json(gather)), str(_fixture(full)), "--no-config"], capsys)
    assert code == 1, out + err
    verdict = out.rstrip().splitlines()[-1]
    assert "grew most per step: class.kv_cast" in verdict and "kv-full-pool-cast" in verdict, verdict


@pytest.mark.parametrize("form", ["traces", "json"])
def test_fixture_against_corrupted_file_is_unusable(form: str, fixture_json, tmp_path: Path, capsys) -> None:
    src = _fixture(GATHER)
    if form == "traces":
        bad = tmp_path / "corrupt"
        bad.mkdir()
        for p in src.iterdir():
            if p.is_file():
                data = p.read_bytes()
                (bad / p.name).write_bytes(data[: len(data) // 2] if ".trace.json" in p.name else data)
        base = str(src)
    else:
        bad = tmp_path / "corrupt.json"
        text = fixture_json(GATHER).read_text()
        bad.write_text(text[: len(text) // 2])
        base = str(fixture_json(GATHER))
    code, out, err = run_cli(["gate", base, str(bad), "--no-config"], capsys)
    assert code == 2 and err.startswith("traceinspect: error:"), out + err
