"""The `redis-session` command line.

Every command takes ``--url`` (default ``$REDIS_URL``, else the embedded server under
``./.redis-session``) and ``--prefix``. Errors are one clear line on stderr and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import typer
from rich.console import Console
from rich.table import Table

from ..errors import SessionError, StoreUnavailableError

app = typer.Typer(
    name="redis-session",
    help="A distributed event store for AI-agent sessions on Redis Streams.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
server_app = typer.Typer(help="The embedded server alone (valkey-server under ./.redis-session).", no_args_is_help=True)
app.add_typer(server_app, name="server")

out = Console()
err = Console(stderr=True)

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="REDIS_URL", help="redis:// URL; default: the embedded server."),
]
PrefixOpt = Annotated[str, typer.Option("--prefix", envvar="REDIS_SESSION_PREFIX", help="Key prefix.")]
T = TypeVar("T")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(fn)


def _store(url: str | None, prefix: str, **options: Any) -> Any:
    from ..redis.connect import open_store

    return open_store(url, prefix=prefix, **options)


@contextlib.asynccontextmanager
async def _opened(url: str | None, prefix: str, **options: Any) -> AsyncIterator[Any]:
    """The store for one command, closed after it."""
    store = _store(url, prefix, **options)
    try:
        yield store
    finally:
        await store.aclose()


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
) -> None:
    """List sessions, newest first."""

    async def main() -> None:
        async with _opened(url, prefix) as store:
            page = await store.list(parent=parent, limit=limit, cursor=cursor)
            heads = [await store.head(h.id) for h in page.items]
        table = Table(box=None)
        widest = max((len(h.header.id) for h in heads if h is not None), default=2)
        table.add_column("id", no_wrap=True, min_width=widest)  # ids are copied from here: whole
        table.add_column("n", no_wrap=True, justify="right")
        table.add_column("title", overflow="fold")
        table.add_column("created", no_wrap=True)
        table.add_column("parent@at", overflow="fold")
        for h in heads:
            if h is None:
                continue
            hd = h.header
            table.add_row(
                hd.id,
                str(h.n),
                hd.title or "",
                _fmt_ms(hd.created_at),
                f"{hd.parent}@{hd.at}" if hd.parent else "",
            )
        out.print(table)
        if page.cursor:
            out.print(f"[dim]more: --cursor '{page.cursor}'[/dim]")

    _run(main)


@app.command("show")
def show_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    messages: Annotated[bool, typer.Option("--messages", help="Show the derived messages.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="openai | anthropic | json")] = "json",
    start: Annotated[int, typer.Option(min=0)] = 0,
    stop: Annotated[int | None, typer.Option(min=0)] = None,
) -> None:
    """Show a session's header and entries (or its derived messages)."""
    if fmt not in ("openai", "anthropic", "json"):
        raise CliError(f"--format must be openai, anthropic or json, not {fmt!r}")

    async def main() -> None:
        import msgspec

        from ..errors import SessionNotFoundError

        async with _opened(url, prefix) as store:
            head = await store.head(session)
            if head is None:
                raise SessionNotFoundError(session)
            if messages:
                from ..snapshots import load_messages

                state, _ = await load_messages(store, session)
                msgs = state.messages()
                if fmt == "openai":
                    from ..projection.fold import to_openai

                    body: Any = to_openai(msgs)
                elif fmt == "anthropic":
                    from ..projection.fold import to_anthropic

                    body = to_anthropic(msgs)
                else:
                    body = msgspec.to_builtins(msgs)
                out.print_json(data=body)
                return
            entries = await store.read(session, start, stop)
        hd = head.header
        out.print(
            f"[bold]{hd.id}[/bold]  n={head.n}  last_cut={head.last_cut}  "
            f"created={_fmt_ms(hd.created_at)}" + (f"  branch of {hd.parent}@{hd.at}" if hd.parent else "")
        )
        if fmt == "json":
            for e in entries:
                out.print_json(msgspec.json.encode(e).decode())
        else:
            for e in entries:
                out.print(f"[cyan]{e.n:>6}[/cyan] {_fmt_ms(e.time)} [bold]{e.type}[/bold] {_short(e.data)}")

    _run(main)


