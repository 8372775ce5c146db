"""A stand-in for an SGLang 0.5.23 HTTP server, for testing ``traceinspect capture`` without a GPU.

Same endpoints, request and response shapes as sglang's ``http_server.py``: ``/server_info``,
``/get_server_info``, ``/model_info``, ``/get_model_info``, ``/health``, ``/health_generate``, ``/ready``,
``/generate``, ``/v1/loads``, ``/start_profile`` and ``/stop_profile`` (GET or POST, a ``ProfileReq``
body), Bearer API-key auth with SGLang's auth levels, and SGLang's quirks: ``/start_profile`` returns as
soon as the profiler is armed, a second profile fails inside the tokenizer manager with a
``RuntimeError`` that reaches the client as ``500 Internal Server Error``.

Each simulated TP rank is a process (:mod:`.worker`) running a tiny torch decoder on the CPU once per
scheduler batch, so trace files appear only after N steps of real traffic. Options simulate old
releases (``old``: no ``/server_info``, ``/model_info``, ``/v1/loads`` nor step spans), ranks that never
write (``silent_ranks``), slow writers and a forbidden profiling endpoint. ``gpu_trace_from`` makes each
rank write a pre-recorded real GPU trace (``fixture-TP-<r>.trace.json.gz``) instead of its CPU trace.

For load sweeps: ``/generate`` streams (``stream: true``, SGLang's ``data: {...}`` lines with cumulative
``text`` and ``meta_info.completion_tokens``, every ``stream_interval`` tokens, then ``data: [DONE]``); a
batch takes ``step_ms + step_us_per_req x batch`` (a fake forward whose time grows with the batch), the
running batch is capped by ``max_running_requests`` and the KV pool; ``experts``/``top_k`` put a MoE
model config into ``/model_info``; ``die_at_running`` ends the server the first time its running batch
reaches that size; ``/standin/tokens?since=T&until=T`` counts the output tokens it wrote to clients between
two wall-clock times; ``enable_mixed_chunk`` decodes the running requests in the batches that admit new ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

VERSION = "0.5.23"
OLD_VERSION = "0.4.6.post5"
WORDS = ("the", "decode", "step", "runs", "on", "every", "rank", "and", "writes", "a", "trace", "file")


@dataclass
class StandinConfig:
    """How the stand-in behaves."""

    host: str = "127.0.0.1"
    port: int = 0
    tp_size: int = 2
    ep_size: int = 1
    api_key: str | None = None
    admin_api_key: str | None = None
    old: bool = False
    silent_ranks: tuple[int, ...] = ()
    gpu_trace_from: str | None = None
    forbid_profile: bool = False
    write_delay_s: float = 0.0
    tick_s: float = 0.01
    max_running_requests: int = 128
    max_total_num_tokens: int = 1 << 20
    model_path: str = "standin/tiny-decoder"
    port_file: str | None = None
    extra_server_info: dict[str, Any] = field(default_factory=dict)
    extra_model_info: dict[str, Any] = field(default_factory=dict)
    step_ms: float = 0.0  # fixed time of a batch
    step_us_per_req: float = 0.0  # plus this per request in the batch
    stream_interval: int = 1  # SGLang --stream-interval: a streamed chunk every N tokens
    num_continuous_decode_steps: int = 1  # reported only: it changes nothing here
    experts: int | None = None  # MoE config in /model_info (n_routed_experts, num_experts_per_tok)
    top_k: int | None = None
    die_at_running: int | None = None  # exit (as a crash) once the running batch reaches this size
    enable_mixed_chunk: bool = False  # SGLang --enable-mixed-chunk: a prefill batch also decodes the running ones
    max_prefill_tokens: int = 16384  # prompt tokens one prefill batch admits (SGLang --max-prefill-tokens)
    pinned: tuple[str, ...] = ()  # fields given on the command line: a recorded set's values do not replace them


@dataclass
class Req:
    rid: str
    input_len: int
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    out: int = 0
    created: float = field(default_factory=time.time)
    aborted: bool = False
    stream: Any = None  # asyncio.Queue of (tokens so far, finished) for a streamed request
    sent: int = 0  # tokens written to the client so far


class Scheduler:
    """The batch loop: admit waiting requests (one EXTEND batch), else one DECODE step for all running.

    Every batch and every profile request goes to all rank processes, which answer before the loop
    moves on (SGLang's ranks run in lock step). With no request there is no batch, so no step.
    """

    def __init__(self, cfg: StandinConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.control: list[tuple[tuple, Any]] = []
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.forward_ct = 0
        self.generated = 0
        self.gen_throughput = 0.0
        self.calls: dict[str, int] = {"start_profile": 0, "stop_profile": 0}
        # (wall time, output tokens) of each streamed chunk or response written to a client
        self.history: collections.deque = collections.deque(maxlen=1_000_000)

    def start_workers(self) -> None:
        from .worker import worker_main

        ctx = mp.get_context("spawn")
        wcfg = {"tp_size": self.cfg.tp_size, "ep_size": self.cfg.ep_size, "old": self.cfg.old,
                "silent_ranks": tuple(self.cfg.silent_ranks), "gpu_trace_from": self.cfg.gpu_trace_from,
                "write_delay_s": self.cfg.write_delay_s}
        for r in range(self.cfg.tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, wcfg, child), daemon=True, name=f"standin-TP{r}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120):
                raise RuntimeError("a stand-in rank did not start")
            c.recv()
        self.thread = threading.Thread(target=self._loop, name="standin-scheduler", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(10)
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("exit",))
        for p in self.procs:
            p.join(3)
            if p.is_alive():
                p.terminate()
                p.join(3)

    def _all(self, msg: tuple) -> list[Any]:
        for c in self.conns:
            c.send(msg)
        return [c.recv() for c in self.conns]

    # -- called from the HTTP loop ----------------------------------------------------------------

    def submit(self, req: Req) -> None:
        with self.lock:
            self.waiting.append(req)

    def profile(self, body: dict[str, Any]) -> Any:
        """Queue a profile request; returns a concurrent future with rank 0's ``ProfileReqOutput``."""
        return self._control(("profile", body))

    def configure(self, changes: dict[str, Any]) -> Any:
        """Change rank behaviour (``silent_ranks``, ``write_delay_s``) between batches."""
        return self._control(("configure", changes))

    def _control(self, msg: tuple) -> Any:
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.control.append((msg, fut))
        return fut

    def loads(self) -> dict[str, Any]:
        with self.lock:
            running, waiting = list(self.running), list(self.waiting)
        used = sum(r.input_len + r.out for r in running)
        return {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
            "num_waiting_uncached_tokens": sum(r.input_len for r in waiting),
            "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.cfg.max_total_num_tokens,
            "max_running_requests": self.cfg.max_running_requests,
            "token_usage": round(used / self.cfg.max_total_num_tokens, 4),
            "gen_throughput": round(self.gen_throughput, 2), "cache_hit_rate": 0.0,
            "utilization": round(len(running) / self.cfg.max_running_requests, 4),
            "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
        }

    # -- the scheduler thread ---------------------------------------------------------------------

    def _finish(self, req: Req) -> None:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(req.out))
        ids = [(17 * i) % 512 for i in range(req.out)]
        out = {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": req.rid,
                "finish_reason": {"type": "length", "length": req.out},
                "prompt_tokens": req.input_len,
                "weight_version": "default",
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": req.out,
                "cached_tokens": 0,
                "e2e_latency": time.time() - req.created,
            },
        }

        def resolve() -> None:
            if not req.future.done():
                req.future.set_result(out)

        with contextlib.suppress(RuntimeError):
            req.loop.call_soon_threadsafe(resolve)

    def _deliver(self, items: list[tuple[Req, int, bool]]) -> None:
        """Hand streamed chunks to their handlers: one wake-up of each event loop per batch."""
        by_loop: dict[Any, list[tuple[Req, int, bool]]] = {}
        for it in items:
            by_loop.setdefault(it[0].loop, []).append(it)

        def put(batch: list[tuple[Req, int, bool]]) -> None:
            for r, n, done in batch:
                r.stream.put_nowait((n, done))

        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(put, batch)

    def _die(self) -> None:
        """End like a crashed server: the ranks and this process go at once, connections are reset."""
        print(f"standin: dying at a running batch of {len(self.running)} (die_at_running)", file=sys.stderr,
              flush=True)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.kill()
        os._exit(3)

    def tokens_between(self, since: float, until: float) -> dict[str, Any]:
        """Output tokens written to clients (streamed chunks, whole responses) between two wall-clock times."""
        hist = list(self.history)
        sel = [n for t, n in hist if since <= t < until]
        return {"tokens": sum(sel), "batches": len(sel), "since": since, "until": until,
                "oldest": hist[0][0] if hist else None}

    def _form_batch(self) -> tuple[str, int, int, list[Req]] | None:
        with self.lock:
            self.waiting = [r for r in self.waiting if not r.aborted]
            self.running = [r for r in self.running if not r.aborted]
            admit: list[Req] = []
            used = sum(r.input_len + r.out for r in self.running)
            while self.waiting and len(self.running) + len(admit) < self.cfg.max_running_requests:
                nxt = self.waiting[0]
                if used + nxt.input_len > self.cfg.max_total_num_tokens and (self.running or admit):
                    break
                if admit and sum(r.input_len for r in admit) + nxt.input_len > self.cfg.max_prefill_tokens:
                    break
                admit.append(self.waiting.pop(0))
                used += nxt.input_len
            if admit:
                decoding = list(self.running) if self.cfg.enable_mixed_chunk else []
                self.running.extend(admit)
                toks = sum(r.input_len for r in admit) + len(decoding)
                return ("MIXED" if decoding else "EXTEND"), len(admit) + len(decoding), toks, decoding + admit
            if self.running:
                return "DECODE", len(self.running), len(self.running), list(self.running)
        return None

    def _handle_control(self) -> None:
        with self.lock:
            items, self.control = self.control, []
        for msg, fut in items:
            replies = self._all(msg)
            fut.set_result(replies[0][1])

    def _loop(self) -> None:
        last_t, last_gen = time.monotonic(), 0
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            self._handle_control()
            batch = self._form_batch()
            if batch is None:
                time.sleep(self.cfg.tick_s)
                continue
            mode, bs, toks, reqs = batch
            self.forward_ct += 1
            if self.cfg.die_at_running and len(self.running) >= self.cfg.die_at_running:
                self._die()
            self._all(("batch", mode, bs, toks))
            # the fake forward: its time grows with the batch
            fake = self.cfg.step_ms / 1e3 + self.cfg.step_us_per_req * bs / 1e6
            if fake > 0:
                time.sleep(max(0.0, fake - (time.monotonic() - t0)))
            streamed: list[tuple[Req, int, bool]] = []
            for r in reqs:
                r.out += 1  # prefill yields the first token, each decode step one more
                self.generated += 1
                done = r.out >= r.max_new_tokens
                if r.stream is not None and (done or r.out == 1 or r.out % self.cfg.stream_interval == 0):
                    streamed.append((r, r.out, done))
                if done:
                    with self.lock:
                        if r in self.running:
                            self.running.remove(r)
                    if r.stream is None:
                        self._finish(r)
            if streamed:
                self._deliver(streamed)
            now = time.monotonic()
            if now - last_t >= 1.0:
                self.gen_throughput = (self.generated - last_gen) / (now - last_t)
                last_t, last_gen = now, self.generated
            time.sleep(max(0.0, self.cfg.tick_s - (time.monotonic() - t0)))


