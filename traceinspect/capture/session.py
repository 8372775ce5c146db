"""One capture from a live SGLang server, step by step (see :func:`traceinspect.capture.capture`)."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from traceinspect.capture.client import SGLangClient, normalize_url
from traceinspect.capture.errors import (
    CaptureError,
    CaptureIncomplete,
    CaptureInterrupted,
    ConfigError,
    ProfileRejected,
)
from traceinspect.capture.expect import check_expected, describe
from traceinspect.capture.interrupt import deferred, interruptible, signal_name
from traceinspect.capture.layout import (
    CAPTURE_JSON,
    CAPTURE_SCHEMA,
    SERVER_INFO_JSON,
    atomic_write_json,
    check_prefix,
    new_profile_id,
    prepare_out_dir,
    redact,
    redact_argv,
    redact_text,
)
from traceinspect.capture.loadsample import LoadSampler
from traceinspect.capture.options import PHASES, WHY_MISSING, CaptureOptions, CaptureResult
from traceinspect.capture.traffic import TrafficDriver, make_driver, wait_for_batch
from traceinspect.capture.ui import CaptureUI
from traceinspect.capture.wait import RankKey, RankWatcher, WaitResult, expected_ranks, wait_for_ranks
from traceinspect.fileio import sha256_of
from traceinspect.version import __version__


def is_local_host(host: str) -> bool:
    """True for loopback addresses and this machine's own name."""
    h = host.strip("[]").lower()
    if h in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    with contextlib.suppress(OSError):
        name = socket.gethostname().lower()
        if h == name or h.split(".")[0] == name:
            return True
    return False


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return sha256_of(f)


