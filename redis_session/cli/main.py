"""The `redis-session` command line.

Every command takes ``--url`` (default ``$REDIS_URL``, else the user's embedded server, see
`redis_session.redis.embedded`) and ``--prefix``. Errors are one clear line on stderr and a
non-zero exit. Human output fits the terminal when there is one and is never wrapped when piped;
``--json`` output is one JSON document per line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import anyio
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import SessionError, StoreUnavailableError

# -h as well as --help, on every command (click passes it down to the subcommands' contexts)
_CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    name="redis-session",
    help="A distributed event store for AI-agent sessions on Redis Streams.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=_CONTEXT,
)
server_app = typer.Typer(
    help="The embedded server alone (one per user; --dir for another data folder).",
    no_args_is_help=True,
    context_settings=_CONTEXT,
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

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="REDIS_URL", help="redis:// URL; default: the embedded server."),
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


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        sys.stdout.write(f"redis-session {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
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
    if data_dir is not None:
        os.environ["REDIS_SESSION_HOME"] = str(data_dir.expanduser().resolve())


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


def _announce(line: str) -> None:
    err.print(line, highlight=False, markup=False)


def _store(url: str | None, prefix: str, **options: Any) -> Any:
    from ..redis.connect import open_store

    return open_store(url, prefix=prefix, announce=_announce, **options)


def _emit_json(value: Any) -> None:
    """One JSON document on one line of stdout, whatever the terminal (never through rich)."""
    sys.stdout.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")


def _emit_table(table: Table) -> None:
    """A table at the terminal's width; piped, at its natural width (columns never squashed)."""
    if out.is_terminal:
        out.print(table)
        return
    buf = io.StringIO()
    Console(file=buf, width=100_000, soft_wrap=True, color_system=None).print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))


def _head_json(head: Any) -> dict[str, Any]:
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
async def _opened(url: str | None, prefix: str, **options: Any) -> AsyncIterator[Any]:
    """The store for one command, closed after it."""
    store = _store(url, prefix, **options)
    try:
        yield store
    finally:
        await store.aclose()


async def _supervised(url: str | None, prefix: str, body: Callable[[Any], Awaitable[None]], **options: Any) -> None:
    """Run a long-lived command's `body(store)`.

    On the embedded server (no ``--url``/``$REDIS_URL``) its ``server.json`` is watched: when the
    server is replaced by one at another address, `body` is restarted on the new one; when none
    replaces it within `GONE_GRACE` seconds, the command ends with a one-line error instead of
    retrying a dead port forever."""
    if url:
        async with _opened(url, prefix, **options) as store:
            await body(store)
        return
    from ..redis.connect import resolve_url
    from ..redis.embedded import default_data_dir

    data_dir = default_data_dir()
    current = resolve_url(None, announce=_announce)
    while True:
        moved: list[str] = []
        async with _opened(current, prefix, **options) as store, anyio.create_task_group() as tg:

            async def watch(moved: list[str] = moved, url: str = current, scope: Any = tg.cancel_scope) -> None:
                moved.append(await _watch_embedded(data_dir, url))
                scope.cancel()

            tg.start_soon(watch)
            await body(store)
            tg.cancel_scope.cancel()
        if not moved:
            return
        current = moved[0]
        err.print(f"the embedded server moved to {current}; reconnected", highlight=False, markup=False)


GONE_GRACE = float(os.environ.get("REDIS_SESSION_GONE_GRACE") or 10.0)
WATCH_INTERVAL = float(os.environ.get("REDIS_SESSION_WATCH_INTERVAL") or 1.0)  # seconds between looks


async def _watch_embedded(data_dir: Path, url: str) -> str:
    """Wait until the embedded server of `data_dir` answers at another URL than `url`; return it.
    Raises `CliError` when no server answers there for `GONE_GRACE` seconds."""
    from ..redis.embedded import running_server

    gone_since: float | None = None
    while True:
        await anyio.sleep(WATCH_INTERVAL)
        found = await anyio.to_thread.run_sync(running_server, data_dir)
        now = anyio.current_time()
        if found is not None:
            if gone_since is not None and found.url == url:
                err.print(f"the embedded server is back at {url}", highlight=False, markup=False)
            gone_since = None
            if found.url != url:
                return found.url
            continue
        if gone_since is None:
            gone_since = now
            err.print(
                f"the embedded server at {url} stopped; waiting {GONE_GRACE:.0f}s for it to come back",
                highlight=False,
                markup=False,
            )
        elif now - gone_since >= GONE_GRACE:
            raise CliError(
                f"the embedded server at {url} stopped (data in {data_dir}); "
                "start it again (`redis-session server start`) and rerun this command"
            )


