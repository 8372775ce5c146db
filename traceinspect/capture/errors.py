"""Errors raised while capturing traces from a live server (all exit 2 through the CLI, or 130 on Ctrl-C and
143 on SIGTERM)."""

from __future__ import annotations

from traceinspect.capture.interrupt import EXIT_CODES
from traceinspect.errors import ConfigError, TraceInspectError

__all__ = [
    "CaptureError",
    "ServerUnreachable",
    "AuthError",
    "ProfileRejected",
    "ServerMismatch",
    "CaptureIncomplete",
    "CaptureInterrupted",
    "ConfigError",
]


class CaptureError(TraceInspectError):
    """A capture could not be made."""


class ServerUnreachable(CaptureError):
    """The server refused the connection, timed out or is not an SGLang server."""


class AuthError(CaptureError):
    """The server answered 401/403: a missing or wrong API key."""


class ProfileRejected(CaptureError):
    """``/start_profile`` failed, usually because a profile is already in progress."""


class ServerMismatch(CaptureError):
    """The live server's configuration is not what ``--expect`` says (nothing was profiled)."""


class CaptureIncomplete(CaptureError):
    """The capture ended without every rank's file; ``capture.json`` says ``incomplete``."""


class CaptureInterrupted(CaptureIncomplete):
    """Ctrl-C or SIGTERM during a capture: the profile was stopped and what was written is kept. Exits 130
    (Ctrl-C) or 143 (SIGTERM)."""

    def __init__(self, message: str, signal_name: str = "Ctrl-C") -> None:
        super().__init__(message)
        self.exit_code = EXIT_CODES[signal_name]
