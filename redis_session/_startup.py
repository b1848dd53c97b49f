"""Imported first by the package: while the ``redis-session`` command is still importing (about
half a second of it is this package's imports, before any of the CLI's code runs), a Ctrl-C exits
quietly with 130 (128 + SIGINT) instead of printing a KeyboardInterrupt traceback from an import.
`redis_session.cli.main` puts Python's own SIGINT handler back as soon as it runs. A program that
merely imports the library (any other ``argv[0]``) is left alone."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

COMMAND = "redis-session"


def _quiet_exit(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(130)


def _is_the_command() -> bool:
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == COMMAND


if _is_the_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _quiet_exit)


def restore() -> None:
    """Python's own SIGINT handler again (KeyboardInterrupt), once the command's code runs."""
    if signal.getsignal(signal.SIGINT) is _quiet_exit:
        signal.signal(signal.SIGINT, signal.default_int_handler)
