"""Driving decode traffic during a capture.

``--load concurrency=256,input=1024,output=2048`` keeps ``concurrency`` requests in flight, each with
``input`` prompt tokens and ``output`` generated tokens (``ignore_eos``), so the running batch stays
full while the profiler records. Two drivers:

* ``builtin`` (default): an async httpx client posting ``input_ids`` to ``/generate``; needs no tokenizer.
  With ``stream=True`` it streams each response and hands every chunk's arrival time and token count to
  a :class:`StreamRecorder` (what ``traceinspect sweep`` measures); :meth:`BuiltinTraffic.set_concurrency`
  changes the number of requests in flight while it runs.
* ``bench_serving``: ``python -m sglang.bench_serving`` (sglang installed) with ``--dataset-name random-ids``
  and ``--max-concurrency``. ``--request-rate`` is left at its default (inf): ``--request-rate -1``
  with ``--max-concurrency`` crashes bench_serving (``np.random.exponential(1/-1)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from traceinspect.capture.errors import ConfigError

DRIVERS = ("builtin", "bench_serving")
POOL_SIZE = 64  # requests in flight per HTTP client of the builtin driver


@dataclass(frozen=True)
class TrafficSpec:
    """What traffic to drive."""

    concurrency: int = 64
    input: int = 1024
    output: int = 2048
    prompts: int | None = None  # bench_serving --num-prompts (default 5 x concurrency)
    driver: str = "builtin"

    @classmethod
    def parse(cls, text: str) -> TrafficSpec:
        """Parse ``concurrency=256,input=1024,output=2048[,prompts=N][,driver=builtin|bench_serving]``."""
        aliases = {"c": "concurrency", "conc": "concurrency", "in": "input", "input_len": "input",
                   "isl": "input", "out": "output", "output_len": "output", "osl": "output",
                   "num_prompts": "prompts", "n": "prompts"}
        kw: dict[str, Any] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            k, eq, v = part.partition("=")
            k = aliases.get(k.strip().lower().replace("-", "_"), k.strip().lower())
            if not eq or k not in ("concurrency", "input", "output", "prompts", "driver"):
                raise ConfigError(
                    f"bad --load item {part!r}: expected concurrency=N,input=N,output=N[,prompts=N]"
                    "[,driver=builtin|bench_serving]")
            if k == "driver":
                v = v.strip().replace("-", "_")
                if v not in DRIVERS:
                    raise ConfigError(f"unknown load driver {v!r}; use one of {', '.join(DRIVERS)}")
                kw[k] = v
                continue
            try:
                n = int(v)
            except ValueError:
                raise ConfigError(f"--load {k} must be an integer, got {v!r}") from None
            if n < 1:
                raise ConfigError(f"--load {k} must be at least 1, got {n}")
            kw[k] = n
        return cls(**kw)

    def as_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "input": self.input, "output": self.output,
                "prompts": self.prompts, "driver": self.driver}


def bench_serving_module() -> str | None:
    """The importable bench_serving module of the installed sglang, without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    if (root / "benchmark" / "serving.py").is_file():
        return "sglang.benchmark.serving"
    if (root / "bench_serving.py").is_file():
        return "sglang.bench_serving"
    return None


def bench_serving_command(url: str, spec: TrafficSpec, module: str = "sglang.bench_serving",
                          model: str | None = None, tokenizer: str | None = None) -> list[str]:
    """The bench_serving command line for ``spec`` (never ``--request-rate``: see the module doc)."""
    cmd = [
        sys.executable, "-m", module, "--backend", "sglang", "--base-url", url,
        "--dataset-name", "random-ids",
        "--random-input-len", str(spec.input), "--random-output-len", str(spec.output),
        "--random-range-ratio", "1.0",
        "--num-prompts", str(spec.prompts or 5 * spec.concurrency),
        "--max-concurrency", str(spec.concurrency),
        "--disable-tqdm",
    ]
    if model:
        cmd += ["--model", model]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    assert "--request-rate" not in cmd
    return cmd


