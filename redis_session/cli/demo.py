"""`redis-session demo`: the product end to end on one machine.

Simulated agent pods write concurrent sessions (turns, streamed chunks, tool calls and results,
compaction cuts, branches) while a projector keeps the derived messages cached and the gateway
serves the viewer. All pods also report to one shared session with optimistic appends, so
conflicts happen and are retried. One session is tailed live in the terminal; the run ends with a
summary and a doctor pass over every session it wrote.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from rich.console import Console, Group
from rich.text import Text

from ..errors import SessionConflictError
from ..model import NewEntry
from ..projection.chunks import Delta, DeltaGap, unpack_row
from ..retry import conflict_backoff
from ..streaming import tail_deltas
from .scripts import SCRIPTS, ToolStep, Turn


@dataclass
class Stats:
    sessions: list[str] = field(default_factory=list)
    entries: int = 0
    turns: int = 0
    conflicts_retried: int = 0
    branches: int = 0
    cuts: int = 0
    current: dict[int, str] = field(default_factory=dict)  # pod -> the session it writes now
    deadline: float = 0.0  # pods start no new turn after it (Ctrl-C moves it to now)
    lag: int | None = None  # the projector's lag, as last measured
    started: float = field(default_factory=time.monotonic)
    # In a terminal the answer being streamed lives in the status display, never on a half-printed
    # line the status line would be drawn after; it is printed whole once done.
    streaming: str = ""
    # Piped, the tail prints whole entries: the session it follows and the next n it will print
    # (a switch to the next session, and the end, wait until it printed the old one to its end).
    shown: tuple[str, int] = ("", 0)

    def rate(self) -> float:
        return self.entries / max(time.monotonic() - self.started, 0.001)


async def _turn(s: Any, number: int, turn: Turn, stats: Stats, pace: float) -> None:
    """One dsh-style turn: the user's message, a step per tool call (a streamed thought, the call,
    its result), then a step streaming the answer, committed as the assistant message."""
    stats.entries += len(
        await s.append_many(
            [
                NewEntry("turn/start", {"turn": number, "trigger": {"kind": "message", "source": "demo"}}),
                NewEntry("user/message", {"content": [{"type": "text", "text": turn.user}], "source": "demo"}),
            ]
        )
    )
    step = 0
    for tool in turn.steps:
        step += 1
        await _tool_step(s, number, step, tool, stats, pace)
    step += 1
    stats.entries += len(await s.append("step/start", {"turn": number, "step": step}))
    await _stream(s, number, step, turn.answer, stats, pace)  # ends with the assistant/message
    stats.entries += len(
        await s.append_many(
            [
                NewEntry("step/end", {"turn": number, "step": step}),
                NewEntry("turn/end", {"turn": number, "reason": {"kind": "completed"}}),
            ]
        )
    )
    stats.turns += 1


async def _tool_step(s: Any, turn: int, step: int, tool: ToolStep, stats: Stats, pace: float) -> None:
    call_id = f"call_{random.randrange(16**8):08x}"
    args = json.dumps(tool.args)
    stats.entries += len(await s.append("step/start", {"turn": turn, "step": step}))
    # the thought and the call's arguments stream; the writer commits the assistant/message
    await _stream(s, turn, step, tool.thought, stats, pace, call=(call_id, tool.tool, args))
    call = {"turn": turn, "step": step, "callId": call_id, "name": tool.tool, "arguments": args}
    stats.entries += len(await s.append("tool/call", call))
    await anyio.sleep(pace * 20)  # the tool runs
    result = {
        "turn": turn,
        "step": step,
        "callId": call_id,
        "content": [{"type": "text", "text": tool.result}],
        "isError": False,
    }
    stats.entries += len(
        await s.append_many([NewEntry("tool/result", result), NewEntry("step/end", {"turn": turn, "step": step})])
    )


async def _stream(
    s: Any, turn: int, step: int, text: str, stats: Stats, pace: float, call: tuple[str, str, str] | None = None
) -> None:
    """Stream `text` a word at a time (and a tool call's arguments, in pieces) with the streaming
    writer: each word reaches tailing readers at once, the log gets a few packed chunk rows and,
    on exit, the assistant message."""
    before = s.n
    async with s.stream(turn=turn, step=step) as w:
        for i, word in enumerate(text.split(" ")):
            await w.delta((" " if i else "") + word)
            await anyio.sleep(pace)
        if call is not None:
            call_id, name, args = call
            for i in range(0, len(args), 8):
                await w.tool_call_delta(call_id, name if i == 0 else None, args[i : i + 8])
                await anyio.sleep(pace / 2)
    stats.entries += s.n - before


async def _report(sessions: Any, shared_id: str, pod: int, note: str, stats: Stats) -> None:
    """Every pod writes to one shared session with an expected-n append: conflicts are normal."""
    s = await sessions.open(shared_id)
    for attempt in range(50):
        try:
            await s.append("message", {"role": "user", "content": f"[pod {pod}] {note}"})
            stats.entries += 1
            return
        except SessionConflictError:
            stats.conflicts_retried += 1
            await conflict_backoff(attempt, base=0.002, cap=0.1)
            await s.refresh()


async def _pod(sessions: Any, run_id: str, pod: int, stats: Stats, shared_id: str, pace: float) -> None:
    k = 0
    while time.monotonic() < stats.deadline:
        script = SCRIPTS[(pod + k) % len(SCRIPTS)]
        sid = f"{run_id}-pod{pod}-{script.kind}-{k}"
        s = await sessions.create(sid, title=f"{script.title} (pod {pod})", origin={"pod": pod, "script": script.kind})
        stats.sessions.append(sid)
        stats.current[pod] = sid
        number = 0
        for turn in script.turns:
            if time.monotonic() >= stats.deadline:
                break
            number += 1
            await _turn(s, number, turn, stats, pace)
            await _report(sessions, shared_id, pod, f"{sid} finished turn {number}", stats)
        if k % 2 == 0 and s.n > 12:
            # compaction: everything before the last turn collapses into one summary message
            keep_from = max(0, s.n - 11)
            msgs = await s.messages()
            await s.compact(
                keep_from, [{"role": "user", "content": f"Summary of {len(msgs)} earlier messages."}], "token_limit"
            )
            stats.cuts += 1
            stats.entries += 1
        if k % 3 == 1 and number and time.monotonic() < stats.deadline:
            b = await sessions.branch(sid, s.n)  # the user edits their last request on a branch
            stats.branches += 1
            stats.sessions.append(b.id)
            stats.current[pod] = b.id
            await _turn(b, number + 1, script.branch, stats, pace)
        k += 1


async def _watch(store: Any, stats: Stats, console: Console) -> None:
    """A live tail of whatever pod 0 writes now: in a terminal the answers stream delta by delta;
    piped, each entry is printed whole in log order (`_print_entries`)."""
    piped = not console.is_terminal
    while True:
        sid = stats.current.get(0)
        if sid is None:
            await anyio.sleep(0.05)
            continue
        async with anyio.create_task_group() as tg:

            async def follow_switch(sid: str = sid) -> None:
                while stats.current.get(0) == sid:  # noqa: ASYNC110 - another task's progress
                    await anyio.sleep(0.05)
                if piped:
                    with anyio.move_on_after(10):
                        await _printed_to_the_end(store, stats, sid)
                else:
                    await anyio.sleep(0.3)  # let the last entries of the old session print
                tg.cancel_scope.cancel()

            tg.start_soon(follow_switch)
            if piped:
                await _print_entries(store, sid, console, stats)
            else:
                await _print_tail(store, sid, console, stats)


async def _printed_to_the_end(store: Any, stats: Stats, session_id: str) -> None:
    """Wait until the piped tail printed `session_id` up to its end now (its writer moved on)."""
    head = await store.head(session_id)
    end = head.n if head is not None else 0
    while stats.shown[0] != session_id or stats.shown[1] < end:  # noqa: ASYNC110 - another task's progress
        await anyio.sleep(0.02)


def _rule(store_head: Any, session_id: str, console: Console) -> int:
    """The session's title rule; returns the first n to show (a branch: only what is its own)."""
    from rich.markup import escape

    hd = store_head.header if store_head is not None else None
    start = hd.at if hd is not None and hd.parent and hd.at else 0
    title = escape(hd.title or "") if hd is not None else ""
    if hd is not None and hd.parent:
        title = f"branch of {escape(hd.parent)} at {hd.at}"
    console.rule(f"[dim]{escape(session_id)}[/dim] {title}", style="dim")
    return int(start)


async def _print_entries(store: Any, session_id: str, console: Console, stats: Stats) -> None:
    """Piped: the session as a conversation, one whole entry per line in log order — an answer as
    its committed assistant/message (its streamed chunks are not printed), never interleaved."""
    from ..live import follow

    start = _rule(await store.head(session_id), session_id, console)
    stats.shown = (session_id, start)
    async with contextlib.aclosing(follow(store, session_id, start)) as entries:
        async for e in entries:
            if e.type != "assistant/chunk":
                line = _line(e, streamed=False)
                if line:
                    console.print(line, highlight=False)
            stats.shown = (session_id, e.n + 1)


async def _print_tail(store: Any, session_id: str, console: Console, stats: Stats | None = None) -> None:
    """The session as a conversation: the user, each answer once as it streams (its chunks, never
    the committed message again), tool calls and results; turn and step marks are left out."""
    start = _rule(await store.head(session_id), session_id, console)
    streaming = False
    live: set[str] = set()  # answers printed from their live deltas (their chunk rows are not)
    # A terminal has the status display below the conversation: the answer is kept there while it
    # streams and printed as one line when it ends. (Piped, `_print_entries` prints whole entries.)
    buffered = console.is_terminal and stats is not None
    answer = ""
    async for e in tail_deltas(store, session_id, start):
        if isinstance(e, DeltaGap):
            continue  # the demo's writer streams everything live
        if isinstance(e, Delta) or e.type == "assistant/chunk":
            if isinstance(e, Delta):
                live.add(e.answer)
                pieces = [e.text] if e.kind == "text" else []
            elif e.data.get("answer") in live:
                continue
            else:
                pieces = [c.get("text", "") for c in unpack_row(e.data) if c.get("type") == "text-delta"]
            if not streaming:
                label = "" if isinstance(e, Delta) else f"#{e.n:<4}"
                answer = ""
                if not buffered:
                    console.print(_answer_label(label), end="")
                streaming = True
            if buffered:
                answer += "".join(pieces)
                if stats is not None:
                    stats.streaming = answer
            else:
                console.print(Text("".join(pieces), style="blue"), end="")
            continue
        if streaming:
            if buffered:
                console.print(Text.assemble(_answer_label(label), (answer, "blue")))
                if stats is not None:
                    stats.streaming = ""
            else:
                console.print()
        line = _line(e, streamed=streaming)
        streaming = False
        if line:
            console.print(line, highlight=False)


def _answer_label(label: str) -> Text:
    return Text.assemble((f"{label:<5}", "dim"), " ", ("assistant", "bold blue"), " ")


def _line(e: Any, *, streamed: bool) -> str | None:
    """One entry as a line of the conversation (None: not shown)."""
    from rich.markup import escape

    d = e.data
    n = f"[dim]#{e.n:<4}[/dim]"
    if e.type == "user/message":
        return f"{n} [bold green]user[/bold green]      {escape(_text(d.get('content')))}"
    if e.type == "assistant/message":
        calls = [b for b in d.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool-call"]
        shown = "" if streamed else escape(_text(d.get("content")))
        for c in calls:
            shown += f"  [yellow]→ {escape(c.get('name', ''))}({escape(c.get('arguments', ''))})[/yellow]"
        return f"{n} [bold blue]assistant[/bold blue] {shown.strip()}" if shown.strip() else None
    if e.type == "tool/result":
        first = _text(d.get("content")).splitlines()[0] if _text(d.get("content")) else ""
        return f"{n} [yellow]tool      ← {escape(first[:100])}[/yellow]"
    if e.type == "cut":
        return f"{n} [magenta]cut       compacted before {d.get('before')}[/magenta]"
    if e.type == "message":
        return f"{n} [dim]{escape(str(d.get('content', ''))[:100])}[/dim]"
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _progress(stats: Stats, started: float) -> Any:
    """The status display: the answer streaming now (its last line), then the counters. Built of
    `Text` parts, never markup strings: it is rendered inside other prints, whose options (markup
    off, a style) must not reach it."""
    from rich.table import Table

    def counter(value: object, what: str) -> Text:
        return Text.assemble((str(value), "bold"), f" {what}")

    grid = Table.grid(padding=(0, 3))
    for _ in range(6):
        grid.add_column(no_wrap=True)
    lag = "…" if stats.lag is None else str(stats.lag)
    grid.add_row(
        counter(len(stats.sessions), f"sessions ({stats.branches} branches)"),
        counter(stats.entries, "entries"),
        counter(f"{stats.rate():.0f}", "entries/s"),
        counter(stats.conflicts_retried, "conflicts retried"),
        Text.assemble("projector lag ", (lag, "bold")),
        Text(f"{time.monotonic() - started:.0f}s · Ctrl-C to stop", style="dim"),
    )
    if not stats.streaming:
        return grid
    last = stats.streaming.splitlines()[-1] if stats.streaming.strip() else ""
    answer = Text.assemble(_answer_label(""), (last, "blue"), no_wrap=True, overflow="ellipsis")
    return Group(answer, grid)


async def _measure_lag(store: Any, stats: Stats) -> None:
    from ..projector import status as projector_status

    while True:
        with contextlib.suppress(Exception):
            stats.lag = int((await projector_status(store)).get("lag") or 0)
        await anyio.sleep(1.0)


async def _on_ctrl_c(stats: Stats, console: Console, traffic: anyio.CancelScope) -> None:
    """First Ctrl-C: no new turns (the ones in flight finish, so every session stays whole); the
    second: stop at once. The summary follows either way."""
    try:
        receiver = anyio.open_signal_receiver(signal.SIGINT)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no signals
        return
    with receiver as signals:
        async for _ in signals:
            if stats.deadline > time.monotonic():
                stats.deadline = time.monotonic()
                console.print("\n[yellow]stopping: finishing the turns in flight (Ctrl-C again to stop now)[/yellow]")
                continue
            traffic.cancel()
            return


def _gateway_port(port: int, console: Console) -> int:
    """`port`, or a free one (said) when it is taken: checked before anything is written."""
    from ..redis.embedded import free_port, port_free

    if not port or port_free(port):
        return port
    other = free_port()
    console.print(f"[yellow]port {port} is taken (a `redis-session up`?); the viewer uses port {other}[/yellow]")
    return other


async def run_demo(
    *,
    url: str | None,
    prefix: str = "demo",
    duration: float = 20.0,
    pods: int = 4,
    port: int = 8765,
    quiet: bool = False,
    console: Console | None = None,
    pace: float = 0.01,
) -> int:
    """Run the demo; returns 0 when every session it wrote passes the doctor, else 1."""
    from ..projector import Projector
    from ..redis.connect import open_store
    from ..sessions import Sessions

    console = console or Console()
    port = _gateway_port(port, console)  # before anything is written
    store = open_store(url, prefix=prefix, announce=lambda line: console.print(line, style="dim", highlight=False))
    sessions = Sessions(store)
    stats = Stats()
    run_id = f"{int(time.time()) % 100000:05d}"
    shared_id = f"shared-{run_id}"
    stats.deadline = stats.started + duration
    viewer = f"http://127.0.0.1:{port}/#{shared_id}" if port else None
    try:
        await sessions.create(shared_id, title="all pods report here (contended)")
        async with anyio.create_task_group() as services:
            projector = Projector(store, consumer=f"demo-{run_id}")
            services.start_soon(projector.run)
            services.start_soon(_measure_lag, store, stats)
            if port:
                from ..gateway.app import serve

                await services.start(lambda task_status: serve(store, "127.0.0.1", port, task_status=task_status))
                console.print(f"[bold]viewer[/bold]: {viewer}", highlight=False)
            console.print(
                f"[bold]demo[/bold]: {pods} pods for {duration:.0f}s on prefix '{prefix}': a coding agent, a support "
                "chat and a research agent (Ctrl-C to stop early)",
                highlight=False,
            )
            await _traffic(sessions, store, stats, console, run_id, shared_id, pods, pace, quiet)
            await _catch_up(store, stats)
            problems = await _doctor_all(store, [shared_id, *stats.sessions], console)
            _summary(console, stats, await store.head(shared_id), problems, viewer, prefix)
            services.cancel_scope.cancel()
        return 0 if problems == 0 else 1
    finally:
        await store.aclose()


async def _traffic(
    sessions: Any,
    store: Any,
    stats: Stats,
    console: Console,
    run_id: str,
    shared_id: str,
    pods: int,
    pace: float,
    quiet: bool,
) -> None:
    """The pods, the live tail and the progress line, until the deadline (or Ctrl-C)."""
    from rich.live import Live

    live = None if quiet else Live(console=console, refresh_per_second=4, transient=True)
    if live is not None:
        live.update(_progress(stats, stats.started))
        live.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_on_ctrl_c, stats, console, tg.cancel_scope)
            if not quiet:
                tg.start_soon(_watch, store, stats, console)
            if live is not None:
                tg.start_soon(_refresh, live, stats)
            async with anyio.create_task_group() as writers:
                for p in range(pods):
                    writers.start_soon(_pod, sessions, run_id, p, stats, shared_id, pace)
            if not quiet and not console.is_terminal and stats.current.get(0):
                with anyio.move_on_after(10):  # the piped tail prints the last session to its end
                    await _printed_to_the_end(store, stats, stats.current[0])
            elif not quiet:
                await anyio.sleep(0.3)  # the tail prints the last entries
            tg.cancel_scope.cancel()
    finally:
        if live is not None:
            live.stop()


async def _refresh(live: Any, stats: Stats) -> None:
    while True:
        live.update(_progress(stats, stats.started))
        await anyio.sleep(0.25)


async def _catch_up(store: Any, stats: Stats, within: float = 10.0) -> None:
    """Let the projector catch up before reporting its lag."""
    from ..projector import status as projector_status

    with anyio.move_on_after(within):
        while True:
            stats.lag = int((await projector_status(store)).get("lag") or 0)
            if not stats.lag:
                return
            await anyio.sleep(0.1)


async def _doctor_all(store: Any, ids: list[str], console: Console) -> int:
    from ..doctor import doctor

    problems = 0
    for sid in ids:
        report = await doctor(store, sid)
        if not report.ok:
            problems += 1
            for problem in report.problems:
                console.print(f"[red]doctor {sid}[/red] {problem.code}: {problem.message}", highlight=False)
    return problems


def _summary(console: Console, stats: Stats, shared: Any, problems: int, viewer: str | None, prefix: str) -> None:
    elapsed = time.monotonic() - stats.started
    console.rule("summary")
    console.print(f"sessions written      {len(stats.sessions) + 1} ({stats.branches} branches)")
    console.print(f"entries appended      {stats.entries} ({stats.entries / max(elapsed, 0.001):.0f}/s)")
    console.print(f"turns completed       {stats.turns}")
    console.print(f"compaction cuts       {stats.cuts}")
    console.print(f"conflicts retried     {stats.conflicts_retried} (shared session n={shared.n if shared else '?'})")
    console.print(f"projection lag        {stats.lag or 0} entries")
    console.print(f"doctor                {'clean' if problems == 0 else f'{problems} session(s) with problems'}")
    if viewer:
        # the demo's gateway stops with it: the link works again once `up` serves that port
        port = viewer.split(":")[2].split("/")[0]
        console.print(
            f"viewer                stopped with the demo; `redis-session up --prefix {prefix} --port {port}`, "
            f"then open {viewer}",
            highlight=False,
            markup=False,
        )
