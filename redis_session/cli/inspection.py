"""The commands that read: `ls`, `show`, `tail`, `doctor`."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Annotated, Any

import anyio
import typer
from rich.table import Table
from rich.text import Text

from ..checks import MAX_N
from .common import (
    CliError,
    JsonOpt,
    PrefixOpt,
    UrlOpt,
    app,
    emit_json,
    emit_table,
    err,
    fmt_ms,
    head_json,
    opened,
    out,
    run,
    short,
)
from .supervised import supervised


def _cursor_arg(value: str | None) -> str | None:
    """A --cursor that no listing printed is a usage error (exit 2), not the first page again."""
    from ..errors import InvalidCursorError
    from ..store.rules import check_cursor

    try:
        check_cursor(value)
    except InvalidCursorError as e:
        raise typer.BadParameter(str(e)) from None
    return value


@app.command("ls")
def ls_cmd(
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    parent: Annotated[str | None, typer.Option(help="Only branches of this session.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    cursor: Annotated[
        str | None, typer.Option(help="Continue a previous listing (the 'more:' cursor).", callback=_cursor_arg)
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, newest first."""

    async def main() -> tuple[list[Any], str | None, list[str]]:
        from ..errors import SessionCorruptError, SessionNotFoundError

        async with opened(url, prefix) as store:
            if parent is not None and await store.head(parent) is None:
                raise SessionNotFoundError(parent)
            page = await store.list(parent=parent, limit=limit, cursor=cursor)
            heads, unreadable = [], list(page.unreadable)
            for h in page.items:
                try:
                    heads.append(await store.head(h.id))
                except SessionCorruptError:  # its header changed kind since it was listed
                    unreadable.append(h.id)
        return [h for h in heads if h is not None], page.cursor, unreadable

    heads, more, unreadable = run(main)
    for sid in unreadable:  # on stderr: the listing on stdout stays what a script parses
        err.print(
            f"warning: session {sid!r} is listed but its header cannot be read (edited outside "
            f"redis-session?): redis-session doctor {shlex.quote(sid)}",
            highlight=False,
            markup=False,
        )
    if as_json:
        for h in heads:
            emit_json(head_json(h))
    elif heads:
        emit_table(_ls_table(heads))
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
            hd.id, str(h.n), hd.title or "", fmt_ms(hd.created_at), f"{hd.parent}@{hd.at}" if hd.parent else ""
        )
    return table