def _sessions(url: str | None, prefix: str) -> Any:
    from ..sessions import Sessions

    return Sessions(_store(url, prefix))


# --------------------------------------------------------------------------- inspection


@app.command("ls")
def ls_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    parent: Annotated[str | None, typer.Option(help="Only branches of this session.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    cursor: Annotated[str | None, typer.Option(help="Continue a previous listing.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, newest first."""

    async def main() -> tuple[list[Any], str | None]:
        from ..errors import SessionNotFoundError

        async with _opened(url, prefix) as store:
            if parent is not None and await store.head(parent) is None:
                raise SessionNotFoundError(parent)
            page = await store.list(parent=parent, limit=limit, cursor=cursor)
            heads = [await store.head(h.id) for h in page.items]
        return [h for h in heads if h is not None], page.cursor

    heads, more = _run(main)
    if as_json:
        for h in heads:
            _emit_json(_head_json(h))
    elif heads:
        _emit_table(_ls_table(heads))
    if not heads:
        where = f"session {parent!r} has no branches" if parent else f"no sessions under prefix {prefix!r}"
        err.print(where + (" on this page" if cursor else ""), highlight=False, markup=False)
    if more:
        err.print(f"more: --cursor '{more}'", highlight=False, markup=False)


def _ls_table(heads: list[Any]) -> Table:
    table = Table(box=None, pad_edge=False)
    widest = max((len(h.header.id) for h in heads), default=2)
    table.add_column("id", no_wrap=True, min_width=widest)  # ids are copied from here: whole
    table.add_column("n", no_wrap=True, justify="right")
    table.add_column("title", overflow="fold")
    table.add_column("created", no_wrap=True)
    table.add_column("parent@at", overflow="fold")
    for h in heads:
        hd = h.header
        table.add_row(
            hd.id, str(h.n), hd.title or "", _fmt_ms(hd.created_at), f"{hd.parent}@{hd.at}" if hd.parent else ""
        )
    return table


@app.command("show")
def show_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    messages: Annotated[bool, typer.Option("--messages", help="Show the derived messages.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="openai | anthropic | json (with --messages)")] = "json",
    start: Annotated[int, typer.Option(min=0, help="First entry n.")] = 0,
    stop: Annotated[int | None, typer.Option(min=0, help="Stop before this n.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a session's header and entries (or its derived messages)."""
    if fmt not in ("openai", "anthropic", "json"):
        raise CliError(f"--format must be openai, anthropic or json, not {fmt!r}")

    async def main() -> tuple[Any, Any]:
        import msgspec

        from ..errors import SessionNotFoundError

        async with _opened(url, prefix) as store:
            head = await store.head(session)
            if head is None:
                raise SessionNotFoundError(session)
            if not messages:
                return head, await store.read(session, start, stop)
            from ..snapshots import load_messages

            state, _ = await load_messages(store, session)
            msgs = state.messages()
            if fmt == "openai":
                from ..projection.render import to_openai

                return head, to_openai(msgs)
            if fmt == "anthropic":
                from ..projection.render import to_anthropic

                return head, to_anthropic(msgs)
            return head, msgspec.to_builtins(msgs)

    head, body = _run(main)
    if messages:
        if as_json:
            _emit_json(body)
        elif out.is_terminal:
            out.print_json(data=body)
        else:
            sys.stdout.write(json.dumps(body, ensure_ascii=False, indent=2) + "\n")
        return
    _show_entries(head, body, as_json)


def _show_entries(head: Any, entries: list[Any], as_json: bool) -> None:
    import msgspec

    if as_json:
        _emit_json(_head_json(head))
        for e in entries:
            sys.stdout.write(msgspec.json.encode(e).decode() + "\n")
        return
    hd = head.header
    last_cut = "-" if head.last_cut is None else str(head.last_cut)
    out.print(
        f"[bold]{hd.id}[/bold]  n={head.n}  last_cut={last_cut}  created={_fmt_ms(hd.created_at)}"
        + (f"  branch of {hd.parent}@{hd.at}" if hd.parent else ""),
        highlight=False,
    )
    if out.is_terminal:
        # one line per entry, cut to the terminal's width: a long session stays scannable
        # (the full entries: piped, or --json)
        for e in entries:
            data = _short(e.data, limit=100_000)
            line = Text.assemble((f"{e.n:>5} ", "dim"), (f"{e.type:<20}", "bold"), " ", data)
            out.print(line, no_wrap=True, overflow="ellipsis", highlight=False)
        return
    for e in entries:
        sys.stdout.write(msgspec.json.encode(e).decode() + "\n")


@app.command("tail")
def tail_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    start: Annotated[int | None, typer.Option("--from", min=0, help="Start at entry n (default: the end).")] = None,
    messages: Annotated[bool, typer.Option("--messages", help="Print derived messages, not raw entries.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help='One JSON document per line: entries, and {"delta": …} as answers stream.')
    ] = False,
) -> None:
    """Follow a session live; reconnects after a dropped connection without gaps or repeats."""
    if as_json and messages:
        raise CliError("--json prints entries: use it without --messages")

    async def main() -> None:
        from .tailview import TailPosition, run_tail

        position = TailPosition()  # kept across the stores `_supervised` re-resolves

        async def body(store: Any) -> None:
            await run_tail(
                store, session, start=start, messages=messages, console=out, as_json=as_json, position=position
            )

        await _supervised(url, prefix, body)

    try:
        _run(main)
    except KeyboardInterrupt:
        pass


@app.command("doctor")
def doctor_cmd(
    session: Annotated[str | None, typer.Argument(help="A session id, or --all.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Check every session.")] = False,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="First remove stale branch links (a branch cut short by a crash) and a replacing "
            "import's leftover staging copy.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check log invariants and storage consistency. Reports; repairs only stale links, with
    --repair (the log itself is never rewritten). Exit 1 on problems."""
    if (session is None) == (not all_):
        raise CliError("give a SESSION or --all")

    async def main() -> tuple[int, int]:
        from ..doctor import doctor
        from ..errors import SessionNotFoundError
        from ..keys import is_staging_id

        bad = checked = 0
        async with _opened(url, prefix) as store:
            ids = await _all_ids(store) if all_ else [session]
            for sid in ids:
                assert sid is not None
                if repair and is_staging_id(sid):  # a replacing import's leftover: never a session
                    await store.delete(sid)
                    (err if as_json else out).print(f"removed the staging copy {sid!r}", highlight=False)
                    continue
                if repair:
                    for child in await store.repair_links(sid):
                        (err if as_json else out).print(
                            f"[yellow]{sid}[/yellow] removed the stale link to branch {child!r}", highlight=False
                        )
                try:
                    report = await doctor(store, sid)
                except SessionNotFoundError:
                    if not all_ and not repair:
                        raise
                    continue  # deleted or expired since it was listed (or purged by the repair)
                checked += 1
                bad += not report.ok
                _doctor_report(sid, report, as_json)
        return checked, bad

    checked, bad = _run(main)
    line = f"{checked} session(s) checked, {bad} with problems"
    if as_json:
        err.print(line, highlight=False, markup=False)
    else:
        style = "green" if bad == 0 else "red"
        out.print(f"[{style}]{line}[/{style}]", highlight=False)
    if bad:
        raise typer.Exit(1)


async def _all_ids(store: Any) -> list[str | None]:
    ids: list[str | None] = []
    cursor = None
    while True:
        page = await store.list(limit=1000, cursor=cursor)
        ids += [h.id for h in page.items]
        cursor = page.cursor
        if cursor is None:
            return ids


def _doctor_report(sid: str, report: Any, as_json: bool) -> None:
    if as_json:
        problems = [{"n": p.n, "code": p.code, "message": p.message} for p in report.problems]
        _emit_json({"session": sid, "ok": report.ok, "problems": problems})
        return
    for p in report.problems:
        out.print(f"[red]{sid}[/red] n={p.n} {p.code}: {p.message}", highlight=False)


# --------------------------------------------------------------------------- writes


@app.command("branch")
def branch_cmd(
    session: str,
    at: Annotated[int, typer.Option("--at", min=0, help="Branch point: the child holds entries [0, at).")],
    branch_id: Annotated[str | None, typer.Option("--id", help="Id of the new branch.")] = None,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
) -> None:
    """Branch a session at entry AT (costs the same for any parent length)."""

    async def main() -> None:
        sessions = _sessions(url, prefix)
        try:
            b = await sessions.branch(session, at, branch_id=branch_id)
            out.print(b.id)
        finally:
            await sessions.aclose()

    _run(main)


@app.command("export")
def export_cmd(
    session: str,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="File (default: stdout).")] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="redis-session (ours: every entry) | nanobot | dsh | tutorial (that system's own file, "
            "for its own loader)",
        ),
    ] = "redis-session",
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Export a session as JSONL: ours (header line, then one entry per line), or the file nanobot,
    dsh or the tutorial harness would have written for it."""

    async def main() -> int:
        from ..importers import export_session

        async with _opened(url, prefix) as store:
            if output is None:
                return await export_session(store, session, sys.stdout, format=fmt)
            return await export_session(store, session, output, format=fmt)

    n = _run(main)
    if output is None:
        return
    if as_json:
        _emit_json({"session": session, "entries": n, "output": str(output)})
    else:
        err.print(f"exported {n} entries to {output} ({fmt})", highlight=False, markup=False)


@app.command("import")
def import_cmd(
    path: Annotated[
        Path, typer.Argument(help="A JSONL file (.jsonl or .jsonl.zstd) or a folder of them (nanobot sessions/).")
    ],
    fmt: Annotated[str, typer.Option("--format", help="auto | redis-session | nanobot | dsh | tutorial")] = "auto",
    session_id: Annotated[str | None, typer.Option("--id", help="Import under this id (single file).")] = None,
    on_exists: Annotated[str, typer.Option("--on-exists", help="When the id exists: error | skip | replace")] = "error",
    keep_going: Annotated[
        bool,
        typer.Option(
            "--keep-going", help="Import every good file of a folder; list the bad ones at the end (exit 1 if any)."
        ),
    ] = False,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Import sessions: our JSONL, nanobot session files, dsh logs (.jsonl or .jsonl.zstd), or the
    tutorial's JSONL. Each file is all or nothing. A folder stops at the first bad file (the files
    before it stay imported) unless --keep-going."""
    if not path.exists():
        raise CliError(f"{path}: no such file or folder")

    async def main() -> list[Any]:
        from ..importers import import_path

        async with _opened(url, prefix) as store:
            with _progress(f"importing {path.name}") as on_progress:
                return list(
                    await import_path(
                        store,
                        path,
                        format=fmt,
                        session_id=session_id,
                        progress=on_progress,
                        on_exists=on_exists,
                        errors="collect" if keep_going else "stop",
                    )
                )

    results = _run(main)
    failed = [r for r in results if r.status == "failed"]
    for r in results:
        if r.status != "failed":
            _print_result(r, as_json)
    if not failed:
        return
    if as_json:
        for r in failed:
            _print_result(r, as_json)
    if keep_going:
        good = len(results) - len(failed)
        err.print(f"{good} file(s) imported, {len(failed)} failed:", highlight=False, markup=False)
        for r in failed:
            err.print(f"  {r.error}", highlight=False, markup=False)
        raise typer.Exit(1)
    [bad] = failed
    assert bad.error is not None
    ok = [r for r in results if r.status != "failed"]
    if len(ok) or path.is_dir():
        done = ", ".join(Path(r.path).name for r in ok) or "none"
        raise CliError(
            f"{bad.error} — stopped at this file; imported before it: {done}; "
            "the files after it were not tried (--keep-going imports every good file)"
        )
    raise bad.error


def _print_result(r: Any, as_json: bool) -> None:
    if as_json:
        doc = {"path": r.path, "session": r.session_id, "format": r.format, "status": r.status, "entries": r.entries}
        if r.repaired:
            doc["repaired"] = list(r.repaired)
        if r.original_id is not None:
            doc["original_id"] = r.original_id
        if r.error is not None:
            doc["error"] = str(r.error)
        _emit_json(doc)
        return
    line = f"{r.status} {r.session_id} ({r.entries} entries, {r.format}) from {r.path}"
    if r.original_id is not None:
        line += f" (key {r.original_id!r} mapped to a valid id)"
    out.print(line, highlight=False)
    for note in r.repaired:
        out.print(f"  repaired: {note}", highlight=False)


@app.command("repair")
def repair_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Close a turn a crashed writer left open (as dsh's load() does): an interrupted error result
    for each unanswered tool call, step/end, turn/end {interrupted}; and drop stale branch links."""

    async def main() -> list[Any]:
        sessions = _sessions(url, prefix)
        try:
            return list(await sessions.repair(session))
        finally:
            await sessions.aclose()

    appended = _run(main)
    if as_json:
        _emit_json({"session": session, "appended": [{"n": e.n, "type": e.type} for e in appended]})
    elif appended:
        kinds = ", ".join(e.type for e in appended)
        out.print(f"repaired {session}: appended {len(appended)} entries ({kinds})", highlight=False)
    else:
        out.print(f"nothing to repair in {session}: no open turn", highlight=False)


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None] | None]:
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


# --------------------------------------------------------------------------- services


@app.command("projector")
def projector_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    status: Annotated[bool, typer.Option("--status", help="Print lag and counters as JSON, then exit.")] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="REDIS_SESSION_METRICS_PORT",
            min=1,
            max=65535,
            help="Serve Prometheus metrics on this port (1-65535).",
        ),
    ] = None,
    metrics_addr: Annotated[str, typer.Option(help="Address of the metrics server.")] = "0.0.0.0",
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    group: Annotated[str, typer.Option(help="Consumer group.")] = "projector",
    batch: Annotated[int, typer.Option(min=1, help="Feed entries per shard per read.")] = 200,
    claim_idle_ms: Annotated[int, typer.Option(min=0, help="Reclaim others' feed entries idle this long.")] = 30_000,
    lock_ms: Annotated[int, typer.Option(min=0, help="Per-session fold lock expiry (0: no lock).")] = 10_000,
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions folded at once.")] = 8,
    feed_shards: Annotated[int, typer.Option(min=1, help="Change-feed shards (as the writers use).")] = 4,
) -> None:
    """Run a projector worker (keeps each session's derived messages cached), or show --status."""

    async def main() -> None:
        import logging

        from .. import projector as proj

        if status:
            async with _opened(url, prefix, feed_shards=feed_shards) as store:
                _emit_json(await proj.status(store, group=group))
                return

        async def body(store: Any) -> None:
            logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            worker = proj.Projector(
                store,
                consumer=consumer,
                group=group,
                batch=batch,
                claim_idle_ms=claim_idle_ms,
                lock_ms=lock_ms,
                concurrency=concurrency,
                metrics_port=metrics_port,
                metrics_addr=metrics_addr,
            )
            err.print(f"projector {worker.consumer} running (Ctrl-C or SIGTERM to stop)")
            await worker.run_forever()

        await _supervised(url, prefix, body, feed_shards=feed_shards)

    _run(main)