@app.command("tail")
def tail_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    start: Annotated[int | None, typer.Option("--from", min=0, help="Start at entry n (default: the end).")] = None,
    messages: Annotated[bool, typer.Option("--messages", help="Print derived messages, not raw entries.")] = False,
) -> None:
    """Follow a session live; reconnects after a dropped connection without gaps or repeats."""

    async def main() -> None:
        from .tailview import run_tail

        async with _opened(url, prefix) as store:
            await run_tail(store, session, start=start, messages=messages, console=out)

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
        bool, typer.Option("--repair", help="First remove stale branch links (a branch cut short by a crash).")
    ] = False,
) -> None:
    """Check log invariants and storage consistency. Reports; repairs only stale links, with
    --repair (the log itself is never rewritten). Exit 1 on problems."""
    if (session is None) == (not all_):
        raise CliError("give a SESSION or --all")

    async def main() -> int:
        from ..errors import SessionNotFoundError
        from ..sessions import doctor

        bad = 0
        checked = 0
        async with _opened(url, prefix) as store:
            ids: list[str] = []
            if all_:
                cursor = None
                while True:
                    page = await store.list(limit=1000, cursor=cursor)
                    ids += [h.id for h in page.items]
                    cursor = page.cursor
                    if cursor is None:
                        break
            else:
                assert session is not None
                ids = [session]
            for sid in ids:
                if repair:
                    for child in await store.repair_links(sid):
                        out.print(f"[yellow]{sid}[/yellow] removed the stale link to branch {child!r}")
                try:
                    report = await doctor(store, sid)
                except SessionNotFoundError:
                    if not all_ and not repair:
                        raise
                    continue  # deleted or expired since it was listed (or purged by the repair)
                checked += 1
                if report.ok:
                    continue
                bad += 1
                for p in report.problems:
                    out.print(f"[red]{sid}[/red] n={p.n} {p.code}: {p.message}")
        style = "green" if bad == 0 else "red"
        out.print(f"[{style}]{checked} session(s) checked, {bad} with problems[/{style}]")
        return bad

    if _run(main):
        raise typer.Exit(1)


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
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
) -> None:
    """Export a session as JSONL (header line, then one entry per line)."""

    async def main() -> int:
        from ..importers import export_session

        async with _opened(url, prefix) as store:
            if output is None:
                return await export_session(store, session, sys.stdout)
            return await export_session(store, session, output)

    n = _run(main)
    if output is not None:
        err.print(f"exported {n} entries to {output}")


@app.command("import")
def import_cmd(
    path: Annotated[Path, typer.Argument(help="A JSONL file or a folder of them (nanobot sessions/).")],
    fmt: Annotated[str, typer.Option("--format", help="auto | redis-session | nanobot | dsh | tutorial")] = "auto",
    session_id: Annotated[str | None, typer.Option("--id", help="Import under this id (single file).")] = None,
    on_exists: Annotated[str, typer.Option(help="error | skip | replace")] = "error",
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
) -> None:
    """Import sessions: our JSONL, nanobot session files, dsh JSONL, or the tutorial's JSONL."""
    if not path.exists():
        raise CliError(f"{path}: no such file or folder")

    async def main() -> list[Any]:
        from rich.progress import Progress

        from ..importers import import_path

        async with _opened(url, prefix) as store:
            with Progress(console=err, transient=True) as progress:
                task = progress.add_task(f"importing {path.name}", total=None)

                def on_progress(done: int, total: int) -> None:
                    progress.update(task, completed=done, total=total)

                return list(
                    await import_path(
                        store,
                        path,
                        format=fmt,
                        session_id=session_id,
                        progress=on_progress,
                        on_exists=on_exists,
                    )
                )

    for r in _run(main):
        out.print(_short(r, 200))


