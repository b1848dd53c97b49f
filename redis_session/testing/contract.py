"""The `SessionStore` contract as reusable test cases: one suite, every backend.

Every store in this package passes it (tests/test_store_contract.py runs it on the memory store, a
real server and a real 3+3 cluster), and a third-party backend can run the very same cases, as
eventsourcing ships its recorder test cases. Each bad input asserts that nothing changed: a
rejected write leaves the header and log as they were.

How a third-party backend uses it (needs pytest and anyio's pytest plugin, which comes with
anyio)::

    # test_my_store.py
    import pytest
    from redis_session.testing.contract import SessionStoreContract

    class TestMyStore(SessionStoreContract):
        @pytest.fixture
        async def store(self):
            store = MyStore(...)          # a fresh, empty store for every test
            yield store
            await store.aclose()

    @pytest.fixture
    def anyio_backend():
        return "asyncio"

The cases take the store from a fixture named ``store`` (a method of the subclass, as above, or
a conftest fixture, parametrised over several backends if you like); a test runs against an
empty store and may create any session id. A backend that lives on Redis can use the fixtures of
`redis_session.testing.pytest_plugin` (a server URL, a fresh key prefix, clean-up)::

    pytest -p redis_session.testing.pytest_plugin

Run one case with ``-k``, e.g. ``pytest test_my_store.py -k tail``. The cases follow
docs/design.md §4 (and §8 for incarnations); `MemorySessionStore` is the reference behaviour.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import pytest

from .. import (
    Entry,
    InvalidEntryError,
    InvalidSessionIdError,
    NewEntry,
    SessionAlreadyExistsError,
    SessionConflictError,
    SessionHeader,
    SessionNotFoundError,
    SessionReplacedError,
)

__all__ = ["ArchivedPrefixStore", "SessionStoreContract"]


def um(text: str) -> NewEntry:
    """A user message."""
    return NewEntry("user/message", {"content": text})


async def make(store: Any, sid: str = "s1", k: int = 0, **hdr: Any) -> None:
    await store.create(SessionHeader(id=sid, **hdr), [um(f"m{i}") for i in range(k)])


async def snapshot(store: Any, sid: str) -> tuple[Any, list[Entry]]:
    head = await store.head(sid)
    return head, (await store.read(sid) if head is not None else [])


def cut_data(before: int) -> dict[str, Any]:
    return {"before": before, "summary": [{"role": "user", "content": "summary"}], "reason": "manual"}


# --------------------------------------------------------------------------- hostile ids

HOSTILE_IDS = ["", "a{b}", "{x}", "a b", "tab\there", "line\nbreak", "nul\x00", "x" * 10_000, "del\x7f"]


def _cut(before: Any, summary: Any = None) -> NewEntry:
    return NewEntry("cut", {"before": before, "summary": [] if summary is None else summary, "reason": "t"})


class SessionStoreContract:
    """The store contract's test cases; subclass it and provide a ``store`` fixture (see the
    module docstring). The class name does not start with ``Test``, so pytest collects only your
    subclass."""

    pytestmark = pytest.mark.anyio

    # --------------------------------------------------------------------------- create / head

    async def test_create_and_head(self, store: Any) -> None:
        head = await store.create(SessionHeader(id="chat-1", title="hello", origin={"platform": "qq"}))
        assert head.n == 0 and head.last_cut is None
        assert head.header.created_at > 0
        got = await store.head("chat-1")
        assert got is not None
        assert got.header == head.header
        assert got.header.title == "hello" and got.header.origin == {"platform": "qq"}
        assert got.header.format_version == 1 and got.header.delegation_depth == 0
        assert await store.head("nope") is None

    async def test_create_with_seed_entries(self, store: Any) -> None:
        head = await store.create(SessionHeader(id="s"), [um("a"), um("b"), NewEntry("cut", cut_data(1))])
        assert head.n == 3 and head.last_cut == 2
        entries = await store.read("s")
        assert [e.n for e in entries] == [0, 1, 2]
        assert entries[2].kind == "cut" and entries[0].kind == "message"

    async def test_create_twice_raises_and_keeps_first(self, store: Any) -> None:
        await make(store, "dup", 2)
        with pytest.raises(SessionAlreadyExistsError):
            await store.create(SessionHeader(id="dup"), [um("x")])
        assert [e.data["content"] for e in await store.read("dup")] == ["m0", "m1"]

    async def test_a_keyed_create_retried_after_a_delete_is_not_made_again(self, store: Any) -> None:
        """A create with a ``create_key`` (a keyed create: `Sessions.create(idempotency_key=)`)
        whose reply was lost, retried after the session it made was deleted: refused with
        `SessionReplacedError` and nothing made, not the deleted session made again. Unkeyed and
        other-keyed creates of the id still make it; so do branches under another key."""
        keyed = SessionHeader(id="k", create_key="key-1")
        await store.create(keyed, [um("a")])
        assert await store.delete("k") is True
        with pytest.raises(SessionReplacedError, match="deleted since"):
            await store.create(keyed, [um("a")])
        assert await store.head("k") is None
        again = await store.create(SessionHeader(id="k", create_key="key-2"), [um("b")])  # another key
        assert [e.data["content"] for e in await store.read("k")] == ["b"]
        await store.delete("k")
        for key in ("key-1", "key-2"):  # both lives' keys are remembered
            with pytest.raises(SessionReplacedError):
                await store.create(SessionHeader(id="k", create_key=key))
        await store.create(SessionHeader(id="kr", create_key="kd.request-1"))  # key "kd", a request digest
        await store.delete("kr")
        with pytest.raises(SessionReplacedError):  # the same key with another request: its life ended too
            await store.create(SessionHeader(id="kr", create_key="kd.request-2"))
        plain = await store.create(SessionHeader(id="k"), [um("c")])  # unkeyed: made
        assert plain.header.incarnation != again.header.incarnation
        for key in ("key-1", "key-2"):  # another life holds the id now: still the deleted one's key
            with pytest.raises(SessionReplacedError):
                await store.create(SessionHeader(id="k", create_key=key))
        assert (await store.head("k")).header.incarnation == plain.header.incarnation
        # a branch whose keyed create was deleted: its retry is refused too, its parent unlinked
        await make(store, "p", 2)
        branch = SessionHeader(id="p-b", parent="p", at=1, create_key="branch-key")
        await store.create(branch)
        await store.delete("p-b")
        with pytest.raises(SessionReplacedError):
            await store.create(branch)
        assert await store.head("p-b") is None
        await store.create(SessionHeader(id="p-b", parent="p", at=2))  # another life of the branch id
        with pytest.raises(SessionReplacedError):
            await store.create(branch)
        await store.delete("p-b")
        assert [h.id for h in (await store.list(parent="p")).items] == []

    # --------------------------------------------------------------------------- put

    async def test_put_assigns_contiguous_n_and_time(self, store: Any) -> None:
        await make(store)
        a = await store.put("s1", 0, [um("a"), um("b")])
        b = await store.put("s1", 2, [um("c")])
        c = await store.put("s1", None, [um("d")])
        assert [e.n for e in a + b + c] == [0, 1, 2, 3]
        assert all(e.time > 1_600_000_000_000 for e in a + b + c)
        read = await store.read("s1")
        assert read == a + b + c
        head = await store.head("s1")
        assert head.n == 4 and head.updated_at >= head.header.created_at

    async def test_put_keeps_given_time_meta_surface(self, store: Any) -> None:
        await make(store)
        [e] = await store.put(
            "s1",
            0,
            [
                NewEntry(
                    "assistant/message",
                    {"content": "hi"},
                    {"turn": 1, "usage": {"input": 3}},
                    {"surfaceOp": "append"},
                    1234,
                )
            ],
        )
        assert e.time == 1234 and e.meta == {"turn": 1, "usage": {"input": 3}}
        assert e.surface is not None and e.surface.op == "append"
        assert (await store.read("s1")) == [e]

    async def test_put_accepts_tuples_and_mappings(self, store: Any) -> None:
        await make(store)
        out = await store.put(
            "s1", 0, [("user/message", {"content": "a"}), {"type": "user/message", "data": {"content": "b"}}]
        )
        assert [e.data["content"] for e in out] == ["a", "b"]

    async def test_conflict_carries_fields_and_writes_nothing(self, store: Any) -> None:
        await make(store, k=3)
        before = await snapshot(store, "s1")
        with pytest.raises(SessionConflictError) as ei:
            await store.put("s1", 1, [um("late")])
        assert (ei.value.session_id, ei.value.expected_n, ei.value.actual_n) == ("s1", 1, 3)
        assert await snapshot(store, "s1") == before

    async def test_put_missing_session(self, store: Any) -> None:
        with pytest.raises(SessionNotFoundError):
            await store.put("ghost", 0, [um("x")])
        with pytest.raises(SessionNotFoundError):
            await store.put("ghost", None, [um("x")])
        assert await store.head("ghost") is None

    async def test_failing_batch_writes_nothing(self, store: Any) -> None:
        await make(store, k=2)
        before = await snapshot(store, "s1")
        bad_batches: list[list[Any]] = [
            [um("ok"), NewEntry("user/message", {"content": float("nan")})],
            [um("ok"), NewEntry("user/message", {"content": 5})],
            [um("ok"), NewEntry("turn/end", {"turn": 1, "reason": "exploded"})],
            [um("ok"), NewEntry("cut", cut_data(99))],
            [um("ok"), NewEntry("turn/start", {"turn": 1}, None, {"surfaceOp": "append"})],
        ]
        for batch in bad_batches:
            with pytest.raises(InvalidEntryError) as ei:
                await store.put("s1", 2, batch)
            assert ei.value.index == 1
            assert await snapshot(store, "s1") == before
        # the cut check also holds for "append at the end" writers, whose n is only known server-side
        with pytest.raises(InvalidEntryError):
            await store.put("s1", None, [um("ok"), NewEntry("cut", cut_data(4))])
        assert await snapshot(store, "s1") == before

    @pytest.mark.parametrize(
        "data",
        [
            {"x": float("nan")},
            {"x": float("inf")},
            {"x": -float("inf")},
            {"x": b"bytes"},
            {"x": {1, 2}},
            {"x": (1, 2)},
            {1: "non-string key"},
            {"x": object()},
            "not an object",
            ["a", "list"],
            None,
        ],
        ids=lambda d: type(d).__name__ if not isinstance(d, dict) else repr(d)[:24],
    )
    async def test_lossless_json_only(self, store: Any, data: Any) -> None:
        await make(store, k=1)
        before = await snapshot(store, "s1")
        with pytest.raises(InvalidEntryError):
            await store.put("s1", 1, [NewEntry("custom/mark", data)])
        assert await snapshot(store, "s1") == before

    async def test_cyclic_data_rejected(self, store: Any) -> None:
        await make(store)
        d: dict[str, Any] = {}
        d["self"] = d
        with pytest.raises(InvalidEntryError):
            await store.put("s1", 0, [NewEntry("custom/mark", d)])
        assert (await store.head("s1")).n == 0

    async def test_json_edge_values_accepted(self, store: Any) -> None:
        await make(store)
        data = {"nested": [[1, [2, [3]]], {"a": None}], "t": True, "f": False, "u": "ünï 🎨 \u2028", "neg": -0.5}
        [e] = await store.put("s1", 0, [NewEntry("custom/mark", data)])
        assert e.data == data and e.kind == "mark"
        assert (await store.read("s1"))[0].data == data

    async def test_oversize_entry_rejected(self, store: Any) -> None:
        await make(store)
        with pytest.raises(InvalidEntryError, match="limit"):
            await store.put("s1", 0, [um("x" * (1 << 20))])
        assert (await store.head("s1")).n == 0
        [ok] = await store.put("s1", 0, [um("x" * 500_000)])
        assert len((await store.read("s1"))[0].data["content"]) == 500_000
        assert ok.n == 0

    async def test_bad_type_names_rejected(self, store: Any) -> None:
        await make(store)
        for t in ["", "has space", 'quote"', "{brace}", "x" * 200, "\nnl", 5]:
            with pytest.raises(InvalidEntryError):
                await store.put("s1", 0, [NewEntry(t, {})])  # type: ignore[arg-type]
        assert (await store.head("s1")).n == 0

    async def test_surface_rules(self, store: Any) -> None:
        await make(store, k=2)
        with pytest.raises(InvalidEntryError, match="expected_n"):
            await store.put(
                "s1",
                None,
                [
                    NewEntry(
                        "assistant/message",
                        {"content": "x"},
                        None,
                        {"surfaceOp": {"op": "replace", "start": 0, "end": 1}, "sourceEventSeqs": [0, 1]},
                    )
                ],
            )
        bad_surfaces: list[Any] = [
            {"surfaceOp": "invalid"},
            {"surfaceOp": {"op": "replace", "start": -1, "end": 0}, "sourceEventSeqs": [0]},
            {"surfaceOp": {"op": "replace", "start": 0, "end": 0, "extra": 1}, "sourceEventSeqs": [0]},
            {"surfaceOp": "append", "sourceEventSeqs": [-1]},
            {"surfaceOp": "append", "sourceEventSeqs": [0, 0]},
            {"surfaceOp": "append", "sourceEventSeqs": [2]},  # not earlier than itself
            {"surfaceOp": {"op": "replace", "start": 0, "end": 0}},  # replace without source seqs
            {"bogus": 1},
        ]
        for surface in bad_surfaces:
            with pytest.raises(InvalidEntryError):
                await store.put("s1", 2, [NewEntry("assistant/message", {"content": "x"}, None, surface)])
        assert (await store.head("s1")).n == 2

    # --------------------------------------------------------------------------- idempotency

    async def test_idempotent_retry_returns_landed_entries(self, store: Any) -> None:
        await make(store)
        first = await store.put("s1", 0, [um("a"), um("b")], idempotency_key="req-1")
        # the retry's expected_n is stale now, yet it is not a conflict: it already landed
        again = await store.put("s1", 0, [um("a"), um("b")], idempotency_key="req-1")
        assert again == first
        also = await store.put("s1", None, [um("a"), um("b")], idempotency_key="req-1")
        assert also == first
        assert (await store.head("s1")).n == 2
        nxt = await store.put("s1", 2, [um("c")], idempotency_key="req-2")
        assert nxt[0].n == 2

    async def test_idempotency_key_is_per_session(self, store: Any) -> None:
        await make(store, "a")
        await make(store, "b")
        await store.put("a", 0, [um("x")], idempotency_key="k")
        [e] = await store.put("b", 0, [um("y")], idempotency_key="k")
        assert e.data["content"] == "y"

    # --------------------------------------------------------------------------- read

    async def test_read_ranges(self, store: Any) -> None:
        await make(store, k=10)
        assert [e.n for e in await store.read("s1", 5)] == [5, 6, 7, 8, 9]
        assert [e.n for e in await store.read("s1", 2, 4)] == [2, 3]
        assert await store.read("s1", 4, 4) == []
        assert await store.read("s1", 7, 3) == []
        assert [e.n for e in await store.read("s1", 8, 100)] == [8, 9]
        assert await store.read("s1", 50) == []
        with pytest.raises(ValueError):
            await store.read("s1", -1)
        with pytest.raises(SessionNotFoundError):
            await store.read("ghost")

    async def test_entries_are_snapshots(self, store: Any) -> None:
        """Later changes by the caller to what it passed have no effect on the log."""
        await make(store)
        data = {"content": [{"type": "text", "text": "original"}]}
        [e] = await store.put("s1", 0, [NewEntry("user/message", data)])
        data["content"][0]["text"] = "mutated"
        assert e.data["content"][0]["text"] == "original"
        assert (await store.read("s1"))[0].data["content"][0]["text"] == "original"

    # --------------------------------------------------------------------------- branches

    async def test_branch_stitches_parent_prefix(self, store: Any) -> None:
        await make(store, "p", 5)
        head = await store.create(SessionHeader(id="c", parent="p", at=3), [um("c3")])
        assert head.n == 4 and head.header.parent == "p" and head.header.at == 3
        child = await store.read("c")
        parent = await store.read("p")
        assert child[:3] == parent[:3]
        assert [e.n for e in child] == [0, 1, 2, 3] and child[3].data["content"] == "c3"
        await store.put("c", 4, [um("c4")])
        await store.put("p", 5, [um("p5")])  # the parent moves on; the branch does not see it
        assert [e.data["content"] for e in await store.read("c")] == ["m0", "m1", "m2", "c3", "c4"]
        assert [e.n for e in await store.read("c", 2, 4)] == [2, 3]

    async def test_branch_of_branch(self, store: Any) -> None:
        await make(store, "g", 6)
        await store.create(SessionHeader(id="p", parent="g", at=4), [um("p4"), um("p5")])
        await store.create(SessionHeader(id="c", parent="p", at=5), [um("c5")])
        await store.create(SessionHeader(id="d", parent="p", at=2))
        assert [e.data["content"] for e in await store.read("c")] == ["m0", "m1", "m2", "m3", "p4", "c5"]
        assert [e.data["content"] for e in await store.read("d")] == ["m0", "m1"]
        assert (await store.head("d")).n == 2

    async def test_branch_errors(self, store: Any) -> None:
        await make(store, "p", 2)
        with pytest.raises(SessionNotFoundError):
            await store.create(SessionHeader(id="c", parent="ghost", at=0))
        with pytest.raises(InvalidEntryError):
            await store.create(SessionHeader(id="c", parent="p", at=3))
        with pytest.raises(InvalidEntryError):
            await store.create(SessionHeader(id="c", parent="p"))
        assert await store.head("c") is None
        page = await store.list(parent="p")
        assert page.items == []

    async def test_deleted_parent_stays_readable_for_branches(self, store: Any) -> None:
        await make(store, "p", 4)
        await store.create(SessionHeader(id="c", parent="p", at=3))
        assert await store.delete("p") is True
        assert await store.head("p") is None
        assert "p" not in [h.id for h in (await store.list()).items]
        with pytest.raises(SessionNotFoundError):
            await store.read("p")
        assert [e.data["content"] for e in await store.read("c")] == ["m0", "m1", "m2"]
        assert await store.delete("p") is False
        with pytest.raises(SessionAlreadyExistsError):
            await store.create(SessionHeader(id="p"))
        assert await store.delete("c") is True
        # the last branch gone, the hidden parent is purged and its id is free again
        await store.create(SessionHeader(id="p"))
        assert (await store.head("p")).n == 0

    # --------------------------------------------------------------------------- list / delete

    async def test_list_newest_first_with_pagination(self, store: Any) -> None:
        for i in range(7):
            await store.create(SessionHeader(id=f"s{i}", created_at=1_000 + i))
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            page = await store.list(limit=3, cursor=cursor)
            seen += [h.id for h in page.items]
            pages += 1
            cursor = page.cursor
            if cursor is None:
                break
        assert seen == [f"s{i}" for i in reversed(range(7))]
        assert pages == 3

    async def test_list_parent_filter(self, store: Any) -> None:
        await make(store, "p", 2)
        await make(store, "q", 1)
        await store.create(SessionHeader(id="p:branch:1", parent="p", at=1, created_at=10))
        await store.create(SessionHeader(id="p:branch:2", parent="p", at=2, created_at=20))
        await store.create(SessionHeader(id="q:branch:1", parent="q", at=1))
        assert [h.id for h in (await store.list(parent="p")).items] == ["p:branch:2", "p:branch:1"]
        assert [h.id for h in (await store.list(parent="q")).items] == ["q:branch:1"]
        assert len((await store.list()).items) == 5

    async def test_delete(self, store: Any) -> None:
        await make(store, "s", 3)
        assert await store.delete("s") is True
        assert await store.head("s") is None
        assert await store.delete("s") is False
        assert (await store.list()).items == []
        with pytest.raises(SessionNotFoundError):
            await store.read("s")
        # the id can be reused, from scratch
        await make(store, "s", 1)
        assert [e.data["content"] for e in await store.read("s")] == ["m0"]

    # --------------------------------------------------------------------------- bad read, list and tail arguments

    # The same checks on every backend (StoreRules): each rejected call reads nothing and writes nothing.

    @pytest.mark.parametrize("limit", [0, 1001, -1, True, False, "5", 5.0, None], ids=repr)
    async def test_list_rejects_bad_limits(self, store: Any, limit: Any) -> None:
        await make(store, "s", 1)
        with pytest.raises(ValueError, match="limit"):
            await store.list(limit=limit)
        assert [h.id for h in (await store.list()).items] == ["s"]

    @pytest.mark.parametrize("cursor", [5, b"0:s", "c" * 401, ["x"]], ids=lambda c: repr(c)[:12])
    async def test_list_rejects_bad_cursors(self, store: Any, cursor: Any) -> None:
        await make(store, "s", 1)
        with pytest.raises(ValueError, match="cursor"):
            await store.list(cursor=cursor)

    async def test_list_rejects_a_bad_parent(self, store: Any) -> None:
        with pytest.raises(InvalidSessionIdError):
            await store.list(parent="a b")
        with pytest.raises(InvalidSessionIdError):
            await store.list(parent="{x}")

    @pytest.mark.parametrize(
        ("start", "stop"),
        [(-1, None), (True, None), ("0", None), (0.0, None), (0, -1), (0, True), (0, "3"), (0, 100_001), (5, 100_006)],
        ids=repr,
    )
    async def test_read_rejects_bad_ranges(self, store: Any, start: Any, stop: Any) -> None:
        await make(store, "s", 2)
        with pytest.raises(ValueError):
            await store.read("s", start, stop)
        assert len(await store.read("s", 0, 100_000)) == 2  # the largest range is fine

    @pytest.mark.parametrize("start", [-1, True, "0", 1.5], ids=repr)
    async def test_tail_rejects_a_bad_start(self, store: Any, start: Any) -> None:
        await make(store, "s", 2)
        with pytest.raises(ValueError):
            async for _ in store.tail("s", start):
                pass

    async def test_bad_arguments_are_rejected_before_the_lookup(self, store: Any) -> None:
        """A bad argument is the caller's error whether or not the session exists."""
        with pytest.raises(ValueError):
            await store.read("ghost", -1)
        with pytest.raises(ValueError):
            async for _ in store.tail("ghost", -1):
                pass
        big = {"c": "x" * (store.max_entry_bytes + 1)}
        with pytest.raises(InvalidEntryError, match="draft"):
            await store.set_draft("ghost", big)

    async def test_limits_are_part_of_the_protocol(self, store: Any) -> None:
        from ..store import SessionStore

        assert isinstance(store, SessionStore)
        assert isinstance(store.max_batch, int) and store.max_batch >= 1
        assert isinstance(store.max_entry_bytes, int) and store.max_entry_bytes >= 1
        await make(store, "s", 0)
        with pytest.raises(InvalidEntryError):
            await store.put("s", 0, [um("x")] * (store.max_batch + 1))
        head = await store.head("s")
        assert head is not None and head.n == 0

    @pytest.mark.parametrize("sid", HOSTILE_IDS, ids=lambda s: repr(s)[:20])
    async def test_hostile_ids_rejected_everywhere(self, store: Any, sid: str) -> None:
        await make(store, "ok", 1)
        with pytest.raises(InvalidSessionIdError):
            await store.create(SessionHeader(id=sid))
        with pytest.raises(InvalidSessionIdError):
            await store.put(sid, 0, [um("x")])
        with pytest.raises(InvalidSessionIdError):
            await store.head(sid)
        with pytest.raises(InvalidSessionIdError):
            await store.read(sid)
        with pytest.raises(InvalidSessionIdError):
            await store.delete(sid)
        with pytest.raises(InvalidSessionIdError):
            await store.create(SessionHeader(id="child", parent=sid, at=0))
        assert [h.id for h in (await store.list()).items] == ["ok"]

    async def test_ids_with_colons_and_unicode_work(self, store: Any) -> None:
        for sid in ["telegram:12345", "chat-1:branch:deadbeef", "会话-1", "a/b\\c", "x" * 256]:
            await make(store, sid, 1)
            assert [e.n for e in await store.read(sid)] == [0]

    # --------------------------------------------------------------------------- tail

    async def test_tail_from_zero_and_from_middle_while_appending(self, store: Any) -> None:
        await make(store, k=3)
        got_all: list[int] = []
        got_mid: list[int] = []

        async def consume(start: int, out: list[int]) -> None:
            async for e in store.tail("s1", start):
                out.append(e.n)
                if e.n == 19:
                    return

        async def writer() -> None:
            for i in range(3, 20):
                await store.put("s1", i, [um(f"m{i}")])
                await anyio.sleep(0.002)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, 0, got_all)
                tg.start_soon(consume, 11, got_mid)
                await anyio.sleep(0.05)
                tg.start_soon(writer)
        assert got_all == list(range(20))
        assert got_mid == list(range(11, 20))

    async def test_tail_of_branch_includes_parent_prefix(self, store: Any) -> None:
        await make(store, "p", 4)
        await store.create(SessionHeader(id="c", parent="p", at=2), [um("c2")])
        got: list[str] = []
        with anyio.fail_after(10):
            async for e in store.tail("c", 1):
                got.append(e.data["content"])
                if len(got) == 2:
                    break
        assert got == ["m1", "c2"]

    async def test_tail_missing_session(self, store: Any) -> None:
        with pytest.raises(SessionNotFoundError):
            async for _ in store.tail("ghost"):
                pass

    # --------------------------------------------------------------------------- drafts and leases

    async def test_draft_roundtrip(self, store: Any) -> None:
        await make(store)
        assert await store.get_draft("s1") is None
        await store.set_draft("s1", {"text": "Hel"})
        assert await store.get_draft("s1") == {"text": "Hel"}
        await store.set_draft("s1", None)
        assert await store.get_draft("s1") is None
        with pytest.raises(InvalidEntryError):
            await store.set_draft("s1", {"x": float("nan")})
        with pytest.raises(SessionNotFoundError):
            await store.set_draft("ghost", {"text": ""})

    async def test_lease(self, store: Any) -> None:
        await make(store)
        assert await store.acquire_lease("s1", "pod-a", 5_000) is True
        assert await store.acquire_lease("s1", "pod-b", 5_000) is False
        assert await store.acquire_lease("s1", "pod-a", 5_000) is True  # renew
        assert await store.release_lease("s1", "pod-b") is False
        assert await store.release_lease("s1", "pod-a") is True
        assert await store.acquire_lease("s1", "pod-b", 5_000) is True

    async def test_projection_snapshot_only_moves_forward(self, store: Any) -> None:
        await make(store, k=5)
        assert await store.get_projection("s1") is None
        assert await store.put_projection("s1", 3, b'{"v":3}') is True
        assert await store.put_projection("s1", 2, b'{"v":2}') is False
        assert await store.put_projection("s1", 3, b'{"v":"again"}') is False
        assert await store.get_projection("s1") == (3, b'{"v":3}')
        with pytest.raises(ValueError):
            await store.put_projection("s1", 6, b"{}")
        with pytest.raises(SessionNotFoundError):
            await store.put_projection("ghost", 0, b"{}")

    async def test_surface_source_seqs_checked_after_n_is_known(self, store: Any) -> None:
        """Without expected_n the client cannot check sourceEventSeqs; the rule holds where n is known."""
        await make(store, k=2)
        before = await snapshot(store, "s1")
        for surface in [
            {"surfaceOp": "append", "sourceEventSeqs": [7]},  # a future entry
            {"surfaceOp": "append", "sourceEventSeqs": [0, 2]},  # its own n
        ]:
            with pytest.raises(InvalidEntryError, match="sourceEventSeqs"):
                await store.put("s1", None, [NewEntry("assistant/message", {"content": "x"}, None, surface)])
            # in a batch: the second entry's own n is 3, so naming 3 is refused too
            batch = [um("a"), NewEntry("assistant/message", {"content": "x"}, None, {"sourceEventSeqs": [3]})]
            with pytest.raises(InvalidEntryError, match="entry 1"):
                await store.put("s1", None, batch)
            assert await snapshot(store, "s1") == before
        [e] = await store.put(
            "s1", None, [NewEntry("assistant/message", {"content": "x"}, None, {"sourceEventSeqs": [1]})]
        )
        assert e.n == 2 and e.surface is not None and e.surface.source_event_seqs == [1]

    async def test_surface_replace_range_must_name_earlier_entries(self, store: Any) -> None:
        await make(store, k=2)
        before = await snapshot(store, "s1")
        bad = {"surfaceOp": {"op": "replace", "start": 0, "end": 4}, "sourceEventSeqs": [0]}
        with pytest.raises(InvalidEntryError, match="replace"):
            await store.put("s1", 2, [NewEntry("assistant/message", {"content": "x"}, None, bad)])
        assert await snapshot(store, "s1") == before

    async def test_idempotency_key_reused_with_another_batch(self, store: Any) -> None:
        from .. import IdempotencyKeyReusedError, SessionError

        assert issubclass(IdempotencyKeyReusedError, SessionError)
        await make(store)
        first = await store.put("s1", 0, [um("a"), um("b")], idempotency_key="req-1")
        before = await snapshot(store, "s1")
        for other in (
            [um("a"), um("c")],
            [um("a")],
            [um("a"), um("b"), um("c")],
            [NewEntry("user/message", {"content": "a"}, {"x": 1}), um("b")],
        ):
            for expected in (0, 2, None):
                with pytest.raises(IdempotencyKeyReusedError) as info:
                    await store.put("s1", expected, other, idempotency_key="req-1")
                assert info.value.session_id == "s1" and info.value.idempotency_key == "req-1"
        assert await snapshot(store, "s1") == before
        # the same batch retried still returns what landed
        assert await store.put("s1", 0, [um("a"), um("b")], idempotency_key="req-1") == first
        assert await store.put("s1", None, [um("a"), um("b")], idempotency_key="req-1") == first

    @pytest.mark.parametrize("strict", [False, True])
    async def test_cut_rules_hold_whatever_the_vocabulary(self, store: Any, strict: bool) -> None:
        from .. import Vocabulary

        store.vocabulary = Vocabulary(strict=strict, schemas={"user/message": None})
        await make(store, k=3)
        before = await snapshot(store, "s1")
        bad_cuts = [
            _cut(-3),
            _cut(9),  # beyond its own n
            _cut("1"),
            _cut(1.5),
            _cut(True),
            _cut(None),
            NewEntry("cut", {"summary": [], "reason": "t"}),  # no before
            _cut(1, summary="not a list"),
            _cut(1, summary=[{"no": "role"}]),
            NewEntry("cut", {"before": 1, "summary": []}),  # no reason
        ]
        for bad in bad_cuts:
            for expected in (3, None):
                with pytest.raises(InvalidEntryError):
                    await store.put("s1", expected, [bad])
                with pytest.raises(InvalidEntryError):
                    await store.put("s1", expected, [um("x"), bad])
        with pytest.raises(InvalidEntryError):
            await store.create(SessionHeader(id="s2"), [um("a"), _cut(2)])
        assert await store.head("s2") is None
        assert await snapshot(store, "s1") == before
        [e] = await store.put("s1", None, [_cut(3, [{"role": "user", "content": "sum"}])])
        assert e.n == 3 and (await store.head("s1")).last_cut == 3

    # --------------------------------------------------------------------------- incarnations

    async def test_every_creation_has_its_own_incarnation(self, store: Any) -> None:
        first = await store.create(SessionHeader(id="s1"), [um("old")])
        inc1 = first.header.incarnation
        assert inc1 and (await store.head("s1")).header.incarnation == inc1
        assert [h.incarnation for h in (await store.list()).items] == [inc1]
        assert await store.delete("s1")
        again = await store.create(SessionHeader(id="s1", incarnation=inc1), [um("new")])  # a given one is ignored
        inc2 = again.header.incarnation
        assert inc2 and inc2 != inc1
        assert (await store.head("s1")).header.incarnation == inc2

    async def test_branch_children_have_their_own_incarnation(self, store: Any) -> None:
        parent = await store.create(SessionHeader(id="p"), [um("a"), um("b")])
        c1 = await store.create(SessionHeader(id="c1", parent="p", at=1))
        c2 = await store.create(SessionHeader(id="c2", parent="p", at=2))
        incs = {parent.header.incarnation, c1.header.incarnation, c2.header.incarnation}
        assert len(incs) == 3 and "" not in incs
        assert (await store.head("c1")).header.incarnation == c1.header.incarnation

    async def test_put_with_an_old_incarnation_is_refused_and_writes_nothing(self, store: Any) -> None:
        old = (await store.create(SessionHeader(id="s1"), [um("o0"), um("o1")])).header.incarnation
        await store.delete("s1")
        new = (await store.create(SessionHeader(id="s1"), [um("n0"), um("n1")])).header.incarnation
        before = await snapshot(store, "s1")
        for expected in (2, None):  # n matches: only the incarnation tells the two apart
            with pytest.raises(SessionReplacedError):
                await store.put("s1", expected, [um("stale")], incarnation=old)
            with pytest.raises(SessionReplacedError):
                await store.put("s1", expected, [um("stale")], incarnation=old, idempotency_key="k")
        assert await snapshot(store, "s1") == before
        assert issubclass(SessionReplacedError, SessionNotFoundError)
        [e] = await store.put("s1", 2, [um("n2")], incarnation=new)
        assert e.n == 2
        with pytest.raises(SessionReplacedError):
            await store.read("s1", incarnation=old)
        assert [x.data["content"] for x in await store.read("s1", incarnation=new)] == ["n0", "n1", "n2"]

    async def test_tail_never_yields_the_next_incarnation(self, store: Any) -> None:
        """delete + create under a live tail: the tail ends (or raises SessionNotFoundError); it never
        goes on with the new session's entries as if they were the old one's."""
        old = (await store.create(SessionHeader(id="s1"), [um(f"old{i}") for i in range(3)])).header.incarnation
        got: list[str] = []
        ended: list[str] = []
        three = anyio.Event()

        async def consume() -> None:
            try:
                async for e in store.tail("s1", 0):
                    got.append(e.data["content"])
                    if len(got) == 3:
                        three.set()
            except SessionNotFoundError as e:
                ended.append(type(e).__name__)
            else:
                ended.append("end")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await three.wait()
                await anyio.sleep(0.05)  # the tail is blocked waiting for entry 3
                await store.delete("s1")
                await store.create(SessionHeader(id="s1"), [um(f"new{i}") for i in range(6)])
                for i in range(6, 9):
                    await store.put("s1", i, [um(f"new{i}")])
        assert ended, "the tail went on"
        assert got == ["old0", "old1", "old2"]
        with pytest.raises(SessionReplacedError):
            async for _ in store.tail("s1", 0, incarnation=old):
                pass

    async def test_tail_of_a_replaced_session_with_an_idle_gap(self, store: Any) -> None:
        """Replaced while nothing is appended: the next check (a block timeout, or the next entry)
        ends the tail before any of the new session's entries is yielded."""
        await store.create(SessionHeader(id="s1"), [um("old0")])
        got: list[str] = []
        first = anyio.Event()

        async def consume() -> None:
            with contextlib.suppress(SessionNotFoundError):
                async for e in store.tail("s1", 0):
                    got.append(e.data["content"])
                    first.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await first.wait()
                await store.delete("s1")
                await store.create(SessionHeader(id="s1"), [um("new0"), um("new1")])
                await anyio.sleep(0.05)
                await store.put("s1", 2, [um("new2")])
        assert got == ["old0"]

    async def test_snapshot_of_another_incarnation_is_refused_and_never_served(self, store: Any) -> None:
        old = (await store.create(SessionHeader(id="s1"), [um("o0"), um("o1")])).header.incarnation
        assert await store.put_projection("s1", 2, b'{"old":1}', incarnation=old) is True
        assert await store.get_projection("s1", incarnation=old) == (2, b'{"old":1}')
        await store.delete("s1")
        new = (await store.create(SessionHeader(id="s1"), [um("n0"), um("n1"), um("n2")])).header.incarnation
        # a fold of the old log that finishes after the delete + create
        with pytest.raises(SessionReplacedError):
            await store.put_projection("s1", 2, b'{"old":1}', incarnation=old)
        assert await store.get_projection("s1") is None
        assert await store.put_projection("s1", 3, b'{"new":1}', incarnation=new) is True
        assert await store.get_projection("s1", incarnation=old) is None
        assert await store.get_projection("s1", incarnation=new) == (3, b'{"new":1}')