@app.command("compactor")
def compactor_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    status: Annotated[bool, typer.Option("--status", help="Print lag and counters as JSON, then exit.")] = False,
    budget: Annotated[int, typer.Option(min=1, help="Token budget of a projection.")] = 32_000,
    keep_recent: Annotated[int, typer.Option(min=1, help="Keep at most this many recent messages.")] = 20,
    keep_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens kept (default: budget/4).")] = None,
    summarizer_url: Annotated[
        str | None, typer.Option(envvar="REDIS_SESSION_SUMMARIZER_URL", help="OpenAI-compatible chat-completions URL.")
    ] = None,
    model: Annotated[str | None, typer.Option(envvar="REDIS_SESSION_SUMMARIZER_MODEL", help="Model.")] = None,
    api_key_env: Annotated[str, typer.Option(help="Environment variable holding the API key.")] = "OPENAI_API_KEY",
    summarizer: Annotated[str | None, typer.Option(help="Python summarizer: module:function.")] = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one summary may take.")] = 120.0,
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    group: Annotated[str, typer.Option(help="Consumer group.")] = "compactor",
    claim_idle_ms: Annotated[int, typer.Option(min=1, help="Retry failed/idle entries after.")] = 30_000,
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions checked at once.")] = 4,
    feed_shards: Annotated[int, typer.Option(min=1, help="Change-feed shards (as the writers use).")] = 4,
    metrics_port: MetricsPortOpt = None,
    from_start: Annotated[
        bool,
        typer.Option(
            "--from-start",
            help="A new group starts at the feed's first entry: check every retained session now "
            "(default: the feed's end, only sessions written from now on).",
        ),
    ] = False,
) -> None:
    """Run a compactor worker (summarises sessions over a token budget into a cut), or show --status."""

    async def main() -> None:
        import logging

        from .. import compactor as comp

        if status:
            async with _opened(url, prefix, feed_shards=feed_shards) as store:
                _emit_json(await comp.status(store, group=group))
                return
        if (summarizer is None) == (summarizer_url is None):
            raise CliError("give exactly one of --summarizer-url URL (with --model) or --summarizer module:function")
        if summarizer is not None:
            summarize: Any = comp.load_summarizer(summarizer)
        elif not model:
            raise CliError("--summarizer-url needs --model")
        else:
            summarize = comp.chat_completions(summarizer_url or "", model, api_key_env=api_key_env, timeout=timeout)

        async def body(store: Any) -> None:
            logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            worker = comp.Compactor(
                store, summarize=summarize, budget_tokens=budget, keep_recent=keep_recent, keep_tokens=keep_tokens,
                timeout=timeout, consumer=consumer, group=group, claim_idle_ms=claim_idle_ms,
                concurrency=concurrency, metrics_port=metrics_port, from_start=from_start,
            )  # fmt: skip
            err.print(f"compactor {worker.consumer} running, budget {budget} tokens (Ctrl-C or SIGTERM to stop)")
            await worker.run_forever()

        await _supervised(url, prefix, body, feed_shards=feed_shards)

    _run(main)


