"""Errors that the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from pathlib import Path


class TraceInspectError(Exception):
    """Base class for errors caused by unusable input; the CLI exits with code 2."""

    exit_code = 2

    def __init__(self, reason: str, path: str | Path | None = None) -> None:
        self.reason = " ".join(str(reason).split())  # always one line
        self.path = str(path) if path is not None else None
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class TraceInputError(TraceInspectError):
    """A trace file or trace set cannot be used (missing, corrupt, no kernels, no steps, ...)."""


class RuleError(TraceInspectError):
    """A rule file is malformed or names something unknown."""


class ConfigError(TraceInspectError):
    """A configuration file or command-line value is invalid."""