class TrafficDriver:
    """Common interface: start(), in_flight, error, stop()."""

    name = "none"

    def start(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def in_flight(self) -> int | None:
        return None

    @property
    def error(self) -> str | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}


class StreamRecorder:
    """Arrivals of streamed tokens by this client's own clock (``time.monotonic``), kept while a window is open.

    A chunk carries ``meta_info.completion_tokens`` (the request's tokens so far): the difference to the
    previous chunk is the number of new tokens, all counted at the chunk's arrival. Its gap to the previous
    chunk of the same request, divided by those tokens, is one inter-token latency per token (as
    sglang.bench_serving counts it). Each request's time per output token is taken over its chunks in the
    window after its first one: (last - first arrival) / (tokens between).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._chunks: list[tuple[float, int]] = []
        self._itl: list[tuple[float, int]] = []
        self._done: list[float] = []
        self._spans: dict[int, list[float]] = {}  # request key -> [first t, first n, last t, last n]

    def open(self) -> float:
        """Start recording (forgets an earlier window); returns the start on the monotonic clock."""
        with self._lock:
            self._chunks, self._itl, self._done, self._spans = [], [], [], {}
            self._open = True
            return time.monotonic()

    def close(self) -> dict[str, Any]:
        """Stop recording: ``{end, chunks: [(t, tokens)], itl_s: [(gap per token, tokens)], finished: [t],
        tpot_s: [per request]}``."""
        with self._lock:
            self._open = False
            tpot = [(s[2] - s[0]) / (s[3] - s[1]) for s in self._spans.values() if s[3] > s[1] and s[2] > s[0]]
            return {"end": time.monotonic(), "chunks": self._chunks, "itl_s": self._itl, "finished": self._done,
                    "tpot_s": tpot}

    def recent_rate(self, now: float, span_s: float, min_chunks: int = 16) -> float | None:
        """Tokens per second over the last ``span_s`` seconds of the open window, or over as much longer as
        holds ``min_chunks`` chunks (a few chunks carry too few tokens for a rate); None before that."""
        with self._lock:
            if not self._chunks:
                return None
            times = [t for t, _ in self._chunks]
            i = len(times)
            start = now - span_s
            while i > 0 and (times[i - 1] >= start or len(times) - i < min_chunks):
                i -= 1
            if len(times) - i < min_chunks or i == 0:
                return None  # not enough arrivals yet (the first chunks may predate a steady state)
            first = times[i - 1]
            return sum(n for _, n in self._chunks[i:]) / max(now - first, 1e-9)

    def tokens_between(self, t0: float, t1: float) -> int:
        """Tokens that arrived between two monotonic times of the open window."""
        with self._lock:
            return sum(n for t, n in self._chunks if t0 <= t < t1)

    def chunk(self, key: int, t: float, new: int, total: int, gap_s: float | None, finished: bool) -> None:
        """One chunk of request ``key``: ``new`` tokens arrived at ``t`` (``total`` so far), ``gap_s`` after the
        request's previous chunk (None for its first)."""
        with self._lock:
            if not self._open:
                return
            self._chunks.append((t, new))
            if gap_s is not None:
                self._itl.append((gap_s / new, new))
                span = self._spans.get(key)
                if span is None:
                    self._spans[key] = [t, float(total), t, float(total)]
                else:
                    span[2], span[3] = t, float(total)
            else:  # the first token (prefill): later tokens are timed from it
                self._spans[key] = [t, float(total), t, float(total)]
            if finished:
                self._done.append(t)


@dataclass
class _Counters:
    sent: int = 0
    finished: int = 0
    failed: int = 0
    in_flight: int = 0
    last_error: str | None = None
    statuses: dict[int, int] = field(default_factory=dict)