_DURATION_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(text: str) -> int:
    """``7d``, ``12h``, ``30m``, ``45s``, ``500ms`` or plain seconds, as ms."""
    t = text.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * _DURATION_UNITS[unit])
    if t.replace(".", "", 1).isdigit():
        return int(float(t) * 1000)
    raise CliError(f"not a duration: {text!r} (e.g. 7d, 12h, 30m, 45s)")


async def _cold_tier(store: Any, to: str | None) -> Any:
    """The prefix's cold tier: `to` (recorded for every store of the prefix), else the one
    recorded, else a local folder in the user data dir (recorded)."""
    from ..archiver import set_cold_url

    if to is None and await store.cold_tier() is not None:
        return store.cold
    if to is None:
        from ..redis.embedded import default_data_dir

        to = str(default_data_dir() / "cold")
    return await set_cold_url(store, to)


@app.command("archive")
def archive_cmd(
    session_id: Annotated[str | None, typer.Argument(help="One session (else every one the policy selects).")] = None,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            envvar="REDIS_SESSION_COLD",
            help="Object store URL (file:///path or a path, s3://, gs://, az://); recorded for the prefix. "
            "Default: the one recorded, else <data dir>/cold.",
        ),
    ] = None,
    idle: Annotated[
        str | None, typer.Option(help="Only sessions idle this long (7d, 12h, 30m); alone: whole logs.")
    ] = None,
    before_last_cut: Annotated[bool, typer.Option("--before-last-cut", help="Up to the last cut's 'before'.")] = False,
    keep: Annotated[int | None, typer.Option(min=0, help="Keep at most this many entries hot.")] = None,
    min_entries: Annotated[int, typer.Option(min=1, help="Leave shorter ranges hot.")] = 1,
    worker: Annotated[
        bool, typer.Option("--worker", help="Run as a change-feed worker (beside the projector).")
    ] = False,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Delete objects no header names (older than --grace).")
    ] = False,
    grace: Annotated[str, typer.Option(help="Age before an unnamed object is swept.")] = "1h",
    status: Annotated[
        bool, typer.Option("--status", help="Print the tier and the archiver counters, then exit.")
    ] = False,
    group: Annotated[
        str, typer.Option(help="Consumer group (--worker) and the counters every run adds to (--status).")
    ] = "archiver",
    consumer: Annotated[str | None, typer.Option(help="Consumer name (default: <host>-<pid>-<random>).")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Serve Prometheus metrics on this port (--worker).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Move old entries into the cold tier (object storage): one session, a policy pass, --worker, or --sweep."""

    async def main() -> None:
        import logging

        from ..archiver import Archiver, ArchiveWorker, Policy

        grace_ms = _duration_ms(grace)
        policy = None
        if idle is not None or before_last_cut or keep is not None:
            policy = Policy(
                idle_ms=None if idle is None else _duration_ms(idle), before_last_cut=before_last_cut,
                keep=keep, min_entries=min_entries,
            )  # fmt: skip
        if policy is None and session_id is None and not (sweep or status):
            raise CliError("give a SESSION_ID, a policy (--idle, --before-last-cut, --keep), --sweep or --status")
        if worker and policy is None:
            raise CliError("--worker needs a policy (--idle, --before-last-cut or --keep)")

        if worker:
            assert policy is not None

            async def body(store: Any) -> None:
                logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
                tier = await _cold_tier(store, to)
                w = ArchiveWorker(
                    store, policy, tier=tier, group=group, consumer=consumer, grace_ms=grace_ms,
                    metrics_port=metrics_port,
                )  # fmt: skip
                err.print(f"archiver {w.consumer} running into {tier.url} (Ctrl-C or SIGTERM to stop)")
                await w.run_forever()

            await _supervised(url, prefix, body)
            return
        async with _opened(url, prefix) as store:
            tier = await _cold_tier(store, to)
            if status:
                from ..archiver import status as archive_status

                _emit_json(await archive_status(store, group=group))
                return
            archiver = Archiver(store, tier, grace_ms=grace_ms, group=group)  # one-pass runs count there too
            if sweep:
                removed = await archiver.sweep()
                _emit_json({"swept": len(removed), "keys": removed}) if as_json else out.print(
                    f"swept {len(removed)} objects", highlight=False
                )
                return
            results = (
                [await archiver.archive(session_id, policy=policy)]
                if session_id is not None
                else await archiver.run_policy(policy)  # type: ignore[arg-type]
            )
            for r in results:
                if as_json:
                    _emit_json(r._asdict())
                else:
                    out.print(f"{r.session}: {r.status} [{r.lo}, {r.hi}) {r.bytes} B", highlight=False, markup=False)

    _run(main)


@app.command("restore")
def restore_cmd(
    session_id: Annotated[str, typer.Argument(help="The session to bring back hot.")],
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    as_json: JsonOpt = False,
) -> None:
    """Bring a session's archived entries back into Redis (and delete its segment objects)."""

    async def main() -> None:
        from ..archiver import Archiver

        async with _opened(url, prefix) as store:
            r = await Archiver(store, await _cold_tier(store, None)).restore(session_id)
            if r.status == "absent":
                raise CliError(f"session {session_id!r} not found")
            if as_json:
                _emit_json(r._asdict())
            else:
                out.print(f"{r.session}: {r.status} [{r.lo}, {r.hi})", highlight=False, markup=False)

    _run(main)


@app.command("gateway")
def gateway_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Port (0: any free one).")] = 8765,
    token: Annotated[
        str | None, typer.Option(help="Bearer token with every scope (default: $REDIS_SESSION_TOKEN).")
    ] = None,
    tokens: TokensOpt = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="A Host name the gateway answers (repeat; '.example.com' for a domain, '*' for any; "
            "default: the --host address, localhost, 127.0.0.1, ::1; $REDIS_SESSION_ALLOWED_HOSTS)."
        ),
    ] = None,
    allowed_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="An origin (scheme://host:port) whose pages may call the gateway: CORS (repeat; "
            "none by default; $REDIS_SESSION_ALLOWED_ORIGINS)."
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool, typer.Option(help="Serve a non-loopback --host without any token (anyone may read and write).")
    ] = False,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes sharing the port.")] = 1,
    http: Annotated[str, typer.Option(help="HTTP parser: auto (httptools if installed), httptools, h11.")] = "auto",
    loop: Annotated[str, typer.Option(help="Event loop: auto (uvloop if installed), uvloop, asyncio.")] = "auto",
) -> None:
    """Serve the HTTP/SSE gateway (reads, live tails, writes) and the web viewer."""
    from ..gateway.app import check_exposure, listen, run_workers
    from ..gateway.auth import load_tokens
    from ..gateway.routes import WebPolicy, split_list

    # read here, not through typer's envvar: click takes an empty value for "unset", and an
    # empty token would silently open the gateway
    if token is None and "REDIS_SESSION_TOKEN" in os.environ:
        token = os.environ["REDIS_SESSION_TOKEN"]
        if not token.strip():
            raise CliError("REDIS_SESSION_TOKEN is set but empty: set a token, or unset the variable")
    if token is not None and not token.strip():
        raise CliError("--token is empty")
    if http not in ("auto", "httptools", "h11") or loop not in ("auto", "uvloop", "asyncio"):
        raise CliError("--http is auto, httptools or h11; --loop is auto, uvloop or asyncio")
    hosts = allowed_host or split_list(os.environ.get("REDIS_SESSION_ALLOWED_HOSTS")) or None
    origins = allowed_origin or split_list(os.environ.get("REDIS_SESSION_ALLOWED_ORIGINS"))
    try:
        scoped = load_tokens(tokens)
        check_exposure(host, has_token=token is not None or bool(scoped), insecure_no_auth=insecure_no_auth)
        WebPolicy.make(hosts, origins, bound=host)
    except ValueError as e:
        raise CliError(str(e)) from None

    def serve_on(sockets: Any) -> None:
        async def main() -> None:
            from ..gateway.app import serve

            async def body(store: Any) -> None:
                await serve(
                    store,
                    host=host,
                    port=port,
                    token=token,
                    tokens=scoped,
                    allowed_hosts=hosts,
                    allowed_origins=origins,
                    insecure_no_auth=insecure_no_auth,
                    http=http,
                    sockets=sockets,
                )

            await _supervised(url, prefix, body)

        _run_fast(main, loop)

    shown = f"[{host}]" if ":" in host else host
    if workers == 1:
        err.print(f"gateway on http://{shown}:{port}/", highlight=False)
        serve_on(None)
        return
    if not url:  # the workers share one embedded server: start it (or find it) once, here
        from ..redis.connect import resolve_url

        url = resolve_url(None, announce=_announce)
    sock = listen(host, port)
    err.print(f"gateway on http://{shown}:{port}/ ({workers} worker processes)", highlight=False)
    code = run_workers(workers, lambda: serve_on([sock]))
    if code:
        raise typer.Exit(code)


