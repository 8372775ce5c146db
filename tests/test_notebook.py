"""The notebook API: ``traceinspect.analyze(path)`` returns DataFrames with the numbers of the JSON and
the CLI's outputs, and the README's example runs as written."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from conftest import FIXTURES, ROOT, fixture_dir, real_trace


@pytest.fixture(scope="module")
def graph_analysis():
    import traceinspect

    return traceinspect.analyze(str(fixture_dir("kv-full-cast-graph")), jobs=1)


def test_accessors_are_dataframes_with_the_json_numbers(graph_analysis) -> None:
    import traceinspect
    from traceinspect.render.story import story

    a = graph_analysis
    assert isinstance(a, traceinspect.Analysis)
    doc = a.to_json()
    for name in ("kernels", "steps", "classes", "gemm", "findings", "ops", "kernel_table"):
        assert isinstance(getattr(a, name), pd.DataFrame), name
    # findings: the one order, the JSON's savings
    assert a.findings["rule"].tolist() == [f["rule"] for f in story(doc).findings]
    assert a.findings["rule"].iloc[0] == "kv-full-pool-cast"
    by_rule = {f["rule"]: f for f in doc["findings"]}
    for r in a.findings.itertuples():
        assert r.saving_us_per_step == by_rule[r.rule]["est_saving_us_per_step"]
    # classes: time per step as in the JSON, shares of the step time
    cls = a.classes.set_index("cls")
    for c, v in doc["classes"].items():
        assert cls.loc[c, "us_per_step"] == v["us_per_step"]
        assert cls.loc[c, "share_of_step"] == v["share_of_step"]  # the document's (of its unrounded time)
        assert cls.loc[c, "share_of_step"] == pytest.approx(v["us_per_step"] / doc["steps"]["median_us"], rel=1e-3)
    # kernels: every activity of the analysed steps; steps: one row per rank and step
    assert len(a.kernels) == doc["coverage"]["kernels_analysed"]
    assert len(a.steps) == doc["steps"]["count"] * doc["run"]["ranks"]
    assert a.kernels["dur_us"].sum() == pytest.approx(sum(r["kernel_us"] for r in doc["ranks"]), rel=1e-6)
    assert len(a.gemm) == len(doc["gemm"]) and {"m", "n", "k", "tflops", "pct_peak"} <= set(a.gemm.columns)
    # the pipeline's attributes stay reachable
    assert a.n_ranks == 2 and a.trace is a.result.trace


def test_analyze_on_a_real_trace() -> None:
    import traceinspect

    a = traceinspect.analyze(str(real_trace("tracelens__b200__eager_trace.json.gz")), jobs=1)
    assert len(a.kernels) > 0 and len(a.classes) > 0
    assert a.kernels["cls"].isin(a.classes["cls"]).all()
    assert "rank(s)" in repr(a)


def test_readme_example_runs(monkeypatch) -> None:
    """The README's notebook example, run as written from the repository root."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Notebook API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "traceinspect.analyze(" in code
    monkeypatch.chdir(ROOT)
    if not (FIXTURES / "kv-full-cast-graph").is_dir():
        pytest.skip("fixture absent")
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own example
    assert isinstance(ns["a"].findings, pd.DataFrame)
