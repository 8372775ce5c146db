"""``traceinspect capture`` against a stand-in SGLang server (tests/standin_sglang), plus unit tests.

The stand-in profiles a tiny CPU model with torch, one process per simulated rank, so these tests
need torch; they are skipped without it. CPU traces hold no GPU kernels, so the analyzer refuses
them; the end-to-end ``--analyze`` test serves recorded GPU traces instead (``--gpu-trace-from``).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import cli_popen

from traceinspect.capture.errors import ConfigError
from traceinspect.capture.layout import check_prefix, redact, redact_argv
from traceinspect.capture.traffic import TrafficSpec, bench_serving_command
from traceinspect.capture.wait import RankWatcher, check_complete, expected_ranks

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GPU_FIXTURE = ROOT / "fixtures" / "kv-gather-cast-eager"
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_AIOHTTP = importlib.util.find_spec("aiohttp") is not None
needs_standin = pytest.mark.skipif(
    not (HAS_TORCH and HAS_AIOHTTP),
    reason="the stand-in SGLang server needs torch (CPU build) and aiohttp: pip install torch aiohttp")

SECRET = "sk-standin-Zq81xLw0"
ADMIN_SECRET = "sk-admin-Pp40vTy7"
LOAD = "concurrency=6,input=16,output=4000"  # requests outlive a capture: no prefill churn mid-window
# Every wait below is for a condition (a file complete, a count reached); these bounds only end a hung test,
# and a loaded machine (two cores, stand-in ranks profiling torch) makes nothing here fail, only slower.
SAFETY_S = 600  # pytest's timeout of a test that talks to the stand-ins
CAPTURE_TIMEOUT = "120"  # `capture --timeout` where the capture must complete
WAIT_S = 120.0  # waits for a condition


# -- the stand-in servers ---------------------------------------------------------------------------

class Standin:
    """A running ``python -m standin_sglang`` subprocess."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.port_file = workdir / f"{name}.port"
        self.log = workdir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        self._logf = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "standin_sglang", "--port-file", str(self.port_file), *args],
            cwd=TESTS, env=env, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = ""

    def wait_ready(self, deadline: float) -> None:
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stand-in {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port_file.read_text().strip()}"

    def state(self, key: str | None = None) -> dict:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/standin/state", headers=h, timeout=5).json()

    @contextlib.contextmanager
    def configured(self, **changes: object) -> Iterator[Standin]:
        """Change the stand-in's behaviour for one test (silent_ranks, forbid_profile)."""
        undo = {"silent_ranks": [], "forbid_profile": False}
        httpx.post(self.url + "/standin/configure", json=changes, timeout=10).raise_for_status()
        try:
            yield self
        finally:
            httpx.post(self.url + "/standin/configure", json={k: undo[k] for k in changes},
                       timeout=10).raise_for_status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.reap()

    def reap(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._logf.close()


SERVERS = {
    "main": ["--tp", "2"],
    "keyed": ["--tp", "1", "--api-key", SECRET, "--admin-api-key", ADMIN_SECRET],
    "old": ["--tp", "1", "--old"],
}
if sorted(GPU_FIXTURE.glob("fixture-TP-*.trace.json.gz")):
    SERVERS["gpu"] = ["--gpu-trace-from", str(GPU_FIXTURE)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Standin]]:
    """All stand-ins at once (started in parallel: each rank process imports torch)."""
    if not (HAS_TORCH and HAS_AIOHTTP):
        pytest.skip("the stand-in SGLang server needs torch and aiohttp")
    work = tmp_path_factory.mktemp("standin")
    started = {name: Standin(name, args, work) for name, args in SERVERS.items()}
    try:
        deadline = time.monotonic() + 300
        for s in started.values():
            s.wait_ready(deadline)
        yield started
    finally:
        for s in started.values():
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in started.values():
            s.reap()