def read_server(client: SGLangClient, url: str, secrets: tuple[str, ...],
                warn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``/server_info`` with ``/model_info`` under ``model_info`` and, for a server on this machine, the model's
    config under ``model_config``, secrets redacted; and what to record about where they came from.
    ``warn(text)`` is told about an old server or a model info that could not be read."""
    si_path, info = client.server_info()
    meta: dict[str, Any] = {}
    try:
        mi_path, model = client.model_info()
    except CaptureError as e:
        mi_path, model = None, None
        warn(f"could not read model info: {e.one_line()}")
    if si_path != "/server_info":
        warn(f"old server: read {si_path} (no /server_info)")
    info = dict(info)
    info["model_info"] = model
    from traceinspect.capture.modelconfig import model_config

    cfg, why = model_config(info, model, is_local_host(urlsplit(url).hostname or ""))
    if cfg is not None:
        info["model_config"] = cfg
    else:
        meta["model_config"] = why
    meta.update({"server_info_endpoint": si_path, "model_info_endpoint": mi_path,
                 "server_version": info.get("version")})
    return redact(info, secrets), meta


class _Capture:
    def __init__(self, opts: CaptureOptions, ui: CaptureUI) -> None:
        self.o = opts
        self.ui = ui
        self.secrets = tuple(s for s in (opts.api_key, opts.admin_api_key) if s)
        self.warnings: list[str] = []
        self.timings: dict[str, float] = {}
        self.t0 = time.time()
        self.out_dir: Path | None = None
        self.client: SGLangClient | None = None
        self.driver: TrafficDriver | None = None
        self.profile_started = False
        self.armed = False  # a profile_by_stage request left state on the server
        self.server_info: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.expected: list[RankKey] = []
        self.watcher: RankWatcher | None = None
        self.profile_id = new_profile_id()
        self.body: dict[str, Any] = {}
        self.load: LoadSampler | None = None  # the server's load in the profile window

    # -- helpers -------------------------------------------------------------------------------

    def warn(self, msg: str) -> None:
        msg = redact_text(msg, self.secrets)
        self.warnings.append(msg)
        self.ui.warn(msg)

    def _validate(self) -> None:
        o = self.o
        check_prefix(o.prefix)
        if o.phase not in PHASES:
            raise ConfigError(f"unknown phase {o.phase!r}; use one of {', '.join(PHASES)}")
        if o.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {o.steps}")
        if o.timeout_s <= 0:
            raise ConfigError("--timeout must be positive")
        bad = [a for a in o.activities if a not in ("CPU", "GPU", "MEM", "CUDA_PROFILER", "RPD", "XPU")]
        if bad:
            raise ConfigError(f"unknown profiler activities {bad}")
        o.url = normalize_url(o.url)

    def _capture_json(self, status: str, reason: str | None, res: WaitResult | None) -> dict[str, Any]:
        assert self.out_dir is not None
        files = []
        if res is not None:
            for tf in res.files:
                if not tf.path.is_file():
                    continue
                files.append({
                    "name": tf.path.name,
                    "size": tf.path.stat().st_size,
                    "sha256": _sha256(tf.path) if tf.complete else None,
                    "rank": tf.key.label if tf.key else None,
                    "stage": tf.stage,
                    "complete": tf.complete,
                    "problem": tf.problem if not tf.complete else None,
                })
        data = {
            "schema": CAPTURE_SCHEMA,
            "status": status,
            "reason": reason,
            "traceinspect_version": __version__,
            "url": self.o.url,
            "command": redact_argv(self.o.command or [], self.secrets),
            "out_dir": str(self.out_dir),
            "server_output_dir": self.body.get("output_dir"),
            "profile_id": self.profile_id,
            "profile_prefix": self.o.prefix,
            "phase": self.o.phase,
            "num_steps": self.o.steps,
            "profile_request": self.body,
            "expected_ranks": [k.label for k in self.expected],
            "missing_ranks": [k.label for k in res.missing] if res is not None else [k.label for k in self.expected],
            "files": files,
            "load": (self.o.load.as_dict() if self.o.load else None),
            "load_stats": self.driver.stats() if self.driver else None,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.t0)),
            "finished_at": (time.strftime("%Y-%m-%dT%H:%M:%S%z") if status != "running" else None),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "warnings": self.warnings,
            **self.meta,
        }
        return redact(data, self.secrets)

    def _write_capture_json(self, status: str, reason: str | None, res: WaitResult | None,
                            extra: dict[str, Any] | None = None) -> None:
        data = self._capture_json(status, reason, res)
        if extra:
            data.update(redact(extra, self.secrets))
        assert self.out_dir is not None
        atomic_write_json(self.out_dir / CAPTURE_JSON, data)

    # -- the steps -----------------------------------------------------------------------------

    def _read_server(self) -> None:
        assert self.client is not None
        t = time.monotonic()
        self.server_info, meta = read_server(self.client, self.o.url, self.secrets, self.warn)
        self.timings["server_info"] = time.monotonic() - t
        self.meta.update(meta)

    def _target_batch(self) -> int:
        o, info = self.o, self.server_info
        if o.load is None:
            return o.min_batch
        target = o.load.concurrency
        caps = []
        states = info.get("internal_states")
        if isinstance(states, list):
            eff = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
            eff = [int(x) for x in eff if isinstance(x, (int, float)) and x > 0]
            if eff:
                caps.append(sum(eff))
        mrr = info.get("max_running_requests")
        if isinstance(mrr, (int, float)) and mrr > 0 and not caps:
            caps.append(int(mrr))
        if caps and min(caps) < target:
            self.warn(f"--load concurrency={target} exceeds the server's max_running_requests={min(caps)}; "
                      f"waiting for a batch of {min(caps)}")
            target = min(caps)
        pool = info.get("max_total_num_tokens")
        need = o.load.concurrency * (o.load.input + o.load.output)
        if isinstance(pool, (int, float)) and pool > 0 and need > pool:
            self.warn(f"the KV pool holds {int(pool)} tokens but concurrency x (input+output) = {need}: "
                      "the server will queue or retract requests before they finish")
        return max(1, target)

    def _drive_traffic(self) -> None:
        assert self.client is not None
        o = self.o
        target = self._target_batch()
        if o.load is not None:
            model = self.server_info.get("model_path")
            tok = (self.server_info.get("model_info") or {}).get("tokenizer_path") or self.server_info.get(
                "tokenizer_path")
            log = self.out_dir / "bench_serving.log" if (o.load.driver == "bench_serving" and self.out_dir) else None
            self.driver = make_driver(o.url, o.load, api_key=o.api_key, model=model, tokenizer=tok, log_path=log)
            self.ui.info(f"driving load with {self.driver.name}: concurrency={o.load.concurrency} "
                         f"input={o.load.input} output={o.load.output}")
            self.driver.start()

        first = self.client.running_requests()
        if first is None and self.driver is None:
            self.warn("the server does not report its running batch (no /v1/loads or /metrics): make sure "
                      "decode traffic is flowing, or pass --load")
            self.meta["running_batch_at_start"] = None
            return
        t = time.monotonic()
        with self.ui.progress("running batch", target, "requests") as update:
            def prog(n: int | None, tgt: int, source: str) -> None:
                update(n or 0, tgt, f"({source})")

            n, waited, problem = wait_for_batch(self.client.running_requests, target, o.ramp_timeout_s,
                                                driver=self.driver, poll_s=0.25, progress=prog)
        self.timings["ramp"] = time.monotonic() - t
        self.meta["running_batch_at_start"] = n
        self.meta["running_batch_target"] = target
        if problem and problem != "timeout":
            raise CaptureError(f"the load generator failed: {problem}")
        if problem == "timeout":
            if not n:
                raise CaptureError(
                    f"no traffic: the server's running batch stayed at 0 for {o.ramp_timeout_s:g} s. The profiler "
                    "only records forward steps; drive load with --load concurrency=N,input=N,output=N")
            self.warn(f"the running batch reached {n} of {target} in {o.ramp_timeout_s:g} s; capturing anyway")
        else:
            self.ui.info(f"running batch: {n} requests")

    def _start_profile(self) -> None:
        assert self.client is not None and self.out_dir is not None
        o = self.o
        by_stage, _stage = PHASES[o.phase]
        server_dir = o.server_out_dir
        if server_dir:
            server_dir = str(Path(server_dir) / self.out_dir.name) if self.meta.get("subdirectory") else server_dir
        self.body = {
            "output_dir": server_dir or str(self.out_dir),
            "num_steps": o.steps,
            "activities": list(o.activities),
            "record_shapes": o.record_shapes,
            "with_stack": o.with_stack,
            "profile_by_stage": by_stage,
            "profile_id": self.profile_id,
            "profile_prefix": o.prefix,
        }
        self.load = LoadSampler(self.client)
        self.load.sample("start")
        t = time.monotonic()
        self.load.profile_started()
        reply = self.client.start_profile(self.body)
        self.profile_started = True
        self.armed = by_stage
        self.timings["start_profile"] = time.monotonic() - t
        self.meta["start_profile_reply"] = reply
        self.meta["server_load"] = self.load.record()

    def _wait(self) -> WaitResult:
        assert self.watcher is not None
        o = self.o
        t = time.monotonic()
        n = len(self.expected)
        self.ui.info(f"waiting for {n} rank file{'s' if n != 1 else ''} ({o.steps} {o.phase} steps) in "
                     f"{self.out_dir} (timeout {o.timeout_s:g} s)")

        def stop_reason() -> str | None:
            return self.driver.error if self.driver is not None else None

        with self.ui.progress("rank files", n, "ranks") as update:
            def prog(done: int, total: int, note: str) -> None:
                update(done, total, note)
                if self.load is not None:
                    self.load.maybe_sample()

            res = wait_for_ranks(self.watcher, o.timeout_s, poll_s=o.poll_s, progress=prog,
                                 should_stop=stop_reason)
        self.timings["wait"] = time.monotonic() - t
        if self.load is not None:
            self.load.sample("end")
            self.meta["server_load"] = self.load.record()
        return res

    def _stop_profile(self) -> None:
        if not self.profile_started or self.client is None:
            return
        if self.watcher is not None:
            self.watcher.accept_stageless = False
        try:
            ok, reply = self.client.stop_profile(timeout=60.0)
            self.meta["stop_profile"] = {"ok": ok, "reply": reply}
        except CaptureError as e:
            self.meta["stop_profile"] = {"ok": False, "reply": e.one_line()}
        self.profile_started = False

    def _settle(self, seconds: float, grace: float = 1.5) -> WaitResult:
        """Poll a little longer so files the server writes on stop are recorded.

        SGLang writes them before it answers ``/stop_profile``; when none has shown up after
        ``grace`` seconds, none is coming.
        """
        assert self.watcher is not None
        t0 = time.monotonic()
        while True:
            self.watcher.poll()
            res = self.watcher.result(True, 0.0)
            unfinished = any(not tf.complete for tf in res.files)
            waited = time.monotonic() - t0
            if waited >= seconds or (res.files and not unfinished) or (not res.files and waited >= grace):
                return res
            time.sleep(0.25)

    def _missing_message(self, before: WaitResult, after: WaitResult) -> str:
        """Why the wait timed out, judged from the files before and after ``/stop_profile``."""
        o = self.o
        got, n = n_complete(after), len(self.expected)
        missing = ", ".join(k.label for k in after.missing[:16]) + (" ..." if len(after.missing) > 16 else "")
        head = f"timed out after {o.timeout_s:g} s"
        stopped = (self.meta.get("stop_profile") or {}).get("ok")
        if not after.complete and not before.files and after.files:
            return (f"{head}: no rank file appeared while waiting, but the server wrote {len(after.files)} when "
                    f"/stop_profile was sent, so {self.out_dir} is visible to it: the profile did not reach "
                    f"{o.steps} forward steps in time. Is {o.phase} traffic flowing (--load)? Otherwise raise "
                    "--timeout or lower --steps")
        if not after.complete and not before.files:
            host = urlsplit(o.url).hostname or "?"
            where = (f"the server is on another host ({host}), so it wrote into ITS {self.body.get('output_dir')}: "
                     "use a directory both hosts share, or --server-out-dir"
                     if not is_local_host(host) else
                     "if the server runs in a container or another mount namespace, it wrote to its own view of "
                     "that path (mount it, or give --server-out-dir)")
            evidence = (" even though /stop_profile stopped a running profile" if stopped else "")
            return (f"{head}: no trace file appeared in {self.out_dir}{evidence}. The output directory may not "
                    f"be visible from the server: {where}. Also check that {o.phase} traffic was flowing and "
                    "that no other profile was in progress")
        note = self.watcher.pending_note() if self.watcher else ""
        stage_note = ""
        if PHASES[o.phase][0]:
            stage_note = (". With profile_by_stage, SGLang also drops or cuts a DECODE capture when a new "
                          "request's prefill lands in its window: use long outputs (--load ...,output=N) or "
                          "--phase all")
        return (f"{head}: {got} of {n} rank files complete; missing {missing}"
                + (f" ({note})" if note else "") + f". {WHY_MISSING}{stage_note}")

    # -- the whole -----------------------------------------------------------------------------

    def _disarm(self) -> None:
        """Leave the server's profiler as we found it.

        SGLang (0.5.23) never resets its by-stage counters after a ``profile_by_stage`` capture: the
        next prefill would start an EXTEND profile with our id, and the decode batch after it would
        write it over our ``-DECODE`` files. A plain start with no activities clears that state
        without recording anything; if a leftover stage profile is already running, stop it first.
        """
        if not self.armed or self.client is None:
            return
        body = {
            "output_dir": str(Path(self.body["output_dir"]) / ".traceinspect-reset"),
            "activities": [], "profile_by_stage": False, "record_shapes": False, "with_stack": False,
            "profile_id": f"{self.profile_id}_reset", "profile_prefix": self.o.prefix,
        }
        outcome = "failed"
        for _ in range(3):
            try:
                self.client.start_profile(body)
                outcome = "ok"
                break
            except ProfileRejected:
                # a stage profile restarted after ours finished; stop it (it writes a stage-less file)
                self.profile_started = True
                self._stop_profile()
                time.sleep(0.2)
            except CaptureError as e:
                outcome = f"failed: {e.one_line()}"
                break
        self.armed = False
        self.meta["profiler_reset"] = outcome
        if outcome != "ok":
            self.warn("could not reset the server's by-stage profiler state; its next prefill may start a "
                      "profile that writes into this directory")

    def _set_aside_extras(self, res: WaitResult) -> WaitResult:
        """Move stage-less files a reset had to stop out of a complete stage capture (into ``extra/``)."""
        assert self.out_dir is not None and self.watcher is not None
        stage = self.watcher.stage
        if stage is None:
            return res
        kept = {id(tf) for tf in res.complete.values()}
        extras = [tf for tf in res.files if tf.stage is None and tf.path.is_file() and id(tf) not in kept]
        if not extras:
            return res
        dest = self.out_dir / "extra"
        dest.mkdir(exist_ok=True)
        for tf in extras:
            tf.path.replace(dest / tf.path.name)
            self.watcher.files.pop(tf.path.name, None)
        self.warn(f"moved {len(extras)} trace file(s) the server wrote after the capture into {dest}")
        return self.watcher.result(res.timed_out, res.elapsed_s)

    def _check_unchanged(self, res: WaitResult) -> str | None:
        """Complete files must not have changed since they were verified."""
        changed = []
        for tf in res.complete.values():
            try:
                st = tf.path.stat()
            except OSError:
                changed.append(f"{tf.path.name} (gone)")
                continue
            if (st.st_size, st.st_mtime) != (tf.size, tf.mtime):
                changed.append(tf.path.name)
        if changed:
            return ("the server rewrote " + ", ".join(changed) + " after it was complete (a profile "
                    "restarted with this capture's id); capture again")
        return None

    def run(self) -> CaptureResult:
        o = self.o
        self._validate()
        host = urlsplit(o.url).hostname or ""
        if not is_local_host(host):
            self.warn(f"the server ({host}) is not on this machine: SGLang writes traces to output_dir on "
                      "ITS filesystem, so --out must be a directory both hosts see at the same path "
                      "(or pass --server-out-dir with the server's path for it)")
        self.client = SGLangClient(o.url, api_key=o.api_key, admin_api_key=o.admin_api_key)
        res: WaitResult | None = None
        status, reason = "incomplete", None
        try:
            self._read_server()
            check_expected(self.server_info, o.expect)  # before anything is written or profiled
            self.out_dir, old = prepare_out_dir(o.out)
            if old:
                self.meta["subdirectory"] = True
                shown = ", ".join(old[:5]) + (f" and {len(old) - 5} more" if len(old) > 5 else "")
                self.warn(f"{Path(o.out)} already holds files of an earlier capture ({shown}); writing this "
                          f"capture to {self.out_dir}")
            self.expected = expected_ranks(self.server_info)
            _by_stage, stage = PHASES[o.phase]
            self.watcher = RankWatcher(self.out_dir, f"{o.prefix}-{self.profile_id}", self.expected, stage,
                                       stable_s=o.stable_s, alt_stem=self.profile_id)
            atomic_write_json(self.out_dir / SERVER_INFO_JSON, self.server_info)
            self._write_capture_json("running", None, None)
            self.ui.info(f"server {o.url}: {describe(self.server_info)}")
            try:
                with interruptible(self.ui.info):
                    self._drive_traffic()
                    self._start_profile()
                    res = self._wait()
            except KeyboardInterrupt as e:
                by = signal_name(e)
                with deferred():
                    self.ui.info("interrupted: stopping the load and the profile; keeping what was written")
                    if self.driver is not None:
                        self.driver.stop()
                    self._stop_profile()
                    self._disarm()
                    res = self._settle(5.0)
                    reason = f"interrupted ({by})"
                    self._write_capture_json("incomplete", reason, res)
                kept = [tf.path.name for tf in res.files if tf.path.is_file()]
                raise CaptureInterrupted(
                    f"capture interrupted ({by}); the profile was stopped and {len(kept)} file(s) written so far "
                    f"are kept in {self.out_dir} (capture.json: incomplete)", by) from None
            load_error = self.driver.error if self.driver is not None else None
            if self.driver is not None:
                self.driver.stop()
            if res.missing:
                before = res
                self._stop_profile()
                self._disarm()
                res = self._settle(3.0)
                reason = self._missing_message(before, res)
                if load_error:
                    reason = f"the load generator failed ({load_error}); " + reason
            else:
                self.profile_started = False  # the server stopped it after num_steps
                self._disarm()
                if stage is not None and any(tf.stage is None for tf in res.complete.values()):
                    self.warn(f"the server ignored profile_by_stage (an older release): the files hold the next "
                              f"{o.steps} batches of any kind, not only {o.phase} steps")
                reason = self._check_unchanged(res)
                self.watcher.poll(verify=False)  # files a reset had to stop
                res = self._set_aside_extras(self.watcher.result(False, res.elapsed_s))
                if reason is None and res.missing:
                    reason = "a rank file changed after it was verified; capture again"
                status = "complete" if reason is None else "incomplete"
        except CaptureInterrupted:
            raise
        except CaptureError as e:
            reason = e.one_line()
            if self.out_dir is not None:
                with deferred():
                    if isinstance(e, ProfileRejected):
                        self.profile_started = self.armed = False  # not ours to stop
                    if self.driver is not None:
                        self.driver.stop()
                    self._stop_profile()
                    self._disarm()
                    if self.watcher is not None:
                        res = self.watcher.result(True, 0.0)
                    self._write_capture_json("incomplete", reason, res)
            raise
        finally:
            if self.driver is not None:
                self.driver.stop()
            if self.client is not None:
                self.client.close()

        assert self.out_dir is not None and res is not None
        self.timings["total"] = time.time() - self.t0
        self._write_capture_json(status, reason, res)
        files = [tf.path for tf in res.files if tf.path.is_file()]
        result = CaptureResult(status=status, out_dir=self.out_dir, profile_id=self.profile_id, prefix=o.prefix,
                               files=files, missing=[k.label for k in res.missing], server_info=self.server_info,
                               reason=reason, warnings=self.warnings)
        if status != "complete":
            err = CaptureIncomplete(f"{reason} (capture.json: incomplete, in {self.out_dir})")
            err.result = result  # type: ignore[attr-defined]
            raise err
        self.ui.info(f"captured {len(res.complete)} rank files in {self.out_dir} "
                     f"({res.elapsed_s:.1f} s after /start_profile)")
        if o.analyze:
            self._analyze(result, res)
        return result

    def _analyze(self, result: CaptureResult, res: WaitResult) -> None:
        # imported here for start-up speed: capturing alone needs none of the analyzer's table stack
        from traceinspect.capture.report import analyze_into

        assert self.out_dir is not None
        command = "traceinspect " + " ".join(redact_argv(self.o.command or [], self.secrets))
        try:
            analysis, written = analyze_into(self.out_dir, phase=self.o.phase, command=command)
        except Exception as e:
            msg = e.one_line() if hasattr(e, "one_line") else f"{type(e).__name__}: {e}"
            self._write_capture_json("complete", None, res, {"analysis": {"status": "failed", "error": msg}})
            raise
        result.analysis = analysis
        result.report = written[0] if written else None
        self._write_capture_json("complete", None, res, {"analysis": {
            "status": "ok", "files": [p.name for p in written]}})
        for p in written:
            self.ui.info(f"wrote {p}")


def n_complete(res: WaitResult | None) -> int:
    return len(res.complete) if res is not None else 0


def run_capture(opts: CaptureOptions, ui: CaptureUI | None = None) -> CaptureResult:
    """Run one capture; raises a :class:`~traceinspect.capture.errors.CaptureError` when it cannot finish."""
    ui = ui or CaptureUI(quiet=True)
    return _Capture(opts, ui).run()


__all__ = ["CaptureOptions", "CaptureResult", "run_capture", "is_local_host", "read_server"]
