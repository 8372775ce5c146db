"""Messages and progress for a capture: rich on a terminal, plain lines otherwise, or nothing."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO


class CaptureUI:
    """Where a capture reports. ``quiet`` drops info lines; live progress shows only on a terminal."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None, force_terminal: bool | None = None,
                 secrets: tuple[str, ...] = ()) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self._secrets = tuple(s for s in secrets if s)
        self._console: Any = None
        try:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=force_terminal, highlight=False,
                                    soft_wrap=True)
            self.is_terminal = bool(self._console.is_terminal)
        except ImportError:  # pragma: no cover - rich is a dependency
            self.is_terminal = bool(force_terminal) or self.stream.isatty()

    def _clean(self, msg: str) -> str:
        from traceinspect.capture.layout import redact_text

        return redact_text(msg, self._secrets)

    def _print(self, msg: str, style: str | None = None) -> None:
        msg = self._clean(msg)
        if self._console is not None:
            self._console.print(msg, style=style, markup=False)
        else:
            print(msg, file=self.stream, flush=True)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self._print(msg)

    def warn(self, msg: str) -> None:
        if not self.quiet:
            self._print(f"warning: {msg}", style="yellow")

    @contextlib.contextmanager
    def progress(self, description: str, total: int, unit: str) -> Iterator[Callable[[int, int, str], None]]:
        """A progress bar on a terminal; yields ``update(done, total, note)``. Silent elsewhere."""
        if self.quiet or not self.is_terminal or self._console is None:
            yield lambda done, tot, note: None
            return
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        cols = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total} " + unit), TimeElapsedColumn(),
                TextColumn("{task.fields[note]}", style="dim"))
        with Progress(*cols, console=self._console, transient=False) as prog:
            task = prog.add_task(description, total=max(total, 1), note="")

            def update(done: int, tot: int, note: str) -> None:
                prog.update(task, completed=max(0, min(done, tot)), total=max(tot, 1),
                            note=self._clean(note)[:80])

            yield update