# -- HTTP -------------------------------------------------------------------------------------------

NORMAL, ADMIN_OPTIONAL = "normal", "admin_optional"
ADMIN_PATHS = {"/start_profile", "/stop_profile"}


def _bearer_ok(header: str | None, expected: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)


def decide(cfg: StandinConfig, method: str, path: str, header: str | None) -> tuple[bool, int]:
    """sglang.srt.utils.auth.decide_request_auth for NORMAL and ADMIN_OPTIONAL endpoints."""
    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True, 200
    level = ADMIN_OPTIONAL if path in ADMIN_PATHS else NORMAL
    if level == ADMIN_OPTIONAL:
        if cfg.admin_api_key:
            return _bearer_ok(header, cfg.admin_api_key), 401
        if cfg.api_key:
            return _bearer_ok(header, cfg.api_key), 401
        return True, 200
    if cfg.api_key:
        return _bearer_ok(header, cfg.api_key), 401
    return True, 200


def _server_args(cfg: StandinConfig) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "tokenizer_mode": "auto",
        "load_format": "dummy", "dtype": "float32", "device": "cpu", "served_model_name": cfg.model_path,
        "host": cfg.host, "port": cfg.port, "api_key": cfg.api_key, "admin_api_key": cfg.admin_api_key,
        "tp_size": cfg.tp_size, "dp_size": 1, "attn_dp_size": 1, "ep_size": cfg.ep_size, "pp_size": 1,
        "moe_dp_size": 1, "enable_dp_attention": False, "quantization": None, "kv_cache_dtype": "auto",
        "page_size": 1, "context_length": 4096, "mem_fraction_static": 0.8,
        "max_running_requests": cfg.max_running_requests, "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": 8192, "enable_mixed_chunk": cfg.enable_mixed_chunk, "cuda_graph_max_bs": 256, "disable_cuda_graph": True,
        "attention_backend": "torch_native", "decode_attention_backend": None,
        "prefill_attention_backend": None, "sampling_backend": "pytorch", "moe_runner_backend": "auto",
        "moe_a2a_backend": "none", "fp8_gemm_runner_backend": "auto", "fp4_gemm_runner_backend": "auto",
        "disable_custom_all_reduce": False, "enable_torch_compile": False, "speculative_algorithm": None,
        "num_continuous_decode_steps": cfg.num_continuous_decode_steps, "stream_interval": cfg.stream_interval,
        "schedule_policy": "fcfs", "random_seed": 0,
        "enable_metrics": False, "log_level": "info", "skip_server_warmup": True,
    }
    if cfg.step_ms or cfg.step_us_per_req:  # the stand-in's fake forward time, a configuration like any other
        args["standin_step_ms"] = cfg.step_ms
        args["standin_step_us_per_req"] = cfg.step_us_per_req
    args.update(cfg.extra_server_info)
    return args


