"""``traceinspect capture``: profile a live SGLang server's decode steps into a trace set."""

from __future__ import annotations

from typing import Any

import click

from traceinspect.capture.options import DEFAULT_STEPS


@click.command("capture")
@click.option("--url", required=True, help="The SGLang server, e.g. http://127.0.0.1:30000.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Capture directory; must be on a filesystem the server writes to.")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULT_STEPS, show_default=True,
              help="Forward steps to record on each rank (SGLang num_steps). The default gives the gate's "
                   "noise test enough analysed steps (the first and last are not analysed).")
@click.option("--expect", "expect", multiple=True, metavar="KEY=VALUE",
              help="Check the live server's /server_info before profiling: exit 2 naming each key whose "
                   "value differs (repeatable; a.b.0 reaches nested values).")
@click.option("--phase", type=click.Choice(["decode", "all"]), default="decode", show_default=True,
              help="decode: SGLang profile_by_stage, -DECODE files; all: the next N batches of any kind.")
@click.option("--api-key", envvar="TRACEINSPECT_API_KEY", default=None, metavar="KEY",
              help="Bearer key (the server's --api-key); also TRACEINSPECT_API_KEY. Never written to disk.")
@click.option("--admin-api-key", envvar="TRACEINSPECT_ADMIN_API_KEY", default=None, metavar="KEY",
              help="The server's --admin-api-key, for /start_profile and /stop_profile when it has one; "
                   "also TRACEINSPECT_ADMIN_API_KEY. Never written to disk.")
@click.option("--load", "load", default=None, metavar="SPEC",
              help="Drive traffic: concurrency=N,input=N,output=N[,prompts=N][,driver=builtin|bench_serving].")
@click.option("--analyze", is_flag=True, help="Analyze the capture right away (analysis.json, report.html).")
@click.option("--prefix", default="traceinspect", show_default=True,
              help="profile_prefix for the file names (a plain name, no path separators).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for every rank file after /start_profile.")
@click.option("--ramp-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds to wait for the running batch to reach its target before profiling.")
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Without --load: the running batch to wait for before profiling.")
@click.option("--record-shapes/--no-record-shapes", default=True, show_default=True)
@click.option("--with-stack/--no-with-stack", default=False, show_default=True)
@click.option("--activities", default="CPU,GPU", show_default=True, help="Profiler activities (CPU,GPU,MEM,...).")
@click.option("--server-out-dir", default=None, metavar="PATH",
              help="The capture directory as the server sees it, when it is mounted at another path there.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors.")
def capture_cmd(url: str, out: str, steps: int, expect: tuple[str, ...], phase: str, api_key: str | None, admin_api_key: str | None,
                load: str | None, analyze: bool,
                prefix: str, timeout: float, ramp_timeout: float, min_batch: int, record_shapes: bool,
                with_stack: bool, activities: str, server_out_dir: str | None, quiet: bool) -> None:
    """Profile STEPS forward steps of every rank of a running SGLang server.

    Saves server_info.json, waits for every rank's trace file, and records the outcome in
    capture.json. Exits 2 when the capture is incomplete, 130 when interrupted by Ctrl-C and 143 by
    SIGTERM (the load and the profile are stopped and what was written is kept, marked incomplete).
    """
    from traceinspect.capture.layout import redact_argv
    from traceinspect.capture.options import CaptureOptions
    from traceinspect.capture.session import run_capture
    from traceinspect.capture.traffic import TrafficSpec
    from traceinspect.capture.ui import CaptureUI

    secrets = tuple(k for k in (api_key, admin_api_key) if k)
    pairs = []
    for e in expect:
        key, sep, value = e.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{e!r}: expected KEY=VALUE", param_hint="--expect")
        pairs.append((key.strip(), value.strip()))
    spec = TrafficSpec.parse(load) if load else None
    opts = CaptureOptions(
        url=url, out=out, steps=steps, expect=tuple(pairs), phase=phase, api_key=api_key, admin_api_key=admin_api_key, load=spec,
        analyze=analyze, prefix=prefix,
        timeout_s=timeout, ramp_timeout_s=ramp_timeout, min_batch=min_batch,
        activities=tuple(a.strip().upper() for a in activities.split(",") if a.strip()),
        record_shapes=record_shapes, with_stack=with_stack, server_out_dir=server_out_dir,
        command=redact_argv(_command_line(click.get_current_context()), secrets),
    )
    ui = CaptureUI(quiet=quiet, secrets=secrets)
    result = run_capture(opts, ui)
    click.echo(str(result.out_dir))


def _command_line(ctx: click.Context) -> list[str]:
    """The options given on the command line, as a command line (the API key is blanked later)."""
    from click.core import ParameterSource

    args = ["capture"]
    for param in ctx.command.params:
        name = param.name or ""
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        value: Any = ctx.params.get(name)
        if not isinstance(param, click.Option):
            continue
        if param.is_flag:
            if param.secondary_opts:
                args.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                args.append(param.opts[0])
            continue
        flag = max(param.opts, key=len)
        args += [flag, str(value)]
    return args
