"""The what-if replay's share of the analysis time on a large trace set.

Builds the same synthetic set as ``bench.py`` (a real fixture replicated to ``--size-mb`` per rank,
``--ranks`` files), runs ``analyze`` once in a fresh interpreter with the cache off, and times the
replay inside it: building the model, the replay as measured, every replay of a finding's fix, the
pairwise replays that group findings and the all-fixed replay. Reported, and checked against the
target (replay < 20% of the analysis time; exit 1 when missed, unless --smoke).

    python benchmarks/replay_bench.py                          # 8 ranks x 100 MB, eager
    python benchmarks/replay_bench.py --source fixtures/kv-full-cast-graph
    python benchmarks/replay_bench.py --size-mb 4 --ranks 2 --smoke
    python benchmarks/replay_bench.py --write-readme           # the run, and its table in benchmarks/README.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the set builder shared with bench.py)

TARGET = 0.20
MARK_START, MARK_END = "<!-- replay:results:start -->", "<!-- replay:results:end -->"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import traceinspect.whatif as R
from traceinspect.pipeline import analyze
spent = {"build_s": 0.0, "replay_s": 0.0, "replays": 0}
_init, _predict = R.Replayer.__init__, R.Replayer.predict
def init(self, *a, **k):
    t = time.perf_counter(); _init(self, *a, **k); spent["build_s"] += time.perf_counter() - t
def predict(self, *a, **k):
    t = time.perf_counter(); out = _predict(self, *a, **k)
    spent["replay_s"] += time.perf_counter() - t; spent["replays"] += 1
    return out
R.Replayer.__init__, R.Replayer.predict = init, predict
t1 = time.perf_counter()
a = analyze(sys.argv[1], use_cache=False)
t2 = time.perf_counter()
m = a.replay.model
print(json.dumps({"import_s": t1 - t0, "analyze_s": t2 - t1, **spent, "ops": m.n_ops, "host_calls": len(m.h_t),
                  "steps_replayed": len(m.pos), "steps_available": m.steps_available,
                  "findings": len(a.findings)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--source", type=Path, default=bench.DEFAULT_SOURCE)
    ap.add_argument("--work", type=Path, default=None, help="where to build the set (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="report only, never fail")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-readme", action="store_true", help="write the results table into benchmarks/README.md")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="ti-replay-bench-"))
    dst = work / f"set-{args.source.name}-{args.ranks}x{args.size_mb:g}"
    total = bench.make_set(args.source, dst, args.size_mb, args.ranks, work / "gen")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", CHILD, str(dst)], capture_output=True, text=True, env=env,
                       timeout=3600)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        return 2
    r = json.loads(p.stdout.strip().splitlines()[-1])
    replay = r["build_s"] + r["replay_s"]
    r.update({"source": str(args.source), "ranks": args.ranks, "size_mb": args.size_mb,
              "json_mb": round(total / 1e6, 1), "replay_total_s": replay,
              "replay_share": replay / r["analyze_s"] if r["analyze_s"] else None,
              "per_replay_s": r["replay_s"] / r["replays"] if r["replays"] else None,
              "target_share": TARGET, "load_avg": os.getloadavg()})
    r["passed"] = bool(r["replay_share"] is not None and r["replay_share"] < TARGET)
    text = json.dumps(r, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    if args.write_readme:
        write_readme(r, argv if argv is not None else sys.argv[1:])
    return 0 if r["passed"] or args.smoke else 1


def table(r: dict[str, Any], argv: list[str]) -> str:
    """The README's results table of one run."""
    load = ", ".join(f"{x:.2f}" for x in r["load_avg"])
    per = f" ({r['per_replay_s']:.2f} s each)" if r["per_replay_s"] else ""
    shown = " ".join(a for a in argv if a != "--write-readme")
    return "\n".join([
        "| measurement | value |", "| --- | --- |",
        f"| analysis (`analyze`, replay included) | {r['analyze_s']:.1f} s |",
        f"| replay in it: model {r['build_s']:.2f} s + {r['replays']} replays {r['replay_s']:.2f} s{per} | "
        f"{r['replay_total_s']:.2f} s |",
        f"| share of the analysis | **{r['replay_share']:.1%}** (target < {TARGET:.0%}: "
        f"{'met' if r['passed'] else 'missed'}) |",
        f"| model size | {r['ops']:,} GPU operations and {r['host_calls']:,} host calls in {r['steps_replayed']} "
        f"replayed steps (of {r['steps_available']}) |",
        "",
        f"`python benchmarks/replay_bench.py {shown}`".replace(" `", "`") + f": {r['ranks']} ranks x "
        f"{r['size_mb']:g} MB ({r['json_mb']:,} MB of JSON) from `{Path(r['source']).name}`, load average "
        f"(1, 5, 15 min) {load} at the end. Written by the benchmark from its latest run; not edited by hand.",
    ])


def write_readme(r: dict[str, Any], argv: list[str]) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    if MARK_START not in text or MARK_END not in text:
        raise SystemExit(f"{readme}: no {MARK_START} ... {MARK_END} block")
    head, rest = text.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    readme.write_text(f"{head}{MARK_START}\n{table(r, argv)}\n{MARK_END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