# --------------------------------------------------------------------------- services


@app.command("projector")
def projector_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    status: Annotated[bool, typer.Option("--status", help="Print lag and counters as JSON, then exit.")] = False,
    metrics_port: Annotated[
        int | None, typer.Option(envvar="REDIS_SESSION_METRICS_PORT", help="Serve Prometheus metrics on this port.")
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

        async with _opened(url, prefix, feed_shards=feed_shards) as store:
            if status:
                out.print_json(data=await proj.status(store, group=group))
                return
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

    _run(main)


@app.command("gateway")
def gateway_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: int = 8765,
    token: Annotated[str | None, typer.Option(envvar="REDIS_SESSION_TOKEN", help="Bearer token (read-only).")] = None,
) -> None:
    """Serve the read-only HTTP/SSE gateway and the web viewer."""

    async def main() -> None:
        from ..gateway.app import serve

        async with _opened(url, prefix) as store:
            err.print(f"gateway on http://{host}:{port}/")
            await serve(store, host=host, port=port, token=token)

    _run(main)


@app.command("up")
def up_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    host: str = "127.0.0.1",
    port: int = 8765,
) -> None:
    """Server + projector + gateway in the foreground, for local development."""

    async def main() -> None:
        from ..gateway.app import serve
        from ..projector import Projector

        async with _opened(url, prefix) as store:
            out.print(f"[bold]redis-session up[/bold]: viewer on http://{host}:{port}/  (Ctrl-C to stop)")
            async with anyio.create_task_group() as tg:
                tg.start_soon(Projector(store).run)
                await serve(store, host=host, port=port)
                tg.cancel_scope.cancel()

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
    port: Annotated[int, typer.Option(help="Gateway port (0: no gateway).")] = 8765,
    quiet: Annotated[bool, typer.Option("--quiet", help="No live tail, summary only.")] = False,
) -> None:
    """The main job: pods writing concurrent sessions, a projector, the gateway, a live tail."""

    async def main() -> int:
        from .demo import run_demo

        return await run_demo(url=url, prefix=prefix, duration=duration, pods=pods, port=port, quiet=quiet, console=out)

    try:
        if _run(main):
            raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("interrupted")


@server_app.command("start")
def server_start(
    data_dir: Annotated[Path, typer.Option(help="Data folder.")] = Path(".redis-session"),
) -> None:
    """Start (or find) the embedded server and print its URL."""
    from ..redis.embedded import ensure_server

    out.print(ensure_server(data_dir).url)


@server_app.command("stop")
def server_stop(
    data_dir: Annotated[Path, typer.Option(help="Data folder.")] = Path(".redis-session"),
) -> None:
    """Stop the embedded server."""
    from ..redis.embedded import stop_server

    if not stop_server(data_dir):
        raise CliError(f"no embedded server is running for {data_dir}")
    out.print("stopped")


@server_app.command("status")
def server_status(
    data_dir: Annotated[Path, typer.Option(help="Data folder.")] = Path(".redis-session"),
) -> None:
    """Is the embedded server up? Exit 1 if not."""
    from ..redis.embedded import running_server

    found = running_server(data_dir)
    if found is None:
        out.print("not running")
        raise typer.Exit(1)
    out.print(f"running: {found.url} (pid {found.pid}, data in {found.data_dir})")


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
    from redis.exceptions import RedisError

    from ..redis.embedded import EmbeddedServerError

    expected = (CliError, SessionError, EmbeddedServerError, StoreUnavailableError, OSError, ValueError, RedisError)
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit:
        raise
    except BaseException as e:
        leaf = _leaf(e)
        if isinstance(leaf, KeyboardInterrupt):
            raise SystemExit(130) from None
        if not isinstance(leaf, expected):
            raise
        msg = str(leaf).splitlines()[0] if str(leaf) else type(leaf).__name__
        err.print(f"[red]error:[/red] {msg}", highlight=False)
        raise SystemExit(1) from None


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups from task groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


if __name__ == "__main__":
    main()
