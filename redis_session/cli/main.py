"""The `redis-session` command line: `app` with every command on it, and `main`, its entry point.

The commands live by what they do: `cli.inspection` (ls, show, tail, doctor), `cli.writes` (branch,
export, import, repair), `cli.workers` (projector, compactor, archive, restore), `cli.serve`
(gateway, up, demo), `cli.server` (the embedded server, redis-cli); what they share is in
`cli.common`. Errors are one clear line on stderr and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, NoReturn

from ..errors import SessionError, StoreUnavailableError
from .common import CliError, app, err

# The command modules register their commands on `app` as they load, in the order --help lists them.
# isort: off
from . import inspection, writes, workers, serve, server  # noqa: F401
# isort: on


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; turn every expected failure into one line and exit code 1."""
    from .._startup import restore

    restore()  # a Ctrl-C from here on is a KeyboardInterrupt, turned into a quiet 130 (or a stop)
    try:
        code = app(args=argv, standalone_mode=False)
        sys.stdout.flush()  # a closed pipe shows here for output still buffered
    except SystemExit as e:
        if _click_saw_closed_stdout(e):
            _quiet_exit_on_closed_stdout()
        raise
    except BaseException as e:
        if _closed_stdout(e):
            _quiet_exit_on_closed_stdout()
        if _is_usage_error(e):
            _usage_error(e)
        _fail(e)
    raise SystemExit(code if isinstance(code, int) else 0)


EXIT_CLOSED_STDOUT = 141
"""The exit code of every command whose reader closed stdout (``| head``): 128 + SIGPIPE, what
coreutils' commands exit with there; nothing is printed."""


def _closed_stdout(e: BaseException) -> bool:
    """A `BrokenPipeError` anywhere in `e` (task groups nest it in exception groups)."""
    if isinstance(e, BaseExceptionGroup):
        return any(_closed_stdout(x) for x in e.exceptions)
    return isinstance(e, BrokenPipeError)


def _click_saw_closed_stdout(e: SystemExit) -> bool:
    """click turns an EPIPE out of a command into `sys.exit(1)` after wrapping stdout in its
    (private) `PacifyFlushWrapper`; that wrapper is how it is told from a command's own exit 1."""
    return e.code == 1 and type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _quiet_exit_on_closed_stdout() -> NoReturn:
    # stdout goes to /dev/null, so that the interpreter's last flush of what is still buffered
    # does not fail again ("Exception ignored ... BrokenPipeError", exit 120)
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(EXIT_CLOSED_STDOUT) from None


def _is_usage_error(e: BaseException) -> bool:
    """A click (typer's vendored click) usage error or abort: duck-typed, the classes are private."""
    return type(e).__name__ == "Abort" or (hasattr(e, "format_message") and hasattr(e, "exit_code"))


def _usage_error(e: Any) -> NoReturn:
    if type(e).__name__ == "Abort":
        raise SystemExit(130) from None
    if type(e).__name__ == "NoArgsIsHelpError":
        e.show()
        raise SystemExit(2) from None
    ctx = getattr(e, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    msg = " ".join(str(e.format_message()).split())
    err.print("[red]error:[/red] ", end="", highlight=False)
    err.print(msg + hint, highlight=False, markup=False)
    raise SystemExit(int(e.exit_code)) from None


def _fail(e: BaseException) -> NoReturn:
    """One line on stderr and exit 1 for an expected failure; anything else is a bug: re-raised."""
    from redis.exceptions import RedisError

    from ..redis.embedded import EmbeddedServerError

    expected = (CliError, SessionError, EmbeddedServerError, StoreUnavailableError, OSError, ValueError, RedisError)
    leaf = _leaf(e)
    if isinstance(leaf, KeyboardInterrupt):
        raise SystemExit(130) from None
    if not isinstance(leaf, expected):
        raise e
    msg = " ".join(str(leaf).split()) or type(leaf).__name__
    err.print("[red]error:[/red] ", end="", highlight=False)
    err.print(msg, highlight=False, markup=False)
    raise SystemExit(1) from None


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups from task groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


__all__ = ["EXIT_CLOSED_STDOUT", "app", "main"]

if __name__ == "__main__":
    main()
