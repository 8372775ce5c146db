"""Ingest and end-to-end benchmarks: traceinspect side by side with HTA on the same traces.

Large traces are made from a real fixture by replicating its events: each copy's timestamps are
shifted past the previous copy, correlation / External ids / flow ids / event indices are made
unique, and events are written in Kineto's own layout (an object per event over a few lines) and
gzipped, so kernel mix, event shapes, field order and compression ratio stay those of a real capture.

    python benchmarks/bench.py                              # full size: 100 MB per rank, 8 ranks
    python benchmarks/bench.py --size-mb 4 --ranks 2 --smoke   # CI smoke: runs everything, asserts nothing

Every timing is a fresh child process (start-up and imports included) and every child's peak RSS
is its own ``ru_maxrss``. Checks (exit 1 when one is missed, unless --smoke):

* ingest (load + link + steps: analysis-ready tables) of one rank file >= 20x HTA's throughput
  (``TraceAnalysis(trace_dir=...)``) on the same file;
* peak RSS of that ingest, and of every ingest in the size series, <= uncompressed JSON + 200 MB;
* N ranks: ``traceinspect report`` (analyze + HTML) < 3x the time of ``gzip -dc`` over the same files;
* (reported, not checked) the same N-rank run on CUDA-graph decode traces, with their capture traces;
* cost grows linearly with size (1x, 2x, 4x, 8x): the CPU seconds per MB of the last step (4x -> 8x)
  are at most 1.5x those of the first steps (1x -> 4x); the same for ranks (1, 2, 4, 8 files). CPU
  time, because wall time also counts whatever else the machine runs (the load average is recorded).

HTA runs under the first Python that can import it: ``--hta-python``, ``$TRACEINSPECT_HTA_PYTHON``,
this interpreter, or ``/tmp/htavenv/bin/python``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = ROOT / "fixtures" / "kv-full-cast-eager"
GRAPH_SOURCE = ROOT / "fixtures" / "kv-full-cast-graph"
HTA_VENV = Path("/tmp/htavenv/bin/python")

RATIO_HTA = 20.0
RSS_SLACK_MB = 200.0
RATIO_GZIP = 3.0
LINEAR = 1.5

# The child prints one JSON line: its own timings and peak RSS. Imports are timed too.
CHILD_TI = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from traceinspect.load import load_trace_set
from traceinspect.link import link
from traceinspect.steps import build_steps
t1 = time.perf_counter()
ts = load_trace_set(sys.argv[1:], use_cache=False)
t2 = time.perf_counter()
link(ts)
steps = build_steps(ts)
t3 = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"kernels": len(ts.kernels), "cpu_ops": len(ts.cpu_ops), "steps": len(steps),
                  "import_s": t1 - t0, "load_s": t2 - t1, "link_steps_s": t3 - t2,
                  "rss": ru.ru_maxrss * 1024, "children_rss": ch.ru_maxrss * 1024,
                  "cpu_s": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime}))
"""

CHILD_HTA = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
n = sum(len(ta.t.get_trace(r)) for r in ta.t.traces)
t2 = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"events": n, "import_s": t1 - t0, "load_s": t2 - t1, "rss": ru.ru_maxrss * 1024,
                  "children_rss": ch.ru_maxrss * 1024,
                  "cpu_s": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime}))
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
    """Write ``dst`` (gzipped) with about ``target_mb`` MB of uncompressed JSON made of copies of the
    events of ``src``; returns the uncompressed size in bytes."""
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
    one = sum(len(t.text) + 2 for t in tpl)
    copies = max(target_mb * 1e6 - len(head), one * 0.05) / one
    full, frac = int(copies), copies - int(copies)
    written = 0
    with open(dst, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=level, mtime=0) as out:
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


