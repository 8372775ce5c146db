"""What the console entry point does before an analysis: pandas is imported with pyarrow hidden from it
(and only from it), and what the commands write is what the library gives under a pandas that has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, fixture_dir, real_trace

from traceinspect.document import write_document
from traceinspect.pipeline import analyze

pytest.importorskip("pyarrow")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, check=True,
                          env={**os.environ, **(env or {})})


def _doc(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    doc["source"].pop("command")
    return doc


def test_the_command_imports_pandas_without_pyarrow(tmp_path: Path) -> None:
    r = _cli("-X", "importtime", "-m", "traceinspect", "analyze", "--no-cache", "-q",
             str(fixture_dir("tp1-l6-gather-eager")))
    mods = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    # (an import refused is listed too: pyarrow's own modules are not)
    assert "pandas" in mods and not {m for m in mods if m.startswith("pyarrow.")}


def test_pyarrow_is_hidden_only_while_pandas_imports() -> None:
    code = ("import sys; from traceinspect import cli; cli.hide_pyarrow_from_pandas(); f = sys.meta_path[0]; "
            "import pandas, pandas.compat as c; import pyarrow.parquet; "
            "print(c.HAS_PYARROW, pandas.Series(['a']).dtype.storage, f in sys.meta_path)")
    assert _cli("-c", code).stdout.split() == ["False", "python", "False"]
    # a pandas imported before the finder is installed is left as it is
    code = ("import sys, pandas, pandas.compat as c; from traceinspect import cli; "
            "n = len(sys.meta_path); cli.hide_pyarrow_from_pandas(); print(c.HAS_PYARROW, len(sys.meta_path) - n)")
    assert _cli("-c", code).stdout.split() == ["True", "0"]


@pytest.mark.parametrize("trace", [
    lambda: fixture_dir("kv-full-cast-graph"),
    lambda: real_trace("tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"),
], ids=["fixture", "tracelens-sglang-decode"])
def test_the_command_writes_what_the_library_gives(trace: Any, tmp_path: Path) -> None:
    path = trace()
    lib = tmp_path / "lib.json"
    write_document(lib, analyze([path], use_cache=False).to_json())
    want = _doc(lib)
    cache = {"TRACEINSPECT_CACHE": str(tmp_path / "cache")}
    for run in ("cold", "warm"):  # the cache written, then read, through pyarrow imported after pandas
        out = tmp_path / f"{run}.json"
        _cli("-m", "traceinspect", "analyze", "-q", "--json", str(out), str(path), env=cache)
        assert _doc(out) == want, run
    assert list((tmp_path / "cache").rglob("meta.json"))


def _imported(*args: str) -> set[str]:
    r = _cli("-X", "importtime", "-m", "traceinspect", *args)
    return {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("width", ["60", "80", "200"])
def test_the_command_list_is_what_the_commands_say(width: str) -> None:
    """``traceinspect --help`` lists each command with the short help click makes of its own help text, from
    the summaries kept beside the command names, at any terminal width."""
    from traceinspect import cli

    r = _cli("-W", "error::DeprecationWarning", "-m", "traceinspect", "--help", env={"COLUMNS": width})
    lazy = r.stdout
    assert "Warning" not in r.stderr, r.stderr  # nothing deprecated is used (click warns on such imports)
    # the same group with every command imported, listed by click itself
    code = ("import click; from traceinspect import cli; g = click.Group(name='traceinspect', help=cli.cli.help, "
            "params=cli.cli.params, context_settings=cli.cli.context_settings, commands={n: "
            "cli.cli.get_command(click.Context(cli.cli), n) for n in cli.COMMANDS}); "
            "g.main(['--help'], prog_name='traceinspect')")
    assert lazy == _cli("-c", code, env={"COLUMNS": width}).stdout and "Commands:" in lazy
    assert set(cli.SUMMARIES) == set(cli.COMMANDS)


def test_help_and_stored_document_comparisons_start_without_pandas(tmp_path: Path) -> None:
    """The command list imports no command; ``gate`` and ``diff`` of two stored analysis documents import
    neither pandas nor the analysis."""
    mods = _imported("--help")
    assert "pandas" not in mods and not {m for m in mods if m.startswith("traceinspect.commands.")}
    a = analyze([str(fixture_dir("tp1-l6-gather-eager"))], use_cache=False).to_json()
    base, cand = write_document(tmp_path / "base.json", a), write_document(tmp_path / "cand.json", a)
    for cmd in ("gate", "diff"):
        mods = _imported(cmd, str(base), str(cand))
        assert "pandas" not in mods and "traceinspect.analysis" not in mods, cmd


def test_rule_listings_start_without_pandas() -> None:
    """``rules list`` and ``rules show`` load every rule and the metric registry its expressions are checked
    against, but none of the code that computes the metrics from the tables: no pandas."""
    for cmd in (("rules", "list"), ("rules", "show", "kv-full-pool-cast"), ("rules", "metrics"),
                ("rules", "check", str(ROOT / "rules"))):
        mods = _imported(*cmd)
        assert "pandas" not in mods and "traceinspect.tables" not in mods, cmd
        assert "traceinspect.judge.metrics.run" in mods, cmd  # the registry is complete


def test_the_analysis_modules_import_without_yaml() -> None:
    """PyYAML is imported where YAML is parsed, not by importing the analysis."""
    code = ("import sys, traceinspect.pipeline, traceinspect.commands.analyze, traceinspect.judge.rules; "
            "print(sorted(m for m in sys.modules if m == 'yaml.reader' or m.startswith('_yaml')))")
    assert _cli("-c", code).stdout.split() == ["[]"]
    code = ("import sys, traceinspect.pipeline as p; from traceinspect.steps import step_rules; step_rules(); "
            "print('yaml.reader' in sys.modules)")
    assert _cli("-c", code).stdout.split() == ["True"]  # (read here: imported then)


def test_a_lazy_module_imports_once_whole_for_threads_that_ask_at_once() -> None:
    code = ("import sys, threading; from traceinspect.resources import lazy_module\n"
            "m = lazy_module('yaml'); assert 'yaml' not in sys.modules\n"
            "got = []; go = threading.Barrier(8)\n"
            "def ask():\n    go.wait(); got.append((m.safe_load('a: [1, 2]'), m.YAMLError.__name__))\n"
            "ts = [threading.Thread(target=ask) for _ in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "print(len(got), all(g == ({'a': [1, 2]}, 'YAMLError') for g in got), lazy_module('yaml') is sys.modules['yaml'])")
    assert _cli("-c", code).stdout.split() == ["8", "True", "True"]
