"""``traceinspect sweep`` against stand-in SGLang servers (tests/standin_sglang), plus unit tests.

The stand-ins serve recorded GPU traces (no torch in their ranks), stream ``/generate`` and fake a
forward whose time grows with the batch, so a sweep sees throughput grow with the concurrency and level
off where ``max_running_requests`` caps the running batch. Waiting is on the servers' own state (the
sweep's ramp polls ``/v1/loads``), never on fixed sleeps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pandas as pd
import pytest
from conftest import cli_popen

from traceinspect.capture.sweep import compare_sweeps
from traceinspect.capture.sweep_levels import (
    SweepSettings,
    cap_of,
    knee,
    moe_model,
    parse_levels,
    power_note,
    server_config,
    window_metrics,
)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GPU_FIXTURE = ROOT / "fixtures" / "kv-gather-cast-eager"
HAS_AIOHTTP = importlib.util.find_spec("aiohttp") is not None


class Standin:
    """A running ``python -m standin_sglang`` subprocess (serving recorded GPU traces: no torch needed)."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.port_file = workdir / f"{name}.port"
        self.log = workdir / f"{name}.log"
        self._logf = open(self.log, "wb")  # noqa: SIM115 - closed in reap()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "standin_sglang", "--port-file", str(self.port_file), *args], cwd=TESTS,
            env={**os.environ, "PYTHONPATH": str(TESTS)}, stdout=self._logf, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        self.url = ""

    def wait_ready(self, deadline: float) -> None:
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.reap()
                raise RuntimeError(f"stand-in did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port_file.read_text().strip()}"

    def state(self) -> dict:
        return httpx.get(self.url + "/standin/state", timeout=5).json()

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._logf.close()


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRACEINSPECT_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "traceinspect", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


pytestmark = pytest.mark.skipif(not HAS_AIOHTTP or not GPU_FIXTURE.is_dir(),
                                reason="the stand-in needs aiohttp and the recorded GPU fixture")

GPU = ["--gpu-trace-from", str(GPU_FIXTURE)]
# 256..1024 fill the batch; the step time grows with it, so throughput grows less than the batch
MAIN = [*GPU, "--max-running-requests", "1024", "--step-ms", "40", "--step-us-per-req", "40",
        "--stream-interval", "16", "--max-prefill-tokens", "256", "--enable-mixed-chunk",
        "--experts", "256", "--top-k", "8"]
SMALL = [*GPU, "--max-running-requests", "64", "--stream-interval", "4", "--max-prefill-tokens", "64",
         "--enable-mixed-chunk", "--experts", "64", "--top-k", "4"]
SERVERS = {
    "main": MAIN,
    # steps long enough that the machine's own load (the stand-in's CPU work per step) stays small beside them
    "a": [*SMALL, "--step-ms", "25", "--step-us-per-req", "250", "--num-continuous-decode-steps", "8"],
    "b": [*SMALL, "--step-ms", "25", "--step-us-per-req", "250", "--num-continuous-decode-steps", "16"],
    "slow": [*SMALL, "--step-ms", "30", "--step-us-per-req", "300", "--num-continuous-decode-steps", "8"],
    "dying": [*SMALL, "--step-ms", "10", "--die-at-running", "32"],
    "one": [*GPU, "--step-ms", "5", "--experts", "64", "--top-k", "4"],
    "kv": [*SMALL, "--step-ms", "10", "--max-total-num-tokens", "600"],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Standin]]:
    work = tmp_path_factory.mktemp("standin")
    started = {name: Standin(name, args, work) for name, args in SERVERS.items()}
    try:
        deadline = time.monotonic() + 90
        for s in started.values():
            s.wait_ready(deadline)
        yield started
    finally:
        for s in started.values():
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in started.values():
            s.reap()