def _wait_for(cond: Callable[[], object], what: str = "", poll_s: float = 0.05) -> None:
    """Poll ``cond`` until it holds; WAIT_S is only a bound on a hung wait."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting after {WAIT_S:.0f} s {what}"
        time.sleep(poll_s)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRACEINSPECT_API_KEY"}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run([sys.executable, "-m", "traceinspect", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def capture_args(url: str, out: Path, *extra: str, steps: int = 3, load: str | None = LOAD) -> list[str]:
    args = ["capture", "--url", url, "--out", str(out), "--steps", str(steps), "--ramp-timeout", CAPTURE_TIMEOUT]
    if load:
        args += ["--load", load]
    return args + list(extra)


def traces(d: Path) -> list[Path]:
    return sorted(d.glob("*.trace.json.gz"))


def step_spans(path: Path) -> list[str]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    return [e["name"] for e in data["traceEvents"] if str(e.get("name", "")).startswith("step[")]


def no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr, p.stderr


# -- the full capture path ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_capture(servers: dict[str, Standin], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("full") / "cap"
    p = run_cli(*capture_args(servers["main"].url, out, "--timeout", CAPTURE_TIMEOUT))
    assert p.returncode == 0, p.stderr
    return out, Path(p.stdout.strip())


@pytest.mark.timeout(SAFETY_S)
def test_full_capture_writes_every_rank_and_metadata(full_capture: tuple[Path, Path]) -> None:
    out, printed = full_capture
    assert printed == out.resolve()
    files = traces(out)
    assert [f.name.split("-TP-")[1] for f in files] == ["0-DECODE.trace.json.gz", "1-DECODE.trace.json.gz"]
    for f in files:
        assert check_complete(f) is None
        assert step_spans(f) == ["step[DECODE bs=6]"] * 3  # exactly num_steps decode batches, full batch

    info = json.loads((out / "server_info.json").read_text())
    for key in ("tp_size", "dp_size", "ep_size", "pp_size", "model_path", "quantization", "kv_cache_dtype",
                "max_total_num_tokens", "attention_backend", "moe_runner_backend", "max_running_requests",
                "cuda_graph_max_bs", "internal_states", "version"):
        assert key in info, key
    assert info["tp_size"] == 2 and info["model_info"]["architectures"] == ["LlamaForCausalLM"]

    cap = json.loads((out / "capture.json").read_text())
    assert cap["status"] == "complete" and cap["reason"] is None
    assert cap["expected_ranks"] == ["TP-0", "TP-1"] and cap["missing_ranks"] == []
    assert {f["name"] for f in cap["files"]} == {f.name for f in files}
    assert all(f["complete"] and len(f["sha256"]) == 64 for f in cap["files"])
    req = cap["profile_request"]
    assert req["profile_by_stage"] is True and req["num_steps"] == 3 and req["output_dir"] == str(out.resolve())
    assert all(f.name.startswith(f"traceinspect-{cap['profile_id']}-TP-") for f in files)
    assert cap["profiler_reset"] == "ok"
    assert cap["running_batch_at_start"] == 6 and set(cap["timings_s"]) >= {"ramp", "start_profile", "wait"}
    load = cap["server_load"]  # the server's load in the profile window, as /v1/loads reported it
    ats = [s["at"] for s in load["samples"]]
    assert ats[0] == "start" and ats[-1] == "end" and "problem" not in load
    assert load["samples"][0]["t_s"] <= 0 <= load["samples"][-1]["t_s"]
    for s in load["samples"]:
        assert s["source"] == "/v1/loads" and s["running"] == 6 and s["used_tokens"] > 0
        assert s["max_total_num_tokens"] == info["max_total_num_tokens"]


@pytest.mark.timeout(SAFETY_S)
def test_capture_saves_the_model_config(servers: dict[str, Standin], tmp_path: Path) -> None:
    """SGLang's /server_info and /model_info have no layer count: a local server's model config
    (here from the Hugging Face cache) goes into server_info.json's model_config block, and the
    analysis takes its layers from there."""
    hub = tmp_path / "hub"
    snap = hub / "models--standin--tiny-decoder" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512,
                                                  "model_type": "llama", "rope_scaling": None}))
    out = tmp_path / "cap"
    p = run_cli(*capture_args(servers["main"].url, out, "--timeout", CAPTURE_TIMEOUT), env={"HF_HUB_CACHE": str(hub)})
    assert p.returncode == 0, p.stderr
    info = json.loads((out / "server_info.json").read_text())
    assert info["model_config"] == {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512,
                                    "model_type": "llama", "source": str(snap / "config.json")}
    from traceinspect.model.run import LAYER_KEYS, model_int

    assert model_int(info, LAYER_KEYS) == (6, "model_config.num_hidden_layers=6")


def test_model_config_sources(tmp_path: Path) -> None:
    from traceinspect.capture.modelconfig import model_config

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "n_routed_experts": 256,
                                               "num_experts_per_tok": 8, "text_config": {"hidden_size": 7168}}))
    cfg, why = model_config({"model_path": str(d)}, {"model_type": "deepseek_v3"}, local=True)
    assert why is None and cfg["num_hidden_layers"] == 61 and cfg["text_config"] == {"hidden_size": 7168}
    assert model_config({"model_path": str(d)}, None, local=False) == (
        None, "the server is not on this machine: its model config cannot be read")
    # a server that puts config fields into /model_info needs nothing else
    cfg, _ = model_config({"model_path": "x/y"}, {"num_hidden_layers": 4, "architectures": ["A"]}, local=False)
    assert cfg == {"num_hidden_layers": 4, "architectures": ["A"], "source": "/model_info"}
    assert model_config({"model_path": "no/such-model"}, None, local=True)[0] is None


@pytest.mark.timeout(SAFETY_S)
def test_later_traffic_does_not_rewrite_a_finished_capture(full_capture: tuple[Path, Path],
                                                          servers: dict[str, Standin], tmp_path: Path) -> None:
    """SGLang keeps its by-stage counters armed after a capture: a new prefill restarts the profile and
    the next decode batch writes it over the -DECODE files. The capture resets that state."""
    out, _ = full_capture
    cap = json.loads((out / "capture.json").read_text())
    url = servers["main"].url
    httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
               timeout=60).raise_for_status()
    time.sleep(0.3)
    import hashlib

    for f in cap["files"]:
        assert hashlib.sha256((out / f["name"]).read_bytes()).hexdigest() == f["sha256"]
    assert {p.name for p in traces(out)} == {f["name"] for f in cap["files"]}

    # without the reset: a by-stage profile armed by hand during steady decode (no prefill in its window)
    import threading

    other = tmp_path / "by-hand"
    long_req = threading.Thread(target=lambda: httpx.post(url + "/generate", timeout=WAIT_S, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 150}}))
    long_req.start()
    try:
        _wait_for(lambda: servers["main"].state()["running"] >= 1, poll_s=0.02)
        r = httpx.post(url + "/start_profile", json={"output_dir": str(other), "num_steps": 2,
                                                     "profile_by_stage": True, "profile_id": "byhand"})
        assert r.status_code == 200
        decode = other / "byhand-TP-0-DECODE.trace.json.gz"
        _wait_for(lambda: decode.exists() and check_complete(decode) is None)
        first = decode.stat().st_mtime_ns, decode.stat().st_size
        assert step_spans(decode) == ["step[DECODE bs=1]"] * 2
        # a new request: its prefill restarts the profile, the next decode batch writes it as -DECODE
        httpx.post(url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3}},
                   timeout=60).raise_for_status()
        _wait_for(lambda: (decode.stat().st_mtime_ns, decode.stat().st_size) != first
                  and check_complete(decode) is None)
        assert step_spans(decode)[0] == "step[EXTEND bs=1 toks=2]"  # the capture was overwritten
    finally:
        long_req.join(WAIT_S)
        r = httpx.post(url + "/start_profile", json={"output_dir": str(other), "activities": [],
                                                     "profile_id": "reset"})  # what capture does after
    assert r.status_code == 200


@pytest.mark.timeout(SAFETY_S)
def test_cpu_traces_are_refused_by_the_analyzer(full_capture: tuple[Path, Path], servers: dict[str, Standin],
                                                tmp_path: Path) -> None:
    """CPU-only traces carry no kernels; the analyzer must say so rather than invent a GPU."""
    out, _ = full_capture
    p = run_cli("analyze", str(out))
    if "No such command" in p.stderr:
        pytest.skip("the analyze command is not available")
    assert p.returncode == 2
    assert "no GPU kernel" in p.stderr or "CUPTI" in p.stderr, p.stderr
    no_traceback(p)

    # capture --analyze: the capture itself is complete, the analysis failure is recorded and exits 2
    out2 = tmp_path / "cap"
    p = run_cli(*capture_args(servers["main"].url, out2, "--analyze", "--timeout", CAPTURE_TIMEOUT))
    assert p.returncode == 2 and ("no GPU kernel" in p.stderr or "CUPTI" in p.stderr), p.stderr
    cap = json.loads((out2 / "capture.json").read_text())
    assert cap["status"] == "complete" and cap["analysis"]["status"] == "failed"
    assert not (out2 / "analysis.json").exists() and not (out2 / "report.html").exists()


@pytest.mark.timeout(SAFETY_S)
def test_capture_analyze_end_to_end_with_recorded_gpu_traces(servers: dict[str, Standin], tmp_path: Path) -> None:
    if "gpu" not in servers:
        pytest.skip(f"no recorded GPU traces in {GPU_FIXTURE}")
    if importlib.util.find_spec("traceinspect.analysis") is None:
        pytest.skip("traceinspect.analysis is not available")
    out = tmp_path / "cap"
    p = run_cli(*capture_args(servers["gpu"].url, out, "--analyze", "--timeout", CAPTURE_TIMEOUT), timeout=300)
    assert p.returncode == 0, p.stderr
    n = len(sorted(GPU_FIXTURE.glob("fixture-TP-*.trace.json.gz")))
    assert len(traces(out)) == n
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis
    if importlib.util.find_spec("traceinspect.render.html") is not None:
        assert (out / "report.html").is_file()
    cap = json.loads((out / "capture.json").read_text())
    assert cap["status"] == "complete" and cap["analysis"]["status"] == "ok"
    # the server's load is evidence of the analysis: the recorded traces' bs=N markers win the batch, and
    # the server's running batch (the load's concurrency) disagrees with them, which is warned about
    facts = analysis["run"]["facts"]
    running, in_use = facts["running_requests"], facts["kv_tokens_in_use"]
    assert running["value"] == 6 and running["source"] == "server_load" and "capture.json" in running["detail"]
    assert in_use["source"] == "server_load" and in_use["value"] > 0
    assert facts["batch"]["source"] == "trace_structure"
    marker = facts["batch"]["value"]
    assert marker != 6 and any(f"batch of {marker:,.0f}" in w and "6 running requests" in w
                               for w in analysis["warnings"])


@pytest.mark.timeout(SAFETY_S)
def test_python_api_capture(servers: dict[str, Standin], tmp_path: Path) -> None:
    import traceinspect

    res = traceinspect.capture(servers["main"].url, tmp_path / "api", steps=2, load=LOAD, timeout=float(CAPTURE_TIMEOUT),
                               ramp_timeout=float(CAPTURE_TIMEOUT), phase="all")
    assert res.complete and res.missing == [] and len(res.files) == 2
    assert [f.name.split("-TP-")[1] for f in res.files] == ["0.trace.json.gz", "1.trace.json.gz"]
    assert all(step_spans(f) == ["step[DECODE bs=6]"] * 2 for f in res.files)  # the next 2 batches
    assert res.server_info["tp_size"] == 2
    assert callable(traceinspect.capture)  # still callable once the package is imported


# -- failure modes ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(SAFETY_S)
def test_server_down_exits_2_with_message(tmp_path: Path) -> None:
    p = run_cli("capture", "--url", f"http://127.0.0.1:{_free_port()}", "--out", str(tmp_path / "o"))
    assert p.returncode == 2
    assert "connection refused" in p.stderr and "is it running" in p.stderr
    assert p.stderr.count("\n") == 1  # one line
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(SAFETY_S)
@pytest.mark.parametrize("prefix", ["../evil", "a/b", "..", ".hidden", "x\\y"])
def test_prefix_that_could_escape_out_is_rejected(prefix: str, tmp_path: Path) -> None:
    p = run_cli("capture", "--url", f"http://127.0.0.1:{_free_port()}", "--out", str(tmp_path / "o"),
                "--prefix", prefix)
    assert p.returncode == 2 and "prefix" in p.stderr
    assert "connection refused" not in p.stderr  # refused before any request
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError):
        check_prefix(prefix)


@pytest.mark.timeout(SAFETY_S)
def test_api_keys_missing_wrong_and_right_and_never_written(servers: dict[str, Standin], tmp_path: Path) -> None:
    """A server with --api-key and --admin-api-key: /server_info takes the first, profiling only the second."""
    s = servers["keyed"]
    p = run_cli(*capture_args(s.url, tmp_path / "nokey"))
    assert p.returncode == 2 and "requires an API key" in p.stderr and "HTTP 401" in p.stderr
    no_traceback(p)

    wrong = "sk-wrong-Kq7aa19"  # given through the environment
    p = run_cli(*capture_args(s.url, tmp_path / "wrong"), env={"TRACEINSPECT_API_KEY": wrong})
    assert p.returncode == 2 and "rejected the API key for /server_info" in p.stderr
    assert wrong not in p.stderr + p.stdout

    no_admin = tmp_path / "noadmin"
    p = run_cli(*capture_args(s.url, no_admin, "--api-key", SECRET))
    assert p.returncode == 2 and "/start_profile" in p.stderr and "--admin-api-key" in p.stderr
    assert json.loads((no_admin / "capture.json").read_text())["status"] == "incomplete"
    assert s.state(SECRET)["running"] == 0  # the load was stopped

    out = tmp_path / "right"
    p = run_cli(*capture_args(s.url, out, "--api-key", SECRET, "--timeout", CAPTURE_TIMEOUT),
                env={"TRACEINSPECT_ADMIN_API_KEY": ADMIN_SECRET})
    assert p.returncode == 0, p.stderr
    assert len(traces(out)) == 1
    for key in (SECRET, ADMIN_SECRET):
        assert key not in p.stderr + p.stdout

    # the server reports its keys in /server_info, as SGLang does: they must not reach the disk
    raw = httpx.get(s.url + "/server_info", headers={"Authorization": f"Bearer {SECRET}"}).json()
    assert raw["api_key"] == SECRET and raw["admin_api_key"] == ADMIN_SECRET
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(written) >= 5
    for f in written:
        data = f.read_bytes()
        if f.suffix == ".gz":
            data += gzip.decompress(data)
        for key in (SECRET, ADMIN_SECRET):
            assert key.encode() not in data, f
    info = json.loads((out / "server_info.json").read_text())
    assert info["api_key"] == info["admin_api_key"] == "<redacted>"
    cap = json.loads((out / "capture.json").read_text())
    assert cap["command"][cap["command"].index("--api-key") + 1] == "<redacted>"


@pytest.mark.timeout(SAFETY_S)
def test_forbidden_profile_endpoint_exits_2(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "o"
    with servers["main"].configured(forbid_profile=True) as s:
        p = run_cli(*capture_args(s.url, out))
        assert p.returncode == 2 and "HTTP 403" in p.stderr and "admin API key" in p.stderr
        cap = json.loads((out / "capture.json").read_text())
        assert cap["status"] == "incomplete" and "403" in cap["reason"]
        assert s.state()["running"] == 0  # the load was stopped


@pytest.mark.timeout(SAFETY_S)
def test_old_server_falls_back_to_get_server_info(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "o"
    p = run_cli(*capture_args(servers["old"].url, out, "--timeout", CAPTURE_TIMEOUT))
    assert p.returncode == 0, p.stderr
    assert "/get_server_info" in p.stderr
    cap = json.loads((out / "capture.json").read_text())
    assert cap["server_info_endpoint"] == "/get_server_info"
    assert cap["model_info_endpoint"] == "/get_model_info"
    assert cap["status"] == "complete"
    assert any("profile_by_stage" in w for w in cap["warnings"])
    # old releases ignore profile_prefix: "{profile_id}-TP-{r}.trace.json.gz"
    assert [f.name for f in traces(out)] == [f"{cap['profile_id']}-TP-0.trace.json.gz"]
    info = json.loads((out / "server_info.json").read_text())
    assert info["version"].startswith("0.4") and info["model_info"]["is_generation"] is True
    assert all(step_spans(f) == [] for f in traces(out))  # no step spans in old releases


@pytest.mark.timeout(SAFETY_S)
def test_profile_already_in_progress(servers: dict[str, Standin], tmp_path: Path) -> None:
    s = servers["main"]
    other = tmp_path / "someone-else"
    r = httpx.post(s.url + "/start_profile", json={"output_dir": str(other), "profile_id": "theirs"})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    try:
        out = tmp_path / "o"
        p = run_cli(*capture_args(s.url, out))
        assert p.returncode == 2
        assert "already in progress" in p.stderr and "HTTP 500" in p.stderr and "/stop_profile" in p.stderr
        no_traceback(p)
        cap = json.loads((out / "capture.json").read_text())
        assert cap["status"] == "incomplete" and "already in progress" in cap["reason"]
        assert not other.exists()  # their profile was not stopped by us
    finally:
        r = httpx.post(s.url + "/stop_profile")
    assert r.status_code == 200 and r.text == "Stop profiling. This will take some time.\n"
    _wait_for(lambda: len(list(other.glob("theirs-TP-*.trace.json.gz"))) == 2, "for their rank files")


@pytest.mark.timeout(SAFETY_S)
def test_timeout_names_the_missing_rank(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "o"
    with servers["main"].configured(silent_ranks=[1]) as s:
        # rank 0 must complete within the capture's wait, rank 1 never does: the whole wait is spent
        p = run_cli(*capture_args(s.url, out, "--timeout", "20"))
    assert p.returncode == 2
    assert "1 of 2 rank files complete; missing TP-1" in p.stderr
    assert "no traffic" in p.stderr and "not visible from the server" in p.stderr
    cap = json.loads((out / "capture.json").read_text())
    assert cap["status"] == "incomplete" and cap["missing_ranks"] == ["TP-1"]
    assert [f["rank"] for f in cap["files"] if f["complete"]] == ["TP-0"]


@pytest.mark.timeout(SAFETY_S)
def test_timeout_with_no_file_says_directory_may_not_be_visible(servers: dict[str, Standin],
                                                                tmp_path: Path) -> None:
    """The server writes somewhere this host doesn't look (as on another host): files never appear here."""
    out, elsewhere = tmp_path / "o", tmp_path / "server-side"
    p = run_cli(*capture_args(servers["main"].url, out, "--timeout", "2", "--server-out-dir", str(elsewhere),
                              steps=100000))
    assert p.returncode == 2
    assert "no trace file appeared" in p.stderr and "may not be visible from the server" in p.stderr
    assert "stopped a running profile" in p.stderr
    assert traces(out) == []
    _wait_for(lambda: len(traces(elsewhere)) == 2, "for the files written on the server side when stopped")
    assert json.loads((out / "capture.json").read_text())["status"] == "incomplete"


