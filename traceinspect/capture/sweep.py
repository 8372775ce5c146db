"""A load sweep of a live SGLang server: for each concurrency level, a closed-loop load with exactly N
requests in flight, the throughput and latencies this client sees, the server's running batch and what
caps it, GPU power and clocks, and a decode-step trace of that level (:func:`run_sweep`); and two sweeps
compared level by level with the gate's noise test (:func:`compare_sweeps`).

Per level, in order: set the load to N requests in flight (streamed ``/generate``, no rate limit); wait
until the server's running batch reaches N, or stops short of it with requests queued (capped: by
``max_running_requests``, or by the KV pool when its token usage is high); measure over a window; capture
``steps`` decode steps (the capture's own code). After the last level the load stops and each level's
trace is analysed in this process into ``level-N/analysis.json``. ``sweep.json`` is rewritten
(atomically) after every level, so a sweep that stops half-way keeps what it measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from traceinspect.capture.client import SGLangClient, normalize_url
from traceinspect.capture.errors import CaptureError, ConfigError, ServerUnreachable
from traceinspect.capture.expect import check_expected, describe
from traceinspect.capture.interrupt import interruptible, signal_name
from traceinspect.capture.layout import atomic_write_json, redact_argv
from traceinspect.capture.options import DEFAULT_STEPS, CaptureOptions
from traceinspect.capture.session import is_local_host, read_server, run_capture
from traceinspect.capture.sweep_levels import (
    SweepSettings,
    bare_level,
    cap_of,
    knee,
    moe_model,
    power_note,
    server_config,
    window_metrics,
)
from traceinspect.capture.traffic import BuiltinTraffic, StreamRecorder, TrafficSpec
from traceinspect.capture.ui import CaptureUI
from traceinspect.capture.wait import expected_ranks
from traceinspect.errors import TraceInspectError
from traceinspect.model.run import ServerInfo
from traceinspect.units import json_num
from traceinspect.version import __version__

SCHEMA = "traceinspect.sweep/1"
SWEEP_JSON = "sweep.json"
LEVEL_JSON = "level.json"
ANALYSIS_JSON = "analysis.json"


class SweepError(TraceInspectError):
    """A level could not be measured."""


# -- settings ------------------------------------------------------------------------------------------

# -- options -------------------------------------------------------------------------------------------

@dataclass
class SweepOptions:
    """Everything :func:`run_sweep` needs."""

    url: str
    out: str | Path
    levels: list[int]
    input: int = 1024
    output: int = 1024
    expect: tuple[tuple[str, str], ...] = ()
    steps: int = DEFAULT_STEPS  # decode steps captured per level; 0: measure only
    window_s: float = 30.0
    ramp_timeout_s: float = 300.0
    capture_timeout_s: float = 300.0
    api_key: str | None = None
    admin_api_key: str | None = None
    gpus: list[int] | None = None
    poll_s: float = 0.25
    settle_s: float = 5.0  # after the ramp, before the window: the prefills of the ramp drain
    stall_s: float = 5.0  # a running batch that has not grown for this long, with requests queued, is capped
    command: list[str] | None = None
    settings: SweepSettings = field(default_factory=SweepSettings)


class _Sweep:
    def __init__(self, o: SweepOptions, ui: CaptureUI) -> None:
        self.o = o
        self.ui = ui
        self.secrets = tuple(s for s in (o.api_key, o.admin_api_key) if s)
        self.warnings: list[str] = []
        self.out = Path(o.out)
        self.doc: dict[str, Any] = {}
        self.info: dict[str, Any] = {}
        self.client: SGLangClient | None = None
        self.driver: BuiltinTraffic | None = None
        self.recorder = StreamRecorder()
        self.sampler: Any = None
        self.gpu_note: str | None = None
        self._no_state_warned = False

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self.ui.warn(msg)

    # -- files ---------------------------------------------------------------------------------------

    def write(self) -> None:
        self.doc["warnings"] = self.warnings
        atomic_write_json(self.out / SWEEP_JSON, self.doc)

    def write_level(self, level: dict[str, Any]) -> None:
        d = self.out / f"level-{level['concurrency']}"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_json(d / LEVEL_JSON, level)
        self.write()

    # -- set-up --------------------------------------------------------------------------------------

    def _gpus(self) -> None:
        from traceinspect.capture.nvml import GpuSampler, load_nvml, server_gpus

        host = urlsplit(self.o.url).hostname or ""
        if not is_local_host(host):
            self.gpu_note = (f"GPU power and clocks not sampled: the server ({host}) is not on this machine "
                             "(NVML reads only local GPUs)")
            return
        nvml, why = load_nvml()
        if nvml is None:
            self.gpu_note = f"GPU power and clocks not sampled: {why}"
            return
        indices = self.o.gpus if self.o.gpus else server_gpus(self.info, len(expected_ranks(self.info)))
        try:
            self.sampler = GpuSampler(nvml, indices)
        except Exception as e:  # an index NVML does not have
            self.gpu_note = f"GPU power and clocks not sampled: GPUs {indices}: {type(e).__name__}: {e}"
            return
        self.gpu_note = (f"GPUs {', '.join(map(str, indices))} sampled through NVML"
                         + ("" if self.o.gpus else " (base_gpu_id and gpu_id_step of server_info; --gpus to name "
                            "others, e.g. when the server's CUDA_VISIBLE_DEVICES remaps them)"))

    def _mrr(self) -> int | None:
        states = self.info.get("internal_states")
        if isinstance(states, list):
            eff = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
            eff = [int(x) for x in eff if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
            if eff:
                return sum(eff)
        return ServerInfo(self.info).count("max_running_requests")

    # -- a level -------------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any] | None:
        assert self.client is not None
        return self.client.load_state()

    def _ramp(self, n: int) -> tuple[dict[str, Any] | None, float]:
        """Wait until the running batch reaches ``n`` or stops short with requests queued (capped)."""
        assert self.driver is not None
        t0 = time.monotonic()
        best, best_t = -1, t0
        while True:
            st = self._state()
            now = time.monotonic()
            if st is None:
                if not self._no_state_warned:
                    self._no_state_warned = True
                    self.warn("the server reports no running batch (no /v1/loads, no sglang:num_running_reqs on "
                              "/metrics): a level counts as ramped once this client has its requests in flight, "
                              "and what caps the batch is unknown (start SGLang with --enable-metrics)")
                inflight = self.driver.in_flight or 0
                if inflight >= n:
                    return None, now - t0
            else:
                mrr = st.get("max_running_requests") or self._mrr()
                target = min(n, mrr) if mrr else n
                # steady: the running batch at its target, and every request in flight on the server
                if st["running"] >= target and st["running"] + st["waiting"] >= n:
                    return st, now - t0
                if st["running"] + st["waiting"] > best:
                    best, best_t = st["running"] + st["waiting"], now
                elif st["waiting"] > 0 and now - best_t >= self.o.stall_s:
                    return st, now - t0  # capped below the target: the window tells by what
            done, failed, last = self.driver.failures
            if failed >= max(3, n) and done == 0 and last:
                raise SweepError(f"the load failed: {last}")
            if now - t0 >= self.o.ramp_timeout_s:
                got = st["running"] if st else self.driver.in_flight
                raise SweepError(f"the running batch reached {got} of {n} in {self.o.ramp_timeout_s:g} s "
                                 "(--ramp-timeout)")
            time.sleep(self.o.poll_s)

    def _settle(self, n: int) -> float:
        """After the ramp: at least ``settle_s``, then until this client receives tokens as fast as the server
        says it generates them (``gen_throughput`` of ``/v1/loads``; where the server does not say, until two
        consecutive halves of ``settle_s`` agree), within ``steady_tolerance``: the ramp's prefills and any
        backlog of streamed chunks have drained. At most ``window_s + 4 x settle_s``. Returns the seconds."""
        o = self.o
        t0 = self.recorder.open()
        piece = max(o.settle_s / 2.0, 0.5)
        limit = o.settle_s * 4.0 + o.window_s
        tol = o.settings.steady_tolerance
        while True:
            st = self._state()  # a server that goes away now fails the level
            time.sleep(o.poll_s)
            now = time.monotonic()
            if now - t0 < max(o.settle_s, 2 * piece):
                continue
            gen = st.get("gen_throughput") if st else None
            if gen:
                b = self.recorder.recent_rate(now, piece)
                if b is not None and abs(b - gen) <= tol * gen:
                    break
                what = f"this client received {b:.0f} tok/s, the server generated {gen:.0f}" if b is not None else ""
            else:
                b = self.recorder.tokens_between(now - piece, now) / piece
                a = self.recorder.tokens_between(now - 2 * piece, now - piece) / piece
                if a > 0 and abs(b - a) <= tol * a:
                    break
                what = f"{a:.0f} then {b:.0f} tok/s"
            if now - t0 >= limit:
                if what:  # a measured mismatch; too few arrivals to tell is no warning (a slow trickle has no backlog)
                    self.warn(f"level {n}: the output throughput was not steady after {now - t0:.1f} s ({what}); "
                              "measuring anyway")
                break
        self.recorder.close()
        return time.monotonic() - t0

    def _measure(self, n: int) -> dict[str, Any]:
        assert self.driver is not None
        self.driver.set_concurrency(n)
        _, ramp_s = self._ramp(n)
        settle_s = self._settle(n)
        running, waiting, usage, mrrs, gens = [], [], [], [], []
        if self.sampler is not None:
            self.sampler.start()
        wall0 = time.time()
        t0 = self.recorder.open()
        try:
            while time.monotonic() - t0 < self.o.window_s:
                st = self._state()
                if st is not None:
                    running.append(st["running"])
                    waiting.append(st["waiting"])
                    if st.get("token_usage") is not None:
                        usage.append(st["token_usage"])
                    if st.get("max_running_requests"):
                        mrrs.append(st["max_running_requests"])
                    if st.get("gen_throughput") is not None:
                        gens.append(st["gen_throughput"])
                time.sleep(min(self.o.poll_s, max(0.0, self.o.window_s - (time.monotonic() - t0))))
        finally:
            rec = self.recorder.close()
            wall1 = time.time()
            gpus = self.sampler.stop() if self.sampler is not None else None
        m = window_metrics(rec, t0, self.o.settings.sub_windows)
        level: dict[str, Any] = {"concurrency": n}
        run_med = int(round(float(np.median(running)))) if running else None
        wait_med = int(round(float(np.median(waiting)))) if waiting else 0
        mrr = int(np.median(mrrs)) if mrrs else self._mrr()
        use = float(np.median(usage)) if usage else None
        level["running_requests"] = run_med
        level["waiting_requests"] = wait_med if running else None
        level["capped_by"] = (cap_of(n, run_med, wait_med, mrr, use, self.o.settings)
                              if run_med is not None else None)
        level.update({k: m[k] for k in ("output_tokens_per_s", "request_per_s", "tpot_ms", "itl_ms")})
        # what the server logs as its generation throughput, for comparison (not this client's measurement)
        level["server_gen_tokens_per_s"] = json_num(float(np.mean(gens)), 1) if gens else None
        level["step_us"] = None
        level["step_between_share"] = None
        model = self.doc["model"]
        tokens = run_med if run_med is not None else self.driver.in_flight
        if model["experts"] and model["top_k"] and tokens:
            level["per_expert_m"] = json_num(tokens * model["top_k"] / model["experts"], 4)
        else:
            level["per_expert_m"] = None
        g: dict[str, Any] = {}
        if gpus is not None:
            from traceinspect.capture.nvml import summarize

            g = summarize(gpus)
        for k in ("power_w", "power_limit_w", "sm_clock_mhz", "mem_clock_mhz", "gpu_util_pct"):
            level[k] = json_num(g.get(k), 1)
        level["gpus"] = g.get("gpus")
        level["power_note"] = power_note(level, self.o.settings)
        level["classes"] = None
        level["analysis"] = None
        level["capture"] = None
        level["status"] = "ok"
        level["error"] = None
        level["window"] = {"start_unix": round(wall0, 3), "end_unix": round(wall1, 3), "seconds": m["seconds"],
                           "ramp_s": json_num(ramp_s, 3), "settle_s": json_num(settle_s, 3), "tokens": m["tokens"],
                           "requests_finished": m["requests_finished"], "token_usage": json_num(use, 4),
                           "max_running_requests": mrr, "sub_windows": self.o.settings.sub_windows}
        level["throughput_samples"] = m["throughput_samples"]
        return level

    def _capture(self, level: dict[str, Any]) -> None:
        d = self.out / f"level-{level['concurrency']}"
        d.mkdir(parents=True, exist_ok=True)
        copts = CaptureOptions(url=self.o.url, out=d, steps=self.o.steps, api_key=self.o.api_key,
                               admin_api_key=self.o.admin_api_key, load=None, timeout_s=self.o.capture_timeout_s,
                               ramp_timeout_s=30.0, min_batch=1,
                               command=redact_argv(list(self.o.command or []) + [f"(level {level['concurrency']})"],
                                                   self.secrets))
        try:
            res = run_capture(copts, CaptureUI(quiet=True, secrets=self.secrets))
            level["capture"] = {"status": res.status, "dir": str(res.out_dir.relative_to(self.out))}
        except ServerUnreachable:
            raise  # the server is gone: the level fails
        except CaptureError as e:
            level["capture"] = {"status": "incomplete", "error": e.one_line()}
            level["status"] = "partial"
            level["error"] = f"capture: {e.one_line()}"

    def _analyze(self, level: dict[str, Any]) -> None:
        """Analyse a level's captured steps in this process; its figures go into the level."""
        cap = level.get("capture") or {}
        if cap.get("status") != "complete":
            return
        from traceinspect.document import write_document
        from traceinspect.pipeline import analyze

        d = self.out / cap["dir"]
        try:
            a = analyze(d, phase="decode", command=f"traceinspect analyze {d}")
            doc = a.to_json()
            write_document(d / ANALYSIS_JSON, doc)
        except Exception as e:  # an unusable trace: the level keeps its measurements
            msg = e.one_line() if hasattr(e, "one_line") else f"{type(e).__name__}: {e}"
            level["status"], level["error"] = "partial", f"analysis: {msg}"
            return
        steps = doc.get("steps") or {}
        level["analysis"] = str((d / ANALYSIS_JSON).relative_to(self.out))
        level["step_us"] = json_num(steps.get("median_us"), 1)
        level["step_between_share"] = json_num(steps.get("between_share"), 4)
        level["classes"] = {c: json_num(v.get("share"), 4) for c, v in (doc.get("classes") or {}).items()
                            if isinstance(v, dict)}

    # -- the whole -----------------------------------------------------------------------------------

    def run(self) -> int:
        o = self.o
        o.url = normalize_url(o.url)
        if o.window_s <= 0:
            raise ConfigError("--window must be positive")
        if o.steps < 0:
            raise ConfigError("--steps must be 0 (no capture) or more")
        self.client = SGLangClient(o.url, api_key=o.api_key, admin_api_key=o.admin_api_key)
        try:
            self.info, meta = read_server(self.client, o.url, self.secrets, self.warn)
            check_expected(self.info, o.expect)  # before any load is sent
            if (self.out / SWEEP_JSON).exists():
                raise ConfigError(f"{self.out} already holds a sweep ({SWEEP_JSON}); give another --out")
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.out / "server_info.json", self.info)
            self.ui.info(f"server {o.url}: {describe(self.info)}")
            self._gpus()
            host = urlsplit(o.url).hostname or ""
            if o.steps > 0 and not is_local_host(host):
                self.warn(f"the server ({host}) is not on this machine: each level's trace is written on ITS "
                          f"filesystem, so {self.out} must be a directory both hosts see at the same path "
                          "(else --steps 0 measures only)")
            if self.gpu_note and "not sampled" in self.gpu_note:
                self.ui.info(self.gpu_note)
            self.doc = {
                "schema": SCHEMA, "tool": {"name": "traceinspect", "version": __version__},
                "url": o.url, "command": redact_argv(o.command or [], self.secrets),
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished_at": None,
                "load": {"input": o.input, "output": o.output, "stream": True, "driver": "builtin",
                         "window_s": o.window_s, "steps": o.steps},
                "server_config": server_config(self.info), "server_version": meta.get("server_version"),
                "model": moe_model(self.info), "gpu_note": self.gpu_note,
                "levels": [bare_level(n, "not_run", None) for n in o.levels],
                "knee": None, "warnings": self.warnings,
            }
            pool = ServerInfo(self.info).count("max_total_num_tokens")
            if pool and max(o.levels) * (o.input + o.output) > pool:
                self.warn(f"the KV pool holds {pool} tokens but {max(o.levels)} x (input {o.input} + output "
                          f"{o.output}) = {max(o.levels) * (o.input + o.output)}: the top levels may be capped by it")
            self.write()
            with interruptible(self.ui.info):
                return self._levels()
        finally:
            if self.driver is not None:
                self.driver.stop()
            if self.client is not None:
                self.client.close()

    def _levels(self) -> int:
        o = self.o
        failed = False
        # no request yet: each level sets how many are in flight
        self.driver = BuiltinTraffic(o.url, TrafficSpec(concurrency=0, input=o.input, output=o.output),
                                     api_key=o.api_key, recorder=self.recorder)
        self.driver.start()
        levels = self.doc["levels"]
        for i, n in enumerate(o.levels):
            self.ui.info(f"level {n}: {n} request(s) in flight")
            try:
                level = self._measure(n)
                if o.steps > 0:
                    self._capture(level)
            except KeyboardInterrupt as e:
                levels[i] = bare_level(n, "failed", f"interrupted ({signal_name(e)})")
                failed = True
            except (TraceInspectError, RuntimeError, OSError) as e:
                msg = e.one_line() if isinstance(e, TraceInspectError) else f"{type(e).__name__}: {e}"
                levels[i] = bare_level(n, "failed", msg)
                failed = True
            else:
                levels[i] = level
                self.ui.info(f"level {n}: {level['output_tokens_per_s']} output tok/s, running "
                             f"{level['running_requests']}" + (f" (capped by {level['capped_by']})"
                                                               if level["capped_by"] else ""))
            self.write_level(levels[i])
            if failed:
                for j in range(i + 1, len(o.levels)):
                    levels[j]["error"] = f"not run: the sweep stopped at level {n}"
                self.ui.warn(f"level {n} failed: {levels[i]['error']}; the levels before it are kept")
                break
        self.driver.stop()
        self.driver = None
        for level in levels:
            if level.get("capture"):
                try:
                    self._analyze(level)
                except KeyboardInterrupt as e:
                    level["status"], level["error"] = "partial", f"analysis: interrupted ({signal_name(e)})"
                    failed = True
                self.write_level(level)
        self.doc["knee"] = knee(levels, o.settings.knee_growth_per_doubling)
        self.doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.write()
        return 2 if failed or any(lv.get("status") != "ok" for lv in levels) else 0


