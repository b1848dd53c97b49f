"""What every `redis-session` command shares: the typer apps, the two consoles, the options,
`CliError`, the store a command opens, and its output (one JSON document per line, or a table).

Every command takes ``--url`` (default ``$REDIS_URL``, else the user's embedded server, see
`redis_session.redis.embedded`) and ``--prefix``. Human output fits the terminal when there is one
and is never wrapped when piped; ``--json`` output is one JSON document per line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import typer
from rich.console import Console
from rich.table import Table

# -h as well as --help, on every command (click passes it down to the subcommands' contexts).
# Help on a terminal is rich's; piped (``redis-session -h | cat``, a script grepping it) it is
# click's plain text: no ANSI escapes, no box drawing, no padding to the width, never wrapped.
_PLAIN_HELP = not sys.stdout.isatty()
_CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}
if _PLAIN_HELP:
    _CONTEXT.update(terminal_width=100_000, max_content_width=100_000)
_MARKUP: Any = None if _PLAIN_HELP else "rich"
app = typer.Typer(
    name="redis-session",
    help="A distributed event store for AI-agent sessions on Redis Streams.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=_CONTEXT,
    rich_markup_mode=_MARKUP,
)
server_app = typer.Typer(
    help="The embedded server alone (one per user; --dir for another data folder).",
    no_args_is_help=True,
    context_settings=_CONTEXT,
    rich_markup_mode=_MARKUP,
)
app.add_typer(server_app, name="server")


class _Stdout(Console):
    """stdout's console: a reader closing the pipe raises `BrokenPipeError` (rich's default is
    `SystemExit(1)`), which `main` turns into the one quiet exit every command shares."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(32, "Broken pipe")


# piped output is never wrapped (soft_wrap); a terminal's width is used when there is one
out = _Stdout(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=True)


def _url_arg(value: str | None) -> str | None:
    """A ``redis://`` / ``rediss://`` URL whose database part (the path) is no non-negative integer
    is refused: redis-py ignores such a path (``/abc``, ``/1x``, ``/3.5``) and would use database 0.
    Everything else about the URL is checked where it is used (the scheme, the server's answer)."""
    from urllib.parse import unquote, urlsplit

    if not value or not value.lower().startswith(("redis://", "rediss://")):
        return value
    try:
        path = urlsplit(value).path
    except ValueError:
        return value  # redis-py says what is wrong with it
    db = unquote(path)[1:] if path.startswith("/") else unquote(path)
    if db and not (db.isascii() and db.isdigit()):
        # (the URL itself is not printed: it may hold a password)
        raise CliError(
            f"--url (or $REDIS_URL): the database part {path!r} is not a non-negative integer; give one "
            "(redis://HOST:PORT/0 for database 0), or no path"
        )
    return value


UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="REDIS_URL", callback=_url_arg, help="redis:// URL; default: the embedded server."),
]
PrefixOpt = Annotated[str, typer.Option("--prefix", envvar="REDIS_SESSION_PREFIX", help="Key prefix.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document per line (never wrapped).")]
DirOpt = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        "--data-dir",
        help="Data folder of the embedded server (default: $REDIS_SESSION_HOME, else the user data dir).",
    ),
]
TokensOpt = Annotated[
    Path | None,
    typer.Option(
        "--tokens",
        help="Token file: lines 'TOKEN [read|write|admin [PREFIX]]' or JSON (see docs); "
        "$REDIS_SESSION_TOKENS is read too.",
    ),
]
# a TCP port at the option: out of range is a usage error naming the option (bind() would raise
# OverflowError deep in a task group, and uvicorn would silently take the port modulo 65536)
PORT_RANGE: dict[str, Any] = {"min": 0, "max": 65535}
MetricsPortOpt = Annotated[
    int | None, typer.Option(min=1, max=65535, help="Serve Prometheus metrics on this port (1-65535).")
]
T = TypeVar("T")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", "-V", help="Print the version and exit.")] = False,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="Use the embedded server of this data folder (e.g. ./.redis-session for a project-local one) "
            "instead of the user's ($REDIS_SESSION_HOME).",
        ),
    ] = None,
) -> None:
    """A distributed event store for AI-agent sessions on Redis Streams."""
    # --version alone (an argument after it is no command: click refuses it before this runs)
    if version:
        if ctx.invoked_subcommand is not None:
            ctx.fail(f"--version takes no command or argument (got {ctx.invoked_subcommand!r})")
        from .. import __version__

        sys.stdout.write(f"redis-session {__version__}\n")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:  # options alone (`redis-session --dir D`): a command is missing
        ctx.fail("Missing command.")  # what click says without invoke_without_command
    if data_dir is not None:
        os.environ["REDIS_SESSION_HOME"] = str(data_dir.expanduser().resolve())


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


def announce(line: str) -> None:
    err.print(line, highlight=False, markup=False)


def connect_store(url: str | None, prefix: str, **options: Any) -> Any:
    from ..redis.connect import open_store

    return open_store(url, prefix=prefix, announce=announce, **options)


def emit_json(value: Any) -> None:
    """One JSON document on one line of stdout, whatever the terminal (never through rich)."""
    sys.stdout.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")


def emit_table(table: Table) -> None:
    """A table at the terminal's width; piped, at its natural width (columns never squashed)."""
    if out.is_terminal:
        out.print(table)
        return
    buf = io.StringIO()
    Console(file=buf, width=100_000, soft_wrap=True, color_system=None).print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))


def head_json(head: Any) -> dict[str, Any]:
    hd = head.header
    return {
        "id": hd.id,
        "n": head.n,
        "title": hd.title,
        "created_at": hd.created_at,
        "updated_at": head.updated_at,
        "parent": hd.parent,
        "at": hd.at,
        "last_cut": head.last_cut,
    }


@contextlib.asynccontextmanager
async def opened(url: str | None, prefix: str, **options: Any) -> AsyncIterator[Any]:
    """The store for one command, closed after it."""
    store = connect_store(url, prefix, **options)
    try:
        yield store
    finally:
        await store.aclose()


def open_sessions(url: str | None, prefix: str) -> Any:
    from ..sessions import Sessions

    return Sessions(connect_store(url, prefix))


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on a terminal's stderr; nothing at all when stderr is not one."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield on_progress


def fmt_ms(ms: int) -> str:
    import datetime as dt

    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def short(value: Any, limit: int = 100) -> str:
    try:
        import msgspec

        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
