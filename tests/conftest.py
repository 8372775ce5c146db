"""Shared test helpers: fixture lookup, CPU traces made with torch's profiler, a CLI runner."""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
# public traces that other systems wrote: ``shared/`` lies beside the checkout (TRACEINSPECT_SHARED overrides)
SHARED = Path(os.environ.get("TRACEINSPECT_SHARED", ROOT.parent / "shared"))
REAL_TRACES = SHARED / "real-traces"


# Property tests (hypothesis): by default the same examples every run, a fixed number of them, no example
# database, no deadline (timings vary with machine load) and no shrinking (a failure reports the example
# as found, at once, instead of minutes of shrinking on a loaded machine): the "ci" profile. Open-ended
# fuzzing (new examples each run, failures shrunk and kept in .hypothesis/) is the opt-in "fuzz" profile:
#     TRACEINSPECT_FUZZ_RANDOM=1 python -m pytest -q tests/test_fuzz.py tests/test_native.py tests/test_classify.py
# (TRACEINSPECT_FUZZ_SCALE=N multiplies the examples of tests/test_fuzz.py.)
FUZZ_RANDOM = os.environ.get("TRACEINSPECT_FUZZ_RANDOM") == "1"
try:
    from hypothesis import HealthCheck, Phase, settings
except ImportError:  # the property tests skip themselves without hypothesis
    pass
