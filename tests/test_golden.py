"""Every fixture set's JSON, Markdown, HTML and terminal output equal the stored golden copies (see
tests/golden/golden.py), so a change that moves code cannot move a number or a word unnoticed."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from golden import OUTPUTS, fixture_sets, render, report_from_json, set_name, stored  # noqa: E402


@pytest.mark.parametrize("fixture", fixture_sets(), ids=set_name)
def test_outputs_equal_golden(fixture: Path, tmp_path: Path) -> None:
    got, want = render(fixture, tmp_path / set_name(fixture)), stored(fixture)
    for name in OUTPUTS:
        if got[name] != want[name]:
            diff = "".join(list(difflib.unified_diff(want[name].splitlines(True), got[name].splitlines(True),
                                                     "golden/" + name, "now/" + name, n=1))[:60])
            pytest.fail(f"{set_name(fixture)}/{name} differs from the golden copy "
                        f"(python tests/golden/update.py {set_name(fixture)} after a change meant to alter it):\n{diff}")
    # the report made from the stored analysis JSON is the report made from the traces
    for name, text in report_from_json(tmp_path / set_name(fixture)).items():
        assert text == got[name], f"{set_name(fixture)}: `report analysis.json` gives another {name} than the traces"


def test_every_fixture_set_has_a_golden_copy() -> None:
    names = {set_name(f) for f in fixture_sets()}
    stored_names = {p.name for p in (Path(__file__).resolve().parent / "golden").iterdir() if p.is_dir()}
    assert names == stored_names - {"__pycache__"}


@pytest.mark.parametrize("name", ["kv-full-cast-eager", "tp1-l6-full-graph", "moe-small-m-eager"])
def test_terminal_alone_equals_golden(name: str) -> None:
    """``analyze`` with no output file (the document is built without its report section) prints the
    terminal summary the golden run printed."""
    import os
    import subprocess

    fixture = next(f for f in fixture_sets() if set_name(f) == name)
    rel = fixture.relative_to(fixture.parents[1]).as_posix()
    env = {**os.environ, "COLUMNS": "120", "TRACEINSPECT_CACHE": "off"}
    proc = subprocess.run([sys.executable, "-m", "traceinspect", "analyze", rel, "--no-cache"], cwd=fixture.parents[1],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == stored(fixture)["terminal.txt"]
