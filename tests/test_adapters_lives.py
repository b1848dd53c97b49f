"""An adapter object belongs to one life of its session id (DESIGN.md §9, "One
session reference").

The reproduction: pod A holds a framework object on session X; pod B deletes X and creates X
again with the SAME number of entries (and with more); A's next write must not land in the new
conversation, and its reads must not return the old history as if current. Each adapter built on
`SessionLog` (OpenAI Agents, LangChain) is driven through its framework's own methods, on every
store backend; `SessionLog` itself is checked for the pieces every adapter relies on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from redis_session import NewEntry, SessionHeader
from redis_session.adapters._log import Life, SessionLog
from redis_session.errors import SessionReplacedError

from support import require_extra

pytestmark = pytest.mark.anyio

ITEM = "openai/item"


async def _recreate(store: Any, sid: str, entries: list[NewEntry]) -> None:
    """Pod B: delete the id and create it again with `entries` (a new life)."""
    assert await store.delete(sid)
    await store.create(SessionHeader(id=sid), entries)


def _texts(entries: list[Any]) -> list[str]:
    return [e.data.get("content") for e in entries]


# =========================================================================== SessionLog


class _Folded:
    def __init__(self, store: Any, sid: str, life: Life | None = None) -> None:
        self.seen: list[Any] = []
        self.log = SessionLog(
            store, sid, origin=None, fold=self.seen.extend, reset=self.seen.clear, mark_types=(ITEM,), life=life
        )

    async def add(self, text: str) -> None:
        await self.log.write(lambda: [NewEntry(ITEM, {"content": text})], fresh=False)


@pytest.mark.parametrize("extra", [0, 2], ids=["same-length", "longer"])
async def test_session_log_refuses_another_life(store: Any, extra: int) -> None:
    a = _Folded(store, "X")
    for t in ("old-0", "old-1", "old-2"):
        await a.add(t)
    pinned = a.log.incarnation
    assert pinned == (await store.head("X")).header.incarnation
    new = [NewEntry(ITEM, {"content": f"new-{i}"}) for i in range(3 + extra)]
    await _recreate(store, "X", new)

    with pytest.raises(SessionReplacedError):
        await a.add("from-A")
    with pytest.raises(SessionReplacedError):
        await a.log.catch_up()
    with pytest.raises(SessionReplacedError):
        await a.log.write(lambda: [NewEntry(ITEM, {"content": "fresh"})], fresh=True)
    assert _texts(await store.read("X")) == [f"new-{i}" for i in range(3 + extra)]  # nothing of A's
    assert a.log.incarnation == pinned  # still the old life: it never moves onto B's

    b = _Folded(store, "X")  # a new object works on the new life
    await b.add("from-B")
    assert _texts(b.seen)[-1] == "from-B" and len(b.seen) == 4 + extra


async def test_session_log_a_life_that_ended_reads_empty_and_its_next_write_starts_one(store: Any) -> None:
    a = _Folded(store, "ended")
    await a.add("old")
    assert await store.delete("ended")
    await a.log.catch_up()
    assert a.seen == [] and a.log.n == 0
    await a.add("new")  # A creates the next life itself: it belongs to it now
    head = await store.head("ended")
    assert a.log.incarnation == head.header.incarnation and _texts(await store.read("ended")) == ["new"]
    # ... but a life somebody else created after A's ended is not A's
    assert await store.delete("ended")
    await a.log.catch_up()
    await store.create(SessionHeader(id="ended"), [NewEntry(ITEM, {"content": "B"})])
    with pytest.raises(SessionReplacedError):
        await a.add("A again")
    assert _texts(await store.read("ended")) == ["B"]


async def test_session_log_a_write_that_finds_its_life_deleted_starts_a_new_one(store: Any) -> None:
    a = _Folded(store, "gone")
    await a.add("old-0")
    await a.add("old-1")
    assert await store.delete("gone")
    await a.add("after")  # no read in between: the put finds nothing, A starts over alone
    assert _texts(await store.read("gone")) == ["after"] and _texts(a.seen) == ["after"]


async def test_logs_sharing_a_life_follow_the_one_their_object_created(store: Any) -> None:
    """Two logs of one object (an adapter keeps one per event loop): when one of them starts the
    next life, the other drops what it folded of the ended one and follows, without raising."""
    life = Life()
    one, two = _Folded(store, "shared", life), _Folded(store, "shared", life)
    await one.add("a")
    await two.log.catch_up()
    assert _texts(two.seen) == ["a"]
    assert await store.delete("shared")
    await one.add("b")  # `one` creates the next life
    await two.log.catch_up()
    assert _texts(two.seen) == ["b"]
    await two.add("c")
    assert _texts(await store.read("shared")) == ["b", "c"]


async def test_two_objects_whose_life_ended_race_for_the_next_one(store: Any) -> None:
    """Both objects held the life that ended; both write at once: exactly one creates the next
    life and writes into it, the other is refused (its items never join a conversation it did
    not start), and nothing is half-written."""
    a, b = _Folded(store, "race2"), _Folded(store, "race2")
    await a.add("old")
    await b.log.catch_up()
    assert await store.delete("race2")
    results = await asyncio.gather(a.add("from-a"), b.add("from-b"), return_exceptions=True)
    refused = [r for r in results if isinstance(r, SessionReplacedError)]
    assert len(refused) == 1 and results.count(None) == 1, results
    assert len(_texts(await store.read("race2"))) == 1


async def test_a_fresh_log_joins_whichever_life_is_there(store: Any) -> None:
    """Before it has seen any life, a log adopts the current one (two pods starting one new
    conversation at once both write to it)."""
    logs = [_Folded(store, "race") for _ in range(4)]
    await asyncio.gather(*(log.add(f"w{i}") for i, log in enumerate(logs)))
    assert sorted(_texts(await store.read("race"))) == ["w0", "w1", "w2", "w3"]
    assert len({log.log.incarnation for log in logs}) == 1


# =========================================================================== OpenAI Agents


@pytest.fixture
def Ev() -> Any:
    require_extra("agents", "openai-agents")
    from redis_session.adapters.openai_agents import RedisEventSession

    return RedisEventSession


@pytest.mark.parametrize("extra", [0, 2], ids=["same-length", "longer"])
async def test_openai_session_never_reads_or_writes_another_life(store: Any, Ev: Any, extra: int) -> None:
    a = Ev("X", store)  # pod A
    await a.add_items([{"role": "user", "content": f"old-{i}"} for i in range(3)])
    assert len(await a.get_items()) == 3
    new = [NewEntry(ITEM, {"role": "user", "content": f"new-{i}"}) for i in range(3 + extra)]
    await _recreate(store, "X", new)  # pod B

    with pytest.raises(SessionReplacedError):
        await a.add_items([{"role": "user", "content": "from-A"}])
    with pytest.raises(SessionReplacedError):
        await a.get_items()  # never the old history as if current
    with pytest.raises(SessionReplacedError):
        await a.pop_item()
    with pytest.raises(SessionReplacedError):
        await a.clear_session()
    with pytest.raises(SessionReplacedError):
        await a._atomic_replace_items([{"role": "user", "content": "compacted"}])
    log = await store.read("X")
    assert [e.data["content"] for e in log] == [f"new-{i}" for i in range(3 + extra)]
    assert [i["content"] for i in await Ev("X", store).get_items()] == [f"new-{i}" for i in range(3 + extra)]


async def test_openai_session_before_its_first_read_refuses_a_replacement_too(store: Any, Ev: Any) -> None:
    """A session that only ever wrote (add_items is optimistic: no read first) is pinned by that
    write: a replacement afterwards is refused on the next add."""
    a = Ev("W", store)
    await a.add_items([{"role": "user", "content": "only-write"}])
    await _recreate(store, "W", [NewEntry(ITEM, {"role": "user", "content": "B"})])
    with pytest.raises(SessionReplacedError):
        await a.add_items([{"role": "user", "content": "A"}])
    assert [e.data["content"] for e in await store.read("W")] == ["B"]


# =========================================================================== LangChain


@pytest.fixture
def History() -> Any:
    require_extra("langchain_core.messages", "langchain")
    from redis_session.adapters.langchain import RedisChatMessageHistory

    return RedisChatMessageHistory


def _message(text: str) -> NewEntry:
    return NewEntry("message", {"role": "user", "content": text})


@pytest.mark.parametrize("extra", [0, 2], ids=["same-length", "longer"])
async def test_langchain_history_never_reads_or_writes_another_life(store: Any, History: Any, extra: int) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    h = History("X", store)
    await h.aadd_messages([HumanMessage("old-0"), AIMessage("old-1"), HumanMessage("old-2")])
    assert len(await h.aget_messages()) == 3
    await _recreate(store, "X", [_message(f"new-{i}") for i in range(3 + extra)])

    with pytest.raises(SessionReplacedError):
        await h.aadd_messages([AIMessage("from-A")])
    with pytest.raises(SessionReplacedError):
        await h.aget_messages()
    with pytest.raises(SessionReplacedError):
        await h.aclear()
    assert [e.data["content"] for e in await store.read("X")] == [f"new-{i}" for i in range(3 + extra)]


def test_langchain_history_sync_and_async_faces_share_one_life(redis_url: str, prefix: str, History: Any) -> None:
    """The sync methods run on a private loop and the async ones on the caller's: each has its own
    view of the log, and both belong to the life the history first saw."""
    from langchain_core.messages import AIMessage, HumanMessage

    from redis_session import RedisSessionStore

    async def replace() -> None:
        other = RedisSessionStore.from_url(redis_url, prefix=prefix)  # pod B
        try:
            await _recreate(other, "Y", [_message("new-0"), _message("new-1")])
        finally:
            await other.aclose()

    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        h = History("Y", store)
        h.add_messages([HumanMessage("old-0"), AIMessage("old-1")])  # the sync view pins the life
        asyncio.run(replace())

        async def use_async_face() -> None:
            with pytest.raises(SessionReplacedError):
                await h.aget_messages()  # a view that never saw the old life still refuses the new one
            with pytest.raises(SessionReplacedError):
                await h.aadd_messages([AIMessage("from-A")])

        asyncio.run(use_async_face())
        with pytest.raises(SessionReplacedError):
            h.add_messages([AIMessage("from-A")])
        with pytest.raises(SessionReplacedError):
            _ = h.messages
        assert [m.content for m in History("Y", store).messages] == ["new-0", "new-1"]
    finally:
        import redis as sync_redis

        r = sync_redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


async def test_langchain_delete_then_a_new_conversation_on_the_same_object(store: Any, History: Any) -> None:
    """`delete()` ends the life through this history: its next write starts the next one."""
    from langchain_core.messages import HumanMessage

    h = History("D", store)
    await h.aadd_messages([HumanMessage("old")])
    await h.adelete()
    assert await h.aget_messages() == []
    await h.aadd_messages([HumanMessage("new")])
    assert [m.content for m in await h.aget_messages()] == ["new"]


async def test_store_delete_with_an_incarnation_deletes_only_that_life(store: Any) -> None:
    """The guard the histories' delete relies on: checked by the store, atomically."""
    first = await store.create(SessionHeader(id="G"), [_message("life-1")])
    await _recreate(store, "G", [_message("life-2")])
    with pytest.raises(SessionReplacedError):
        await store.delete("G", incarnation=first.header.incarnation)
    assert [e.data["content"] for e in await store.read("G")] == ["life-2"]
    assert await store.delete("G", incarnation=(await store.head("G")).header.incarnation)
    assert await store.head("G") is None
    assert not await store.delete("G", incarnation=first.header.incarnation)  # absent: nothing to refuse