@app.command("show")
def show_cmd(
    session: str,
    url: UrlOpt = None,
    prefix: PrefixOpt = "rs",
    messages: Annotated[bool, typer.Option("--messages", help="Show the derived messages.")] = False,
    fmt_opt: Annotated[
        str | None, typer.Option("--format", help="openai | anthropic | json (with --messages; default json)")
    ] = None,
    start: Annotated[int | None, typer.Option(min=0, max=MAX_N, help="First entry n.")] = None,
    stop: Annotated[int | None, typer.Option(min=0, max=MAX_N, help="Stop before this n.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a session's header and entries (or its derived messages)."""
    # contradictory options are usage errors (exit 2), never silently ignored
    if fmt_opt is not None and not messages:
        raise typer.BadParameter("goes with --messages (the entries are shown as stored)", param_hint="'--format'")
    if messages and (start is not None or stop is not None):
        raise typer.BadParameter(
            "select entries; with --messages the whole projection is shown", param_hint="'--start' / '--stop'"
        )
    if start is not None and stop is not None and stop < start:
        raise typer.BadParameter(f"stop ({stop}) is before start ({start})", param_hint="'--stop'")
    fmt = fmt_opt or "json"
    if fmt not in ("openai", "anthropic", "json"):
        raise CliError(f"--format must be openai, anthropic or json, not {fmt!r}")

    async def main() -> tuple[Any, Any]:
        import msgspec

        from ..errors import SessionNotFoundError

        async with opened(url, prefix) as store:
            head = await store.head(session)
            if head is None:
                raise SessionNotFoundError(session)
            if not messages:
                return head, await store.read(session, start or 0, stop)
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

    head, body = run(main)
    if messages:
        if as_json:
            emit_json(body)
        elif out.is_terminal:
            out.print_json(data=body)
        else:
            sys.stdout.write(json.dumps(body, ensure_ascii=False, indent=2) + "\n")
        return
    _show_entries(head, body, as_json)


def _show_entries(head: Any, entries: list[Any], as_json: bool) -> None:
    import msgspec

    if as_json:
        emit_json(head_json(head))
        for e in entries:
            sys.stdout.write(msgspec.json.encode(e).decode() + "\n")
        return
    hd = head.header
    last_cut = "-" if head.last_cut is None else str(head.last_cut)
    out.print(
        f"[bold]{hd.id}[/bold]  n={head.n}  last_cut={last_cut}  created={fmt_ms(hd.created_at)}"
        + (f"  branch of {hd.parent}@{hd.at}" if hd.parent else ""),
        highlight=False,
    )
    if out.is_terminal:
        # one line per entry, cut to the terminal's width: a long session stays scannable
        # (the full entries: piped, or --json)
        for e in entries:
            data = short(e.data, limit=100_000)
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
    start: Annotated[
        int | None, typer.Option("--from", min=0, max=MAX_N, help="Start at entry n (default: the end).")
    ] = None,
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

        position = TailPosition()  # kept across the stores `supervised` re-resolves

        async def body(store: Any) -> None:
            await run_tail(
                store, session, start=start, messages=messages, console=out, as_json=as_json, position=position
            )

        await supervised(url, prefix, body)

    try:
        run(main)
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
        from ..errors import SessionNotFoundError
        from ..keys import is_staging_id

        bad = checked = 0
        async with opened(url, prefix) as store:
            ids = await _all_ids(store) if all_ else [session]
            # checked DOCTOR_WINDOW at a time (a stale link waits out its grace: one after another,
            # a thousand such sessions took minutes), reported in the listing's order
            for start in range(0, len(ids), DOCTOR_WINDOW):
                window: list[str] = []
                for sid in ids[start : start + DOCTOR_WINDOW]:
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
                    window.append(sid)
                reports = await _doctor_window(store, window)
                for sid, report in zip(window, reports, strict=True):
                    if isinstance(report, SessionNotFoundError):
                        if not all_ and not repair:
                            raise report
                        continue  # deleted or expired since it was listed (or purged by the repair)
                    checked += 1
                    bad += not report.ok
                    _doctor_report(sid, report, as_json)
        return checked, bad

    checked, bad = run(main)
    line = f"{checked} session(s) checked, {bad} with problems"
    if as_json:
        err.print(line, highlight=False, markup=False)
    else:
        style = "green" if bad == 0 else "red"
        out.print(f"[{style}]{line}[/{style}]", highlight=False)
    if bad:
        raise typer.Exit(1)


DOCTOR_WINDOW = 32
"""Sessions `doctor --all` checks at once."""


async def _doctor_window(store: Any, ids: list[str]) -> list[Any]:
    """`doctor` of each of `ids` at once: its report, or the `SessionNotFoundError` it raised."""
    from ..doctor import doctor
    from ..errors import SessionNotFoundError

    reports: list[Any] = [None] * len(ids)

    async def check(i: int, sid: str) -> None:
        try:
            reports[i] = await doctor(store, sid)
        except SessionNotFoundError as e:
            reports[i] = e

    async with anyio.create_task_group() as tg:
        for i, sid in enumerate(ids):
            tg.start_soon(check, i, sid)
    return reports


async def _all_ids(store: Any) -> list[str | None]:
    ids: list[str | None] = []
    cursor = None
    while True:
        page = await store.list(limit=1000, cursor=cursor)
        ids += [h.id for h in page.items] + page.unreadable  # the doctor says what is wrong with those
        cursor = page.cursor
        if cursor is None:
            return ids


def _doctor_report(sid: str, report: Any, as_json: bool) -> None:
    if as_json:
        problems = [{"n": p.n, "code": p.code, "message": p.message} for p in report.problems]
        emit_json({"session": sid, "ok": report.ok, "problems": problems})
        return
    for p in report.problems:
        out.print(f"[red]{sid}[/red] n={p.n} {p.code}: {p.message}", highlight=False)
