"""One simulated scheduler rank: a tiny torch decoder on the CPU and SGLang's profiler logic.

The main process sends one message per forward batch (as SGLang's TP ranks all run every batch)
and one per profile request; this process runs the batch under ``record_function("step[...]")``
and starts/stops/exports ``torch.profiler`` exactly when SGLang's ``SchedulerProfilerManager``
(sglang 0.5.23, non-V2 path) would, writing the same file names.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def log(rank: int, msg: str) -> None:
    print(f"[standin TP{rank}] {msg}", file=sys.stderr, flush=True)


class TinyDecoder:
    """A few layers of attention over a small KV cache plus an MLP: enough CPU ops to profile."""

    def __init__(self, torch: Any, hidden: int = 64, layers: int = 2, ctx: int = 32, vocab: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.t = torch
        self.ctx = ctx
        self.emb = torch.randn(vocab, hidden, generator=g)
        self.layers = [
            {n: torch.randn(hidden, hidden, generator=g) * 0.05 for n in ("q", "k", "v", "o", "up", "down")}
            for _ in range(layers)
        ]
        self.lm = torch.randn(hidden, vocab, generator=g) * 0.05

    def forward(self, bs: int, toks: int | None = None) -> Any:
        t = self.t
        n = max(1, bs)
        ids = t.arange(n) % self.emb.shape[0]
        x = self.emb[ids]
        kv = x.unsqueeze(1).expand(n, self.ctx, x.shape[-1]).contiguous()
        for w in self.layers:
            q = x @ w["q"]
            k = kv @ w["k"]
            v = kv @ w["v"]
            att = t.softmax((k @ q.unsqueeze(-1)).squeeze(-1) / 8.0, dim=-1)
            x = x + (att.unsqueeze(1) @ v).squeeze(1) @ w["o"]
            x = x + t.relu(x @ w["up"]) @ w["down"]
        return t.argmax(x @ self.lm, dim=-1)


class ProfilerManager:
    """SGLang's ``SchedulerProfilerManager`` (non-V2), with the stand-in's write options."""

    def __init__(self, torch: Any, rank: int, cfg: dict[str, Any]) -> None:
        self.torch = torch
        self.rank = rank
        self.cfg = cfg
        self.forward_ct = 0
        self.torch_profiler: Any = None
        self.output_dir: Path | None = None
        self.activities: list[str] | None = None
        self.profile_id: str | None = None
        self.profile_prefix = ""
        self.start_forward_ct: int | None = None
        self.target_forward_ct: int | None = None
        self.prefill_ct: int | None = None
        self.decode_ct: int | None = None
        self.target_prefill_ct: int | None = None
        self.target_decode_ct: int | None = None
        self.profile_by_stage = False
        self.profile_in_progress = False
        self.with_stack: bool | None = None
        self.record_shapes: bool | None = None

    # -- control ----------------------------------------------------------------------------------

    def init_profile(self, r: dict[str, Any]) -> dict[str, Any]:
        if self.profile_in_progress:
            return {"success": False, "message": "Profiling is already in progress. Call /stop_profile first."}
        self.profile_by_stage = bool(r.get("profile_by_stage"))
        output_dir = r.get("output_dir") or os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        self.output_dir = Path(output_dir).expanduser()
        self.with_stack = r.get("with_stack")
        self.record_shapes = r.get("record_shapes")
        acts = r.get("activities")
        self.activities = acts if acts is not None else ["CPU", "GPU"]
        self.profile_id = r.get("profile_id")
        self.profile_prefix = r.get("profile_prefix") or ""
        start_step, num_steps = r.get("start_step"), r.get("num_steps")
        if start_step:
            self.start_forward_ct = max(start_step, self.forward_ct + 1)
        if num_steps:
            if self.profile_by_stage:
                self.prefill_ct = 0
                self.decode_ct = 0
                self.target_prefill_ct = num_steps
                self.target_decode_ct = num_steps
            elif start_step:
                assert self.start_forward_ct is not None
                self.target_forward_ct = self.start_forward_ct + num_steps
            else:
                self.target_forward_ct = self.forward_ct + num_steps + 1
        else:
            self.target_forward_ct = None
        return {"success": True, "message": "Succeeded"}

    def start_profile(self, stage: str | None = None) -> dict[str, Any]:
        torch = self.torch
        log(self.rank, f"Profiling starts{' for ' + stage if stage else ''}. Traces will be saved to: "
                       f"{self.output_dir} (with profile id: {self.profile_id})")
        if self.cfg.get("gpu_trace_from"):  # the recorded trace stands in for this one: nothing to record
            if self.activities:
                self.profile_in_progress = True
            return {"success": True, "message": "Succeeded"}
        acts = [torch.profiler.ProfilerActivity.CPU] if "CPU" in (self.activities or []) else []
        # "GPU" maps to CUDA; this CPU build has none, so it is dropped as SGLang's activity map would
        if acts:
            self.torch_profiler = torch.profiler.profile(
                activities=acts,
                with_stack=self.with_stack if self.with_stack is not None else True,
                record_shapes=self.record_shapes if self.record_shapes is not None else False,
            )
            try:
                self.torch_profiler.start()
            except RuntimeError as e:
                self.torch_profiler = None
                return {"success": False, "message": str(e)}
            self.profile_in_progress = True
        return {"success": True, "message": "Succeeded"}

    def _file_name(self, stage: str | None) -> str:
        parts = [str(self.profile_id), f"TP-{self.rank}"]
        ep = int(self.cfg.get("ep_size") or 1)
        if ep > 1 and not self.cfg.get("old"):
            tp = int(self.cfg["tp_size"])
            parts.append(f"EP-{self.rank // max(1, tp // ep)}")
        prefix = self.profile_prefix + "-" if self.profile_prefix else ""
        return prefix + "-".join(parts) + (f"-{stage}" if stage else "") + ".trace.json.gz"

    def stop_profile(self, stage: str | None = None) -> dict[str, Any]:
        if not self.profile_in_progress:
            return {"success": False, "message": "Profiling is not in progress. Call /start_profile first."}
        assert self.output_dir is not None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        log(self.rank, "Stop profiling" + (f"-{stage}" if stage else "") + "...")
        path = self.output_dir / self._file_name(stage)
        prof, self.torch_profiler = self.torch_profiler, None
        if prof is not None:
            prof.stop()
        if self.rank in self.cfg.get("silent_ranks", ()):
            log(self.rank, f"(silent rank: not writing {path.name})")
        elif self.cfg.get("gpu_trace_from"):
            src = Path(self.cfg["gpu_trace_from"]) / f"fixture-TP-{self.rank}.trace.json.gz"
            self._write_slowly(src, path)
        elif prof is not None:
            if self.cfg.get("write_delay_s"):
                fd, tmp = tempfile.mkstemp(suffix=".trace.json.gz")
                os.close(fd)
                try:
                    prof.export_chrome_trace(tmp)
                    self._write_slowly(Path(tmp), path)
                finally:
                    os.unlink(tmp)
            else:
                prof.export_chrome_trace(str(path))
        log(self.rank, f"Profiling done. Traces are saved to: {self.output_dir}")
        self.profile_in_progress = False
        self.start_forward_ct = None
        return {"success": True, "message": "Succeeded."}

    def _write_slowly(self, src: Path, dst: Path) -> None:
        """Copy ``src`` to ``dst`` in pieces over ``write_delay_s`` (a file being written, as on a busy disk)."""
        delay = float(self.cfg.get("write_delay_s") or 0.0)
        data = src.read_bytes()
        if not delay:
            dst.write_bytes(data)
            return
        pieces = 4
        step = max(1, len(data) // pieces + 1)
        with open(dst, "wb") as f:
            for i in range(0, len(data), step):
                f.write(data[i: i + step])
                f.flush()
                time.sleep(delay / pieces)

    def profile(self, r: dict[str, Any]) -> dict[str, Any]:
        """``SchedulerProfilerManager._profile``: start (arm or start now) or stop."""
        if self.cfg.get("old"):
            return self.old_profile(r)
        if r.get("req_type") == "stop":
            return self.stop_profile()
        if r.get("profile_by_stage") or r.get("start_step"):
            return self.init_profile(r)
        self.init_profile(r)  # SGLang ignores this result on the plain path
        return self.start_profile()

    # -- sglang 0.4.6: no profile_by_stage, no profile_prefix, no start_step ----------------------

    def old_profile(self, r: dict[str, Any]) -> dict[str, Any]:
        if r.get("req_type") == "stop":
            if self.activities is None:
                return {"success": False, "message": "Profiling is not in progress. Call /start_profile first."}
            self.profile_prefix, self.profile_in_progress = "", True
            out = self.stop_profile()
            self.activities = None
            return out
        if self.activities:
            return {"success": False, "message": "Profiling is already in progress. Call /stop_profile first."}
        self.output_dir = Path(r.get("output_dir") or os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
        acts = r.get("activities")
        self.activities = acts if acts is not None else ["CPU", "GPU"]
        self.profile_id, self.profile_prefix = r.get("profile_id"), ""
        self.with_stack, self.record_shapes = r.get("with_stack"), r.get("record_shapes")
        self.start_profile()
        n = r.get("num_steps")
        self.target_forward_ct = self.forward_ct + n if n else None
        return {"success": True, "message": "Succeeded"}

    def predicate(self, mode: str, bs: int) -> None:
        """``_profile_batch_predicate``, run after ``forward_ct += 1`` and before the forward."""
        if self.cfg.get("old"):
            if self.target_forward_ct and self.target_forward_ct <= self.forward_ct and self.activities is not None:
                self.old_profile({"req_type": "stop"})
            return
        if self.profile_by_stage:
            if self.prefill_ct is None or self.decode_ct is None:
                return
            if mode == "EXTEND":
                if self.prefill_ct == 0:
                    self.start_profile("EXTEND")
                self.prefill_ct += 1
                if self.prefill_ct > (self.target_prefill_ct or 0) and self.profile_in_progress:
                    self.stop_profile("EXTEND")
            elif mode == "DECODE":
                if self.decode_ct == 0:
                    if self.profile_in_progress:
                        self.stop_profile("EXTEND")
                    min_bs = int(os.getenv("SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS", "0"))
                    if min_bs > 0 and bs < min_bs:
                        return
                    self.start_profile("DECODE")
                self.decode_ct += 1
                if self.decode_ct > (self.target_decode_ct or 0) and self.profile_in_progress:
                    self.stop_profile("DECODE")
        else:
            if self.target_forward_ct and self.target_forward_ct <= self.forward_ct:
                self.stop_profile()
            if self.start_forward_ct and self.start_forward_ct == self.forward_ct:
                self.start_profile()


def worker_main(rank: int, cfg: dict[str, Any], conn: Any) -> None:
    """Serve batches and profile requests from the main process until told to exit.

    With ``gpu_trace_from`` the rank writes a recorded trace, so it neither loads torch nor runs the model.
    """
    torch: Any = None
    model: TinyDecoder | None = None
    if not cfg.get("gpu_trace_from"):
        import torch

        torch.set_num_threads(1)
        model = TinyDecoder(torch)
        model.forward(4)  # warm-up
        # the first profiler start in a process initialises Kineto (seconds); pay it before serving
        warm = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        warm.start()
        warm.stop()
    pm = ProfilerManager(torch, rank, cfg)
    spans = not cfg.get("old")
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "exit":
            break
        if kind == "batch":
            _, mode, bs, toks = msg
            pm.forward_ct += 1
            pm.predicate(mode, bs)
            if model is None:
                pass
            elif spans:
                name = f"step[{mode} bs={bs}" + (f" toks={toks}" if mode == "EXTEND" else "") + "]"
                with torch.profiler.record_function(name):
                    model.forward(bs, toks)
            else:
                model.forward(bs, toks)
            conn.send(("ok",))
        elif kind == "configure":
            cfg.update(msg[1])
            conn.send(("configure", {"success": True}))
        elif kind == "profile":
            try:
                conn.send(("profile", pm.profile(msg[1])))
            except Exception as e:  # reported like SGLang's failed ProfileReqOutput
                conn.send(("profile", {"success": False, "message": f"{type(e).__name__}: {e}"}))
        elif kind == "state":
            conn.send(("state", {"rank": rank, "forward_ct": pm.forward_ct,
                                 "profile_in_progress": pm.profile_in_progress}))
    if pm.torch_profiler is not None:
        with contextlib.suppress(Exception):
            pm.torch_profiler.stop()
    sys.stderr.flush()
    os._exit(0)  # nothing left to flush; interpreter teardown with Kineto loaded takes seconds


__all__ = ["worker_main", "ProfilerManager", "TinyDecoder"]