def _run_fast(fn: Callable[[], Awaitable[T]], loop: str = "auto") -> T:
    """`_run` on uvloop when it is installed (`loop` auto) or asked for, else asyncio's."""
    import importlib.util

    fast = loop == "uvloop" or (loop == "auto" and importlib.util.find_spec("uvloop") is not None)
    return anyio.run(fn, backend_options={"use_uvloop": True} if fast else {})


@app.command("up")
def up_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Port (0: any free one).")] = 8765,
    tokens: TokensOpt = None,
) -> None:
    """Server + projector + gateway in the foreground, for local development."""

    async def main() -> None:
        from ..gateway.app import serve
        from ..gateway.auth import load_tokens
        from ..projector import Projector

        scoped = load_tokens(tokens)

        async def body(store: Any) -> None:
            out.print(
                f"[bold]redis-session up[/bold]: viewer on http://{host}:{port}/  (Ctrl-C to stop)", highlight=False
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(Projector(store).run)
                await serve(store, host=host, port=port, tokens=scoped)
                tg.cancel_scope.cancel()

        await _supervised(url, prefix, body)

    try:
        _run(main)
    except KeyboardInterrupt:
        pass


@app.command("demo")
def demo_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "demo",
    duration: Annotated[float, typer.Option(min=1.0, help="Seconds of simulated traffic.")] = 20.0,
    pods: Annotated[int, typer.Option(min=1, max=64, help="Simulated agent pods.")] = 4,
    port: Annotated[int, typer.Option(**PORT_RANGE, help="Gateway port (0: no gateway).")] = 8765,
    quiet: Annotated[bool, typer.Option("--quiet", help="No live tail, summary only.")] = False,
) -> None:
    """The main job: pods writing concurrent sessions, a projector, the gateway, a live tail."""

    async def main() -> int:
        from .demo import run_demo

        return await run_demo(url=url, prefix=prefix, duration=duration, pods=pods, port=port, quiet=quiet, console=out)

    if _run(main):
        raise typer.Exit(1)


