"""Imported first by the package: while the ``redis-session`` command is still importing (about
half a second of it is this package's imports, before any of the CLI's code runs), a Ctrl-C exits
quietly with 130 (128 + SIGINT) instead of printing a KeyboardInterrupt traceback from an import
(also as ``python -m redis_session.cli``).
`redis_session.cli.main` puts Python's own SIGINT handler back as soon as it runs. A program that
merely imports the library (any other ``argv[0]``) is left alone."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from types import FrameType

COMMAND = "redis-session"


def _quiet_exit(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(130)


MODULES = ("redis_session.cli",)  # ``python -m redis_session.cli``: the same command


def _is_the_command() -> bool:
    if sys.argv and os.path.basename(sys.argv[0]) == COMMAND:
        return True
    # ``python [options] -m redis_session.cli …``: while the package imports, argv[0] is still "-m"
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b in MODULES for a, b in itertools.pairwise(argv))


if _is_the_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _quiet_exit)


def restore() -> None:
    """Python's own SIGINT handler again (KeyboardInterrupt), once the command's code runs."""
    if signal.getsignal(signal.SIGINT) is _quiet_exit:
        signal.signal(signal.SIGINT, signal.default_int_handler)
