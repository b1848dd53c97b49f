"""The Sessions service and the Session handle (docs/design.md §5), on every store backend.

Concurrency is exercised for real: tasks with their own handles, tasks sharing one handle, and
two OS processes against the same Redis server. Each rejected write asserts that nothing changed.
"""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from redis_session import (
    Entry,
    InvalidCursorError,
    InvalidEntryError,
    NewEntry,
    RedisSessionStore,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionForkError,
    SessionHeader,
    SessionNotFoundError,
    SessionReplacedError,
)
from redis_session.projection import ProjectionState, project
from redis_session.sessions import Session, Sessions, doctor

from support import am, let_pass, um

pytestmark = pytest.mark.anyio


def chat(role: str, text: str) -> NewEntry:
    return NewEntry("message", {"role": role, "content": text})


class Spy:
    """A store wrapper that records reads (what the handle's laziness is measured by)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: list[tuple[str, int, int | None, int]] = []
        self.projection_gets = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def read(self, session_id: str, start: int = 0, stop: int | None = None, **kw: Any) -> list[Entry]:
        out: list[Entry] = await self.inner.read(session_id, start, stop, **kw)
        self.reads.append((session_id, start, stop, len(out)))
        return out

    async def get_projection(self, session_id: str, **kw: Any) -> Any:
        self.projection_gets += 1
        return await self.inner.get_projection(session_id, **kw)

    @property
    def entries_read(self) -> int:
        return sum(r[3] for r in self.reads)


async def full(store: Any, sid: str) -> list[Entry]:
    head = await store.head(sid)
    return await store.read(sid, 0, head.n)


# --------------------------------------------------------------------------- open / create / list


async def test_open_creates_implicitly_and_each_open_is_a_snapshot(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("chat-1")
    b = await sessions.open("chat-1")
    assert a is not b and a.id == b.id == "chat-1" and a.n == b.n == 0
    assert a.header.created_at > 0 and a.header.parent is None and a.header.delegation_depth == 0
    await a.append("user/message", {"content": "hi"})
    assert (a.n, b.n) == (1, 0)
    c = await sessions.open("chat-1")
    assert c.n == 1 and c.header == a.header
    assert await b.read() == []  # b still stands at its n
    assert await b.refresh() == 1 and [e.data["content"] for e in await b.read()] == ["hi"]


async def test_concurrent_implicit_creates_all_open_the_same_session(store: Any) -> None:
    sessions = Sessions(store)
    handles: list[Session] = []

    async def opener() -> None:
        handles.append(await sessions.open("race"))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(opener)
    assert len({h.header.created_at for h in handles}) == 1 and all(h.n == 0 for h in handles)
    assert [h.id for h in (await sessions.list()).items] == ["race"]


async def test_create_defaults_fields_and_duplicates(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.create()
    assert s.id.startswith("session-") and len(s.id) == len("session-") + 32
    t = await sessions.create("t1", title="hello", origin={"platform": "qq"}, delegation_depth=2)
    assert (t.header.title, t.header.origin, t.header.delegation_depth) == ("hello", {"platform": "qq"}, 2)
    head = await sessions.head("t1")
    assert head is not None and head.header == t.header and head.n == 0
    with pytest.raises(SessionAlreadyExistsError):
        await sessions.create("t1")
    seeded = await sessions.create("seeded", entries=[um("a"), am("b")])
    assert seeded.n == 2 and [m.text for m in await seeded.messages()] == ["a", "b"]
    assert await sessions.head("missing") is None


MALFORMED_CURSORS = [
    "abc",
    "x",
    "inf:x",
    "nan:x",
    "1e26:x",
    "-1",
    "0:x",
    "1e400:x",
    "18446744073709551616:x",
    "1_0:x",
    "\x00",
    "",
    "0000000000000",
    "000000000000:x",
    "00000000000000:x",
    "\u0661" * 13 + ":x",
    "0000000000000:a b",
    "0000000000000:{x}",
]


async def test_a_list_cursor_no_list_returned_raises_invalid_cursor_error(store: Any) -> None:
    """`list(cursor=)` took any string: "abc", "inf:x" … listed nothing (a pager stopped early),
    "-1", "0:x" … the first page again (a pager looped). Now anything but a returned cursor
    (``<13 digits>:<id>``, or a tenant page's ``<13 digits>:``) raises `InvalidCursorError`."""
    for i in range(3):
        await store.create(SessionHeader(id=f"c{i}", created_at=1_700_000_000_000 + i))
    page = await store.list(limit=2)
    assert page.cursor is not None
    assert [h.id for h in (await store.list(limit=2, cursor=page.cursor)).items] == ["c0"]
    assert [h.id for h in (await store.list(limit=2, cursor=page.cursor[:14])).items] == ["c1", "c0"]
    for bad in MALFORMED_CURSORS:
        with pytest.raises(InvalidCursorError):
            await store.list(limit=2, cursor=bad)


async def test_list_delete_and_reopen(store: Any) -> None:
    sessions = Sessions(store)
    for i in range(5):
        await sessions.create(f"s{i}")
        await anyio.sleep(0.002)  # distinct created_at: the listing is newest first
    page = await sessions.list(limit=3)
    assert [h.id for h in page.items] == ["s4", "s3", "s2"] and page.cursor is not None
    rest = await sessions.list(limit=3, cursor=page.cursor)
    assert [h.id for h in rest.items] == ["s1", "s0"] and rest.cursor is None
    s = await sessions.open("s1")
    await s.append("user/message", {"content": "x"})
    assert await sessions.delete("s1") is True and await sessions.delete("s1") is False
    assert await sessions.head("s1") is None
    with pytest.raises(SessionNotFoundError):
        await s.append("user/message", {"content": "after delete"})
    fresh = await sessions.open("s1")
    assert fresh.n == 0


# --------------------------------------------------------------------------- writes


async def test_writes_return_stored_entries_and_move_n(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("w")
    [e0] = await s.append("user/message", {"content": "q"}, {"turn": 1})
    assert (e0.n, e0.type, e0.meta, s.n) == (0, "user/message", {"turn": 1}, 1)
    many = await s.append_many(
        [
            ("preset/selected", {"presetId": "p"}),
            NewEntry("assistant/chunk", {"chunk": {"text": "a"}}),
            chat("user", "u2"),
        ]
    )
    assert [e.n for e in many] == [1, 2, 3] and s.n == 4
    [m] = await s.mark("request/context", {"provider": "openai", "model": "gpt"})
    assert m.kind == "mark" and m.n == 4
    [c] = await s.commit({"content": "answer"})
    assert c.type == "assistant/message" and c.n == 5
    [c2] = await s.commit({"role": "assistant", "content": "plain"})
    assert c2.type == "message"
    [cut] = await s.compact(3, [{"role": "user", "content": "summary"}], "token_limit", meta={"by": "test"})
    assert cut.type == "cut" and cut.data["before"] == 3 and cut.data["meta"] == {"by": "test"}
    assert s.n == 8 and s.last_cut == 7
    assert await full(store, "w") == [e0, *many, m, c, c2, cut]
    assert [x.text for x in await s.messages()] == ["summary", "u2", "answer", "plain"]


async def test_mark_and_commit_refuse_the_wrong_types(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("m")
    for t in ("user/message", "message", "cut", "tool/result"):
        with pytest.raises(InvalidEntryError):
            await s.mark(t, {"content": "x"})
    for bad in (
        {"role": "user", "content": "x"},
        NewEntry("user/message", {"content": "x"}),
        NewEntry("message", {"role": "tool", "content": "x", "tool_call_id": "c"}),
    ):
        with pytest.raises(InvalidEntryError):
            await s.commit(bad)
    with pytest.raises(InvalidEntryError):
        await s.commit("just text")  # type: ignore[arg-type]
    assert s.n == 0 and (await store.head("m")).n == 0


async def test_commit_clears_the_draft_other_readers_see(store: Any) -> None:
    sessions = Sessions(store)
    writer = await sessions.open("d")
    reader = await sessions.open("d")
    assert await reader.draft() is None
    await writer.set_draft({"content": "partial ans"})
    assert await reader.draft() == {"content": "partial ans"}
    await writer.commit({"content": "partial answer, done"})
    assert await reader.draft() is None


async def test_bad_writes_change_nothing(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("bad")
    await s.append_many([um("a"), am("b")])
    before = (await store.head("bad"), await full(store, "bad"), s.n)
    for batch in (
        [um("ok"), NewEntry("user/message", {"content": float("nan")})],
        [um("ok"), NewEntry("cut", {"before": 99, "summary": [], "reason": "x"})],
        "not a batch",
    ):
        with pytest.raises(InvalidEntryError):
            await s.append_many(batch)  # type: ignore[arg-type]
    with pytest.raises(InvalidEntryError):
        await s.compact(10, [], "too far")
    assert (await store.head("bad"), await full(store, "bad"), s.n) == before


async def test_define_registers_a_schema_that_rejects_bad_data(store: Any) -> None:
    class Vote(msgspec.Struct):
        choice: str
        weight: int = 1

    sessions = Sessions(store)
    sessions.define("poll/vote", Vote)
    s = await sessions.open("poll")
    await s.mark("poll/vote", {"choice": "a", "weight": 3})
    for bad in ({"choice": 1}, {"weight": 2}, {"choice": "b", "weight": "heavy"}):
        with pytest.raises(InvalidEntryError, match="poll/vote"):
            await s.mark("poll/vote", bad)
    assert s.n == 1 and (await store.head("poll")).n == 1
    sessions.define("free/form")  # None: any JSON object
    await s.mark("free/form", {"anything": [1, 2]})
    with pytest.raises(InvalidEntryError):
        await s.mark("free/form", ["not", "an", "object"])
    with pytest.raises(ValueError):
        sessions.define("cut", Vote)  # the projection depends on the cut schema


# --------------------------------------------------------------------------- concurrency


async def test_conflict_leaves_the_handle_consistent_and_refresh_recovers(store: Any) -> None:
    sessions = Sessions(store)
    a = await sessions.open("c")
    b = await sessions.open("c")
    await a.append("user/message", {"content": "one"})
    assert [m.text for m in await b.messages()] == []  # b's projection loaded at n=0
    with pytest.raises(SessionConflictError) as ei:
        await b.append("user/message", {"content": "late"})
    assert (ei.value.expected_n, ei.value.actual_n) == (0, 1)
    assert b.n == 0 and await b.messages() == [] and await b.read() == []
    await a.append_many([am("two"), um("three")])
    assert await b.refresh() == 3
    assert await b.messages() == project(await full(store, "c"))
    await b.append("user/message", {"content": "four"})
    assert [e.data["content"] for e in await full(store, "c")] == ["one", "two", "three", "four"]


async def test_two_tasks_two_handles_conflict_refresh_retry(store: Any) -> None:
    sessions = Sessions(store)
    await sessions.create("shared")
    attempts = {"a": 0, "b": 0}
    per_writer = 25

    async def writer(tag: str) -> None:
        s = await sessions.open("shared")
        for i in range(per_writer):

            async def step(s: Session, i: int = i) -> None:
                attempts[tag] += 1
                # an entry that depends on the log: it names the n it was written after
                await s.append("message", {"role": "user", "content": f"{tag}{i}", "after": s.n})
                await anyio.lowlevel.checkpoint()

            await s.transact(step, retries=200)

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer, "a")
        tg.start_soon(writer, "b")
    log = await full(store, "shared")
    assert [e.n for e in log] == list(range(2 * per_writer))
    assert all(e.data["after"] == e.n for e in log)  # every entry was (re)built at its real position
    for tag in "ab":
        mine = [e.data["content"] for e in log if e.data["content"].startswith(tag)]
        assert mine == [f"{tag}{i}" for i in range(per_writer)]
    assert attempts["a"] + attempts["b"] > 2 * per_writer  # they did conflict, and recovered


async def test_tasks_sharing_one_handle_never_reorder(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("order")
    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(s.append, "user/message", {"content": str(i)})
    assert [e.data["content"] for e in await full(store, "order")] == [str(i) for i in range(40)]
    assert s.n == 40


async def test_transact_holds_the_handle_lock_and_gives_up(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("tx")
    other = await sessions.open("tx")
    calls = 0

    async def always_stale(h: Session) -> None:
        nonlocal calls
        calls += 1
        await other.enqueue("user/message", {"content": f"noise{calls}"})
        await h.append("user/message", {"content": "never"})

    with pytest.raises(SessionConflictError):
        await s.transact(always_stale, retries=3, base_delay=0.001)
    assert calls == 4 and all(e.data["content"] != "never" for e in await full(store, "tx"))

    async def reads_then_writes(h: Session) -> int:
        msgs = await h.messages()  # re-enters the lock transact holds
        await h.append("user/message", {"content": f"after {len(msgs)}"})
        return h.n

    assert await s.transact(reads_then_writes) == 5
    with pytest.raises(ValueError):
        await s.transact(reads_then_writes, retries=-1)


async def test_enqueue_appends_at_the_end_without_conflict(store: Any) -> None:
    sessions = Sessions(store)
    stale = await sessions.open("q")
    fresh = await sessions.open("q")
    assert await stale.messages() == []
    await fresh.append_many([um("a"), am("b")])
    [e] = await stale.enqueue("user/message", {"content": "queued"})
    assert e.n == 2 and stale.n == 3
    # the entries it had not seen were folded in: its projection is the log's
    assert await stale.messages() == project(await full(store, "q"))
    blind = await sessions.open("q")
    await fresh.enqueue("agent/input-enqueued", {"messageId": "m1"})
    await blind.enqueue("user/message", {"content": "x"})
    assert blind.n == 5 and await blind.messages() == project(await full(store, "q"))


async def test_two_processes_append_to_one_session(redis_url: str, prefix: str) -> None:
    script = """
import sys, anyio, redis.asyncio as aioredis
from redis_session import RedisSessionStore
from redis_session.sessions import Sessions
url, prefix, sid, tag, count = sys.argv[1:6]
async def main():
    store = RedisSessionStore.from_url(url, prefix=prefix)
    s = await Sessions(store).open(sid)
    barrier = aioredis.Redis.from_url(url)
    await barrier.incr(f"{prefix}:barrier")
    while int(await barrier.get(f"{prefix}:barrier")) < 2:  # start together, so they contend
        await anyio.sleep(0.001)
    tries = 0
    for i in range(int(count)):
        async def step(s, i=i):
            nonlocal tries
            tries += 1
            await s.append("message", {"role": "user", "content": f"{tag}{i}", "after": s.n})
        await s.transact(step, retries=1000)
    print(tries)
    await barrier.aclose()
    await store.aclose()
anyio.run(main)
"""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        await Sessions(store).create("proc")
        per = 100
        done: list[subprocess.CompletedProcess[bytes]] = []

        async def run(tag: str) -> None:
            cmd = [sys.executable, "-c", script, redis_url, prefix, "proc", tag, str(per)]
            done.append(await anyio.run_process(cmd, check=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a")
            tg.start_soon(run, "b")
        log = await full(store, "proc")
        assert [e.n for e in log] == list(range(2 * per))
        assert all(e.data["after"] == e.n for e in log)
        for tag in "ab":
            assert [e.data["content"] for e in log if e.data["content"][0] == tag] == [f"{tag}{i}" for i in range(per)]
        tries = sum(int(p.stdout) for p in done)
        assert tries > 2 * per  # they did conflict, refresh and retry
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- reads


async def test_handle_is_lazy_and_kept_current_by_its_own_writes(store: Any) -> None:
    spy = Spy(store)
    sessions = Sessions(spy)
    await store.create(SessionHeader(id="lazy"), [um("a")])
    s = await sessions.open("lazy")
    assert spy.reads == [] and spy.projection_gets == 0  # opening reads the head only
    assert [m.text for m in await s.messages()] == ["a"]
    assert spy.entries_read == 1
    spy.reads.clear()
    await s.append_many([am("b"), um("c")])
    await s.commit({"content": "d"})
    assert [m.text for m in await s.messages()] == ["a", "b", "c", "d"]
    assert spy.reads == []  # no read: the handle's appends extended its projection
    await s.compact(2, [{"role": "user", "content": "sum"}], "manual")
    assert [m.text for m in await s.messages()] == ["sum", "c", "d"] and spy.reads == []


async def test_messages_equal_a_fold_from_scratch_after_mixed_writes(store: Any) -> None:
    rng = random.Random(7)
    sessions = Sessions(store)
    s = await sessions.open("mix")
    other = await sessions.open("mix")
    turn = 0
    conflicts = 0
    for step in range(120):
        r = rng.random()
        try:
            if r < 0.25:
                await s.append("user/message", {"content": f"u{step}"})
            elif r < 0.45:
                await s.commit(
                    {"content": [{"type": "text", "text": f"a{step}"}]} if rng.random() < 0.5 else {"content": ""}
                )
            elif r < 0.55:
                turn += 1
                await s.append_many(
                    [
                        ("turn/start", {"turn": turn}),
                        ("assistant/chunk", {"chunk": {"text": "x"}}),
                        NewEntry(
                            "message",
                            {
                                "role": "assistant",
                                "content": None,
                                "tool_calls": [{"id": f"c{step}", "function": {"name": "f", "arguments": "{}"}}],
                            },
                        ),
                        NewEntry("message", {"role": "tool", "content": "ok", "tool_call_id": f"c{step}"}),
                        ("turn/end", {"turn": turn, "reason": "completed"}),
                    ]
                )
            elif r < 0.62 and s.n > 0:
                await s.compact(rng.randint(0, s.n), [{"role": "user", "content": f"summary{step}"}], "token_limit")
            elif r < 0.70:
                # replace a span of visible surface nodes (by position), naming every node it shadows
                st = await _state_at(store, "mix", s.n)
                visible = [m.source[0] for m in st.messages() if m.source and m.source[0] != st.last_cut]
                if len(visible) >= 2:
                    i, j = sorted(st.surface.index(k) for k in rng.sample(visible, 2))
                    nodes = st.surface[i : j + 1]
                    await s.append(
                        "user/message",
                        {"content": f"replaced {nodes}"},
                        surface={
                            "surfaceOp": {"op": "replace", "start": nodes[0], "end": nodes[-1]},
                            "sourceEventSeqs": sorted(nodes),
                        },
                    )
            elif r < 0.85:
                await other.enqueue("user/message", {"content": f"other{step}"})
                if rng.random() < 0.5:
                    await s.refresh()
            else:
                await s.mark("preset/selected", {"presetId": f"p{step}"})
        except SessionConflictError:
            conflicts += 1  # `other` wrote since s last looked
            assert await s.refresh() == (await store.head("mix")).n

        if step % 10 == 0:
            await s.refresh()
        assert await s.messages() == project(await store.read("mix", 0, s.n)), f"step {step}"
    await s.refresh()
    assert conflicts > 0
    assert await s.messages() == project(await full(store, "mix"))
    assert await sessions.messages("mix") == project(await full(store, "mix"))


async def test_surface_replace_is_checked_against_the_handle_state(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("surf")
    for text in ("a", "b", "c"):
        await s.append("user/message", {"content": text}, surface={"surfaceOp": "append"})
    before = (await store.head("surf"), s.n)
    bad_surfaces: list[dict[str, Any]] = [
        {"surfaceOp": {"op": "replace", "start": 7, "end": 7}, "sourceEventSeqs": [0]},  # not a node
        {"surfaceOp": {"op": "replace", "start": 2, "end": 0}, "sourceEventSeqs": [0, 1, 2]},  # reversed
        {"surfaceOp": {"op": "replace", "start": 0, "end": 1}, "sourceEventSeqs": [0]},  # misses 1
        {"surfaceOp": "append", "sourceEventSeqs": [5]},  # not earlier
    ]
    for surface in bad_surfaces:
        with pytest.raises(InvalidEntryError):
            await s.append("user/message", {"content": "r"}, surface=surface)
    assert (await store.head("surf"), s.n) == before
    await s.append(
        "user/message",
        {"content": "ab"},
        surface={"surfaceOp": {"op": "replace", "start": 0, "end": 1}, "sourceEventSeqs": [0, 1]},
    )
    assert [m.text for m in await s.messages()] == ["ab", "c"]
    # a replace written against a stale handle cannot land: its check may be stale, expected_n is not
    stale = await sessions.open("surf")
    await s.append("user/message", {"content": "d"})
    with pytest.raises(SessionConflictError):
        await stale.append(
            "user/message",
            {"content": "x"},
            surface={"surfaceOp": {"op": "replace", "start": 2, "end": 2}, "sourceEventSeqs": [2]},
        )
    # a batch may replace a node it appended itself
    await s.append_many(
        [
            NewEntry("user/message", {"content": "e"}, surface={"surfaceOp": "append"}),
            NewEntry(
                "user/message",
                {"content": "E"},
                surface={"surfaceOp": {"op": "replace", "start": 5, "end": 5}, "sourceEventSeqs": [5]},
            ),
        ]
    )
    assert [m.text for m in await s.messages()] == ["ab", "c", "d", "E"]
    assert await s.messages() == project(await full(store, "surf"))


async def test_read_defaults_to_the_handle_n_and_pages(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("r")
    other = await sessions.open("r")
    await s.append_many([um(str(i)) for i in range(10)])
    await other.refresh()
    await s.append("user/message", {"content": "later"})
    assert len(await other.read()) == 10 and len(await other.read(0, None)) == 10
    assert [e.n for e in await other.read(3, 6)] == [3, 4, 5]
    assert len(await other.read(0, 100)) == 11  # an explicit stop may look past the handle
    with pytest.raises(ValueError):
        await s.read(-1)


async def test_history_reconstruct_request_and_invariants(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("h")
    header = {"config": {"model": "m"}, "system": "be brief"}
    await s.append_many(
        [
            ("turn/start", {"turn": 1}),
            ("request/header", {"header": header, "reason": "initial"}),
            ("user/message", {"content": "q1"}),
            ("step/start", {"turn": 1, "step": 1}),
            ("assistant/message", {"turn": 1, "step": 1, "content": "a1"}),
            ("step/end", {"turn": 1, "step": 1}),
            ("turn/end", {"turn": 1, "reason": "completed"}),
            ("user/message", {"content": "q2"}),
        ]
    )
    assert [m.text for m in await s.history(max_messages=1)] == ["q2"]
    assert [m.text for m in await s.history()] == ["q1", "a1", "q2"]
    req = await s.reconstruct_request(4)
    assert req.header == header and [m.text for m in req.messages] == ["q1"]
    with pytest.raises(ValueError):
        await s.reconstruct_request(99)
    assert await s.check_invariants() == []
    await s.append("step/start", {"turn": 1, "step": 1})  # outside any open turn
    assert [p.code for p in await s.check_invariants()] == ["outside-turn"]


async def test_tail_starts_at_the_handle_n(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("t")
    await s.append_many([um("old1"), um("old2")])
    got: list[Entry] = []

    async def follow() -> None:
        async for e in s.tail():
            got.append(e)
            if len(got) == 2:
                return

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await anyio.sleep(0.05)
            w = await sessions.open("t")
            await w.append("user/message", {"content": "new1"})
            await w.append("user/message", {"content": "new2"})
    assert [e.data["content"] for e in got] == ["new1", "new2"]
    assert [e.n async for e in _take(s.tail(0), 2)] == [0, 1]


async def _take(it: Any, k: int) -> Any:
    async for e in it:
        yield e
        k -= 1
        if k == 0:
            return


# --------------------------------------------------------------------------- snapshot loading


async def _state_at(store: Any, sid: str, n: int) -> ProjectionState:
    st = ProjectionState()
    st.extend(await store.read(sid, 0, n))
    return st


async def test_messages_start_from_the_projector_snapshot(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("snap")
    await s.append_many([um(f"u{i}") if i % 2 == 0 else am(f"a{i}") for i in range(40)])
    assert await store.put_projection("snap", 30, (await _state_at(store, "snap", 30)).to_bytes())
    spy = Spy(store)
    svc = Sessions(spy)
    assert await svc.messages("snap") == project(await full(store, "snap"))
    assert spy.entries_read == 10  # only [30, 40) was folded here
    spy.reads.clear()
    h = await svc.open("snap")
    assert await h.messages() == project(await full(store, "snap")) and spy.entries_read == 10


async def test_unusable_snapshots_are_never_trusted(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("u")
    await s.append_many([um(f"u{i}") for i in range(12)])
    truth = project(await full(store, "u"))
    state = (await _state_at(store, "u", 6)).to_bytes()
    for blob in (b"garbage", state[:-5], state.replace(b"u3", b"u9"), b""):
        other = await sessions.create(f"u-{len(blob)}-{hash(blob) & 0xFFFF}", entries=[um(f"u{i}") for i in range(12)])
        if blob:
            await store.put_projection(other.id, 6, blob)
        assert await sessions.messages(other.id) == truth
        assert await (await sessions.open(other.id)).messages() == truth


async def test_a_snapshot_ahead_of_the_handle_is_not_used(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("ahead")
    await s.append_many([um("a"), am("b")])
    old = await sessions.open("ahead")
    await s.append_many([um("c"), am("d")])
    await store.put_projection("ahead", 4, (await _state_at(store, "ahead", 4)).to_bytes())
    assert [m.text for m in await old.messages()] == ["a", "b"]  # the projection at *its* n


async def test_stale_snapshot_beyond_cuts_still_answers_right(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("cuts")
    await s.append_many([um(f"u{i}") for i in range(10)])
    await s.compact(6, [{"role": "user", "content": "S1"}], "manual")  # n=10
    await s.append_many([am(f"a{i}") for i in range(5)])  # 11..15
    # a snapshot the projector rebuilt from that cut (history below n=6 unknown to it)
    window = await store.read("cuts", 6, 10)
    [cut] = await store.read("cuts", 10, 11)
    from_cut = ProjectionState.from_cut(cut, window)
    from_cut.extend(await store.read("cuts", 11, 16))
    assert await store.put_projection("cuts", 16, from_cut.to_bytes())
    # then a cut that shows older entries again: the snapshot cannot follow, the reader falls back
    await s.compact(2, [{"role": "user", "content": "S2"}], "manual")
    await s.append("user/message", {"content": "last"})
    truth = project(await full(store, "cuts"))
    assert [m.text for m in truth][:3] == ["S2", "u2", "u3"]
    assert await sessions.messages("cuts") == truth
    assert await (await sessions.open("cuts")).messages() == truth


async def test_a_cold_long_log_is_rebuilt_from_its_last_cut(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("long")
    for k in range(0, 3000, 1000):
        await s.append_many([um(f"u{i}") for i in range(k, k + 1000)])
    await s.compact(2990, [{"role": "user", "content": "summary"}], "token_limit")
    await s.append_many([am("x"), am("y")])
    spy = Spy(store)
    msgs = await Sessions(spy).messages("long")
    assert msgs == project(await full(store, "long"))
    assert spy.entries_read < 20  # the cut, its window [2990, 3000) and what follows it


# --------------------------------------------------------------------------- ephemeral


async def test_ephemeral_session_keys_expire_together(redis_store: Any, raw_redis: Any, prefix: str) -> None:
    sessions = Sessions(redis_store)
    s = await sessions.open("eph", ephemeral=True, ttl=3.0)  # outlives the writes below on a slow machine
    await s.append("user/message", {"content": "hi"}, idempotency_key="k1")
    await s.set_draft({"content": "typing"})
    await redis_store.put_projection("eph", 1, (await _state_at(redis_store, "eph", 1)).to_bytes())
    async with s.lease(ttl=5):
        await s.commit({"content": "bye"})
    await s.set_draft({"content": "again"})
    keys = sorted(await raw_redis.keys(f"{prefix}:{{eph}}:*"))
    assert {k.rsplit(":", 1)[1] for k in keys} >= {"hdr", "log", "idem", "proj", "draft"}
    ttls = [await raw_redis.pttl(k) for k in keys]
    assert all(0 < t <= 3000 for t in ttls), dict(zip(keys, ttls, strict=True))
    with anyio.fail_after(60):
        while await raw_redis.keys(f"{prefix}:{{eph}}:*"):  # noqa: ASYNC110 - waiting on the server clock
            await anyio.sleep(0.05)
    assert await sessions.head("eph") is None
    created = await sessions.create("eph2", ttl=1.5)  # written to once before it expires, even on a slow machine
    durable = await sessions.create("durable")
    await created.append("user/message", {"content": "x"})
    with anyio.fail_after(60):  # the server's clock expires it: poll for it, never a fixed wait
        while await sessions.head("eph2") is not None:  # noqa: ASYNC110 - waiting on the server clock
            await anyio.sleep(0.05)
    assert await sessions.head("durable") is not None
    assert durable.n == 0


async def test_ephemeral_expiry_through_the_store(store: Any) -> None:
    sessions = Sessions(store)
    ttl = 2.0  # half of it is the room each step below has on a slow machine
    s = await sessions.open("e", ephemeral=True, ttl=ttl)
    kept = await sessions.open("k")
    await s.append("user/message", {"content": "x"})
    await let_pass(store, ttl / 2)
    await s.append("user/message", {"content": "y"})  # every write pushes the expiry back
    await let_pass(store, ttl / 2 + 0.1)  # past x's expiry, half a ttl before y's
    assert (await sessions.head("e")) is not None
    await let_pass(store, ttl)
    assert await sessions.head("e") is None and await sessions.head(kept.id) is not None
    reopened = await sessions.open("e")  # a new, durable session under the same id
    assert reopened.n == 0
    with pytest.raises(ValueError):
        await sessions.create("neg", ttl=0)
    with pytest.raises(ValueError):
        await sessions.create("nan", ttl=float("nan"))


# --------------------------------------------------------------------------- doctor


async def _healthy(sessions: Sessions) -> list[str]:
    s = await sessions.open("ok")
    await s.append_many(
        [
            ("turn/start", {"turn": 1}),
            ("user/message", {"content": "q"}),
            ("turn/end", {"turn": 1, "reason": "completed"}),
        ]
    )
    await s.compact(1, [{"role": "user", "content": "s"}], "manual")
    b = await sessions.branch("ok", 4, branch_id="ok-b")
    await b.append("user/message", {"content": "own"})
    empty = await sessions.branch("ok", 2, branch_id="ok-empty")
    return ["ok", b.id, empty.id]


async def test_doctor_passes_healthy_sessions(store: Any) -> None:
    sessions = Sessions(store)
    for sid in await _healthy(sessions):
        report = await doctor(store, sid)
        assert report.ok, report.problems
        assert report.n == (await store.head(sid)).n
    assert (await sessions.doctor("ok")).ok
    with pytest.raises(SessionNotFoundError):
        await doctor(store, "ghost")


async def test_doctor_reports_invariant_problems(store: Any) -> None:
    sessions = Sessions(store)
    s = await sessions.open("inv")
    await s.append_many([("turn/start", {"turn": 2}), ("turn/end", {"turn": 2, "reason": "completed"})])
    report = await doctor(store, "inv")
    assert not report.ok and [p.code for p in report.problems] == ["turn-number"]


async def test_doctor_finds_storage_damage_on_redis(redis_store: Any, raw_redis: Any, prefix: str) -> None:
    sessions = Sessions(redis_store)
    for sid in ("gap", "cutx", "rot", "behind"):
        s = await sessions.open(sid)
        await s.append_many([um("a"), um("b")])
    hdr, log = f"{prefix}:{{%s}}:hdr", f"{prefix}:{{%s}}:log"
    await raw_redis.xadd(log % "gap", {"type": "user/message", "time": "1", "data": '{"content":"x"}'}, id="5-1")
    await raw_redis.hset(hdr % "cutx", "last_cut", "0")
    await raw_redis.xadd(log % "rot", {"type": "user/message", "time": "1", "data": "{not json"}, id="2-1")
    await raw_redis.hset(hdr % "rot", "n", "3")
    await raw_redis.hset(hdr % "behind", "n", "4")
    codes = {
        sid: {p.code for p in (await doctor(redis_store, sid)).problems} for sid in ("gap", "cutx", "rot", "behind")
    }
    assert codes["gap"] == {"stream-gap", "stream-ahead"}
    assert codes["cutx"] == {"last-cut"}
    assert "decode" in codes["rot"]
    assert codes["behind"] == {"stream-behind"}


async def test_doctor_names_each_edit_once(redis_store: Any, raw_redis: Any, prefix: str) -> None:
    """A log edited outside redis-session is reported by the doctor, not raised: a row added beside
    one (its ID named), a row given a field twice, a log or header key of another kind; the read's own
    corruption error is not reported again beside the row the walk names."""
    sessions = Sessions(redis_store)
    for sid in ("stray", "twice", "string", "hdr", "proj"):
        s = await sessions.open(sid)
        await s.append_many([um("a"), um("b")])
    log, hdr = f"{prefix}:{{%s}}:log", f"{prefix}:{{%s}}:hdr"
    await raw_redis.xadd(log % "stray", {"type": "user/message", "time": "1", "data": "{}"}, id="1-2")
    await raw_redis.execute_command(
        "XADD", log % "twice", "2-1", "type", "user/message", "time", "1", "data", "{}", "data", "{}"
    )
    await raw_redis.hset(hdr % "twice", "n", "3")
    await raw_redis.delete(log % "string")
    await raw_redis.set(log % "string", "oops")
    await raw_redis.delete(hdr % "hdr")
    await raw_redis.set(hdr % "hdr", "oops")
    await raw_redis.set(f"{prefix}:{{proj}}:proj", "oops")  # the projector's snapshot, as a string
    reports = {sid: (await doctor(redis_store, sid)).problems for sid in ("stray", "twice", "string", "hdr", "proj")}
    assert [p.code for p in reports["proj"]] == ["key-type"] and ":proj holds a string" in reports["proj"][0].message
    assert [p.code for p in reports["hdr"]] == ["header"] and "another kind" in reports["hdr"][0].message
    assert [p.code for p in reports["stray"]] == ["stream-id"] and "1-2" in reports["stray"][0].message
    assert [(p.n, p.code) for p in reports["twice"]] == [(2, "decode")]
    assert "a field twice" in reports["twice"][0].message
    assert [p.code for p in reports["string"]] == ["key-type"] and "holds a string" in reports["string"][0].message


async def test_doctor_checks_the_memory_store_through_read() -> None:
    from redis_session import MemorySessionStore

    store = MemorySessionStore()
    sessions = Sessions(store)
    s = await sessions.open("m")
    await s.append_many([um("a"), um("b")])
    store._sessions["m"].last_cut = 1  # damage the header
    assert [p.code for p in (await doctor(store, "m")).problems] == ["last-cut"]


# --------------------------------------------------------------------------- incarnations


async def test_refresh_after_delete_and_create_raises_replaced(store: Any) -> None:
    sessions = Sessions(store)
    old = await sessions.open("r")
    await old.append_many([um("secret"), am("ok")])
    assert [m.text for m in await old.messages()] == ["secret", "ok"]
    await store.delete("r")
    await store.create(SessionHeader(id="r"), [um("clean"), am("ok")])  # same n as the handle
    with pytest.raises(SessionReplacedError):
        await old.refresh()
    assert old.n == 2 and old.header.incarnation != (await store.head("r")).header.incarnation
    # the handle's next write is refused atomically, although its n matches the new log's
    with pytest.raises(SessionReplacedError):
        await old.append("user/message", {"content": "into the wrong session"})
    with pytest.raises(SessionReplacedError):
        await old.enqueue("user/message", {"content": "nor this"})
    with pytest.raises(SessionReplacedError):
        await old.read()
    assert [e.data["content"] for e in await store.read("r")] == ["clean", "ok"]
    new = await sessions.open("r")
    assert [m.text for m in await new.messages()] == ["clean", "ok"]


async def test_refresh_after_a_replace_import_raises_replaced(store: Any, tmp_path: Any) -> None:
    from redis_session.importers import export_session, import_path

    sessions = Sessions(store)
    s = await sessions.open("imp")
    await s.append_many([um("my password is hunter2"), am("noted")])
    out = tmp_path / "imp.jsonl"
    await export_session(store, "imp", out)
    before = (await store.head("imp")).header
    out.write_text(out.read_text().replace("hunter2", "[redacted]"))
    [res] = await import_path(store, out, on_exists="replace")
    assert res.status == "replaced"
    with pytest.raises(SessionReplacedError):
        await s.refresh()
    with pytest.raises(SessionReplacedError):
        await s.append("user/message", {"content": "late"})
    assert (await store.head("imp")).n == 2
    after = (await store.head("imp")).header
    assert after.incarnation != before.incarnation and after.created_at == before.created_at
    assert [m.text for m in await (await sessions.open("imp")).messages()] == ["my password is [redacted]", "noted"]


async def test_last_cut_after_enqueue_over_another_writers_cut(store: Any) -> None:
    sessions = Sessions(store)
    mine = await sessions.open("lc")
    other = await sessions.open("lc")
    await other.append_many([um("a"), am("b")])
    await other.compact(1, [{"role": "user", "content": "sum"}], "test")  # a cut at n=2
    assert other.last_cut == 2
    [e] = await mine.enqueue("user/message", {"content": "queued"})  # no projection loaded
    assert e.n == 3 and mine.n == 4
    assert mine.last_cut == 2 == (await store.head("lc")).last_cut
    # a cut of another writer right before our next enqueue, and a handle that saw neither
    third = await sessions.open("lc")
    await other.refresh()
    await other.compact(3, [{"role": "user", "content": "sum2"}], "test")  # n=4
    [e2] = await mine.enqueue("user/message", {"content": "q2"})
    assert e2.n == 5 and mine.last_cut == 4
    await third.enqueue("user/message", {"content": "q3"})
    assert third.last_cut == 4


async def test_mistyped_arguments_are_typed_errors_and_write_nothing(redis_store: Any) -> None:
    """Each of these raised a bare TypeError/AttributeError/ValueError/OverflowError from inside
    (an outside review's list): a `SessionError` now, and nothing is written."""
    from redis_session import SessionError

    S = Sessions(redis_store)
    s = await S.create("typed-1")
    await s.append("user/message", {"content": "hi"})

    async def snapshot() -> dict[bytes, Any]:
        keys = [k async for k in redis_store.client.scan_iter(match=f"{redis_store.prefix}*")]
        return {k: await redis_store.client.dump(k) for k in sorted(keys)}

    calls: list[Any] = [
        lambda: s.append_many(None),
        lambda: s.append_many(5),
        lambda: S.create("typed-2", idempotency_key=1),
        lambda: S.create("typed-3", entries=None),
        lambda: S.branch("typed-1", 1, idempotency_key=1.5),
        lambda: s.repair(stale_after=None),
        lambda: s.repair(stale_after=float("inf")),
        lambda: s.repair(stale_after=float("nan")),
        lambda: S.delete("typed-1", incarnation=1.5),
        lambda: S.delete("typed-1", incarnation={"a": 1}),
        lambda: s.set_draft("5"),
        lambda: s.set_draft(1.5),
        lambda: s.compact(1, summary=None, reason="r"),
        lambda: s.compact(1, summary="5", reason="r"),
        lambda: s.compact(1, summary=[{"role": "user", "content": "x"}], reason="r", meta=5),
        lambda: s.mark([1], {}),
        lambda: s.mark({"a": 1}, {}),
    ]
    before = await snapshot()
    for i, call in enumerate(calls):
        with pytest.raises(SessionError):
            await call()
        assert await snapshot() == before, i


async def test_an_argument_whose_repr_raises_or_is_huge_is_still_a_typed_error(redis_store: Any) -> None:
    """The error names a bad argument by its repr: one whose repr raises surfaced as the caller's
    own exception from inside ours, and a huge one made a huge message."""
    from redis_session import InvalidArgumentError, InvalidEntryError

    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("repr exploded")

    S = Sessions(redis_store)
    s = await S.create("repr-1")
    with pytest.raises(InvalidArgumentError, match="Hostile"):
        await s.read(Hostile())  # type: ignore[arg-type]
    with pytest.raises(InvalidEntryError, match="Hostile"):
        await redis_store.put("repr-1", Hostile(), [])
    with pytest.raises(InvalidArgumentError) as caught:
        await s.read(["x" * 100_000])  # type: ignore[arg-type]
    assert len(str(caught.value)) < 300
    assert s.n == 0 and await redis_store.read("repr-1") == []


async def test_keyed_create_branch_and_fork_retried_are_the_same_session(store: Any) -> None:
    """`idempotency_key` on `Sessions.create`, `branch` and `fork` (r19): a retry of the same
    request — after a lost reply, or just sent twice — is the session the first attempt made
    (the same life), never `SessionAlreadyExistsError` nor another session; without an id the
    key names it, so an id-less retry finds it too. The same key with another request is
    `IdempotencyKeyReusedError`; another key (or none) for a taken id stays
    `SessionAlreadyExistsError`. The gateway's keyed routes are this, over HTTP."""
    from redis_session import IdempotencyKeyReusedError

    sessions = Sessions(store)
    turn = [NewEntry("turn/start", {"turn": 1}), um("q"), NewEntry("turn/end", {"turn": 1, "reason": "completed"})]
    a = await sessions.create("c1", title="t", entries=turn, idempotency_key="K")
    b = await sessions.create("c1", title="t", entries=turn, idempotency_key="K")
    assert (a.id, a.header.incarnation) == (b.id, b.header.incarnation)
    with pytest.raises(IdempotencyKeyReusedError):
        await sessions.create("c1", title="other", entries=turn, idempotency_key="K")
    for key in ("other-key", None):
        with pytest.raises(SessionAlreadyExistsError):
            await sessions.create("c1", title="t", entries=turn, idempotency_key=key)
    x = await sessions.create(idempotency_key="no-id")  # no id: the key names it
    y = await sessions.create(idempotency_key="no-id")
    assert x.id == y.id and x.header.incarnation == y.header.incarnation
    br1 = await sessions.branch("c1", 2, idempotency_key="B")
    br2 = await sessions.branch("c1", 2, idempotency_key="B")
    assert (br1.id, br1.header.incarnation) == (br2.id, br2.header.incarnation)
    with pytest.raises(IdempotencyKeyReusedError):
        await sessions.branch("c1", 1, idempotency_key="B")  # the key's branch is at 2
    f1 = await sessions.fork("c1", 2, idempotency_key="F")
    f2 = await sessions.fork("c1", 2, idempotency_key="F")
    assert (f1.id, f1.header.incarnation) == (f2.id, f2.header.incarnation)
    kids = sorted(h.id for h in (await sessions.list(parent="c1")).items)
    assert kids == sorted([br1.id, f1.id])  # one child per request, not one per attempt


async def test_a_keyed_branch_or_fork_retried_after_its_parent_was_deleted_is_the_child(store: Any) -> None:
    """A keyed branch (or fork) whose reply was lost, its parent deleted before the retry (hidden
    while the child reads it): the retry is the child the first attempt made (r20 24: it was
    `SessionNotFoundError`, the caller could not get back a child that exists). Without a key, or
    with another, the parent's absence stands."""
    sessions = Sessions(store)
    turn = [NewEntry("turn/start", {"turn": 1}), um("q"), NewEntry("turn/end", {"turn": 1, "reason": "completed"})]
    await sessions.create("P", entries=turn)
    b = await sessions.branch("P", 2, idempotency_key="B")
    f = await sessions.fork("P", 2, idempotency_key="F")
    assert await sessions.delete("P")
    again = await sessions.branch("P", 2, idempotency_key="B")
    assert (again.id, again.header.incarnation) == (b.id, b.header.incarnation)
    fagain = await sessions.fork("P", 2, idempotency_key="F")
    assert (fagain.id, fagain.header.incarnation) == (f.id, f.header.incarnation)
    with pytest.raises(SessionNotFoundError):
        await sessions.branch("P", 2, idempotency_key="other")
    with pytest.raises(SessionNotFoundError):
        await sessions.branch("P", 2)
    with pytest.raises(SessionForkError):
        await sessions.fork("P", 2, idempotency_key="other")
