"""Errors users see: one line on stderr and a documented exit code (see README "Exit codes")."""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class KvtoolError(Exception):
    """An error with a one-line message meant for the user, never a traceback."""

    exit_code: int = EXIT_RUNTIME

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(KvtoolError):
    """Bad input or options (exit code 2)."""

    exit_code = EXIT_USAGE