@pytest.mark.timeout(SAFETY_S)
@pytest.mark.parametrize(("sig", "sigint", "code", "said"), [
    (signal.SIGINT, "default", 130, "Ctrl-C"),
    (signal.SIGTERM, "ignored", 143, "SIGTERM"),  # a background job: Ctrl-C ignored, stopped by kill
])
def test_ctrl_c_stops_load_and_profile_and_marks_incomplete(servers: dict[str, Standin], tmp_path: Path,
                                                            sig: int, sigint: str, code: int, said: str) -> None:
    s = servers["main"]
    stops = s.state()["calls"]["stop_profile"]
    out = tmp_path / "o"
    proc = cli_popen(*capture_args(s.url, out, "--timeout", "300", steps=100000), sigint=sigint,
                     env={"PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, stdin=subprocess.DEVNULL)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("waiting for"):
                break
        assert s.state()["running"] == 6
        assert ("Ctrl-C is ignored in this process" in "".join(lines)) == (sigint == "ignored")
        time.sleep(0.5)
        proc.send_signal(sig)
        rest = proc.stderr.read()
        rc = proc.wait(WAIT_S)
    finally:  # a capture left running would keep the shared stand-in profiling for the next test
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(WAIT_S)
        if proc.poll() is None:
            proc.kill()
    assert rc == code, "".join(lines) + rest
    assert f"interrupted ({said})" in rest and "Traceback" not in rest
    cap = json.loads((out / "capture.json").read_text())
    assert cap["status"] == "incomplete" and cap["reason"] == f"interrupted ({said})"
    assert cap["stop_profile"]["ok"] is True
    assert s.state()["calls"]["stop_profile"] == stops + 1
    kept = traces(out)  # the stop wrote what was recorded so far; it is kept
    assert len(kept) == 2 and all(check_complete(f) is None for f in kept)
    assert {f["name"] for f in cap["files"]} == {f.name for f in kept}
    _wait_for(lambda: s.state()["running"] == 0)  # the load was stopped


@pytest.mark.timeout(SAFETY_S)
def test_earlier_capture_in_out_is_not_mixed(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    old = out / "traceinspect-111.0_aaaa-TP-0-DECODE.trace.json.gz"
    old_bytes = gzip.compress(b'{"traceEvents": []}')
    old.write_bytes(old_bytes)
    (out / "server_info.json").write_text('{"tp_size": 8}')
    p = run_cli(*capture_args(servers["main"].url, out, "--timeout", CAPTURE_TIMEOUT))
    assert p.returncode == 0, p.stderr
    sub = Path(p.stdout.strip())
    assert sub.parent == out.resolve() and sub.name.startswith("capture-")
    assert "already holds files of an earlier capture" in p.stderr and old.name in p.stderr
    assert old.read_bytes() == old_bytes
    assert json.loads((out / "server_info.json").read_text()) == {"tp_size": 8}
    assert traces(out) == [old]
    cap = json.loads((sub / "capture.json").read_text())
    assert len(traces(sub)) == 2 and all(cap["profile_id"] in f.name for f in traces(sub))


# -- units -----------------------------------------------------------------------------------------------

def test_local_host_detection() -> None:
    from traceinspect.capture.session import is_local_host

    for h in ("127.0.0.1", "127.3.0.1", "::1", "[::1]", "localhost", socket.gethostname()):
        assert is_local_host(h), h
    for h in ("10.1.2.3", "192.168.0.7", "gpu-node-17.cluster.invalid"):
        assert not is_local_host(h), h


def test_load_spec_parsing() -> None:
    spec = TrafficSpec.parse("concurrency=256,input=1024,output=2048")
    assert (spec.concurrency, spec.input, spec.output, spec.driver) == (256, 1024, 2048, "builtin")
    assert TrafficSpec.parse("c=4,in=8,out=16,driver=bench-serving").driver == "bench_serving"
    for bad in ("concurrency=0", "concurrency=x", "speed=3", "driver=locust", "concurrency"):
        with pytest.raises(ConfigError):
            TrafficSpec.parse(bad)


def test_bench_serving_command_never_passes_request_rate() -> None:
    cmd = bench_serving_command("http://127.0.0.1:30000", TrafficSpec.parse("concurrency=256,input=1024,output=2048"))
    assert "--request-rate" not in cmd
    assert cmd[cmd.index("--max-concurrency") + 1] == "256"
    assert cmd[cmd.index("--dataset-name") + 1] == "random-ids"
    assert cmd[cmd.index("--random-range-ratio") + 1] == "1.0"
    assert cmd[cmd.index("--num-prompts") + 1] == str(5 * 256)


def test_name_pattern_is_the_analyzers() -> None:
    from traceinspect.capture import wait
    from traceinspect.load.discover import SGLANG_NAME

    assert wait.SGLANG_NAME.pattern == SGLANG_NAME.pattern and wait.SGLANG_NAME.flags == SGLANG_NAME.flags


def test_expected_ranks_follow_sglang_naming() -> None:
    assert [k.label for k in expected_ranks({"tp_size": 8})] == [f"TP-{r}" for r in range(8)]
    ep = expected_ranks({"tp_size": 8, "ep_size": 8})
    assert [k.label for k in ep][:2] == ["TP-0-EP-0", "TP-1-EP-1"]
    dp = expected_ranks({"tp_size": 4, "dp_size": 2})
    assert len(dp) == 8 and dp[4].label == "TP-0-DP-1"
    attn = expected_ranks({"tp_size": 8, "dp_size": 8, "enable_dp_attention": True})
    assert len(attn) == 8 and attn[3].label == "TP-3-DP-3"
    attn2 = expected_ranks({"tp_size": 8, "dp_size": 1, "attn_dp_size": 4})
    assert [k.dp for k in attn2] == [0, 0, 1, 1, 2, 2, 3, 3]
    pp = expected_ranks({"tp_size": 2, "pp_size": 2})
    assert [k.label for k in pp] == ["TP-0-PP-0", "TP-1-PP-0", "TP-0-PP-1", "TP-1-PP-1"]
    assert len(expected_ranks({"tp_size": None})) == 1


def test_watcher_waits_for_complete_gzip(tmp_path: Path) -> None:
    stem = "p-1.5_ab"
    w = RankWatcher(tmp_path, stem, expected_ranks({"tp_size": 2}), "DECODE", stable_s=0.0)
    body = gzip.compress(json.dumps({"traceEvents": [{"name": "x"}] * 2000}).encode())
    (tmp_path / f"{stem}-TP-0-DECODE.trace.json.gz").write_bytes(body[: len(body) // 2])  # being written
    (tmp_path / f"{stem}-TP-1-DECODE.trace.json.gz").write_bytes(body)
    (tmp_path / f"other-{stem}-TP-0-DECODE.trace.json.gz").write_bytes(body)  # another capture
    (tmp_path / "p-9.9_zz-TP-0-DECODE.trace.json.gz").write_bytes(body)  # another capture
    for _ in range(2):
        w.poll()
    res = w.result(False, 0.0)
    assert [k.label for k in res.missing] == ["TP-0"] and len(res.files) == 2
    assert "truncated" in w.pending_note()
    (tmp_path / f"{stem}-TP-0-DECODE.trace.json.gz").write_bytes(body)
    for _ in range(2):
        w.poll()
    assert w.done()
    assert check_complete(tmp_path / f"{stem}-TP-1-DECODE.trace.json.gz") is None
    (tmp_path / "plain.gz").write_bytes(b"not gzip")
    assert "gzip" in (check_complete(tmp_path / "plain.gz") or "")


def test_redaction() -> None:
    info = {"api_key": "k1", "admin_api_key": None, "ssl_keyfile_password": "pw", "hf_token": "t",
            "max_prefill_tokens": 5, "kv_cache_dtype": "fp8_e4m3",
            "launch_command": "python -m sglang.launch_server --api-key k1 --admin-api-key=k2 --tp 8",
            "internal_states": [{"api_key": "k1", "note": "uses k1 inside"}]}
    out = redact(info, ["k1"])
    assert out["api_key"] == "<redacted>" and out["admin_api_key"] is None
    assert out["ssl_keyfile_password"] == "<redacted>" and out["hf_token"] == "<redacted>"
    assert out["max_prefill_tokens"] == 5 and out["kv_cache_dtype"] == "fp8_e4m3"
    assert "k1" not in json.dumps(out) and "k2" not in out["launch_command"]
    assert redact_argv(["capture", "--api-key", "k1", "--api-key=k1", "--url", "u"], ["k1"]) == [
        "capture", "--api-key", "<redacted>", "--api-key=<redacted>", "--url", "u"]


def test_progress_on_a_terminal_hides_secrets() -> None:
    from traceinspect.capture.ui import CaptureUI

    buf = io.StringIO()
    ui = CaptureUI(stream=buf, force_terminal=True, secrets=("sekrit",))
    with ui.progress("rank files", 2, "ranks") as update:
        update(1, 2, "waiting for TP-1 sekrit")
    ui.info("key sekrit")
    assert "rank files" in buf.getvalue() and "sekrit" not in buf.getvalue()
    quiet = io.StringIO()
    with CaptureUI(stream=quiet).progress("x", 1, "y") as update:  # not a terminal: no progress
        update(1, 1, "")
    assert quiet.getvalue() == ""


def test_analyze_into_writes_report_and_json(tmp_path: Path) -> None:
    import shutil

    from traceinspect.capture.report import analyze_into

    d = tmp_path / "capture"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "kv-full-cast-eager", d)
    a, written = analyze_into(d, command="traceinspect capture --api-key <redacted>")
    assert [p.name for p in written] == ["report.html", "analysis.json"]
    doc = json.loads((d / "analysis.json").read_text())
    assert doc == json.loads(json.dumps(a.to_json(), default=str))
    assert doc["source"]["command"].endswith("<redacted>")
    assert (d / "report.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.skipif(not HAS_TORCH, reason="profile_steps needs torch")
def test_profile_steps_in_process(tmp_path: Path) -> None:
    import torch

    from traceinspect.capture import profile_steps
    from traceinspect.load.discover import parse_name

    with profile_steps(tmp_path, rank=1, prefix="mine", profile_id="42.5", server_info={"tp_size": 2}) as prof:
        for bs in (8, 8, 8):
            with prof.step(bs=bs):
                torch.mm(torch.randn(bs, 16), torch.randn(16, 16))
    assert prof.path == tmp_path / "mine-42.5-TP-1-DECODE.trace.json.gz"
    assert [p.name for p in tmp_path.iterdir()] == [prof.path.name]  # rank 1 writes no server_info
    assert step_spans(prof.path) == ["step[DECODE bs=8]"] * 3
    rf = parse_name(prof.path)
    assert (rf.tp, rf.stage, rf.profile_id) == (1, "DECODE", "42.5")
    with profile_steps(tmp_path, rank=0, prefix="mine", profile_id="42.5", server_info={"tp_size": 2}) as p0, \
            p0.step(bs=2):
        torch.ones(2).sum()
    assert json.loads((tmp_path / "server_info.json").read_text()) == {"tp_size": 2}
    with pytest.raises(ConfigError), profile_steps(tmp_path, prefix="../x"):
        pass


@pytest.mark.timeout(SAFETY_S)
def test_bench_serving_driver_runs_sglang_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With sglang installed the bench_serving driver runs it; a stand-in module records how it was called."""
    from traceinspect.capture.traffic import BenchServingTraffic, bench_serving_module

    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    record = tmp_path / "called.json"
    (pkg / "bench_serving.py").write_text(
        "import json, os, sys, time\n"
        "json.dump({'argv': sys.argv[1:], 'key_ok': os.environ.get('OPENAI_API_KEY') == 'k-123'},\n"
        "          open(os.environ['FAKE_BENCH_OUT'], 'w'))\n"
        "print('running', flush=True)\n"
        "time.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_BENCH_OUT", str(record))
    assert bench_serving_module() == "sglang.bench_serving"
    drv = BenchServingTraffic("http://127.0.0.1:1", TrafficSpec.parse("concurrency=4,input=8,output=16,prompts=12"),
                           api_key="k-123", log_path=tmp_path / "bench.log")
    assert "k-123" not in " ".join(drv.cmd)
    drv.start()
    _wait_for(lambda: record.exists() and record.stat().st_size > 0)
    assert drv.error is None
    drv.stop()
    # ended by stop()'s SIGTERM (not its SIGKILL fallback, nor by finishing: it sleeps an hour)
    assert drv.stats()["returncode"] == -signal.SIGTERM
    called = json.loads(record.read_text())
    assert called["key_ok"] and "--request-rate" not in called["argv"]
    assert called["argv"][called["argv"].index("--max-concurrency") + 1] == "4"
    assert called["argv"][called["argv"].index("--num-prompts") + 1] == "12"


@pytest.mark.timeout(SAFETY_S)
def test_expect_checks_server_info_before_profiling(servers: dict[str, Standin], tmp_path: Path) -> None:
    """``--expect`` names every key whose live value differs, with the expected and the actual value,
    and exits 2 before anything is profiled or written."""
    s = servers["main"]
    before = s.state()["calls"]["start_profile"]
    out = tmp_path / "o"
    p = run_cli("capture", "--url", s.url, "--out", str(out), "--expect", "max_running_requests=2048",
                "--expect", "num_continuous_decode_steps=8", "--expect", "tp_size=2")
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("traceinspect: error:")
    assert "max_running_requests: expected 2048, actual 128" in line
    assert "num_continuous_decode_steps: expected 8, actual 1" in line
    assert "tp_size" not in line  # it matches
    assert not out.exists()
    assert s.state()["calls"]["start_profile"] == before  # never profiled
    p = run_cli("capture", "--url", s.url, "--out", str(out), "--expect", "no-equals-sign")
    assert p.returncode == 2 and "KEY=VALUE" in p.stderr