class BuiltinTraffic(TrafficDriver):
    """Keeps ``concurrency`` ``/generate`` requests in flight from a background thread."""

    name = "builtin"

    def __init__(self, url: str, spec: TrafficSpec, api_key: str | None = None, seed: int = 0,
                 stream: bool = False, recorder: StreamRecorder | None = None) -> None:
        self.url = url
        self.spec = spec
        self.stream = stream or recorder is not None
        self.recorder = recorder
        self._workers: list[asyncio.Task] = []
        self._cancelled: list[asyncio.Task] = []
        self._clients: list[httpx.AsyncClient] = []
        self._keys = 0
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._rng = random.Random(seed)
        self._c = _Counters()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._started = threading.Event()

    def __repr__(self) -> str:
        return f"BuiltinTraffic({self.url!r}, {self.spec!r})"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="traceinspect-load", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            # the streamed responses' line iterators end here, not after the loop is gone
            with contextlib.suppress(RuntimeError):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._stop_event = asyncio.Event()
        try:
            self._resize(self.spec.concurrency)
            self._started.set()
            await self._stop_event.wait()
            self._resize(0)
            await asyncio.gather(*self._cancelled, return_exceptions=True)
        finally:
            for c in self._clients:
                await c.aclose()

    def _client_for(self, i: int) -> httpx.AsyncClient:
        """The client of worker ``i``: one per POOL_SIZE workers, since a connection pool's bookkeeping grows
        with the square of its connections (thousands in one pool take seconds per request)."""
        k = i // POOL_SIZE
        while len(self._clients) <= k:
            limits = httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE)
            timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
            self._clients.append(httpx.AsyncClient(base_url=self.url, headers=self._headers, limits=limits,
                                                   timeout=timeout, trust_env=False))
        return self._clients[k]

    def _resize(self, n: int) -> None:
        """Start or cancel workers (in the event loop) so that ``n`` requests are in flight."""
        while len(self._workers) < n:
            i = len(self._workers)
            self._workers.append(asyncio.create_task(self._worker(self._client_for(i), i)))
        while len(self._workers) > n:
            w = self._workers.pop()
            w.cancel()
            self._cancelled.append(w)

    def set_concurrency(self, n: int, timeout: float = 30.0) -> None:
        """Keep ``n`` requests in flight from now on (the extra ones are cancelled: the server aborts them)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the load is not running")
        self.spec = TrafficSpec(concurrency=n, input=self.spec.input, output=self.spec.output,
                                prompts=self.spec.prompts, driver=self.spec.driver)

        async def resize() -> None:
            self._resize(n)

        asyncio.run_coroutine_threadsafe(resize(), loop).result(timeout)

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        assert self._stop_event is not None
        while not self._stop_event.is_set():
            body = {
                "input_ids": [self._rng.randrange(1000, 10000) for _ in range(self.spec.input)],
                "sampling_params": {"max_new_tokens": self.spec.output, "temperature": 0.0,
                                    "ignore_eos": True},
                "stream": self.stream,
            }
            with self._lock:
                self._c.sent += 1
                self._c.in_flight += 1
            try:
                r = await (self._streamed(client, body) if self.stream else client.post("/generate", json=body))
                with self._lock:
                    self._c.statuses[r.status_code] = self._c.statuses.get(r.status_code, 0) + 1
                    if r.status_code == 200:
                        self._c.finished += 1
                    else:
                        self._c.failed += 1
                        self._c.last_error = f"/generate answered HTTP {r.status_code}"
                if r.status_code != 200:
                    await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                raise
            except httpx.HTTPError as e:
                with self._lock:
                    self._c.failed += 1
                    self._c.last_error = f"/generate failed: {type(e).__name__}"
                await asyncio.sleep(0.5)
            finally:
                with self._lock:
                    self._c.in_flight -= 1

    async def _streamed(self, client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        """POST a streamed /generate and read it to the end, recording each chunk; returns the response."""
        self._keys += 1
        key = self._keys
        rec = self.recorder
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r
            seen, last_t = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                t = time.monotonic()
                try:
                    meta = json.loads(data).get("meta_info") or {}
                    total = int(meta.get("completion_tokens") or 0)
                except (ValueError, TypeError, AttributeError):
                    continue
                new = total - seen
                if new <= 0:
                    continue
                if rec is not None:
                    rec.chunk(key, t, new, total, None if last_t is None else t - last_t,
                              meta.get("finish_reason") is not None)
                seen, last_t = total, t
        return r

    @property
    def in_flight(self) -> int | None:
        with self._lock:
            return self._c.in_flight

    @property
    def failures(self) -> tuple[int, int, str | None]:
        """(finished, failed, last error) so far."""
        with self._lock:
            return self._c.finished, self._c.failed, self._c.last_error

    @property
    def error(self) -> str | None:
        with self._lock:
            # only an error while nothing succeeds: a few failures under a full server are normal
            if self._c.failed >= max(3, self.spec.concurrency) and self._c.finished == 0:
                return self._c.last_error
        return None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"sent": self._c.sent, "finished": self._c.finished, "failed": self._c.failed,
                    "statuses": {str(k): v for k, v in sorted(self._c.statuses.items())}}

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every request (the server aborts them when the connection closes) and join."""
        loop, ev = self._loop, self._stop_event
        if loop is not None and ev is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(ev.set)
        if self._thread is not None:
            self._thread.join(timeout)


