"""Speed of traceinspect against the machine's own yardsticks, each paired with it in the same run.

Traces are made from a real fixture by replicating its events: each copy's timestamps are shifted
past the previous copy, correlation / External ids / flow ids / event indices are made unique, and
events are written in Kineto's own layout (an object per event over a few lines), so kernel mix,
event shapes, field order and compression ratio stay those of a real capture.

    python benchmarks/bench.py --write-readme            # the full run (~15 min on 2 cores)
    python benchmarks/bench.py --smoke                   # tiny sizes: runs everything, asserts nothing

Cases (every timing is a whole fresh process, start-up and imports included, parsed-table cache off;
each case alternates the tool and its yardstick ``--repeat`` times and reports min and median):

* ``small``: ``traceinspect analyze`` of a 5 MB rank file: under 1.0 s wall.
* ``hta``: ``traceinspect analyze`` of a 114 MB rank file against HTA 0.5.0's load of the same file
  (``TraceAnalysis(trace_dir=...)``): at least 20x faster.
* ``big``: ``traceinspect analyze`` of a 1 GB rank file (plain JSON) against ``hashlib.sha256`` of
  the same file: at most 3x its time; peak RSS at most the JSON size + 200 MB.
* ``ranks``: ``traceinspect report`` (analyze + HTML) of 8 rank files of ~120 MB against ``gzip -dc``
  over the same files: at most 1.5x its time.

Ratios compare medians. The exit status is 1 when a target is missed (0 with --smoke). The JSON
printed (and written by --json) has every number, the load average before and after each case, and
what ran; ``--write-readme`` regenerates the results table of benchmarks/README.md and README.md from
it. HTA runs under the first Python that can import it: ``--hta-python``, ``$TRACEINSPECT_HTA_PYTHON``,
this interpreter, or ``/tmp/htavenv/bin/python``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = ROOT / "fixtures" / "kv-full-cast-eager"
# public traces that other systems wrote: ``shared/`` lies beside the checkout (TRACEINSPECT_SHARED overrides)
SHARED = Path(os.environ.get("TRACEINSPECT_SHARED", ROOT.parent / "shared"))
# the event mixes the benchmarks replicate: a fixture directory of rank files, or one rank file
MIXES = {
    # SGLang TP2 decode, eager, record_shapes: ~3 CPU ops and ~1 runtime call per kernel
    "eager": DEFAULT_SOURCE,
    # eager inference on B200 with record_shapes and with_stack: ~26 CPU events (Python frames, CPU ops)
    # per kernel, one long step per copy
    "cpu-heavy": SHARED / "real-traces" / "tracelens__b200__eager_trace.json.gz",
    # SGLang TP2 decode under CUDA graphs: ~70 kernels per CPU op, graph capture traces beside
    "graph": ROOT / "fixtures" / "kv-full-cast-graph",
}
HTA_VENV = Path("/tmp/htavenv/bin/python")
README = ROOT / "benchmarks" / "README.md"
MAIN_README = ROOT / "README.md"
MARK_START, MARK_END = "<!-- bench:results:start -->", "<!-- bench:results:end -->"

TARGETS = {
    "small_s": 1.0,  # 5 MB analyze, wall seconds
    "hta_speedup": 20.0,  # HTA load / analyze
    "big_ratio_sha256": 3.0,  # analyze / sha256 of the file
    "big_rss_slack_mb": 200.0,  # peak RSS <= JSON + this
    "ranks_ratio_gzip": 1.5,  # report / gzip -dc
}

CHILD_HTA = r"""
import sys
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
print(sum(len(ta.t.get_trace(r)) for r in ta.t.traces))
"""

CHILD_SHA = r"""
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    while b := f.read(1 << 20):
        h.update(b)
