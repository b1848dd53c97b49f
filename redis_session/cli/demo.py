"""`redis-session demo`: the product end to end on one machine.

Simulated agent pods write concurrent sessions (turns, streamed chunks, tool calls and results,
compaction cuts, branches) while a projector keeps the derived messages cached and the gateway
serves the viewer. All pods also report to one shared session with optimistic appends, so
conflicts happen and are retried. One session is tailed live in the terminal; the run ends with a
summary and a doctor pass over every session it wrote.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from rich.console import Console

from ..errors import SessionConflictError
from ..model import NewEntry
from ..retry import conflict_backoff

WORDS = (
    "the session log is the single source of truth and every view of it is a projection "
    "computed from the entries appended in order by agents that may run anywhere"
).split()
QUESTIONS = [
    "What is on my calendar tomorrow?",
    "Summarise the last incident report.",
    "Find flights to Lisbon under 200 euros.",
    "Why did the nightly build fail?",
    "Draft a reply to the vendor.",
]


@dataclass
class Stats:
    sessions: list[str] = field(default_factory=list)
    entries: int = 0
    turns: int = 0
    conflicts_retried: int = 0
    branches: int = 0
    cuts: int = 0
    current: dict[int, str] = field(default_factory=dict)  # pod -> the session it writes now


async def _turn(s: Any, turn: int, rng: random.Random, stats: Stats, pace: float) -> None:
    """One dsh-style turn: a question, a streamed answer with a tool call, a result, a final answer."""
    q = rng.choice(QUESTIONS)
    call_id = f"call_{rng.randrange(16**8):08x}"
    stats.entries += len(
        await s.append_many(
            [
                NewEntry("turn/start", {"turn": turn, "trigger": {"kind": "message", "source": "demo"}}),
                NewEntry("user/message", {"content": [{"type": "text", "text": q}], "source": "demo"}),
                NewEntry("step/start", {"turn": turn, "step": 1}),
            ]
        )
    )
    thought = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8)))
    await _stream(s, turn, 1, thought, stats, pace)
    import json

    args = json.dumps({"query": q[:20]})
    stats.entries += len(
        await s.append_many(
            [
                NewEntry(
                    "assistant/message",
                    {
                        "turn": turn,
                        "step": 1,
                        "content": [
                            {"type": "text", "text": thought},
                            {"type": "tool-call", "id": call_id, "name": "search", "arguments": args},
                        ],
                    },
                ),
                NewEntry(
                    "tool/call",
                    {"turn": turn, "step": 1, "callId": call_id, "name": "search", "arguments": args},
                ),
            ]
        )
    )
    await anyio.sleep(pace * 3)
    answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
    stats.entries += len(
        await s.append_many(
            [
                NewEntry(
                    "tool/result",
                    {
                        "turn": turn,
                        "step": 1,
                        "callId": call_id,
                        "content": [{"type": "text", "text": f"{rng.randint(1, 9)} results"}],
                        "isError": False,
                    },
                ),
                NewEntry("step/end", {"turn": turn, "step": 1}),
                NewEntry("step/start", {"turn": turn, "step": 2}),
            ]
        )
    )
    await _stream(s, turn, 2, answer, stats, pace)
    stats.entries += len(await s.commit({"turn": turn, "step": 2, "content": [{"type": "text", "text": answer}]}))
    stats.entries += len(
        await s.append_many(
            [
                NewEntry("step/end", {"turn": turn, "step": 2}),
                NewEntry("turn/end", {"turn": turn, "reason": {"kind": "completed"}}),
            ]
        )
    )
    stats.turns += 1


async def _stream(s: Any, turn: int, step: int, text: str, stats: Stats, pace: float) -> None:
    so_far = ""
    for word in text.split():
        piece = (" " if so_far else "") + word
        so_far += piece
        await s.append("assistant/chunk", {"turn": turn, "step": step, "chunk": {"type": "text-delta", "text": piece}})
        await s.set_draft({"turn": turn, "step": step, "text": so_far})
        stats.entries += 1
        await anyio.sleep(pace)


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


async def _pod(
    sessions: Any, run_id: str, pod: int, deadline: float, stats: Stats, shared_id: str, pace: float
) -> None:
    rng = random.Random(pod)
    k = 0
    while time.monotonic() < deadline:
        sid = f"{run_id}-pod{pod}-s{k}"
        s = await sessions.create(sid, title=f"pod {pod} · chat {k}", origin={"pod": pod})
        stats.sessions.append(sid)
        stats.current[pod] = sid
        turns = rng.randint(2, 4)
        last_turn = 0
        for turn in range(1, turns + 1):
            await _turn(s, turn, rng, stats, pace)
            last_turn = turn
            await _report(sessions, shared_id, pod, f"{sid} finished turn {turn}", stats)
            if time.monotonic() >= deadline:
                break
        if k % 2 == 0 and s.n > 4:
            # compaction: everything before the last turn collapses into one summary message
            msgs = await s.messages()
            keep_from = max(0, s.n - 11)
            await s.compact(
                keep_from,
                [{"role": "user", "content": f"Summary of {len(msgs)} earlier messages."}],
                "token_limit",
            )
            stats.cuts += 1
            stats.entries += 1
        if k % 3 == 1:
            b = await sessions.branch(sid, s.n)
            stats.branches += 1
            stats.sessions.append(b.id)
            await _turn(b, last_turn + 1, rng, stats, pace)
        k += 1


async def _watch(store: Any, stats: Stats, console: Console, deadline: float) -> None:
    """A small live tail in the terminal of whatever pod 0 writes now: one line per entry, the
    streamed chunks forming the answer inline."""
    with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
        while True:
            sid = stats.current.get(0)
            if sid is None:
                await anyio.sleep(0.05)
                continue
            async with anyio.create_task_group() as tg:

                async def follow_switch(sid: str = sid) -> None:
                    while stats.current.get(0) == sid:  # noqa: ASYNC110 - another task's progress
                        await anyio.sleep(0.05)
                    await anyio.sleep(0.3)  # let the last entries of the old session print
                    tg.cancel_scope.cancel()

                tg.start_soon(follow_switch)
                await _print_tail(store, sid, console)
    console.print()


async def _print_tail(store: Any, session_id: str, console: Console) -> None:
    console.rule(f"[dim]{session_id}[/dim]", style="dim")
    streaming = False
    async for e in store.tail(session_id, 0):
        if e.type == "assistant/chunk":
            chunk = e.data.get("chunk") or {}
            console.print(chunk.get("text", ""), end="", style="green", highlight=False)
            streaming = True
            continue
        if streaming:
            console.print()
            streaming = False
        console.print(f"[dim]#{e.n:<4}[/dim] [bold]{e.type}[/bold] {_brief(e.data)}", highlight=False)


def _brief(data: dict[str, Any]) -> str:
    content = data.get("content")
    if isinstance(content, str):
        return content[:70]
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        calls = [b.get("name", "") for b in content if isinstance(b, dict) and b.get("type") == "tool-call"]
        return " ".join(texts)[:70] + (f" → {', '.join(calls)}()" if calls else "")
    if "reason" in data:
        r = data["reason"]
        return str(r.get("kind") if isinstance(r, dict) else r)
    return ""


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
    from ..projector import status as projector_status
    from ..redis.connect import open_store
    from ..sessions import Sessions, doctor

    console = console or Console()
    store = open_store(url, prefix=prefix)
    sessions = Sessions(store)
    stats = Stats()
    run_id = f"{int(time.time()) % 100000:05d}"
    shared_id = f"shared-{run_id}"
    started = time.monotonic()
    deadline = started + duration
    try:
        await sessions.create(shared_id, title="all pods report here (contended)")
        async with anyio.create_task_group() as services:
            projector = Projector(store, consumer=f"demo-{run_id}")
            services.start_soon(projector.run)
            viewer = None
            if port:
                from ..gateway.app import serve

                services.start_soon(lambda: serve(store, host="127.0.0.1", port=port))
                viewer = f"http://127.0.0.1:{port}/"
                console.print(f"[bold]viewer[/bold]: {viewer}")
            console.print(
                f"[bold]demo[/bold]: {pods} pods for {duration:.0f}s on prefix '{prefix}' (Ctrl-C to stop early)"
            )
            async with anyio.create_task_group() as tg:
                for p in range(pods):
                    tg.start_soon(_pod, sessions, run_id, p, deadline, stats, shared_id, pace)
                if not quiet:
                    tg.start_soon(_watch, store, stats, console, deadline)
            # let the projector catch up before reporting its lag
            lag: Any = None
            with anyio.move_on_after(10):
                while True:
                    st = await projector_status(store)
                    lag = st.get("lag")
                    if not lag:
                        break
                    await anyio.sleep(0.1)
            problems = 0
            for sid in [shared_id, *stats.sessions]:
                report = await doctor(store, sid)
                if not report.ok:
                    problems += 1
                    for problem in report.problems:
                        console.print(f"[red]doctor {sid}[/red] {problem.code}: {problem.message}")
            shared = await store.head(shared_id)
            elapsed = time.monotonic() - started
            console.rule("summary")
            console.print(f"sessions written      {len(stats.sessions) + 1} ({stats.branches} branches)")
            console.print(f"entries appended      {stats.entries} ({stats.entries / max(elapsed, 0.001):.0f}/s)")
            console.print(f"turns completed       {stats.turns}")
            console.print(f"compaction cuts       {stats.cuts}")
            console.print(
                f"conflicts retried     {stats.conflicts_retried} (shared session n={shared.n if shared else '?'})"
            )
            console.print(f"projection lag        {lag or 0} entries")
            console.print(
                f"doctor                {'clean' if problems == 0 else f'{problems} session(s) with problems'}"
            )
            if viewer:
                console.print(f"viewer                {viewer} (browse on with `redis-session up --prefix {prefix}`)")
            services.cancel_scope.cancel()
        return 0 if problems == 0 else 1
    finally:
        await store.aclose()