else:
    _QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile(
        "ci", derandomize=True, database=None, deadline=None, max_examples=100, print_blob=True,
        phases=(Phase.explicit, Phase.generate), suppress_health_check=_QUIET)
    settings.register_profile(
        "fuzz", derandomize=False, deadline=None, max_examples=100, print_blob=True,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        suppress_health_check=_QUIET)
    settings.load_profile("fuzz" if FUZZ_RANDOM else "ci")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["TRACEINSPECT_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@functools.cache
def _analysed(path: str, phase: str) -> Any:
    from traceinspect.pipeline import analyze

    return analyze(path, phase=phase)


def analysed(path: str | Path, phase: str = "decode") -> Any:
    """The analysis of the trace set at ``path`` with the default options and ``phase``, made once per test
    session and shared by the modules that check the committed fixtures (each set is analysed once, not
    once per module): read it, never change it."""
    return _analysed(str(Path(path).resolve()), phase)


def fixture_dir(name: str) -> Path:
    """A committed GPU fixture directory, or skip the test when it is absent."""
    d = FIXTURES / name
    if not d.is_dir():
        pytest.skip(f"fixture {name} is not present")
    return d


def real_trace(name: str) -> Path:
    """A trace (file or directory) under ``shared/real-traces``: skipped when absent, failed under CI."""
    p = REAL_TRACES / name
    if not p.exists():
        if os.environ.get("CI"):
            pytest.fail(f"real trace {p} is missing")
        pytest.skip(f"real trace {name} is not present")
    return p


def manifest(name: str) -> dict:
    return json.loads((fixture_dir(name) / "manifest.json").read_text())


def raw_events(path: Path) -> list[dict]:
    """The traceEvents of a trace file, read with the standard library (an independent reader)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


STEP_SPAN = re.compile(r"^step\[", re.IGNORECASE)
PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")


def raw_cast_shares(d: Path, excluded: dict[str, Any] | None = None) -> tuple[float, float]:
    """The planted KV cast kernels (``direct_copy_kernel_cuda`` with ``LoadWithCast``) of a set's analysed
    steps, from the raw events with the standard library: (their share of the GPU time, their time per
    rank per step over the step time). A kernel belongs to the step span (SGLang's step[...], else
    ProfilerStep#N) that holds its launch (correlation); the steps the analysis left out are left out
    (``excluded``: an analysis document's ``steps``, whose ``excluded`` names them by rank and index, the
    rank files taken in name order; None: none); the step time is the median over aligned steps of the
    slowest rank's GPU span."""
    skip = {(int(x["rank"]), int(x["idx"])) for x in (excluded or {}).get("excluded", [])}
    cast = total = 0.0
    spans_by_rank: list[list[float]] = []
    for rank, p in enumerate(sorted(d.glob("*.trace.json*"))):
        ev = raw_events(p)
        marks = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op", "Operator")]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in marks if STEP_SPAN.match(str(e.get("name", "")))] or \
            [(e["ts"], e["ts"] + e["dur"]) for e in marks if PROFILER_STEP.match(str(e.get("name", "")))]
        spans = [s for i, s in enumerate(sorted(spans)) if (rank, i) not in skip]
        launch = {e["args"]["correlation"]: e["ts"] for e in ev
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        first = [float("inf")] * len(spans)
        last = [float("-inf")] * len(spans)
        for e in ev:
            if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            t = launch.get(e.get("args", {}).get("correlation"))
            i = next((j for j, (a, b) in enumerate(spans) if t is not None and a <= t <= b), None)
            if i is None:
                continue
            first[i], last[i] = min(first[i], e["ts"]), max(last[i], e["ts"] + e["dur"])
            total += e["dur"]
            if "direct_copy_kernel_cuda" in e["name"] and "LoadWithCast" in e["name"]:
                cast += e["dur"]
        spans_by_rank.append([b - a for a, b in zip(first, last, strict=True)])
    n = min(len(s) for s in spans_by_rank)
    tp = sorted(max(s[i] for s in spans_by_rank) for i in range(n))
    step_us = tp[n // 2] if n % 2 else (tp[n // 2 - 1] + tp[n // 2]) / 2
    per_step = cast / sum(len(s) for s in spans_by_rank)
    return cast / total, per_step / step_us


def raw_cast_share(d: Path, excluded: dict[str, Any] | None = None) -> float:
    """The planted KV cast kernels' share of the GPU time of a set's analysed steps (raw events)."""
    return raw_cast_shares(d, excluded)[0]


def copy_set(src: Path, dst: Path) -> Path:
    """Copy a fixture's rank files and server_info.json (not its capture traces) to dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file():
            shutil.copy(p, dst / p.name)
    return dst


def rewrite_trace(src: Path, dst: Path, edit) -> Path:
    """Load a trace, let ``edit`` change the dict, write it gzipped to dst."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    edit(doc)
    with gzip.open(dst, "wt") as f:
        json.dump(doc, f)
    return dst


def graph_set_missing_one_launch(tmp_path: Path) -> Path:
    """A copy of the kv-full-cast-graph set whose rank-0 capture trace lacks one captured kernel
    launch, so its replays no longer line up with the capture."""
    src = fixture_dir("kv-full-cast-graph")
    d = copy_set(src, tmp_path / "set")
    cap_dir = d / "graph_capture_profile"
    cap_dir.mkdir()
    for p in (src / "graph_capture_profile").iterdir():
        shutil.copy(p, cap_dir / p.name)
    p0 = next(cap_dir.glob("*-TP-0.json.gz"))

    def drop_one(doc: dict) -> None:
        launches = [e for e in doc["traceEvents"] if e.get("name") == "cuLaunchKernelEx"]
        doc["traceEvents"].remove(launches[len(launches) // 2])

    rewrite_trace(p0, p0, drop_one)
    return d


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m traceinspect ARGS`` and capture its output."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "traceinspect", *args], capture_output=True, text=True,
                          cwd=cwd, env=e, timeout=timeout)


def cli_popen(*args: str, sigint: str = "default", env: dict | None = None, **kw: Any) -> subprocess.Popen:
    """Start ``python -m traceinspect ARGS`` with Ctrl-C as a terminal gives it (``sigint="default"``) or as
    a shell's background job has it (``"ignored"``), whatever the test runner inherited: a runner started in
    the background ignores SIGINT, and a Python started so keeps ignoring it."""
    disposition = {"default": "SIG_DFL", "ignored": "SIG_IGN"}[sigint]
    start = (f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{disposition}); "
             "os.execv(sys.executable, [sys.executable, '-m', 'traceinspect', *sys.argv[1:]])")
    return subprocess.Popen([sys.executable, "-c", start, *args], env={**os.environ, **(env or {})}, **kw)


@pytest.fixture(scope="session")
def torch_mod():
    return pytest.importorskip("torch", reason="torch (CPU build) is needed to make CPU traces")


CPU_WORKER = r'''
import os, sys, torch, torch.distributed as dist
from torch.profiler import profile, record_function, ProfilerActivity
rank, world, out, port, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
x = torch.randn(32, 64)
w = torch.randn(64, 64)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for i in range(steps):
        with record_function(f"step[DECODE bs={4 + rank}]"):
            y = torch.mm(x, w).relu()
            if world > 1:
                dist.all_reduce(y)
prof.export_chrome_trace(out)
if world > 1:
    dist.destroy_process_group()
'''


def make_cpu_traces(out_dir: Path, world: int = 2, steps: int = 5, names: list[str] | None = None) -> list[Path]:
    """Profile a small CPU model in ``world`` real processes (gloo) and write one trace per rank."""
    import socket

    out_dir.mkdir(parents=True, exist_ok=True)
    script = out_dir / "_worker.py"
    script.write_text(CPU_WORKER)
    paths = [out_dir / (names[r] if names else f"cpu-TP-{r}.trace.json") for r in range(world)]
    for attempt in range(3):  # the free port picked below can be taken by another process before gloo binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(paths[r]), str(port),
                                   str(steps)], stderr=subprocess.PIPE) for r in range(world)]
        codes = [p.wait(timeout=180) for p in procs]
        if all(c == 0 for c in codes):
            break
        errors = [p.stderr.read().decode(errors="replace")[-400:] for p in procs]
        if attempt == 2:
            raise AssertionError(f"CPU trace workers failed: {codes} {errors}")
    script.unlink()
    return paths