print(h.hexdigest())
"""

# --------------------------------------------------------------------------------------------
# synthetic traces

_DYN_TOP = ("ts", "id")
_DYN_ARGS = ("External id", "correlation", "Ev Idx")
_FIRST = ("ph", "cat", "name", "pid", "tid")


def _kv(k: str, v: Any) -> str:
    return f"{json.dumps(k)}: {json.dumps(v)}"


class _Template:
    """One event as Kineto text with %-slots for the values that change from copy to copy."""

    __slots__ = ("text", "ts", "slots")

    def __init__(self, e: dict[str, Any]) -> None:
        self.slots: list[int | None] = []  # None: the timestamp; an int: an id to shift
        self.ts = float(e["ts"]) if isinstance(e.get("ts"), (int, float)) else None

        def val(k: str, v: Any, dyn: bool) -> str:
            if k == "ts" and self.ts is not None:
                self.slots.append(None)
                return "\0"
            if dyn and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                self.slots.append(v)
                return "\0"
            if k == "dur" and isinstance(v, float):
                return f"{v:.3f}"
            return json.dumps(v)

        first = [k for k in _FIRST if k in e]
        rest = [k for k in e if k not in first and k != "args"]
        lines = ["  {", "    " + ", ".join(f"{json.dumps(k)}: {val(k, e[k], k in _DYN_TOP)}" for k in first)
                 + ("," if rest or "args" in e else "")]
        if rest:
            lines.append("    " + ", ".join(f"{json.dumps(k)}: {val(k, e[k], k in _DYN_TOP)}" for k in rest)
                         + ("," if "args" in e else ""))
        if "args" in e:
            args = e["args"]
            lines.append('    "args": {')
            lines.append("      " + ", ".join(f"{json.dumps(k)}: {val(k, v, k in _DYN_ARGS)}"
                                              for k, v in args.items()))
            lines.append("    }")
        lines.append("  }")
        parts = "\n".join(lines).replace("%", "%%").split("\0")
        assert len(parts) == len(self.slots) + 1
        self.text = "%s".join(parts)

    def render(self, shift: float, id_shift: int) -> str:
        if not self.slots:
            return self.text.replace("%%", "%")
        ts = f"{self.ts + shift:.3f}" if self.ts is not None else ""
        return self.text % tuple(ts if v is None else v + id_shift for v in self.slots)


def make_trace(src: Path, dst: Path, target_mb: float, rank: int | None = None, level: int = 6) -> int:
    """Write ``dst`` with about ``target_mb`` MB of JSON made of copies of the events of ``src``
    (gzipped, unless ``dst`` ends in ``.json``); returns the uncompressed size in bytes."""
    with gzip.open(src, "rb") as f:
        doc = json.loads(f.read())
    events = doc.pop("traceEvents")
    trace_name = doc.pop("traceName", "bench")
    if rank is not None and isinstance(doc.get("distributedInfo"), dict):
        doc["distributedInfo"]["rank"] = rank
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e.get("ts", 0.0))
    t0 = min(e["ts"] for e in timed if "ts" in e)
    t1 = max(e["ts"] + e.get("dur", 0) for e in timed if "ts" in e)
    span = math.ceil((t1 - t0) + 1000.0)
    ids = [v for e in timed for v in [e.get("id")] + [(e.get("args") or {}).get(k) for k in _DYN_ARGS]
           if isinstance(v, int)]
    id_step = max(ids + [0]) + 1
    tpl = [_Template(e) for e in timed]
    head = "{\n" + "".join(f"  {_kv(k, v)},\n" for k, v in doc.items()) + '  "traceEvents": [\n'
    one = sum(len(t.render(0.0, 0).encode()) + 2 for t in tpl)  # rendered: ids and times take room
    copies = max(target_mb * 1e6 - len(head), one * 0.05) / one
    full, frac = int(copies), copies - int(copies)
    written = 0
    plain = dst.name.endswith(".json")
    with open(dst, "wb") as raw, (contextlib.nullcontext(raw) if plain else
                                  gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=level, mtime=0)) as out:
        def put(s: str) -> None:
            nonlocal written
            b = s.encode()
            written += len(b)
            out.write(b)

        put(head)
        first = True
        batch: list[str] = []
        for m in meta:
            batch.append(_Template(m).render(0.0, 0))
        for c in range(full + (1 if frac > 0.01 else 0)):
            limit = t0 + frac * (t1 - t0) if c == full else math.inf
            shift, id_shift = c * span, c * id_step
            for t in tpl:
                if t.ts is not None and t.ts > limit:
                    continue
                batch.append(t.render(shift, id_shift))
            if len(batch) > 20000 or c == full:
                put(("" if first else ",\n") + ",\n".join(batch))
                first = False
                batch = []
        if batch:
            put(("" if first else ",\n") + ",\n".join(batch))
        put(f'\n  ],\n  {_kv("traceName", trace_name)}\n}}\n')
    return written


def make_set(src_dir: Path, dst: Path, size_mb: float, ranks: int, gen: Path, plain: bool = False) -> int:
    """``ranks`` rank files of ``size_mb`` each in ``dst`` (named ``bench-TP-<r>``, gzipped unless
    ``plain``, with the fixture's server_info.json); rank r replicates the fixture's rank r % (fixture
    ranks). Files are generated once into ``gen`` and linked. Returns the total uncompressed JSON bytes."""
    dst.mkdir(parents=True, exist_ok=True)
    gen.mkdir(parents=True, exist_ok=True)
    one = src_dir.is_file()  # one rank file: each rank a copy of it, with its own rank number
    sources = [src_dir] if one else sorted(src_dir.glob("*-TP-*.trace.json.gz"))
    if not sources:
        raise SystemExit(f"no *-TP-*.trace.json.gz rank files in {src_dir}")
    if one:
        src_dir = src_dir.parent
    total = 0
    for r in range(ranks):
        s = r % len(sources)
        ext = ".trace.json" if plain else ".trace.json.gz"
        g = gen / (f"r{r}-{size_mb:g}MB{ext}" if one and r else f"src{s}-{size_mb:g}MB{ext}")
        side = g.with_name(g.name + ".size")  # a kept --work directory reuses its traces
        if g not in sizes and g.exists() and side.exists():
            sizes[g] = int(side.read_text())
        if g not in sizes:
            sizes[g] = make_trace(sources[s], g, size_mb, rank=r if one else s)
            side.write_text(str(sizes[g]))
        f = dst / f"bench-TP-{r}{ext}"
        f.unlink(missing_ok=True)
        try:
            os.link(g, f)
        except OSError:
            shutil.copyfile(g, f)
        total += sizes[g]
    si = src_dir / "server_info.json"
    if si.exists() and not one:
        info = json.loads(si.read_text())
        info["tp_size"] = ranks
        (dst / "server_info.json").write_text(json.dumps(info))
    caps = [] if one else sorted((src_dir / "graph_capture_profile").glob("*-TP-*.json*"))
    if caps:  # CUDA-graph capture traces: rank r gets the fixture's rank r % (fixture ranks)
        cdir = dst / "graph_capture_profile"
        cdir.mkdir(exist_ok=True)
        for r in range(ranks):
            c = caps[r % len(caps)]
            shutil.copyfile(c, cdir / re.sub(r"-TP-\d+", f"-TP-{r}", c.name))
    return total


sizes: dict[Path, int] = {}

# --------------------------------------------------------------------------------------------
# runs


def run(cmd: list[str], env: dict[str, str] | None = None, stdout: Any = subprocess.DEVNULL,
        timeout: float = 3600, cwd: str | Path | None = None) -> dict[str, float]:
    """Run a command to completion: wall seconds, CPU seconds and peak RSS (MB) of the process and of
    the processes it waited for (``ru_maxrss``: the largest one)."""
    with tempfile.TemporaryFile() as errf:  # a file, not a pipe: a chatty child never blocks on it
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=stdout, stderr=errf, env=env, cwd=cwd)
        deadline = t + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                raise RuntimeError(f"{' '.join(cmd[:4])} timed out")
            time.sleep(0.005)
        wall = time.perf_counter() - t
        errf.seek(0)
        err = errf.read()[-4000:].decode(errors="replace")
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd[:5])} failed ({p.returncode}): {err.strip()[-1500:]}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_mb": ru.ru_maxrss / 1024}


def hta_python(explicit: str | None) -> str | None:
    cands = [explicit, os.environ.get("TRACEINSPECT_HTA_PYTHON"), sys.executable,
             str(HTA_VENV) if HTA_VENV.exists() else None]
    for c in cands:
        if c and subprocess.run([c, "-c", "import hta.trace_analysis"], capture_output=True).returncode == 0:
            return c
    return None


def _ti(*args: str) -> list[str]:
    return [sys.executable, "-m", "traceinspect", *args]


_ENV = {**os.environ, "TRACEINSPECT_CACHE": "off"}


def _stats(runs: list[dict[str, float]]) -> dict[str, float]:
    w = [r["wall_s"] for r in runs]
    return {"min_s": round(min(w), 3), "median_s": round(statistics.median(w), 3),
            "cpu_median_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
            "peak_rss_mb": round(max(r["rss_mb"] for r in runs), 1), "runs": len(runs)}


def paired(tool: list[str], yard: list[str] | None, repeat: int, yard_env: dict[str, str] | None = None,
           yard_repeat: int | None = None) -> tuple[dict[str, float], dict[str, float] | None]:
    """Alternate the tool and its yardstick; min / median of each."""
    t_runs: list[dict[str, float]] = []
    y_runs: list[dict[str, float]] = []
    yr = repeat if yard_repeat is None else yard_repeat
    for i in range(repeat):
        if yard is not None and i < yr:
            y_runs.append(run(yard, env=yard_env))
        t_runs.append(run(tool, env=_ENV))
    return _stats(t_runs), (_stats(y_runs) if y_runs else None)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


_PROBE = ("import time; t = time.perf_counter(); s = 0\nfor i in range(3_000_000): s += i\n"
          "loop = time.perf_counter() - t; t = time.perf_counter(); import pandas\n"
          "print(loop, time.perf_counter() - t)")


def _probe(runs: int = 3) -> dict[str, float]:
    """How fast this machine is at the moment, for comparing runs: the median over fresh interpreters of a
    3M-iteration Python loop and of ``import pandas`` (start-up work: unmarshalling, module code, page
    faults), in seconds. The yardsticks and the tool depend on these differently."""
    got = []
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=_ENV)
        got.append([float(x) for x in p.stdout.split()] if p.returncode == 0 else [float("nan")] * 2)
    return {"python_loop_s": round(statistics.median(g[0] for g in got), 3),
            "import_pandas_s": round(statistics.median(g[1] for g in got), 3)}


def _bytecode() -> str | None:
    """Byte-compile the traceinspect that ``python -m traceinspect`` imports, as ``pip install`` does:
    an editable checkout run under ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every module
    of the package again at every start. Returns the package directory compiled (None on failure)."""
    code = ("import compileall, pathlib, sys, traceinspect; d = pathlib.Path(traceinspect.__file__).parent; "
            "print(d); sys.exit(0 if compileall.compile_dir(d, quiet=1) else 1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ENV)
    return p.stdout.strip() or None if p.returncode == 0 else None


def _machine() -> dict[str, Any]:
    import platform

    model = ""
    with contextlib.suppress(OSError):
        m = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
        model = m.group(1).strip() if m else ""
    from traceinspect.load import parse

    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "native_scanner": parse._native is not None}


# --------------------------------------------------------------------------------------------
# the results table


def table(res: dict[str, Any]) -> str:
    """The Markdown results table of a run (what --write-readme puts into the READMEs)."""
    m = res["machine"]
    rows = ["| case | traceinspect (median, min) | yardstick (median, min) | ratio | target | met |",
            "| --- | --- | --- | --- | --- | --- |"]

    def t(s: dict[str, float] | None) -> str:
        return "n/a" if not s else f"{s['median_s']:.2f} s, {s['min_s']:.2f} s"

    def met(c: dict[str, Any], key: str = "met") -> str:
        return {True: "yes", False: "**no**", None: "n/a"}[c.get(key)]

    c = res["cases"]
    if "small" in c:
        x = c["small"]
        rows.append(f"| `analyze`, one {x['json_mb']:.0f} MB rank file | {t(x['tool'])} | | "
                    f"| < {TARGETS['small_s']:.1f} s | {met(x)} |")
    if "hta" in c:
        x = c["hta"]
        ratio = f"{x['speedup']:.1f}x faster" if x.get("speedup") else "n/a"
        rows.append(f"| `analyze` vs HTA 0.5.0's load, one {x['json_mb']:.0f} MB rank file | {t(x['tool'])} | "
                    f"{t(x['yardstick'])} | {ratio} | >= {TARGETS['hta_speedup']:.0f}x | {met(x)} |")
    if "big" in c:
        x = c["big"]
        rows.append(f"| `analyze` vs `hashlib.sha256`, one {x['json_mb']:.0f} MB rank file (plain JSON) | "
                    f"{t(x['tool'])} | {t(x['yardstick'])} | {x['ratio']:.2f}x | <= {TARGETS['big_ratio_sha256']:.0f}x"
                    f" | {met(x, 'met_time')} |")
        rows.append(f"| peak RSS of that `analyze` | {x['tool']['peak_rss_mb']:.0f} MB | JSON + "
                    f"{TARGETS['big_rss_slack_mb']:.0f} MB = {x['rss_bound_mb']:.0f} MB | | | {met(x, 'met_rss')} |")
    if "ranks" in c:
        x = c["ranks"]
        rows.append(f"| `report` vs `gzip -dc`, {x['ranks']} rank files, {x['json_mb']:.0f} MB JSON in all | "
                    f"{t(x['tool'])} | {t(x['yardstick'])} | {x['ratio']:.2f}x | <= {TARGETS['ranks_ratio_gzip']:.1f}x"
                    f" | {met(x)} |")
    loads = [res["load_average_start"], res["load_average_end"]]
    note = (f"\n\n{res['date']}, `python benchmarks/bench.py{res['args']}`: {m['cores']} cores ({m['cpu']}), "
            f"Python {m['python']}, native scanner {'built' if m['native_scanner'] else 'NOT built'}; "
            f"{res['repeat']} paired runs per case; load average (1, 5, 15 min) {loads[0]} at the start, "
            f"{loads[1]} at the end.{_probe_note(res)} Generated by the benchmark from its latest run; not edited "
            "by hand.")
    return "\n".join(rows) + note


def _probe_note(res: dict[str, Any]) -> str:
    a, b = res.get("probe_start"), res.get("probe_end")
    if not a or not b:
        return ""
    return (f" Machine speed (median of 3 fresh interpreters, start / end): a 3M-iteration Python loop "
            f"{a['python_loop_s']:.2f} / {b['python_loop_s']:.2f} s, `import pandas` {a['import_pandas_s']:.2f} / "
            f"{b['import_pandas_s']:.2f} s.")


def write_readmes(res: dict[str, Any]) -> None:
    """The results tables of both READMEs, and benchmarks/latest.json, from this run."""
    (ROOT / "benchmarks" / "latest.json").write_text(json.dumps(res, indent=2) + "\n")
    block = f"{MARK_START}\n{table(res)}\n{MARK_END}"
    for path in (README, MAIN_README):
        text = path.read_text()
        if MARK_START in text and MARK_END in text:
            a, b = text.index(MARK_START), text.index(MARK_END) + len(MARK_END)
            path.write_text(text[:a] + block + text[b:])


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=None,
                    help="fixture directory (or one rank file) to replicate (default: that of --mix)")
    ap.add_argument("--mix", choices=sorted(MIXES), default="eager", help="the event mix replicated")
    ap.add_argument("--small-mb", type=float, default=5.0)
    ap.add_argument("--hta-mb", type=float, default=114.0)
    ap.add_argument("--big-mb", type=float, default=1000.0)
    ap.add_argument("--rank-mb", type=float, default=122.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="paired runs per case")
    ap.add_argument("--hta-repeat", type=int, default=2, help="HTA runs (each takes long)")
    ap.add_argument("--cases", default="small,hta,big,ranks")
    ap.add_argument("--hta-python", help="a Python that can import hta (default: found automatically)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one run each: runs everything, asserts nothing")
    ap.add_argument("--work", type=Path, help="keep generated traces here (default: a temporary dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--write-readme", action="store_true", help="regenerate the results tables from this run")
    args = ap.parse_args(argv)
    if args.smoke:
        args.small_mb, args.hta_mb, args.big_mb, args.rank_mb, args.ranks = 2.0, 3.0, 6.0, 2.0, 2
        args.repeat, args.hta_repeat = 1, 1
    args.source = args.source or MIXES[args.mix]
    if not args.source.exists():
        print(f"source fixture {args.source} not found", file=sys.stderr)
        return 2
    cases = [c for c in args.cases.split(",") if c]
    work = args.work or Path(tempfile.mkdtemp(prefix="ti-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    gen = work / "gen"
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-readme"]
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "args": "".join(f" {a}" for a in shown), "machine": _machine(),
                           "repeat": args.repeat, "targets": TARGETS, "bytecode_compiled": _bytecode(),
                           "load_average_start": _load(), "probe_start": _probe(),
                           "cases": {}}
    failures: list[str] = []

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    try:
        if "small" in cases:
            d = work / "small"
            n = make_set(args.source, d, args.small_mb, 1, gen)
            f = next(d.glob("*.trace.json.gz"))
            log(f"small: analyze {n / 1e6:.1f} MB")
            load0 = _load()
            tool, _ = paired(_ti("analyze", str(f), "--no-cache", "--quiet"), None, args.repeat)
            ok = tool["median_s"] < TARGETS["small_s"]
            res["cases"]["small"] = {"json_mb": round(n / 1e6, 1), "tool": tool, "met": ok,
                                     "load_average": [load0, _load()]}
            if not ok:
                failures.append(f"small: {tool['median_s']:.2f} s for {n / 1e6:.0f} MB (target < {TARGETS['small_s']} s)")
        if "hta" in cases:
            d = work / "hta"
            n = make_set(args.source, d, args.hta_mb, 1, gen)
            f = next(d.glob("*.trace.json.gz"))
            hpy = hta_python(args.hta_python)
            hdir = work / "hta-dir"
            hdir.mkdir(exist_ok=True)
            shutil.copyfile(f, hdir / "rank-0.trace.json.gz")
            log(f"hta: analyze vs HTA's load, {n / 1e6:.0f} MB ({hpy or 'HTA not found'})")
            load0 = _load()
            tool, yard = paired(_ti("analyze", str(f), "--no-cache", "--quiet"),
                                [hpy, "-c", CHILD_HTA, str(hdir)] if hpy else None, args.repeat,
                                yard_repeat=args.hta_repeat)
            speed = round(yard["median_s"] / tool["median_s"], 1) if yard else None
            ok = None if speed is None else speed >= TARGETS["hta_speedup"]
            res["cases"]["hta"] = {"json_mb": round(n / 1e6, 1), "gz_mb": round(f.stat().st_size / 1e6, 1),
                                   "tool": tool, "yardstick": yard, "speedup": speed, "met": ok,
                                   "hta_python": hpy, "load_average": [load0, _load()]}
            if not ok:
                failures.append(f"hta: {speed}x HTA's load (target >= {TARGETS['hta_speedup']:.0f}x)" if speed
                                else "hta: HTA not available (pip install 'traceinspect[hta]' or --hta-python)")
        if "big" in cases:
            d = work / "big"
            n = make_set(args.source, d, args.big_mb, 1, gen, plain=True)
            f = next(d.glob("*.trace.json"))
            log(f"big: analyze vs sha256, {n / 1e6:.0f} MB plain JSON")
            load0 = _load()
            tool, yard = paired(_ti("analyze", str(f), "--no-cache", "--quiet"),
                                [sys.executable, "-c", CHILD_SHA, str(f)], args.repeat)
            assert yard is not None
            ratio = tool["median_s"] / yard["median_s"]
            bound = n / 1e6 + TARGETS["big_rss_slack_mb"]
            ok_t, ok_m = ratio <= TARGETS["big_ratio_sha256"], tool["peak_rss_mb"] <= bound
            res["cases"]["big"] = {"json_mb": round(n / 1e6, 1), "tool": tool, "yardstick": yard,
                                   "ratio": round(ratio, 2), "rss_bound_mb": round(bound, 1), "met_time": ok_t,
                                   "met_rss": ok_m, "load_average": [load0, _load()]}
            if not ok_t:
                failures.append(f"big: {ratio:.2f}x sha256 of the file (target <= {TARGETS['big_ratio_sha256']:.0f}x)")
            if not ok_m:
                failures.append(f"big: peak RSS {tool['peak_rss_mb']:.0f} MB > JSON + "
                                f"{TARGETS['big_rss_slack_mb']:.0f} MB = {bound:.0f} MB")
            if args.work is None:
                shutil.rmtree(d, ignore_errors=True)
        if "ranks" in cases:
            d = work / "ranks"
            n = make_set(args.source, d, args.rank_mb, args.ranks, gen)
            files = sorted(d.glob("*.trace.json.gz"))
            log(f"ranks: report vs gzip -dc, {args.ranks} x {args.rank_mb:g} MB")
            load0 = _load()
            gz = ["sh", "-c", 'for f in "$@"; do gzip -dc "$f"; done > /dev/null', "gzip", *map(str, files)]
            tool, yard = paired(_ti("report", str(d), "-o", str(work / "report.html"), "--no-cache"), gz, args.repeat)
            assert yard is not None
            ratio = tool["median_s"] / yard["median_s"]
            ok = ratio <= TARGETS["ranks_ratio_gzip"]
            res["cases"]["ranks"] = {"ranks": args.ranks, "json_mb": round(n / 1e6, 1),
                                     "gz_mb": round(sum(f.stat().st_size for f in files) / 1e6, 1), "tool": tool,
                                     "yardstick": yard, "ratio": round(ratio, 2), "met": ok,
                                     "load_average": [load0, _load()]}
            if not ok:
                failures.append(f"ranks: report took {ratio:.2f}x gzip -dc (target <= {TARGETS['ranks_ratio_gzip']}x)")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    res["load_average_end"] = _load()
    res["probe_end"] = _probe()
    res["failures"] = failures
    res["passed"] = not failures
    text = json.dumps(res, indent=2)
    print(text)
    print(table(res), file=sys.stderr)
    if args.json:
        args.json.write_text(text + "\n")
    if args.write_readme:
        write_readmes(res)
    for f in failures:
        print(("note: " if args.smoke else "FAIL: ") + f, file=sys.stderr)
    return 0 if (args.smoke or not failures) else 1


if __name__ == "__main__":
    sys.exit(main())