@server_app.command("start")
def server_start(
    data_dir: DirOpt = None,
    port: Annotated[
        int | None,
        typer.Option(
            **PORT_RANGE, help="Port (0: any free one; default: $REDIS_SESSION_PORT, else 6390; a free one if taken)."
        ),
    ] = None,
) -> None:
    """Start (or find) the embedded server and print its URL."""
    from ..redis.embedded import ensure_server

    server = ensure_server(data_dir, port=port)
    if server.note:
        _announce(server.note)
    if server.started:
        _announce(f"started the embedded server at {server.url}, data in {server.data_dir}")
    out.print(server.url, highlight=False)


@server_app.command("stop")
def server_stop(data_dir: DirOpt = None) -> None:
    """Stop the embedded server."""
    from ..redis.embedded import default_data_dir, stop_server

    if not stop_server(data_dir):  # already stopped: what was asked holds, so exit 0 (as `systemctl stop`)
        where = (data_dir or default_data_dir()).expanduser().resolve()
        out.print(f"not running (data dir {where})", highlight=False)
        return
    out.print("stopped")


@server_app.command("status")
def server_status(data_dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """The embedded server's URL, data dir, pid and memory. Exit 1 if it is not running."""
    from ..redis.embedded import default_data_dir, running_server, server_info

    found = running_server(data_dir)
    if found is None:
        where = (data_dir or default_data_dir()).expanduser().resolve()
        if as_json:
            _emit_json({"running": False, "data_dir": str(where)})
        else:
            out.print(f"not running (data dir {where})", highlight=False)
        raise typer.Exit(1)
    info = server_info(found)
    status = {
        "running": True,
        "url": found.url,
        "data_dir": str(found.data_dir),
        "pid": found.pid,
        "memory": info.get("used_memory_human", "?"),
        "memory_peak": info.get("used_memory_peak_human", "?"),
        "version": info.get("valkey_version") or info.get("redis_version") or "?",
        "uptime_s": int(info.get("uptime_in_seconds", "0") or 0),
        "keys": info.get("db0", "keys=0").split(",")[0].removeprefix("keys="),
    }
    if as_json:
        _emit_json(status)
        return
    out.print(f"running   {found.url}", highlight=False)
    out.print(f"data dir  {found.data_dir}", highlight=False)
    out.print(f"pid       {found.pid}", highlight=False)
    out.print(f"memory    {status['memory']} (peak {status['memory_peak']})", highlight=False)
    out.print(f"server    valkey {status['version']}, up {status['uptime_s']}s, {status['keys']} keys", highlight=False)


@app.command(
    "cli",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def cli_cmd(
    args: Annotated[list[str] | None, typer.Argument(help="A command and its arguments, as for redis-cli.")] = None,
    url: UrlOpt = None,
    builtin: Annotated[
        bool, typer.Option("--builtin", help="Use the built-in client even when redis-cli is installed.")
    ] = False,
) -> None:
    """Run redis-cli against the current server (`redis-session cli HGETALL 'rs:{chat-1}:hdr'`).

    Uses redis-cli or valkey-cli when installed, else a built-in client that runs the command and
    prints the reply the way redis-cli does. With no command: an interactive prompt."""
    from ..redis.connect import resolve_url
    from .rediscli import run_builtin, run_external

    target = resolve_url(url, announce=_announce)
    argv = list(args or [])
    code = None if builtin else run_external(target, argv)
    if code is None:
        code = run_builtin(target, argv)
    if code:
        raise typer.Exit(code)


# --------------------------------------------------------------------------- helpers


def _fmt_ms(ms: int) -> str:
    import datetime as dt

    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _short(value: Any, limit: int = 100) -> str:
    try:
        import msgspec

        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; turn every expected failure into one line and exit code 1."""
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


if __name__ == "__main__":
    main()