class BenchServingTraffic(TrafficDriver):
    """Runs sglang's bench_serving as a subprocess; the API key goes through its environment."""

    name = "bench_serving"

    def __init__(self, url: str, spec: TrafficSpec, api_key: str | None = None,
                 model: str | None = None, tokenizer: str | None = None, log_path: Path | None = None) -> None:
        module = bench_serving_module()
        if module is None:
            raise ConfigError("driver=bench_serving needs sglang installed (pip install sglang); "
                              "or use the builtin driver")
        self.cmd = bench_serving_command(url, spec, module, model=model, tokenizer=tokenizer)
        self._env = dict(os.environ)
        if api_key:
            self._env["OPENAI_API_KEY"] = api_key  # bench_serving sends it as a Bearer token
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> None:
        out = subprocess.DEVNULL
        if self._log_path is not None:
            self._log = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop()
            out = self._log
        self._proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self._env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def error(self) -> str | None:
        if self._proc is not None and self._proc.poll() is not None:
            return f"bench_serving exited with code {self._proc.returncode}"
        return None

    def stats(self) -> dict[str, Any]:
        rc = self._proc.poll() if self._proc is not None else None
        return {"command": self.cmd, "returncode": rc}

    def stop(self, timeout: float = 10.0) -> None:
        p = self._proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None


def make_driver(url: str, spec: TrafficSpec, api_key: str | None = None, model: str | None = None,
                tokenizer: str | None = None, log_path: Path | None = None) -> TrafficDriver:
    """The driver ``spec.driver`` names."""
    if spec.driver == "bench_serving":
        return BenchServingTraffic(url, spec, api_key=api_key, model=model, tokenizer=tokenizer, log_path=log_path)
    return BuiltinTraffic(url, spec, api_key=api_key)


def wait_for_batch(read_running: Any, target: int, timeout_s: float, driver: TrafficDriver | None = None,
                   poll_s: float = 0.5, progress: Any = None) -> tuple[int | None, float, str | None]:
    """Wait until the server's running batch reaches ``target``.

    ``read_running()`` returns the running request count or None when the server doesn't report it
    (then the driver's in-flight count stands in). Returns ``(last count, seconds waited, problem)``.
    """
    t0 = time.monotonic()
    last: int | None = None
    while True:
        n = read_running()
        source = "server"
        if n is None and driver is not None:
            n, source = driver.in_flight, "client"
        last = n
        if progress is not None:
            progress(n, target, source)
        if n is not None and n >= target:
            return n, time.monotonic() - t0, None
        if driver is not None and driver.error:
            return n, time.monotonic() - t0, driver.error
        if time.monotonic() - t0 >= timeout_s:
            return last, time.monotonic() - t0, "timeout"
        time.sleep(poll_s)