def server_info(cfg: StandinConfig, sched: Scheduler, startup_time: float) -> dict[str, Any]:
    args = _server_args(cfg)
    launch = f"python -m sglang.launch_server --model-path {cfg.model_path} --tp-size {cfg.tp_size}"
    if cfg.api_key:
        launch += " --api-key <redacted>"  # sglang redacts secrets in launch_command (not in api_key)
    state = {
        **args, "world_size": cfg.tp_size, "startup_time": startup_time,
        "effective_max_running_requests_per_dp": cfg.max_running_requests,
        "last_gen_throughput": round(sched.gen_throughput, 2),
        "memory_usage": {"weight": 0.01, "kvcache": 0.02, "token_capacity": cfg.max_total_num_tokens,
                         "graph": {"decode": 0.0, "target_verify": 0.0, "draft_decode": 0.0,
                                   "draft_extend": 0.0}},
    }
    info = {
        **args, "launch_command": launch, "status": "ready",
        "max_total_num_tokens": cfg.max_total_num_tokens, "max_req_input_len": 4090,
        "startup_time": startup_time, "kv_events": None,
        "internal_states": [state], "version": OLD_VERSION if cfg.old else VERSION, "frontend": "python",
    }
    if cfg.old:
        for k in ("attn_dp_size", "moe_dp_size", "fp4_gemm_runner_backend", "launch_command", "kv_events",
                  "frontend", "status", "max_req_input_len"):
            info.pop(k, None)
            state.pop(k, None)
    return info