def make_set(src_dir: Path, dst: Path, size_mb: float, ranks: int, gen: Path) -> int:
    """``ranks`` rank files of ``size_mb`` each in ``dst`` (named ``bench-TP-<r>``, with the fixture's
    server_info.json); rank r replicates the fixture's rank r % (fixture ranks). Files are generated
    once into ``gen`` and linked. Returns the total uncompressed JSON bytes."""
    dst.mkdir(parents=True, exist_ok=True)
    gen.mkdir(parents=True, exist_ok=True)
    sources = sorted(src_dir.glob("*-TP-*.trace.json.gz"))
    if not sources:
        raise SystemExit(f"no *-TP-*.trace.json.gz rank files in {src_dir}")
    total = 0
    for r in range(ranks):
        s = r % len(sources)
        g = gen / f"src{s}-{size_mb:g}MB.trace.json.gz"
        if g not in sizes:
            sizes[g] = make_trace(sources[s], g, size_mb, rank=s)
        f = dst / f"bench-TP-{r}.trace.json.gz"
        f.unlink(missing_ok=True)
        try:
            os.link(g, f)
        except OSError:
            shutil.copyfile(g, f)
        total += sizes[g]
    si = src_dir / "server_info.json"
    if si.exists():
        info = json.loads(si.read_text())
        info["tp_size"] = ranks
        (dst / "server_info.json").write_text(json.dumps(info))
    caps = sorted((src_dir / "graph_capture_profile").glob("*-TP-*.json*"))
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