def sweep_args(url: str, out: Path, levels: str, *extra: str, window: str = "2", steps: str = "0",
               output: str = "512") -> list[str]:
    return ["sweep", "--url", url, "--concurrency", levels, "--out", str(out), "--input", "16", "--output", output,
            "--window", window, "--settle", "1", "--steps", steps, "-q", *extra]


def finite_everywhere(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(finite_everywhere(x) for x in v.values())
    if isinstance(v, list):
        return all(finite_everywhere(x) for x in v)
    return True


# -- the main sweep ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def main_sweep(servers: dict[str, Standin], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    """Outputs outlive the sweep: no request finishes, so the levels' batches hold exactly their requests."""
    out = tmp_path_factory.mktemp("sweep") / "s"
    html = out.parent / "sweep.html"
    p = run_cli(*sweep_args(servers["main"].url, out, "256,512,1024,2048", "--html", str(html),
                            "--json", str(out.parent / "copy.json"), window="3", output="2048"), timeout=200)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    return json.loads((out / "sweep.json").read_text()), out, p.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sweep_levels_caps_and_knee(main_sweep: tuple[dict, Path, str], servers: dict[str, Standin]) -> None:
    doc, out, stdout = main_sweep
    assert doc["schema"] == "traceinspect.sweep/1" and finite_everywhere(doc)
    assert json.loads((out.parent / "copy.json").read_text()) == doc
    levels = {lv["concurrency"]: lv for lv in doc["levels"]}
    assert sorted(levels) == [256, 512, 1024, 2048]
    for n in (256, 512, 1024):
        assert levels[n]["status"] == "ok" and levels[n]["running_requests"] == n and levels[n]["capped_by"] is None
    top = levels[2048]
    assert top["status"] == "ok" and top["running_requests"] == 1024 and top["capped_by"] == "max_running_requests"
    assert top["waiting_requests"] == 1024
    # per-expert M: tokens per step (the running batch) x top-k 8 / 256 experts, from /model_info
    assert doc["model"]["experts"] == 256 and doc["model"]["top_k"] == 8
    for n, lv in levels.items():
        assert lv["per_expert_m"] == pytest.approx(min(n, 1024) * 8 / 256)
    # this client's throughput agrees with the server's own count of the tokens it wrote in each window
    for n, lv in levels.items():
        w = lv["window"]
        own = httpx.get(servers["main"].url + "/standin/tokens", timeout=10,
                        params={"since": w["start_unix"], "until": w["end_unix"]}).json()
        server_rate = own["tokens"] / (w["end_unix"] - w["start_unix"])
        assert lv["output_tokens_per_s"] == pytest.approx(server_rate, rel=0.05), (n, lv, own)
        assert len(lv["throughput_samples"]) == 10
        assert lv["itl_ms"]["p50"] > 0 and lv["tpot_ms"]["p50"] > 0
        assert (out / f"level-{n}" / "level.json").is_file()
    # throughput grows while the batch does, then stops: the knee is the last level the batch grew to
    tput = [levels[n]["output_tokens_per_s"] for n in (256, 512, 1024)]
    assert tput == sorted(tput)
    assert doc["knee"]["concurrency"] == 1024 and doc["knee"]["next"] == 2048
    assert doc["knee"]["next_capped_by"] == "max_running_requests"
    assert "knee: throughput levels off at 1024" in stdout and "max_running_requests" in stdout
    assert "GPU power and clocks not sampled" in doc["gpu_note"]
    assert doc["server_config"]["max_running_requests"] == 1024


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.timeout(240)
def test_sweep_html_in_chromium(main_sweep: tuple[dict, Path, str], tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    exe = os.environ.get("TRACEINSPECT_CHROMIUM", "/usr/bin/chromium")
    exe = exe if Path(exe).is_file() else shutil.which("chromium")
    if not exe:
        pytest.skip("chromium not found (apt-get install -y chromium)")
    doc, out, _ = main_sweep
    html = out.parent / "sweep.html"
    seen: dict[str, list[str]] = {"console": [], "pageerror": [], "network": []}
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = b.new_page(viewport={"width": 1280, "height": 900})

        def route(r):  # only the file itself may load
            if r.request.url.startswith(("file:", "data:", "about:")):
                r.continue_()
            else:
                seen["network"].append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.on("console", lambda m: seen["console"].append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: seen["pageerror"].append(str(e)))
        page.goto(html.resolve().as_uri(), wait_until="load")
        try:
            assert seen == {"console": [], "pageerror": [], "network": []}
            for name in ("throughput", "step", "per_expert_m", "power", "clocks", "classes"):
                assert page.locator(f"figure[data-chart={name}]").is_visible(), name
            # one point per level on the throughput and per-expert M charts, the knee marked
            assert page.locator("figure[data-chart=throughput] circle.point").count() == 4
            assert page.locator("figure[data-chart=per_expert_m] circle.point").count() == 4
            assert page.locator("figure[data-chart=throughput] line.knee").count() == 1
            rows = page.locator("#levels tr[data-level]")
            assert rows.count() == 4
            assert "max_running_requests" in page.locator("#levels tr[data-level='2048']").inner_text()
            assert "knee: throughput levels off at 1024" in page.locator("ul.notes").inner_text()
            page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
        finally:
            b.close()


# -- comparing sweeps --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_sweeps(servers: dict[str, Standin], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three sweeps at once (the same load on the machine for all): a flag with no effect, and 20% slower steps."""
    base = tmp_path_factory.mktemp("cmp")
    env = {k: v for k, v in os.environ.items() if k != "TRACEINSPECT_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    procs = {}
    for name in ("a", "b", "slow"):
        args = sweep_args(servers[name].url, base / name, "16,32", window="5")
        procs[name] = subprocess.Popen([sys.executable, "-m", "traceinspect", *args], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, (name, err)
    return {name: base / name for name in procs}


@pytest.mark.timeout(180)
def test_compare_flag_without_effect_is_no_difference(small_sweeps: dict[str, Path], tmp_path: Path) -> None:
    p = run_cli("sweep", "--compare", str(small_sweeps["a"]), str(small_sweeps["b"]),
                "--json", str(tmp_path / "c.json"))
    assert p.returncode == 0, p.stderr
    cmp = json.loads((tmp_path / "c.json").read_text())
    assert cmp["different"] is False, cmp
    assert [r["concurrency"] for r in cmp["levels"]] == [16, 32]
    assert all(r["decided"] and not r["significant"] for r in cmp["levels"]), cmp["levels"]
    assert cmp["config_diff"] == {"num_continuous_decode_steps": {"a": 8, "b": 16}}
    assert "no difference beyond noise" in p.stdout and "num_continuous_decode_steps" in p.stdout


@pytest.mark.timeout(180)
def test_compare_names_a_20_percent_slower_step(small_sweeps: dict[str, Path], tmp_path: Path) -> None:
    p = run_cli("sweep", "--compare", str(small_sweeps["a"]), str(small_sweeps["slow"]),
                "--json", str(tmp_path / "c.json"))
    assert p.returncode == 0, p.stderr
    cmp = json.loads((tmp_path / "c.json").read_text())
    assert cmp["different"] is True
    for r in cmp["levels"]:
        assert r["significant"] and -0.25 < r["change"] < -0.08, r
    assert set(cmp["config_diff"]) == {"standin_step_ms", "standin_step_us_per_req"}
    assert "different: 16" in p.stdout


# -- failures ----------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_server_killed_during_level_3_keeps_levels_1_and_2(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "s"
    p = run_cli(*sweep_args(servers["dying"].url, out, "8,16,32", window="1"), timeout=100)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "level 32" in p.stderr and "sweep.json keeps every level measured" in p.stderr
    doc = json.loads((out / "sweep.json").read_text())
    lv = doc["levels"]
    assert [x["concurrency"] for x in lv] == [8, 16, 32]
    assert lv[0]["status"] == lv[1]["status"] == "ok"
    assert lv[0]["output_tokens_per_s"] > 0 and lv[1]["output_tokens_per_s"] > 0
    assert lv[2]["status"] == "failed" and "cannot reach the server" in lv[2]["error"]
    assert json.loads((out / "level-16" / "level.json").read_text())["status"] == "ok"
    assert json.loads((out / "level-32" / "level.json").read_text())["status"] == "failed"
    servers["dying"].reap()


@pytest.mark.timeout(60)
def test_expect_mismatch_exits_2_before_any_load(servers: dict[str, Standin], tmp_path: Path) -> None:
    before = servers["one"].state()["forward_ct"]
    out = tmp_path / "s"
    p = run_cli(*sweep_args(servers["one"].url, out, "1,2", "--expect", "max_running_requests=2048",
                            "--expect", "num_continuous_decode_steps=1"))
    assert p.returncode == 2
    assert "max_running_requests: expected 2048, actual 256" in p.stderr  # the recorded set's
    assert "num_continuous_decode_steps" not in p.stderr  # that one matches
    assert not out.exists()
    assert servers["one"].state()["forward_ct"] == before  # no request was sent


@pytest.mark.timeout(120)
def test_ctrl_c_marks_the_level_and_keeps_the_rest(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "s"
    env = {k: v for k, v in os.environ.items() if k != "TRACEINSPECT_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    args = sweep_args(servers["a"].url, out, "4,8", window="30")
    proc = cli_popen(*args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # the first level's 30 s window is open once its running batch holds 4 requests
        while servers["a"].state()["running"] < 4:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:  # a sweep left running would keep the stand-in busy for the next test
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["levels"][0] == {**doc["levels"][0], "status": "failed", "error": "interrupted (Ctrl-C)"}
    assert doc["levels"][1]["status"] == "not_run" and "stopped at level 4" in doc["levels"][1]["error"]


@pytest.mark.timeout(120)
def test_a_full_kv_pool_caps_the_level_and_is_named(servers: dict[str, Standin], tmp_path: Path) -> None:
    """Requests queue on the server while the running batch is below max_running_requests and the KV pool
    is full: the level is capped by the KV pool, and the knee says so."""
    from traceinspect.capture.sweep import SweepOptions, run_sweep

    opts = SweepOptions(url=servers["kv"].url, out=tmp_path / "s", levels=[8, 32], input=16, output=4096,
                        steps=0, window_s=1.0, settle_s=0.2, stall_s=1.0)
    doc, code = run_sweep(opts)
    assert code == 0, doc
    low, high = doc["levels"]
    assert low["capped_by"] is None and low["running_requests"] == 8
    assert high["capped_by"] == "kv_pool" and high["running_requests"] == 8 and high["waiting_requests"] == 24
    assert doc["knee"]["concurrency"] == 8 and doc["knee"]["next_capped_by"] == "kv_pool"
    assert any("KV pool holds 600 tokens" in w for w in doc["warnings"])


# -- one request at a time, with the trace of the level analysed ------------------------------------

@pytest.mark.timeout(120)
def test_concurrency_1_measures_captures_and_analyses(servers: dict[str, Standin], tmp_path: Path) -> None:
    out = tmp_path / "s"
    p = run_cli("sweep", "--url", servers["one"].url, "--concurrency", "1", "--out", str(out), "--input", "8",
                "--output", "32", "--window", "1", "--settle", "0.2", "--steps", "3", "-q", timeout=100)
    assert p.returncode == 0, p.stderr
    doc = json.loads((out / "sweep.json").read_text())
    (lv,) = doc["levels"]
    assert lv["status"] == "ok" and lv["concurrency"] == 1 and lv["running_requests"] == 1
    assert lv["request_per_s"] > 0 and lv["output_tokens_per_s"] > 0 and lv["per_expert_m"] == 1 * 4 / 64
    analysis = json.loads((out / lv["analysis"]).read_text())
    assert lv["analysis"] == "level-1/analysis.json" and lv["capture"]["status"] == "complete"
    assert lv["step_us"] == pytest.approx(analysis["steps"]["median_us"], rel=1e-3)
    assert lv["step_between_share"] == pytest.approx(analysis["steps"]["between_share"], abs=1e-4)
    assert lv["classes"] and all(0 <= v <= 1 for v in lv["classes"].values())
    assert doc["knee"] is None


# -- units -------------------------------------------------------------------------------------------

def test_parse_levels() -> None:
    assert parse_levels("2048, 256,512,256") == [256, 512, 2048]
    for bad in ("", "0", "a,2"):
        with pytest.raises(Exception, match="--concurrency"):
            parse_levels(bad)


def test_window_metrics_from_chunks() -> None:
    t0 = 100.0
    chunks = [(t0 + 0.05 + 0.1 * i, 4) for i in range(20)] + [(t0 - 1.0, 99), (t0 + 2.5, 99)]
    rec = {"end": t0 + 2.0, "chunks": chunks, "itl_s": [(0.025, 4)] * 19, "finished": [t0 + 1.0, t0 + 5.0],
           "tpot_s": [0.02, 0.03]}
    m = window_metrics(rec, t0, 4)
    assert m["tokens"] == 80 and m["output_tokens_per_s"] == 40.0 and m["request_per_s"] == 0.5
    assert m["throughput_samples"] == [40.0, 40.0, 40.0, 40.0]
    assert m["itl_ms"] == {"p50": 25.0, "p99": 25.0} and m["tpot_ms"]["p50"] == 25.0


def test_knee_and_what_caps_the_next_level() -> None:
    def lv(n: int, t: float, cap: str | None = None) -> dict:
        return {"concurrency": n, "status": "ok", "output_tokens_per_s": t, "capped_by": cap}

    # the seeds' numbers: 705 -> 1,111 -> 1,631 -> 2,095 output tok/s
    k = knee([lv(256, 705.0), lv(512, 1110.93), lv(1024, 1631.0), lv(2048, 2095.0)], 0.10)
    assert k is None  # still +28% per doubling at the top
    k = knee([lv(256, 705.0), lv(512, 1110.93), lv(1024, 1631.0), lv(2048, 1700.0, "max_running_requests")], 0.10)
    assert k["concurrency"] == 1024 and k["next_capped_by"] == "max_running_requests"
    k = knee([lv(1, 100.0), lv(4, 390.0), lv(16, 400.0), lv(64, 410.0)], 0.10)
    assert k["concurrency"] == 4 and k["next_capped_by"] == "compute"
    assert k["growth_per_doubling"] == pytest.approx((400 / 390) ** 0.5 - 1, abs=1e-4)
    # a dip and a recovery: the knee is past which growth stays small
    k = knee([lv(1, 100.0), lv(2, 105.0), lv(4, 200.0), lv(8, 205.0, "kv_pool")], 0.10)
    assert k["concurrency"] == 4 and k["next_capped_by"] == "kv_pool"


def test_cap_of() -> None:
    s = SweepSettings()
    assert cap_of(256, 256, 0, 1024, 0.1, s) is None
    assert cap_of(2048, 1024, 1024, 1024, 0.3, s) == "max_running_requests"
    assert cap_of(2048, 700, 1348, 1024, 0.95, s) == "kv_pool"
    assert cap_of(2048, 700, 1348, 1024, 0.5, s) == "scheduler"


def test_moe_model_and_server_config() -> None:
    info = {"tp_size": 8, "port": 30000, "startup_time": 1.0, "max_running_requests": 2048,
            "internal_states": [{"effective_max_running_requests_per_dp": 2048, "memory_usage": {}}],
            "model_config": {"n_routed_experts": 256, "num_experts_per_tok": 8}}
    m = moe_model(info)
    assert (m["experts"], m["top_k"]) == (256, 8) and "n_routed_experts=256" in m["source"]
    assert moe_model({"tp_size": 1})["note"] == "unknown: no model config"
    cfg = server_config(info)
    assert cfg == {"effective_max_running_requests_per_dp": 2048, "max_running_requests": 2048, "tp_size": 8}


def _doc(samples_a: list[float], **cfg: object) -> dict:
    return {"schema": "traceinspect.sweep/1", "url": "u", "server_config": cfg,
            "levels": [{"concurrency": 64, "status": "ok", "output_tokens_per_s": float(np.mean(samples_a)),
                        "throughput_samples": samples_a}]}


def test_compare_uses_the_gate_noise_test_and_threshold() -> None:
    rng = np.random.default_rng(7)
    a = list(1000 + rng.normal(0, 20, 10))
    same = list(1000 + rng.normal(0, 20, 10))
    slower = list(800 + rng.normal(0, 20, 10))
    slight = list(985 + rng.normal(0, 5, 10))
    assert compare_sweeps(_doc(a, x=1), _doc(same, x=2))["different"] is False
    c = compare_sweeps(_doc(a, x=1), _doc(slower, x=1))
    assert c["different"] is True and c["config_diff"] == {} and c["levels"][0]["change"] < -0.15
    # beyond noise but within the threshold (the gate's 5%) is no difference
    c = compare_sweeps(_doc(a), _doc(slight))
    assert c["threshold_pct"] == 5.0 and c["levels"][0]["significant"] is False
    # too few samples: the noise test cannot decide, nothing is called different
    c = compare_sweeps(_doc([1000.0, 1001.0]), _doc([500.0, 501.0]))
    assert c["levels"][0]["decided"] is False and c["different"] is False


class FakeNvml(SimpleNamespace):
    """pynvml's calls the sampler makes, with fixed answers per GPU."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self) -> None:
        super().__init__(calls=0)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA RTX PRO 6000 Blackwell"

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 600_000

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self.calls += 1
        return 230_000 + 10_000 * h

    def nvmlDeviceGetClockInfo(self, h: int, which: int) -> int:
        return 2400 if which == self.NVML_CLOCK_SM else 14000

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=97, memory=40)


def test_gpu_sampler_with_a_fake_nvml_and_the_power_note() -> None:
    from traceinspect.capture.nvml import GpuSampler, server_gpus, summarize

    assert server_gpus({"base_gpu_id": 2, "gpu_id_step": 1}, 2) == [2, 3]
    assert server_gpus({}, 4) == [0, 1, 2, 3]
    fake = FakeNvml()
    s = GpuSampler(fake, [0, 1])
    s.sample_once()
    s.sample_once()
    g = summarize(s.stop())
    assert g["power_w"] == 235.0 and g["power_limit_w"] == 600.0 and g["sm_clock_mhz"] == 2400.0
    assert g["gpu_util_pct"] == 97.0 and [x["samples"] for x in g["gpus"]] == [2, 2]
    note = power_note(g, SweepSettings())
    assert note.startswith("the GPUs draw 235 W of their 600 W limit (39%) while 97% busy")
    assert power_note({**g, "power_w": 560.0}, SweepSettings()) is None  # near the limit: compute-bound
    assert power_note({**g, "gpu_util_pct": 20.0}, SweepSettings()) is None  # idle, not busy


@pytest.mark.timeout(120)
def test_gpu_power_is_sampled_through_nvml_during_each_window(servers: dict[str, Standin], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A local server's GPUs (base_gpu_id..., one per rank) are sampled during each window; a GPU busy at
    well under its power limit is named."""
    import types

    from traceinspect.capture.sweep import SweepOptions, run_sweep
    from traceinspect.render.sweep import render_sweep_html

    fake = FakeNvml()
    mod = types.ModuleType("pynvml")
    for name in dir(fake):
        if name.startswith(("nvml", "NVML")):
            setattr(mod, name, getattr(fake, name))
    mod.nvmlInit = lambda: None
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    opts = SweepOptions(url=servers["one"].url, out=tmp_path / "s", levels=[1, 2], input=8, output=64,
                        steps=0, window_s=1.0, settle_s=0.2)
    doc, code = run_sweep(opts)
    assert code == 0, doc
    assert doc["gpu_note"].startswith("GPUs 0, 1 sampled through NVML")
    for lv in doc["levels"]:
        assert lv["power_w"] == 235.0 and lv["power_limit_w"] == 600.0 and lv["sm_clock_mhz"] == 2400.0
        assert [g["index"] for g in lv["gpus"]] == [0, 1] and all(g["samples"] >= 1 for g in lv["gpus"])
        assert "235 W of their 600 W limit" in lv["power_note"]
    assert fake.calls >= 4
    html = render_sweep_html(doc)
    assert html.count('data-series="power"') == 2 and "limit 600 W" in html


def test_sweep_settings_are_validated(tmp_path: Path) -> None:
    assert SweepSettings.load() == SweepSettings()
    bad = tmp_path / "s.yaml"
    bad.write_text("knee_growth_per_doubling: -1\n")
    with pytest.raises(Exception, match="knee_growth_per_doubling must be a positive number"):
        SweepSettings.load(bad)
    bad.write_text("knee: 1\n")
    with pytest.raises(Exception, match="unknown settings knee"):
        SweepSettings.load(bad)


def test_load_state_from_metrics_when_there_is_no_v1_loads() -> None:
    from traceinspect.capture.client import SGLangClient

    metrics = ('sglang:num_running_reqs{model_name="m",dp_rank="0"} 100.0\n'
               'sglang:num_running_reqs{model_name="m",dp_rank="1"} 28.0\n'
               'sglang:num_queue_reqs{model_name="m"} 7.0\nsglang:token_usage{model_name="m"} 0.42\n')

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(404, json={"detail": "Not Found"})

    c = SGLangClient("http://x:1", transport=httpx.MockTransport(handler))
    st = c.load_state()
    assert (st["running"], st["waiting"], st["token_usage"], st["source"]) == (128, 7, 0.42, "/metrics")


def test_between_steps_share() -> None:
    from traceinspect.measure.between import between_steps

    steps = pd.DataFrame({
        "rank": [0, 0, 0, 0, 1, 1], "idx": [0, 1, 2, 3, 0, 1],
        "phase": ["decode", "decode", "prefill", "decode", "decode", "decode"],
        "gpu_start": [0.0, 1100.0, 2200.0, 3000.0, 0.0, 1050.0],
        "gpu_end": [1000.0, 2000.0, 2900.0, 4000.0, 1000.0, 2000.0],
    })
    b = between_steps(steps, "decode")
    # pairs: rank 0 (0,1): gap 100 of 1100; rank 1 (0,1): gap 50 of 1050; pairs across the prefill do not count
    assert b["between_pairs"] == 2 and b["between_us"] == 75.0 and b["cycle_us"] == 1075.0
    assert b["between_share"] == pytest.approx(150 / 2150, abs=1e-6)
    assert between_steps(steps.iloc[:1], "decode")["between_share"] is None



def test_sweep_html_escapes_server_text_and_has_no_non_finite_numbers() -> None:
    from traceinspect.render.sweep import render_sweep_html

    evil = "<script>alert(1)</script>"
    doc = {"schema": "traceinspect.sweep/1", "url": "http://h:1", "tool": {"version": "x"},
           "load": {"input": 1, "output": 2, "window_s": 1.0}, "server_config": {"served_model_name": evil},
           "model": {"experts": None, "top_k": None, "note": "unknown: no model config"}, "gpu_note": None,
           "levels": [{"concurrency": 1, "status": "failed", "error": f"cannot reach {evil}",
                       "output_tokens_per_s": float("nan")}], "knee": None, "warnings": [evil]}
    html = render_sweep_html(doc)
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "NaN" not in html and "inf" not in html.split("<style>")[0]
    assert "per-expert M: unknown: no model config" in html