def model_info(cfg: StandinConfig) -> dict[str, Any]:
    if cfg.old:
        return {"model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "is_generation": True}
    info = {
        "model_path": cfg.model_path, "served_model_name": cfg.model_path, "tokenizer_path": cfg.model_path,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "load_format": "dummy", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    }
    info.update(cfg.extra_model_info)
    if cfg.experts and cfg.top_k:  # given on the command line: over a recorded set's
        info.update({"n_routed_experts": cfg.experts, "num_experts_per_tok": cfg.top_k})
        info.setdefault("num_hidden_layers", 2)
    return info


_BOOL_FIELDS = ("profile_by_stage", "merge_profiles", "detailed_annotations")
_OPT_BOOL = ("with_stack", "record_shapes")


def parse_profile_req(body: Any) -> dict[str, Any]:
    """Validate a ``ProfileReq`` body as pydantic/msgspec would (``num_steps: "5"`` is coerced)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ValueError("body must be an object")
    out: dict[str, Any] = {"req_type": "start"}
    for k in ("output_dir", "profile_id", "profile_prefix"):
        v = body.get(k)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{k}: Input should be a valid string")
        out[k] = v
    for k in ("start_step", "num_steps"):
        v = body.get(k)
        if v is not None:
            try:
                v = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"{k}: Input should be a valid integer") from None
        out[k] = v
    for k in _BOOL_FIELDS:
        v = body.get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"{k}: Input should be a valid boolean")
        out[k] = v
    for k in _OPT_BOOL:
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{k}: Input should be a valid boolean")
        out[k] = v
    for k in ("activities", "profile_stages"):
        v = body.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ValueError(f"{k}: Input should be a valid list of strings")
        out[k] = v
    return out


def _error_400(message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                              "code": 400}, status=400)


def _internal_error(message: str) -> web.Response:
    # the tokenizer manager raises RuntimeError(message); nothing catches it, so Starlette answers this
    print(f"ERROR: Exception in ASGI application\nRuntimeError: {message}", file=sys.stderr, flush=True)
    return web.Response(status=500, text="Internal Server Error")


def build_app(cfg: StandinConfig, sched: Scheduler) -> web.Application:
    startup_time = time.time()

    @web.middleware
    async def auth_mw(request: web.Request, handler: Any) -> web.StreamResponse:
        allowed, status = decide(cfg, request.method, request.path, request.headers.get("Authorization"))
        if not allowed:
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)

    app = web.Application(middlewares=[auth_mw], client_max_size=64 << 20)
    r = app.router

    async def health(_: web.Request) -> web.Response:
        alive = all(p.is_alive() for p in sched.procs)
        return web.Response(status=200 if alive else 503)

    async def get_server_info(_: web.Request) -> web.Response:
        return web.json_response(server_info(cfg, sched, startup_time))

    async def get_model_info(_: web.Request) -> web.Response:
        return web.json_response(model_info(cfg))

    async def loads(request: web.Request) -> web.Response:
        return web.json_response({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": VERSION,
            "accelerator": None, "num_accelerators": cfg.tp_size, "loads": [sched.loads()],
        })

    async def generate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error_400("Invalid JSON body")
        if not isinstance(body, dict):
            return _error_400("Request body must be a JSON object")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            return web.json_response({"error": "Either text or input_ids should be provided."}, status=400)
        stream = bool(body.get("stream"))
        batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        items = (text if isinstance(text, list) else [text]) if text is not None else (ids if batch else [ids])
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(items)
        loop = asyncio.get_running_loop()
        reqs: list[Req] = []
        rid = body.get("rid")
        for i, item in enumerate(items):
            n_in = max(1, len(str(item).split())) if text is not None else max(1, len(item))
            try:
                max_new = int((sps[i] or {}).get("max_new_tokens", 128))
            except (TypeError, ValueError):
                return _error_400("sampling_params.max_new_tokens must be an integer")
            if max_new < 1:
                return _error_400("max_new_tokens must be at least 1")
            req_id = (rid[i] if isinstance(rid, list) else rid) if rid else uuid.uuid4().hex
            reqs.append(Req(rid=str(req_id), input_len=n_in, max_new_tokens=max_new, loop=loop,
                            future=loop.create_future(), stream=asyncio.Queue() if stream else None))
        if stream:
            if len(reqs) != 1:
                return _error_400("streaming takes one prompt per request")
            return await _stream(request, reqs[0])
        for q in reqs:
            sched.submit(q)
        try:
            outs = await asyncio.gather(*(q.future for q in reqs))
        except asyncio.CancelledError:
            for q in reqs:
                q.aborted = True  # the client went away: abort, as SGLang does
            raise
        sched.history.append((time.time(), sum(q.out for q in reqs)))
        return web.json_response(outs if batch else outs[0])

    async def _stream(request: web.Request, q: Req) -> web.StreamResponse:
        """SGLang's streamed /generate: ``data: {text, output_ids, meta_info}`` lines, then ``data: [DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sched.submit(q)
        try:
            while True:
                n, done = await q.stream.get()
                chunk = {
                    "text": " ".join(WORDS[i % len(WORDS)] for i in range(n)),
                    "output_ids": [(17 * i) % 512 for i in range(n)],
                    "meta_info": {"id": q.rid, "finish_reason": {"type": "length", "length": n} if done else None,
                                  "prompt_tokens": q.input_len, "completion_tokens": n, "cached_tokens": 0},
                }
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                sched.history.append((time.time(), n - q.sent))
                q.sent = n
                if done:
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            q.aborted = True
            raise
        return resp

    async def start_profile(request: web.Request) -> web.Response:
        if cfg.forbid_profile:
            return web.json_response({"error": "Forbidden"}, status=403)
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
            req = parse_profile_req(body)
        except ValueError as e:
            return _error_400(str(e))
        sched.calls["start_profile"] += 1
        # tokenizer_control_mixin.start_profile defaults
        env_stack = os.getenv("SGLANG_PROFILE_WITH_STACK", "true").lower() in ("1", "true", "yes")
        req["with_stack"] = not (req["with_stack"] is False or not env_stack)
        env_shapes = os.getenv("SGLANG_PROFILE_RECORD_SHAPES", "true").lower() in ("1", "true", "yes")
        req["record_shapes"] = (req["record_shapes"] is not False) and env_shapes
        req["profile_id"] = req["profile_id"] or str(time.time())
        result = await asyncio.wrap_future(sched.profile(req))
        if not result["success"]:
            return _internal_error(result["message"])
        return web.Response(text="Start profiling.\n")

    async def stop_profile(_: web.Request) -> web.Response:
        if cfg.forbid_profile:
            return web.json_response({"error": "Forbidden"}, status=403)
        sched.calls["stop_profile"] += 1
        result = await asyncio.wrap_future(sched.profile({"req_type": "stop"}))
        if not result["success"]:
            return _internal_error(result["message"])
        return web.Response(text="Stop profiling. This will take some time.\n")

    async def standin_configure(request: web.Request) -> web.Response:
        """Test hook (not an SGLang endpoint): ``{"silent_ranks": [1], "forbid_profile": true, ...}``."""
        body = await request.json()
        if "forbid_profile" in body:
            cfg.forbid_profile = bool(body["forbid_profile"])
        ranks = {k: body[k] for k in ("silent_ranks", "write_delay_s") if k in body}
        if ranks:
            await asyncio.wrap_future(sched.configure(ranks))
        return web.json_response({"ok": True})

    async def standin_state(_: web.Request) -> web.Response:
        return web.json_response({"forward_ct": sched.forward_ct, "calls": sched.calls,
                                  "running": len(sched.running), "waiting": len(sched.waiting)})

    r.add_get("/health", health)
    r.add_get("/health_generate", health)
    r.add_get("/ready", health)
    if not cfg.old:
        r.add_get("/server_info", get_server_info)
        r.add_get("/model_info", get_model_info)
        r.add_get("/v1/loads", loads)
    r.add_get("/get_server_info", get_server_info)
    r.add_get("/get_model_info", get_model_info)
    r.add_route("POST", "/generate", generate)
    r.add_route("PUT", "/generate", generate)
    for path, h in (("/start_profile", start_profile), ("/stop_profile", stop_profile)):
        r.add_route("GET", path, h)
        r.add_route("POST", path, h)
    async def standin_tokens(request: web.Request) -> web.Response:
        """Test hook: tokens generated between ``since`` and ``until`` (wall-clock seconds)."""
        since = float(request.query.get("since", "0"))
        until = float(request.query.get("until", str(time.time())))
        return web.json_response(sched.tokens_between(since, until))

    r.add_get("/standin/tokens", standin_tokens)
    r.add_get("/standin/state", standin_state)
    r.add_post("/standin/configure", standin_configure)
    return app


def overlay_fixture(cfg: StandinConfig) -> None:
    """With ``gpu_trace_from``: serve the recorded set's configuration (tp_size, KV pool, backends)."""
    if not cfg.gpu_trace_from:
        return
    d = Path(cfg.gpu_trace_from)
    ranks = sorted(d.glob("fixture-TP-*.trace.json.gz"))
    if not ranks:
        raise SystemExit(f"{d}: no fixture-TP-<r>.trace.json.gz files")
    cfg.tp_size = len(ranks)
    si = d / "server_info.json"
    if si.is_file():
        data = json.loads(si.read_text())
        mi = data.pop("model_info", None)
        for k in ("tp_size", "dp_size", "pp_size", "ep_size"):
            data.pop(k, None)
        for key in cfg.pinned:
            data.pop(key, None)
        cfg.extra_server_info = {**data, **cfg.extra_server_info}
        if isinstance(mi, dict):
            cfg.extra_model_info = {**mi, **cfg.extra_model_info}
        for key in ("max_total_num_tokens", "max_running_requests"):
            if isinstance(data.get(key), int) and data[key] > 0 and key not in cfg.pinned:
                setattr(cfg, key, max(data[key], 1))


async def serve(cfg: StandinConfig) -> None:
    overlay_fixture(cfg)
    sched = Scheduler(cfg)
    await asyncio.get_running_loop().run_in_executor(None, sched.start_workers)
    app = build_app(cfg, sched)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg.port = port
    if cfg.port_file:
        tmp = cfg.port_file + ".tmp"
        Path(tmp).write_text(str(port))
        os.replace(tmp, cfg.port_file)
    print(f"standin sglang {cfg.tp_size} ranks ready on http://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        t0 = time.monotonic()
        await runner.cleanup()
        t1 = time.monotonic()
        await loop.run_in_executor(None, sched.shutdown)
        print(f"standin stopped: http {t1 - t0:.2f} s, ranks {time.monotonic() - t1:.2f} s", file=sys.stderr,
              flush=True)