# --------------------------------------------------------------------------- an archived prefix


class ArchivedPrefixStore:
    """A store whose sessions keep all but their last `keep` entries in the cold tier: after
    every create and put it archives the rest (`redis_session.archiver.Archiver`), so the
    contract runs with nearly every entry read back from segment objects (tests/test_archive_contract.py).
    Everything else is the wrapped store's."""

    def __init__(self, store: Any, keep: int = 1) -> None:
        from ..archiver import Archiver

        if store.cold is None:
            raise ValueError("the wrapped store needs a cold tier (cold=…)")
        self._inner = store
        self._keep = keep
        self.archiver = Archiver(store)
        self.archived = 0  # entries moved (a run that archived nothing proves nothing)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _archive(self, session_id: str) -> None:
        head = await self._inner.head(session_id)
        if head is None:
            return
        res = await self.archiver.archive(session_id, upto=head.n - self._keep)
        if res.status == "archived":
            self.archived += res.hi - res.lo

    async def create(self, header: Any, entries: Any = (), **kw: Any) -> Any:
        head = await self._inner.create(header, entries, **kw)
        await self._archive(head.header.id)
        return head

    async def put(self, session_id: str, *args: Any, **kw: Any) -> Any:
        got = await self._inner.put(session_id, *args, **kw)
        await self._archive(session_id)
        return got
