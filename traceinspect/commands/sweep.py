"""``traceinspect sweep``: a load sweep of a live SGLang server, level by level, and two sweeps compared."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from traceinspect.capture.options import DEFAULT_STEPS


@click.command("sweep")
@click.option("--url", default=None, help="The SGLang server, e.g. http://127.0.0.1:30000.")
@click.option("--concurrency", "concurrency", default=None, metavar="N,N,...",
              help="Levels: requests kept in flight, e.g. 256,512,1024,2048 (no rate limit; 1 is one at a time).")
@click.option("--out", "out", default=None, type=click.Path(file_okay=False),
              help="Sweep directory: sweep.json, and level-N/ with each level's trace and analysis.")
@click.option("--input", "input_len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Prompt tokens per request.")
@click.option("--output", "output_len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Output tokens per request (ignore_eos).")
@click.option("--expect", "expect", multiple=True, metavar="KEY=VALUE",
              help="Check the live server's /server_info first: exit 2 naming each key whose value differs, "
                   "before any load is sent (repeatable).")
@click.option("--steps", type=click.IntRange(min=0), default=DEFAULT_STEPS, show_default=True,
              help="Decode steps to capture and analyse per level; 0: measure only.")
@click.option("--window", "window", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds each level is measured once its running batch is steady.")
@click.option("--settle", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="At least this many seconds from a level's running batch reaching its size to its window; "
                   "then until the throughput is steady.")
@click.option("--ramp-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for a level's running batch.")
@click.option("--timeout", "capture_timeout", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Seconds to wait for a level's trace files.")
@click.option("--gpus", default=None, metavar="I,I,...",
              help="NVML indices of the server's GPUs (default: base_gpu_id, gpu_id_step of server_info).")
@click.option("--api-key", envvar="TRACEINSPECT_API_KEY", default=None, metavar="KEY",
              help="Bearer key (the server's --api-key); also TRACEINSPECT_API_KEY. Never written to disk.")
@click.option("--admin-api-key", envvar="TRACEINSPECT_ADMIN_API_KEY", default=None, metavar="KEY",
              help="The server's --admin-api-key, for the profiling endpoints; also TRACEINSPECT_ADMIN_API_KEY.")
@click.option("--compare", "compare", nargs=2, default=None, metavar="DIR_A DIR_B",
              help="Compare two sweeps level by level instead of running one.")
@click.option("--threshold", default=None, metavar="PCT",
              help="--compare: the smallest throughput change that counts (default: the gate's step threshold).")
@click.option("--settings", "settings_path", default=None, type=click.Path(dir_okay=False),
              help="Sweep settings YAML (default rules/tables/sweep.yaml).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), help="Write the HTML report here.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines.")
def sweep_cmd(url: str | None, concurrency: str | None, out: str | None, input_len: int, output_len: int,
              expect: tuple[str, ...], steps: int, window: float, settle: float, ramp_timeout: float, capture_timeout: float,
              gpus: str | None, api_key: str | None, admin_api_key: str | None, compare: tuple[str, str] | None,
              threshold: str | None, settings_path: str | None, json_path: str | None, html_path: str | None,
              quiet: bool) -> None:
    """Measure a live SGLang server at each concurrency level: throughput, latencies, what caps the running batch, GPU power, and each level's decode steps.

    Checks --expect first. For each level it keeps exactly N streamed requests in flight, waits for the
    running batch, measures over --window, captures --steps decode steps and, after the last level,
    analyses them. Writes OUT/sweep.json after every level; exits 2 when a level failed (the levels
    before it are kept). With --compare DIR_A DIR_B, compares two sweeps level by level with the gate's
    noise test.
    """
    from traceinspect.capture.errors import ConfigError
    from traceinspect.capture.layout import redact_argv
    from traceinspect.capture.sweep_levels import SweepSettings

    settings = SweepSettings.load(settings_path)
    if compare:
        _compare(compare, threshold, json_path)
        return
    missing = [name for name, v in (("--url", url), ("--concurrency", concurrency), ("--out", out)) if not v]
    if missing:
        raise ConfigError(f"sweep needs {', '.join(missing)} (or --compare DIR_A DIR_B)")
    from traceinspect.capture.sweep import SweepOptions, run_sweep
    from traceinspect.capture.sweep_levels import parse_levels
    from traceinspect.capture.ui import CaptureUI
    from traceinspect.render.sweep import render_terminal, write_sweep_html

    pairs = []
    for e in expect:
        key, sep, value = e.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{e!r}: expected KEY=VALUE", param_hint="--expect")
        pairs.append((key.strip(), value.strip()))
    gpu_list = None
    if gpus:
        try:
            gpu_list = [int(x) for x in gpus.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--gpus: expected indices like 0,1,2,3, got {gpus!r}") from None
    secrets = tuple(k for k in (api_key, admin_api_key) if k)
    assert url is not None and concurrency is not None and out is not None
    opts = SweepOptions(url=url, out=out, levels=parse_levels(concurrency), input=input_len, output=output_len,
                        expect=tuple(pairs), steps=steps, window_s=window, settle_s=settle, ramp_timeout_s=ramp_timeout,
                        capture_timeout_s=capture_timeout, api_key=api_key, admin_api_key=admin_api_key,
                        gpus=gpu_list, command=redact_argv(["sweep", *sys.argv[2:]], secrets), settings=settings)
    doc, code = run_sweep(opts, CaptureUI(quiet=quiet, secrets=secrets))
    render_terminal(doc)
    if json_path:
        from traceinspect.capture.layout import atomic_write_json

        atomic_write_json(Path(json_path), doc)
    if html_path:
        write_sweep_html(doc, html_path)
    if code:
        failed = [lv for lv in doc["levels"] if lv.get("status") != "ok"]
        first = failed[0] if failed else {}
        click.echo(f"error: sweep incomplete: level {first.get('concurrency')}: {first.get('error')} "
                   f"({Path(out) / 'sweep.json'} keeps every level measured)", err=True)
        sys.exit(code)


def _compare(dirs: tuple[str, str], threshold: str | None, json_path: str | None) -> None:
    from traceinspect.capture.errors import ConfigError
    from traceinspect.capture.sweep import compare_sweeps, load_sweep
    from traceinspect.render.sweep import render_compare_terminal

    thr = None
    if threshold is not None:
        try:
            thr = float(threshold.strip().rstrip("%"))
        except ValueError:
            raise ConfigError(f"--threshold: expected a percentage like 5%, got {threshold!r}") from None
    a, b = load_sweep(dirs[0]), load_sweep(dirs[1])
    cmp = compare_sweeps(a, b, threshold_pct=thr)
    render_compare_terminal(cmp)
    if json_path:
        from traceinspect.capture.layout import atomic_write_json

        atomic_write_json(Path(json_path), cmp)