@pytest.mark.parametrize("face", ["adelete", "delete"])
async def test_langchain_a_stale_history_never_deletes_the_new_life(store: Any, History: Any, face: str) -> None:
    """Pod B deleted the id and started another conversation on it: A's delete (either face)
    raises `SessionReplacedError` and the new conversation stays."""
    from langchain_core.messages import HumanMessage

    if face == "delete" and getattr(store, "cluster", False):
        pytest.skip("the sync face clones the store for its loop: a cluster store has no clone yet")
    a = History("S", store)
    await a.aadd_messages([HumanMessage("life-1")])
    await _recreate(store, "S", [_message("life-2")])
    with pytest.raises(SessionReplacedError):
        if face == "adelete":
            await a.adelete()
        else:
            await asyncio.to_thread(a.delete)
    assert [e.data["content"] for e in await store.read("S")] == ["life-2"]
    fresh = History("S", store)  # an object on the new life deletes it
    await fresh.adelete()
    assert await store.head("S") is None


# =========================================================================== a reply that never comes back


async def test_adapter_writes_land_once_when_replies_are_lost(tmp_path: Any, Ev: Any) -> None:
    """Replies cut after the server ran the append: `SessionLog` re-sends the same batch with its
    idempotency key (and its incarnation), so every acknowledged item is there exactly once, and
    an item whose call still failed is there at most once."""
    from collections import Counter

    from reliability._proxy import FaultProxy

    from redis_session import RedisSessionStore
    from redis_session.errors import StoreUnavailableError
    from redis_session.redis.embedded import start_server

    server = start_server(tmp_path / "srv", appendonly=False)
    try:
        with FaultProxy(server.port, seed=11) as proxy:
            store = RedisSessionStore.from_url(proxy.url, client_options={"socket_timeout": 2})
            direct = RedisSessionStore.from_url(server.url)
            try:
                s = Ev("lossy", store)
                await s.add_items([{"role": "user", "content": "first"}])
                proxy.cut_up, proxy.cut_down, proxy.cut_rate = False, True, 0.25
                acked, failed = ["first"], []
                for i in range(60):
                    text = f"item-{i}"
                    try:
                        await s.add_items([{"role": "user", "content": text}])
                        acked.append(text)
                    except StoreUnavailableError:
                        failed.append(text)
                proxy.heal()
                assert proxy.stats.cuts_mid_reply + proxy.stats.cuts > 5, "the proxy cut nothing"
                occ = Counter(e.data["content"] for e in await direct.read("lossy"))
                assert max(occ.values()) == 1, [k for k, c in occ.items() if c > 1]
                assert all(occ[t] == 1 for t in acked)
                assert len(failed) < len(acked)  # the re-sends absorb most lost replies
            finally:
                await store.aclose()
                await direct.aclose()
    finally:
        server.stop()


def test_lost_replies_are_resent_for_as_long_as_the_store_waits_for_one(redis_url: str) -> None:
    """The resend window is the store's socket timeout (capped), else a default."""
    from redis_session import MemorySessionStore, RedisSessionStore
    from redis_session.adapters._log import DEFAULT_RESEND_WINDOW, MAX_RESEND_WINDOW, resend_window

    assert resend_window(RedisSessionStore.from_url(redis_url, client_options={"socket_timeout": 2})) == 2.0
    assert resend_window(RedisSessionStore.from_url(redis_url, client_options={"socket_timeout": 99})) == (
        MAX_RESEND_WINDOW
    )
    assert resend_window(MemorySessionStore()) == DEFAULT_RESEND_WINDOW
