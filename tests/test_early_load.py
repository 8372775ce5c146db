"""The read begun beside the CLI's imports (traceinspect.load.early) gives exactly what the loader reads
itself: the same tables, digests, errors and error precedence; a warm cache is read, not scanned."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import pickle
import select
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import ROOT, fixture_dir, real_trace

import traceinspect.load as load
from traceinspect.cli import main
from traceinspect.errors import TraceInputError
from traceinspect.load import early, load_rank_file
from traceinspect.load.discover import Discovery, RankFile
from traceinspect.load.parse import ParsedRank
from traceinspect.load.raw import Sha256After, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the early read needs the native scanner")

TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")


@pytest.fixture(autouse=True)
def _no_plan_left() -> Any:
    yield
    early.drop()


def _other_threads_done() -> bool:
    """Wait for the threads earlier reads left (reapers, readers): a process is forked from one thread."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and t.name.startswith("traceinspect-"):
            t.join(300)  # a bound on a hung thread, not a speed
    return threading.active_count() == 1


@pytest.fixture(params=["thread", "process"])
def plan_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the first file read on a thread (:class:`early._Plan`) and in a process
    (:class:`early._ChildPlan`, Linux)."""
    if request.param == "thread":
        monkeypatch.setattr(early, "FORK_MAX", -1)
    elif not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    return request.param


def _plan_class(kind: str) -> type:
    return early._ChildPlan if kind == "process" else early._Plan


def _first_read_done(plan: Any) -> bool:
    """Whether the first file's early read has ended (within five minutes: a bound on a hang)."""
    if isinstance(plan, early._ChildPlan):
        return bool(select.select([plan.res_r], [], [], 300)[0])
    return plan.order[0][1].done.wait(300)


def _no_parse(*_: Any) -> None:
    raise AssertionError("parsed by the loader although read early")


def assert_same(a: ParsedRank, b: ParsedRank) -> None:
    for t in TABLES:
        x, y = getattr(a, t), getattr(b, t)
        assert list(x.columns) == list(y.columns), t
        for c in x.columns:  # column by column: dtype and values
            pd.testing.assert_series_equal(x[c], y[c], check_exact=True, obj=f"{t}.{c}")
    for f in dataclasses.fields(ParsedRank):
        if f.name not in TABLES:
            assert getattr(a, f.name) == getattr(b, f.name), f.name


def _early_load(path: Path, root: Path | None, monkeypatch: pytest.MonkeyPatch, kind: str = "thread"
                ) -> tuple[str, int, ParsedRank]:
    with monkeypatch.context() as m:
        m.setattr(load, "parse_file", _no_parse)  # the early read must serve it
        early.start([path], use_cache=root is not None, jobs=None, executor="local")
        assert isinstance(early._plan, _plan_class(kind))
        assert _first_read_done(early._plan)
        m.setattr(early, "read", _no_parse)  # (not a read of the loader's own)
        return load_rank_file(path, use_cache=root is not None)