def child(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> tuple[float, dict]:
    """Run a child; wall seconds (start-up included) and the JSON line it printed."""
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({p.returncode}): {p.stderr.strip()[-1500:]}")
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
    return wall, (json.loads(lines[-1]) if lines else {})


def hta_python(explicit: str | None) -> str | None:
    cands = [explicit, os.environ.get("TRACEINSPECT_HTA_PYTHON"), sys.executable,
             str(HTA_VENV) if HTA_VENV.exists() else None]
    for c in cands:
        if c and subprocess.run([c, "-c", "import hta.trace_analysis"], capture_output=True).returncode == 0:
            return c
    return None


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def gunzip_time(files: list[Path]) -> tuple[float, float]:
    """Wall and CPU seconds for ``gzip -dc`` over the files, one after another."""
    c, t = _children_cpu(), time.perf_counter()
    for f in files:
        subprocess.run(["gzip", "-dc", str(f)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t, _children_cpu() - c


def report_time(directory: Path, out: Path) -> tuple[float, float]:
    """Wall and CPU seconds (its worker processes included) of ``traceinspect report``, cache off."""
    env = {**os.environ, "TRACEINSPECT_CACHE": "off"}
    c, t = _children_cpu(), time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "traceinspect", "report", str(directory), "-o", str(out)],
                       capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode not in (0, 1):
        raise RuntimeError(f"traceinspect report failed ({p.returncode}): {p.stderr.strip()[-1500:]}")
    return wall, _children_cpu() - c


def slope_ratio(points: list[tuple[float, float]]) -> float | None:
    """Per-unit cost of the last step over that of the first steps: (t4 -> t8) / (t1 -> t4)."""
    (x1, y1), (x4, y4), (x8, y8) = points[0], points[-2], points[-1]
    lo = (y4 - y1) / (x4 - x1) if x4 > x1 else None
    hi = (y8 - y4) / (x8 - x4) if x8 > x4 else None
    if not lo or lo <= 0 or hi is None:
        return None
    return hi / lo


def check_linear(results: dict, failures: list[str], key: str, what: str,
                 cpu: list[tuple[float, float]], wall: list[tuple[float, float]]) -> None:
    """Record the slope ratios of a series under ``{key}_slope_ratio[_wall]`` and fail when the CPU one
    exceeds LINEAR. Cost is judged on CPU time: wall time also measures whatever else the machine does."""
    sr, wr = slope_ratio(cpu), slope_ratio(wall)
    results[f"{key}_slope_ratio"] = None if sr is None else round(sr, 2)
    results[f"{key}_slope_ratio_wall"] = None if wr is None else round(wr, 2)
    if sr is not None and sr > LINEAR:
        failures.append(f"{what} ({sr:.2f}x, limit {LINEAR}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="fixture directory to replicate")
    ap.add_argument("--graph-source", type=Path, default=GRAPH_SOURCE,
                    help="CUDA-graph fixture for the informational end-to-end run ('' to skip)")
    ap.add_argument("--size-mb", type=float, default=100.0, help="uncompressed size of one rank file")
    ap.add_argument("--ranks", type=int, default=8, help="rank files of the end-to-end run")
    ap.add_argument("--scale", default="1,2,4,8", help="size multiples of the linearity series")
    ap.add_argument("--rank-scale", default="1,2,4,8", help="rank counts of the rank series")
    ap.add_argument("--hta-python", help="a Python that can import hta (default: found automatically)")
    ap.add_argument("--no-hta", action="store_true", help="skip HTA (the ratio check then fails)")
    ap.add_argument("--smoke", action="store_true", help="run everything, assert nothing")
    ap.add_argument("--work", type=Path, help="keep generated traces here (default: a temporary dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if not args.source.is_dir():
        print(f"source fixture directory {args.source} not found", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="ti-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    gen = work / "gen"
    results: dict[str, Any] = {
        "size_mb": args.size_mb, "ranks": args.ranks, "cores": os.cpu_count(), "source": str(args.source),
        "python": sys.version.split()[0], "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
    failures: list[str] = []
    py = sys.executable

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    try:
        # 1. ingest of one rank file, side by side with HTA
        one = work / "one"
        json_bytes = make_set(args.source, one, args.size_mb, 1, gen)
        f1 = one / "bench-TP-0.trace.json.gz"
        log(f"ingest: {json_bytes / 1e6:.0f} MB JSON ({f1.stat().st_size / 1e6:.1f} MB gz)")
        wall, r = child([py, "-c", CHILD_TI, str(f1)])
        mb = json_bytes / 1e6
        results["ingest"] = {
            "json_mb": round(mb, 1), "gz_mb": round(f1.stat().st_size / 1e6, 1), "seconds": round(wall, 3),
            "mb_per_s": round(mb / wall, 1), "peak_rss_mb": round(r["rss"] / 1e6, 1),
            "rss_bound_mb": round(mb + RSS_SLACK_MB, 1), "import_s": round(r["import_s"], 3),
            "load_s": round(r["load_s"], 3), "link_steps_s": round(r["link_steps_s"], 3),
            "cpu_s": round(r["cpu_s"], 3), "kernels": r["kernels"], "cpu_ops": r["cpu_ops"], "steps": r["steps"],
        }
        if r["rss"] / 1e6 > mb + RSS_SLACK_MB:
            failures.append(f"ingest peak RSS {r['rss'] / 1e6:.0f} MB > JSON {mb:.0f} MB + {RSS_SLACK_MB:.0f} MB")
        hpy = None if args.no_hta else hta_python(args.hta_python)
        if hpy:
            hdir = work / "hta"
            hdir.mkdir(exist_ok=True)
            shutil.copyfile(f1, hdir / "rank-0.trace.json.gz")
            log(f"HTA ingest ({hpy})")
            h_wall, h = child([hpy, "-c", CHILD_HTA, str(hdir)])
            ratio = h_wall / wall
            results["hta"] = {"python": hpy, "seconds": round(h_wall, 3), "mb_per_s": round(mb / h_wall, 2),
                              "peak_rss_mb": round(h["rss"] / 1e6, 1), "events": h["events"],
                              "cpu_s": round(h["cpu_s"], 3), "speedup": round(ratio, 1),
                              "speedup_cpu": round(h["cpu_s"] / max(results["ingest"]["cpu_s"], 1e-9), 1)}
            if ratio < RATIO_HTA:
                failures.append(f"ingest only {ratio:.1f}x HTA's throughput (target >= {RATIO_HTA:.0f}x)")
        else:
            results["hta"] = None
            failures.append("HTA not available (pip install 'traceinspect[hta]' or --hta-python): no ratio")

        # 2. linearity in size
        series = []
        for mult in [float(x) for x in args.scale.split(",") if x]:
            d = work / f"size-{mult:g}"
            n = make_set(args.source, d, args.size_mb * mult, 1, gen)
            log(f"size series: {n / 1e6:.0f} MB")
            wall, r = child([py, "-c", CHILD_TI, str(d)])
            series.append({"mult": mult, "json_mb": round(n / 1e6, 1), "seconds": round(wall, 3),
                           "mb_per_s": round(n / 1e6 / wall, 1), "peak_rss_mb": round(r["rss"] / 1e6, 1),
                           "cpu_s": round(r["cpu_s"], 3)})
            if r["rss"] / 1e6 > n / 1e6 + RSS_SLACK_MB:
                failures.append(f"{n / 1e6:.0f} MB ingest: peak RSS {r['rss'] / 1e6:.0f} MB > JSON + "
                                f"{RSS_SLACK_MB:.0f} MB")
            shutil.rmtree(d, ignore_errors=True)
            if mult != 1.0:
                for g in gen.glob(f"*-{args.size_mb * mult:g}MB.trace.json.gz"):
                    g.unlink()
                    sizes.pop(g, None)
        results["scaling"] = series
        if len(series) >= 3:
            check_linear(results, failures, "scaling", "ingest CPU cost per MB grows with size",
                         [(s["json_mb"], s["cpu_s"]) for s in series],
                         [(s["json_mb"], s["seconds"]) for s in series])

        # 3. linearity in ranks, and the end-to-end run against gzip -dc
        rank_counts = sorted({int(x) for x in args.rank_scale.split(",") if x} | {args.ranks})
        rseries = []
        e2e = None
        for n_r in rank_counts:
            d = work / f"ranks-{n_r}"
            total = make_set(args.source, d, args.size_mb, n_r, gen)
            files = sorted(d.glob("*.trace.json.gz"))
            log(f"{n_r} ranks x {args.size_mb:g} MB: gzip -dc, then traceinspect report")
            gz, gz_cpu = gunzip_time(files)
            rep, rep_cpu = report_time(d, work / f"report-{n_r}.html")
            row = {"ranks": n_r, "json_mb": round(total / 1e6, 1), "gzip_dc_s": round(gz, 3),
                   "report_s": round(rep, 3), "ratio_to_gzip": round(rep / gz, 2),
                   "gzip_dc_cpu_s": round(gz_cpu, 3), "report_cpu_s": round(rep_cpu, 3)}
            rseries.append(row)
            if n_r == args.ranks:
                e2e = row
            shutil.rmtree(d, ignore_errors=True)
        results["ranks_scaling"] = [r for r in rseries if str(r["ranks"]) in args.rank_scale.split(",")]
        results["end_to_end"] = e2e
        if e2e and e2e["report_s"] > RATIO_GZIP * e2e["gzip_dc_s"]:
            failures.append(f"{args.ranks} ranks: analyze + report took {e2e['ratio_to_gzip']:.2f}x gzip -dc "
                            f"(target < {RATIO_GZIP:.0f}x)")
        # the same end-to-end run on CUDA-graph decode traces (with their capture traces): reported, not checked
        if str(args.graph_source) and args.graph_source.is_dir():
            d = work / "graph"
            total = make_set(args.graph_source, d, args.size_mb, args.ranks, gen / "graph")
            files = sorted(d.glob("*.trace.json.gz"))
            log(f"CUDA-graph traces, {args.ranks} ranks x {args.size_mb:g} MB: gzip -dc, then traceinspect report")
            gz, gz_cpu = gunzip_time(files)
            rep, rep_cpu = report_time(d, work / "report-graph.html")
            results["end_to_end_graph"] = {
                "source": str(args.graph_source), "ranks": args.ranks, "json_mb": round(total / 1e6, 1),
                "gzip_dc_s": round(gz, 3), "report_s": round(rep, 3), "ratio_to_gzip": round(rep / gz, 2),
                "gzip_dc_cpu_s": round(gz_cpu, 3), "report_cpu_s": round(rep_cpu, 3)}
            shutil.rmtree(d, ignore_errors=True)
        rs = results["ranks_scaling"]
        if len(rs) >= 3:
            check_linear(results, failures, "ranks", "report CPU cost per rank grows with ranks",
                         [(r["ranks"], r["report_cpu_s"]) for r in rs],
                         [(r["ranks"], r["report_s"]) for r in rs])
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["failures"] = failures
    results["passed"] = not failures
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    for f in failures:
        print(("note: " if args.smoke else "FAIL: ") + f, file=sys.stderr)
    return 0 if (args.smoke or not failures) else 1


if __name__ == "__main__":
    sys.exit(main())
