"""The ``traceinspect`` command line. Subcommands live beside the stage they drive and are imported
only when used, so ``traceinspect --help`` starts fast."""

from __future__ import annotations

import os

# OpenBLAS's worker threads spin on the few cores and take CPU from the trace reader; nothing here uses BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import contextlib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402

from traceinspect.errors import TraceInspectError  # noqa: E402
from traceinspect.version import __version__  # noqa: E402

# name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "analyze": "traceinspect.commands.analyze:analyze_cmd",
    "classify": "traceinspect.commands.classify:classify_cmd",
    "report": "traceinspect.commands.report:report_cmd",
    "rules": "traceinspect.commands.rules:rules_cmd",
    "diff": "traceinspect.commands.gate:diff_cmd",
    "gate": "traceinspect.commands.gate:gate_cmd",
    "capture": "traceinspect.commands.capture:capture_cmd",
    "doctor": "traceinspect.commands.doctor:doctor_cmd",
    "cache": "traceinspect.commands.cache:cache_cmd",
    "whatif": "traceinspect.commands.whatif:whatif_cmd",
    "sweep": "traceinspect.commands.sweep:sweep_cmd",
}

# name -> the first sentence of its help: the command list of ``traceinspect --help`` without importing every
# command (tests/test_startup.py checks them against the commands' own help)
SUMMARIES: dict[str, str] = {
    "analyze": "Analyse the decode steps of a trace set (a directory, rank files, or globs).",
    "cache": "The parsed-table cache ($TRACEINSPECT_CACHE; limit $TRACEINSPECT_CACHE_MAX, default 2GB).",
    "capture": "Profile STEPS forward steps of every rank of a running SGLang server.",
    "classify": "Print each kernel name with its class, evidence, time and calls.",
    "diff": "Show what changed from BASE to CAND: step time, GPU time per class per step, per-shape GEMM "
            "efficiency, findings added/removed/changed.",
    "doctor": "Explain what is usable in a trace set before analysing it: ranks, steps, recorded shapes, "
              "CUDA-graph replay and capture traces, server_info, clock offsets, classification coverage.",
    "gate": "Fail (exit 1) when CAND regressed against BASE beyond thresholds, floor and step-to-step noise, or "
            "has new findings at or above --fail-on.",
    "report": "Write the HTML report of a trace set (a directory, rank files, or globs) or of a stored analysis "
              "JSON (``analyze --json``; the same page as from its traces): the top finding, run metadata, "
              "findings with evidence and fixes, time by class per rank, a step timeline, GEMM efficiency, "
              "collectives, top kernels, classification coverage and the command that made it.",
    "rules": "List, show, test and explain the diagnostic rules (rules/*.yaml).",
    "sweep": "Measure a live SGLang server at each concurrency level: throughput, latencies, what caps the running "
             "batch, GPU power, and each level's decode steps.",
    "whatif": "Predict the step time after a fix by replaying the trace with edits (none: replay as measured).",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self._resolvable(name))

    @staticmethod
    def _resolvable(name: str) -> bool:
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list as click writes it, from :data:`SUMMARIES` (a command without one is imported)."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for name in names:
            text = SUMMARIES.get(name)
            if text is None:
                cmd = self.get_command(ctx, name)
                if cmd is None or cmd.hidden:
                    continue
                rows.append((name, cmd.get_short_help_str(limit)))
            else:
                # click's own shortening, through the public Command API (its helper in click.utils is
                # deprecated and warns on import)
                rows.append((name, click.Command(name, help=text).get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None or not self._resolvable(name):
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="traceinspect")
def cli() -> None:
    """Find out why LLM inference is slow, from torch-profiler traces of decode steps."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; unusable input prints one line and exits 2."""
    try:
        rc = cli.main(args=argv, prog_name="traceinspect", standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except TraceInspectError as e:
        click.echo(f"traceinspect: error: {e.one_line()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("traceinspect: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code == 2 else e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        sys.exit(0)


class _PandasWithoutArrow:
    """An import finder that hides pyarrow from pandas' own import, and only from it.

    pandas 3 imports pyarrow as it imports itself (about 50 ms of start-up, a tenth of a 100 MB trace's
    analysis on two cores) to back the string columns it infers with Arrow arrays. The tables here hold
    text as categoricals and object arrays and never ask for Arrow storage; with pyarrow hidden, pandas
    keeps inferred strings in its Python storage, whose values, order and missing values are the same.
    pyarrow stays importable afterwards (the parsed-table cache imports it directly), and the finder
    leaves ``sys.meta_path`` once pandas is imported. Installed by the console entry point only (:func:`run`): a program that
    imports traceinspect as a library keeps its pandas as it is."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        pandas = sys.modules.get("pandas")
        importing = getattr(getattr(pandas, "__spec__", None), "_initializing", False)
        if pandas is not None and not importing:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        elif importing and name.partition(".")[0] == "pyarrow":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from pandas' import)", name=name)
        return None


def hide_pyarrow_from_pandas() -> None:
    """Hide pyarrow from pandas' import to come (:class:`_PandasWithoutArrow`); nothing if pandas is imported."""
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _PandasWithoutArrow())


def run() -> None:
    """Console entry point: :func:`main`, then a prompt exit. An analysis leaves a large heap of tables
    behind; freeing it object by object at interpreter shutdown takes a noticeable part of a second
    and serves nothing, so the process ends once its output is flushed. The cyclic garbage collector is
    off for the run: a command builds its tables once and exits; the collector's passes over every
    object of the imported libraries and the tables (a few hundred of them, a tenth of a 5 MB trace's
    analysis) free next to nothing (the tables hold no reference cycles)."""
    import gc

    gc.disable()
    hide_pyarrow_from_pandas()

    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            click.echo(str(e.code), err=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
            stream.flush()
    os._exit(code)