@pytest.mark.parametrize("trace", [
    "fixture:kv-full-cast-eager/fixture-TP-0.trace.json.gz",
    "real:tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz",
    "real:hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz",
])
def test_early_read_gives_the_same_tables(trace: str, plan_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    where, name = trace.split(":")
    path = fixture_dir(name.split("/")[0]) / name.split("/")[1] if where == "fixture" else real_trace(name)
    monkeypatch.setenv("TRACEINSPECT_CACHE", "off")
    want = load_rank_file(path, use_cache=False)
    got = _early_load(path, None, monkeypatch, plan_kind)
    assert got[:2] == want[:2]  # digest, size
    assert_same(got[2], want[2])


def _analysis(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(["analyze", *args, "-q", "--json", str(out)])
    capsys.readouterr()
    return json.loads(out.read_text())


def _record_takes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each file the loader asked for had been read early (the list fills as the loader runs)."""
    calls: list[bool] = []
    real_take = early.take

    def take(path: Path, root: Path | None) -> Any:
        got = real_take(path, root)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(early, "take", take)
    return calls


def test_cli_analysis_is_the_same_with_and_without_the_early_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    d = str(fixture_dir("kv-full-cast-eager"))
    out = tmp_path / "a.json"
    calls = _record_takes(monkeypatch)
    with_early = _analysis([d, "--jobs", "1", "--no-cache"], out, capsys)
    assert calls == [True, True]
    monkeypatch.setattr(early, "start", lambda *a, **k: None)
    calls.clear()
    plain = _analysis([d, "--jobs", "1", "--no-cache"], out, capsys)
    assert calls == [False, False]
    assert with_early == plain


@pytest.mark.parametrize("command", ["diff", "gate"])
def test_diff_and_gate_read_a_trace_set_baseline_early(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base, cand = str(fixture_dir("tp1-l6-full-eager")), str(fixture_dir("tp1-l6-gather-eager"))
    calls = _record_takes(monkeypatch)

    def run(*sides: str) -> dict[str, Any]:
        out = tmp_path / f"{command}.json"
        calls.clear()
        with pytest.raises(SystemExit) if command == "gate" else contextlib.nullcontext():
            main([command, *sides, "--jobs", "1", "--no-cache", "--json", str(out)])
        capsys.readouterr()
        return json.loads(out.read_text())

    with_early = run(base, cand)
    assert calls == [True, False]  # the baseline's one rank file was read early, the candidate's by the loader
    stored = tmp_path / "base.json"
    main(["analyze", base, "-q", "--jobs", "1", "--no-cache", "--json", str(stored)])
    capsys.readouterr()
    run(str(stored), cand)  # a stored baseline: nothing to read early
    assert calls == [False]
    monkeypatch.setattr(early, "start", lambda *a, **k: None)
    assert run(base, cand) == with_early
    assert calls == [False, False]


def test_no_early_read_when_ranks_are_parsed_in_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    d = fixture_dir("kv-full-cast-eager")  # two rank files
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # by default, a parse process per two CPUs
    for kw in ({"jobs": None, "executor": "local"}, {"jobs": 2, "executor": "local"},
               {"jobs": 1, "executor": "dask"}):
        early.start([d], use_cache=False, **kw)
        assert early._plan is None, kw
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # one process parses both: they are read early
    early.start([d], use_cache=False, jobs=None, executor="local")
    assert early._plan is not None
    early.start([d], use_cache=False, jobs=1, executor="local")
    assert early._plan is not None
    early.start([d / "nothing-here"], use_cache=False, jobs=1, executor="local")  # discovery fails: nothing
    assert early._plan is None


def test_the_early_read_keeps_one_file_ahead_of_the_loader(plan_kind: str) -> None:
    d = fixture_dir("kv-full-cast-eager")
    early.start([d], use_cache=False, jobs=1, executor="local")
    plan = early._plan
    assert isinstance(plan, _plan_class(plan_kind))
    assert _first_read_done(plan)
    if plan_kind == "process":
        p0, p1 = plan.files
        assert plan.rest is None  # the second file is begun when the loader takes the first
        load_rank_file(p0, use_cache=False)
        assert plan.child is None and plan.fd < 0  # the process is done with, its memory file closed
        threads = plan.rest
        assert threads is not None and [p for p, _ in threads.order] == [p1]
        second = threads.order[0][1]
    else:
        threads = plan
        (p0, first), (p1, second) = plan.order
        assert not second.done.wait(0.3)  # not read before the loader takes the first
        load_rank_file(p0, use_cache=False)
    assert second.done.wait(300) and second.value is not None
    early.drop()
    assert not threads.thread.is_alive()


def test_the_early_read_process_is_stopped_and_reaped_when_dropped() -> None:
    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    d = fixture_dir("kv-full-cast-eager")
    early.start([d], use_cache=False, jobs=1, executor="local")
    plan = early._plan
    assert isinstance(plan, early._ChildPlan)
    pid = plan.child
    early.drop()  # before anything was taken
    assert plan.child is None and plan.fd < 0 and plan.res_r < 0
    assert _other_threads_done()  # (the reaper has waited for it)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert load_rank_file(plan.files[0], use_cache=False)[2] is not None  # the loader reads it itself


def test_a_large_first_file_is_read_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    d = fixture_dir("kv-full-cast-eager")
    size = min(p.stat().st_size for p in d.glob("*.trace.json.gz"))
    monkeypatch.setattr(early, "FORK_MAX", size - 1)
    early.start([d], use_cache=False, jobs=1, executor="local")
    assert isinstance(early._plan, early._Plan)


def _truncated(tmp_path: Path) -> Path:
    src = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    data = src.read_bytes()
    p = tmp_path / "cut" / "cut-TP-0.trace.json.gz"
    p.parent.mkdir()
    p.write_bytes(data[: len(data) // 2])
    return p


def _error(fn: Any) -> str:
    with pytest.raises(TraceInputError) as ei:
        fn()
    return str(ei.value)


@pytest.mark.parametrize("use_cache", [False, True])
def test_errors_read_the_same_through_the_early_read(tmp_path: Path, use_cache: bool, plan_kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "cache") if use_cache else "off")
    root = tmp_path / "cache" if use_cache else None
    cut = _truncated(tmp_path)
    missing = tmp_path / "gone-TP-0.trace.json.gz"
    bad_json = tmp_path / "bad-TP-0.trace.json"
    bad_json.write_bytes(b'{"traceEvents": [{"ph": "X",')
    for path in (cut, missing, bad_json):
        want = _error(lambda p=path: load_rank_file(p, use_cache=use_cache))
        # the file vanishes (or never was) after discovery: the early read itself meets the error
        monkeypatch.setattr(early, "discover", lambda *_a, p=path, **_k: Discovery([RankFile(p)], None, {}, []))
        if plan_kind == "process":
            assert _other_threads_done()
        early.start([path], use_cache=use_cache, jobs=1, executor="local")
        plan = early._plan
        # (a file that is not there is read on a thread: the process is for a file of a known small size)
        assert isinstance(plan, _plan_class(plan_kind if path.exists() else "thread")) and plan.root == root
        assert _first_read_done(plan)
        if isinstance(plan, early._Plan):
            assert plan.order[0][1].error is not None  # met in the thread
        got = _error(lambda p=path: load_rank_file(p, use_cache=use_cache))  # (process: the loader's own read)
        assert got == want
        monkeypatch.undo()
        monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "cache") if use_cache else "off")
        if plan_kind == "thread":
            monkeypatch.setattr(early, "FORK_MAX", -1)
    assert not list(tmp_path.glob("cache/**/meta.json"))


def test_cli_errors_through_the_early_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _truncated(tmp_path)
    for args in ([str(cut.parent)], [str(cut)], [str(tmp_path / "missing-TP-0.trace.json.gz")]):
        with pytest.raises(SystemExit) as ei:
            main(["analyze", *args, "--no-cache", "-q"])
        assert ei.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("traceinspect: error: ")
        assert str(cut) in err[0] or "missing-TP-0" in err[0]
    assert early._plan is None  # main() drops what it did not take


def test_a_rule_file_error_wins_over_a_trace_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _truncated(tmp_path)
    rules = tmp_path / "bad.yaml"
    rules.write_text("rules:\n  - id: r\n    severity: high\n")
    for cmd in (["analyze", str(cut), "-q"], ["report", str(cut), "-o", str(tmp_path / "r.html")]):
        with pytest.raises(SystemExit) as ei:
            main([*cmd, "--no-cache", "--rules", str(rules)])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert str(rules) in err and "truncated" not in err
    with pytest.raises(SystemExit):
        main(["analyze", str(cut), "-q", "--no-cache"])
    assert "truncated gzip" in capsys.readouterr().err


def test_a_warm_cache_is_read_not_scanned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "set"
    shutil.copytree(fixture_dir("kv-full-cast-eager"), d)
    cold = _analysis([str(d), "--jobs", "1"], tmp_path / "cold.json", capsys)  # scanned early, stored by the loader
    assert len(list((tmp_path / "cache").rglob("meta.json"))) == 2

    def no_scan(*_: Any, **__: Any) -> None:
        raise AssertionError("scanned although cached")

    monkeypatch.setattr(early, "read_scan", no_scan)
    monkeypatch.setattr(load, "parse_file", no_scan)
    warm = _analysis([str(d), "--jobs", "1"], tmp_path / "warm.json", capsys)
    for doc in (cold, warm):
        doc["source"].pop("command")
    assert warm == cold


def test_the_cache_is_written_by_the_loader_not_the_early_read(tmp_path: Path, plan_kind: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "cache"))
    path = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    early.start([path], use_cache=True, jobs=1, executor="local")
    assert isinstance(early._plan, _plan_class(plan_kind))
    assert _first_read_done(early._plan)  # read and scanned: nothing stored yet
    assert not list((tmp_path / "cache").rglob("meta.json"))
    digest, _, parsed = load_rank_file(path, use_cache=True)
    assert len(list((tmp_path / "cache").rglob("meta.json"))) == 1
    assert digest == load._sha256(path)
    again = load_rank_file(path, use_cache=True)[2]  # from the cache
    assert_same(again, parsed)


def test_the_early_read_imports_no_heavy_module() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import traceinspect.load.early"],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    mods = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in mods if m.split(".")[0] in ("numpy", "pandas", "msgspec", "pyarrow")
             or m.startswith("traceinspect.model")}
    assert "traceinspect.load.raw" in mods and not heavy



def test_parse_processes() -> None:
    from traceinspect.load.raw import parse_processes

    assert parse_processes(8, 3) == 3 and parse_processes(2, 8) == 2 and parse_processes(1, None) == 1
    assert parse_processes(8, 0) == 1
    cpus = os.cpu_count() or 1
    assert parse_processes(64, None) == max(1, cpus // 2)


_HUGEPAGE = """
import os, sys
from traceinspect.load import early
early.start([sys.argv[1]], use_cache=False, jobs=None, executor="local")
early.drop()
import numpy as np
print(os.environ.get("NUMPY_MADVISE_HUGEPAGE"), int(np._core.multiarray._get_madvise_hugepage()))
"""


@pytest.mark.parametrize("env, want", [(None, "0 0"), ("1", "1 1")], ids=["default", "set-by-the-user"])
def test_the_commands_keep_numpy_arrays_on_small_pages(env: str | None, want: str) -> None:
    """What the commands set before numpy is imported (a setting in the environment is kept)."""
    e = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        e["NUMPY_MADVISE_HUGEPAGE"] = env
    e["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _HUGEPAGE, str(fixture_dir("tp1-l6-gather-eager"))], env=e,
                       capture_output=True, text=True, check=True, cwd=ROOT)
    assert r.stdout.split() == want.split()


def test_no_process_to_spare_reads_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    path = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    fds = len(os.listdir("/proc/self/fd"))
    early.start([path], use_cache=False, jobs=1, executor="local")
    assert isinstance(early._plan, early._Plan)
    assert _first_read_done(early._plan)
    early._plan.order[0][1].digest.hexdigest()  # (the hash, begun after the scan, holds the file until done)
    assert len(os.listdir("/proc/self/fd")) == fds  # the memory file and pipe of the process not made are closed
    assert load_rank_file(path, use_cache=False)[2] is not None


def test_without_the_cache_the_hash_runs_after_the_scan_and_is_the_files(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", "off")
    src = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    path = tmp_path / "plain-TP-0.trace.json"
    path.write_bytes(gzip.decompress(src.read_bytes()))
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    order: list[str] = []
    real_scan = early.read_scan

    def scan(*a: Any, **k: Any) -> Any:
        order.append("scan")
        return real_scan(*a, **k)

    real_start = Sha256After.start

    def start(self: Sha256After) -> Sha256After:
        if self._t is None:
            order.append("hash")
        return real_start(self)

    monkeypatch.setattr(early, "read_scan", scan)
    monkeypatch.setattr(Sha256After, "start", start)
    ts = load.load_trace_set([path], use_cache=False, jobs=1)
    assert isinstance(ts.ranks[0].digest, Sha256After)
    assert order == ["scan", "hash"]  # the hash begun once the scan is over
    assert ts.ranks[0].sha256 == want and ts.ranks[0].digest == want  # resolved once, then the text
    # the loader's own callers get the text; a pending digest pickles as its text
    assert load_rank_file(path, use_cache=False)[0] == want
    later = Sha256After(path)
    assert pickle.loads(pickle.dumps(later)) == want
    # where the thread never ran (a forked process, say), the digest is computed where it is asked
    never = Sha256After(path)
    never._t = threading.Thread(target=lambda: None)
    never._t.start()
    assert never.hexdigest() == want
    gone = tmp_path / "gone.trace.json"
    with pytest.raises(TraceInputError, match="no such file"):
        Sha256After(gone)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 10_000, 65_537, 300_001])
@pytest.mark.parametrize("start", [0, 1, 4097])
def test_file_hash_through_mappings_is_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int,
                                                 start: int) -> None:
    """A file hashed through memory mappings, a window at a time (windows and the starting position not
    aligned to pages), gives hashlib's digest of its bytes from the position on; files below the size
    for mappings, and files that cannot be mapped, are read instead, with the same digest."""
    from traceinspect.load import raw

    monkeypatch.setattr(raw, "MAP_MIN", 1)
    monkeypatch.setattr(raw, "MAP_WINDOW", 3 * 4096 + 100 if size > 20_000 else 4096)
    data = os.urandom(size)
    path = tmp_path / "t.json"
    path.write_bytes(data)
    want = hashlib.sha256(data[start:]).hexdigest()
    mapped: list[int] = []
    real = raw._hash_mapped
    monkeypatch.setattr(raw, "_hash_mapped", lambda fd, at, h: mapped.append(at) or real(fd, at, h))
    with path.open("rb") as f:
        f.seek(start)
        assert raw._hash_file(f, 1000) == want
    assert mapped == [start]
    with path.open("rb") as f:  # a file the mapping refuses: read as before
        f.seek(start)
        monkeypatch.setattr(raw.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("no mappings")))
        assert raw._hash_file(f, 1000) == want
    r, w = os.pipe()  # not a regular file: read
    os.write(w, data[:4096])
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert raw._hash_file(f, 1000) == hashlib.sha256(data[:4096]).hexdigest()


def _beside_ready(timeout: float = 300.0) -> None:
    """Wait until the early-read process's beside results can be read (without taking them): the last
    part's (the parts are made in turn)."""
    import time

    assert early._later
    later = early._later[-1]
    assert later.fd >= 0
    end = time.monotonic() + timeout
    while not select.select([later.fd], [], [], 0.05)[0]:
        assert time.monotonic() < end, "the early-read process sent nothing"


def test_the_analysis_takes_its_tables_from_the_early_read_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule set, the shipped class and GPU tables and the settings tables that the CLI's early-read
    process reads once its file is read are the ones the analysis uses (nothing is read again here, no
    YAML parsed), with the same analysis."""
    from functools import partial

    import traceinspect.classify.table as table
    import traceinspect.measure.specs as specs
    import traceinspect.pipeline as pipeline
    import traceinspect.resources as resources
    from traceinspect.analysis import Options
    from traceinspect.commands.analyze import read_rules, read_tables
    from traceinspect.judge.gaps import evidence_table
    from traceinspect.measure.comm_settings import load_settings as collectives_settings
    from traceinspect.measure.replay.model import load_settings as replay_settings
    from traceinspect.steps import step_rules

    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    d = fixture_dir("kv-full-cast-eager")
    want = pipeline.analyze([d], Options(use_cache=False)).to_json()
    monkeypatch.setattr(table, "_DEFAULT", [])
    monkeypatch.setattr(specs, "_DEFAULT", [])
    for read in (step_rules, evidence_table, collectives_settings, replay_settings):  # the settings tables
        read.cache_clear()
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(read_tables, partial(read_rules, (), (), ())))
    assert early.beside_expected()
    _beside_ready()

    def read_here(*_: Any, **__: Any) -> None:
        raise AssertionError("read in this process")

    for mod, name in ((pipeline, "load_rule_set"), (table, "load_class_table"), (specs, "load_gpu_specs"),
                      (resources, "load_yaml")):
        monkeypatch.setattr(mod, name, read_here)
    assert pipeline.analyze([d], Options(use_cache=False)).to_json() == want
    assert not early.beside_expected() and early.beside_result() is None  # taken once


def test_tables_for_other_options_or_a_failed_process_are_read_here(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """A rule set read for other --rules/--only/--disable is not taken; a process that failed leaves the
    reading to this one, where a bad rule file is the error."""
    from functools import partial

    import traceinspect.pipeline as pipeline
    from traceinspect.analysis import Options
    from traceinspect.commands.analyze import read_rules, read_tables
    from traceinspect.errors import RuleError

    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    d = fixture_dir("kv-full-cast-eager")
    want = pipeline.analyze([d], Options(use_cache=False, only=("kv-full-pool-cast",))).to_json()
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(read_tables, partial(read_rules, (), (), ())))
    _beside_ready()
    got = pipeline.analyze([d], Options(use_cache=False, only=("kv-full-pool-cast",))).to_json()
    assert got == want and [f["rule"] for f in got["findings"]] in ([], ["kv-full-pool-cast"])

    def fails(names: list[str]) -> None:
        raise RuntimeError("no tables")

    _other_threads_done()
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(fails,))
    _beside_ready()
    assert pipeline.analyze([d], Options(use_cache=False, only=("kv-full-pool-cast",))).to_json() == want

    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: r\n    severity: high\n")
    _other_threads_done()
    early.start([d], use_cache=False, jobs=None, executor="local",
                beside=(read_tables, partial(read_rules, (str(bad),), (), ())))
    _beside_ready()
    with pytest.raises(RuleError, match="bad.yaml"):
        pipeline.analyze([d], Options(use_cache=False, rules=(str(bad),)))


def test_a_bad_rule_file_fails_the_cli_with_a_good_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "bad.yaml"
    rules.write_text("rules:\n  - id: r\n    severity: high\n")
    out = tmp_path / "a.json"
    with pytest.raises(SystemExit) as ei:
        main(["analyze", str(fixture_dir("kv-full-cast-eager")), "-q", "--no-cache", "--rules", str(rules),
              "--json", str(out)])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(rules) in err[0] and not out.exists()


def test_beside_work_runs_in_the_reading_process_and_is_taken_once() -> None:
    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    d = fixture_dir("kv-full-cast-eager")
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(lambda names: os.getpid(),))
    _beside_ready()
    status, pid = early.beside_result()
    assert status == "ok" and pid != os.getpid()
    assert early.beside_result() is None and not early.beside_expected()

    def fails(names: list[str]) -> None:
        raise RuntimeError("no")

    _other_threads_done()
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(fails,))
    _beside_ready()
    assert early.beside_result() == ("error", None)
    _other_threads_done()
    early.start([d], use_cache=False, jobs=None, executor="local", beside=(lambda names: os.getpid(),))
    early.drop()  # given up before it came: the process is stopped
    assert early.beside_result() is None and not early.beside_expected()


def test_beside_parts_come_in_turn_each_when_made(tmp_path: Path) -> None:
    """The first part of the beside work (the shipped tables) is there to take while the process still
    makes the next (the rule set); the next comes once made."""
    import time

    if not early.process_supported() or not _other_threads_done():
        pytest.skip("no early-read process here")
    flag = tmp_path / "go"

    def second(names: list[str]) -> str:
        deadline = time.monotonic() + 300  # a bound on a hung wait, not a speed
        while not flag.exists():
            if time.monotonic() > deadline:
                return "timed out"
            time.sleep(0.01)
        return "second"

    early.start([fixture_dir("kv-full-cast-eager")], use_cache=False, jobs=None, executor="local",
                beside=(lambda names: os.getpid(), second))
    first = early._later[0]
    end = time.monotonic() + 300
    while not select.select([first.fd], [], [], 0.05)[0]:
        assert time.monotonic() < end, "the first part did not come"
    status, pid = early.beside_result()
    assert status == "ok" and pid != os.getpid()
    assert early.beside_expected() and early.beside_result() is None  # (the second is being made)
    flag.touch()
    _beside_ready()
    assert early.beside_result() == ("ok", "second")
    assert not early.beside_expected() and early.beside_result() is None
    early.drop()


@pytest.mark.parametrize("trace", [
    lambda: fixture_dir("kv-full-cast-eager"),
    lambda: real_trace("tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"),
], ids=["fixture", "tracelens-sglang-decode"])
def test_the_gpu_event_names_given_to_the_beside_work_are_the_kernel_tables(trace: Any) -> None:
    from traceinspect.load.raw import gpu_event_names, native_available, read_scan

    if not native_available():
        pytest.skip("no native scanner")
    path = Path(trace())
    f = path if path.is_file() else next(path.glob("*.trace.json*"))
    names = gpu_event_names(read_scan(f, threads=False))
    want = set(load.load_trace_set([str(f)], use_cache=False).kernels["name"].astype(str))
    assert len(names) == len(set(names)) and set(names) == want and want