def run_sweep(opts: SweepOptions, ui: CaptureUI | None = None) -> tuple[dict[str, Any], int]:
    """Run a sweep; returns the ``traceinspect.sweep/1`` document and the exit code (0: every level
    measured, captured and analysed; 2: a level failed or was not run)."""
    sw = _Sweep(opts, ui or CaptureUI(quiet=True))
    code = sw.run()
    return sw.doc, code


# -- comparing two sweeps ------------------------------------------------------------------------------

def load_sweep(path: str | Path) -> dict[str, Any]:
    """A sweep document: ``DIR/sweep.json`` or the file itself."""
    import json

    p = Path(path)
    f = p / SWEEP_JSON if p.is_dir() else p
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{f}: no sweep here (run traceinspect sweep --out {p})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f}: cannot read the sweep ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f"{f}: not a {SCHEMA} document")
    return doc


def default_threshold_pct() -> float:
    """The gate's step threshold (percent): a level differs only beyond it and beyond noise."""
    from traceinspect.gate import DEFAULT_THRESHOLDS, parse_threshold

    for expr in DEFAULT_THRESHOLDS:
        t = parse_threshold(expr)
        if t.metric == "step" and t.kind == "pct":
            return t.value
    return 5.0


def compare_sweeps(a: dict[str, Any], b: dict[str, Any], threshold_pct: float | None = None,
                   alpha: float | None = None) -> dict[str, Any]:
    """Level by level on the levels both measured: output throughput of B against A. A level differs when
    its change is beyond ``threshold_pct`` and beyond noise: the gate's one-sided Mann-Whitney U test on the
    per-window throughput samples, both ways at ``alpha / 2``."""
    from traceinspect.gate import DEFAULT_ALPHA, noise_test

    thr = default_threshold_pct() if threshold_pct is None else threshold_pct
    alpha = DEFAULT_ALPHA if alpha is None else alpha

    def usable(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {lv["concurrency"]: lv for lv in doc.get("levels", [])
                if lv.get("status") in ("ok", "partial") and lv.get("output_tokens_per_s")}

    la, lb = usable(a), usable(b)
    rows = []
    for n in sorted(set(la) & set(lb)):
        ta, tb = la[n]["output_tokens_per_s"], lb[n]["output_tokens_per_s"]
        change = tb / ta - 1.0
        sa, sb = la[n].get("throughput_samples") or [], lb[n].get("throughput_samples") or []
        up, down = noise_test(sa, sb, alpha / 2), noise_test(sb, sa, alpha / 2)
        decided = up.decided and down.decided
        beyond = bool(up.significant or down.significant) if decided else None
        big = abs(change) * 100.0 >= thr
        significant = bool(beyond and big)
        p = min(x for x in (up.p_value, down.p_value) if x is not None) if decided else None
        if not decided:
            why = up.reason if not up.decided else down.reason
        elif significant:
            why = f"{change:+.1%}, beyond noise (Mann-Whitney U, p={p:.3g}) and beyond {thr:g}%"
        elif beyond:
            why = f"{change:+.1%}: beyond noise (p={p:.3g}) but within {thr:g}%"
        else:
            why = f"{change:+.1%}: within noise (p={p:.3g})"
        rows.append({"concurrency": n, "a_tokens_per_s": ta, "b_tokens_per_s": tb, "change": json_num(change, 4),
                     "significant": significant, "p_value": json_num(p, 6), "decided": decided, "reason": why})
    ca, cb = a.get("server_config") or {}, b.get("server_config") or {}
    diff = {k: {"a": ca.get(k), "b": cb.get(k)} for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
    only = sorted(set(la) ^ set(lb))
    return {"schema": "traceinspect.sweep-compare/1", "a": a.get("url"), "b": b.get("url"),
            "different": any(r["significant"] for r in rows), "threshold_pct": thr, "alpha": alpha,
            "levels": rows, "config_diff": diff, "levels_in_one_only": only}
