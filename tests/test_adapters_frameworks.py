"""The drop-in adapters, each driven as its framework drives it:

- `RedisEventSession` (OpenAI Agents SDK): the SDK's settings handling, ``ttl``, the atomic
  replacement hook of ``OpenAIResponsesCompactionSession`` (one batch, checked by a concurrent
  reader), writes that finish when the caller is cancelled, and ``close()``.
- `RedisChatMessageHistory` (LangChain): one history used from several event loops, empty
  messages, langchain-redis's accessors, long key prefixes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from redis_session import MemorySessionStore, RedisSessionStore

from support import SkewClock, let_pass, require_extra, wait_for

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "redis"])
async def fstore(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Any]:
    """The memory store and a server (no cluster: these tests are about the adapters)."""
    if request.param == "memory":
        yield MemorySessionStore(clock=SkewClock())
        return
    store = RedisSessionStore.from_url(request.getfixturevalue("redis_url"), prefix=prefix)
    try:
        yield store
    finally:
        await store.aclose()
        await _cleanup_async(request.getfixturevalue("redis_url"), prefix)


async def _cleanup_async(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await r.delete(*keys)
    finally:
        await r.aclose()


def _cleanup_sync(url: str, prefix: str) -> None:
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    r.close()


# =========================================================================== OpenAI Agents SDK


@pytest.fixture
def Ev() -> Any:
    require_extra("agents", "openai-agents")
    from redis_session.adapters.openai_agents import RedisEventSession

    return RedisEventSession


def _items(*texts: str) -> list[Any]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


async def test_session_settings_default_and_unknown_keys_like_the_sdk(Ev: Any) -> None:
    from agents.extensions.memory.redis_session import RedisSession
    from agents.memory import SessionSettings

    store = MemorySessionStore()
    assert Ev("s", store).session_settings == SessionSettings()
    assert Ev("s", store, session_settings={"limit": 2}).session_settings == SessionSettings(limit=2)
    with pytest.raises(TypeError, match="Unknown session settings: limitt") as ours:
        Ev("s", store, session_settings={"limitt": 1})
    with pytest.raises(TypeError) as sdk:
        RedisSession("s", redis_client=object(), session_settings={"limitt": 1})  # type: ignore[arg-type]
    assert str(ours.value) == str(sdk.value)


async def test_ttl_makes_an_ephemeral_session(fstore: Any, Ev: Any) -> None:
    s = Ev("eph", fstore, ttl=2)  # half of it is the room each step below has on a slow machine
    await s.add_items(_items("a"))
    await let_pass(fstore, 1.0)
    await s.add_items(_items("b"))  # a write restarts the clock
    await let_pass(fstore, 1.1)  # past a's expiry, a second before b's
    assert len(await s.get_items()) == 2
    await let_pass(fstore, 2.1)
    assert await fstore.head("eph") is None
    assert await s.get_items() == []
    assert await Ev("eph", fstore).get_items() == []
    with pytest.raises(ValueError):
        Ev("eph", fstore, ttl=0)


async def test_atomic_replacement_is_one_batch_seen_whole_by_a_concurrent_reader(fstore: Any, Ev: Any) -> None:
    old = _items(*(f"old-{i}" for i in range(30)))
    new = _items("summary", "recent")
    writer = Ev("compact", fstore)
    await writer.add_items(old)
    n_before = (await fstore.head("compact")).n

    seen: list[list[Any]] = []
    done = asyncio.Event()

    async def reader() -> None:
        other = Ev("compact", fstore)
        while not done.is_set():
            seen.append(await other.get_items())
            await asyncio.sleep(0)

    task = asyncio.create_task(reader())
    await wait_for(lambda: bool(seen))  # the reader is reading
    assert await writer._atomic_replace_items(new) is True
    await wait_for(lambda: seen[-1] == new)  # and reads the new history, however slow the machine
    done.set()
    await task
    assert seen and all(h in (old, new) for h in seen), [len(h) for h in seen if h not in (old, new)]
    assert seen[-1] == new
    log = await fstore.read("compact", n_before)
    assert [e.type for e in log] == ["cut", "openai/item", "openai/item"]
    assert log[0].data["reason"] == "openai-agents:compaction"
    head = await fstore.head("compact")
    assert head.n == n_before + 3  # one batch: the cut and the new items


async def test_compaction_session_uses_the_atomic_hook(fstore: Any, Ev: Any) -> None:
    """`OpenAIResponsesCompactionSession` (with a stand-in for ``responses.compact``) replaces the
    history through the hook: never a clear then an add."""
    from agents.memory import OpenAIResponsesCompactionSession

    compacted = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "S"}]}

    class Responses:
        async def compact(self, **kwargs: Any) -> Any:
            return SimpleNamespace(output=[compacted], usage=None)

    under = Ev("cs", fstore)
    await under.add_items(_items("q1", "a1", "q2", "a2"))
    cs = OpenAIResponsesCompactionSession("cs", under, client=SimpleNamespace(responses=Responses()), model="gpt-4.1")
    await cs.run_compaction({"compaction_mode": "input", "force": True})
    log = await fstore.read("cs")
    assert [e.type for e in log[4:]] == ["cut", "openai/item"]  # no clear_session cut before it
    assert log[4].data["reason"] == "openai-agents:compaction"
    got = await Ev("cs", fstore).get_items()
    assert len(got) == 1 and got[0]["role"] == "user"


class _SlowReplies:
    """A store whose put commits, then waits before answering (a reply in flight)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.vocabulary = inner.vocabulary
        self.committed = asyncio.Event()
        self.release = asyncio.Event()
        self.slow = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        out = await self.inner.put(*args, **kwargs)
        if self.slow:
            self.committed.set()
            await self.release.wait()
        return out


@pytest.mark.parametrize("op", ["pop_item", "clear_session"])
async def test_a_cancelled_write_completes_before_the_cancellation(fstore: Any, Ev: Any, op: str) -> None:
    slow = _SlowReplies(fstore)
    s = Ev("cancel", slow)
    await s.add_items(_items("keep", "pop me"))
    slow.slow = True
    task = asyncio.create_task(getattr(s, op)())
    await slow.committed.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # still finishing its write
    slow.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the instance saw its own write through: no half-applied state
    assert s._log.n == (await fstore.head("cancel")).n
    expected = [] if op == "clear_session" else _items("keep")
    assert [item for _, item in s._visible()] == expected
    slow.slow = False
    assert await s.get_items() == expected
    assert await Ev("cancel", fstore).get_items() == expected


async def test_close_of_a_from_url_session_makes_later_calls_raise(
    redis_url: str, prefix: str, redis_store: Any, Ev: Any
) -> None:
    s = Ev.from_url("closing", url=redis_url, prefix=prefix)
    await s.add_items(_items("hi"))
    await s.close()
    for call in (s.get_items(), s.add_items(_items("x")), s.pop_item(), s.clear_session(), s.ping()):
        with pytest.raises(RuntimeError, match="closed"):
            await call
    await s.close()  # again: a no-op
    # a session given a store is the caller's: close() leaves it working
    t = Ev("not-owned", redis_store)
    await t.close()
    await t.add_items(_items("still"))
    assert len(await t.get_items()) == 1


# --------------------------------------------------------------------------- OpenAI Agents, as the SDK's suite expects


async def test_a_subclass_keeps_its_overridden_storage_methods_in_a_compaction(fstore: Any, Ev: Any) -> None:
    """As the SDK's own sessions: the one-batch replacement is ours only; a subclass's compaction
    goes through its own ``clear_session`` and ``add_items`` (the SDK's fallback)."""
    from agents.memory import OpenAIResponsesCompactionSession

    calls: list[str] = []

    class Audited(Ev):  # type: ignore[misc,valid-type]
        async def add_items(self, items: list[Any]) -> None:
            calls.append(f"add:{len(items)}")
            await super().add_items([{**i, "audited": True} for i in items])

        async def clear_session(self) -> None:
            calls.append("clear")
            await super().clear_session()

    compacted = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "S"}]}

    class Responses:
        async def compact(self, **kwargs: Any) -> Any:
            return SimpleNamespace(output=[compacted], usage=None)

    under = Audited("sub", fstore)
    await under.add_items(_items("q1", "a1"))
    assert await under._atomic_replace_items([compacted]) is False  # nothing written by the hook
    assert (await fstore.head("sub")).n == 2
    cs = OpenAIResponsesCompactionSession("sub", under, client=SimpleNamespace(responses=Responses()), model="gpt-4.1")
    await cs.run_compaction({"compaction_mode": "input", "force": True})
    assert calls == ["add:2", "clear", "add:1"]
    got = await under.get_items()
    assert len(got) == 1 and got[0]["audited"] is True


async def test_a_non_json_item_raises_type_error_like_the_sdk(fstore: Any, Ev: Any) -> None:
    from agents.extensions.memory.redis_session import RedisSession

    bad = [{"role": "user", "content": "ok"}, {"role": "user", "content": object()}]
    with pytest.raises(TypeError):  # the SDK's own (json.dumps), before any I/O
        await RedisSession("s", redis_client=_NoIO()).add_items(bad)  # type: ignore[arg-type]
    s = Ev("nonjson", fstore)
    await s.add_items(_items("keep"))
    for call in (
        lambda: s.add_items(bad),
        lambda: s.add_items([{"role": "user", "content": {1, 2}}]),
        lambda: s.add_items([{"role": "user", "content": float("nan")}]),
        lambda: s._atomic_replace_items(bad),
    ):
        with pytest.raises(TypeError):
            await call()
    assert (await fstore.head("nonjson")).n == 1  # nothing written
    assert await s.get_items() == _items("keep")


class _NoIO:
    """A stand-in client for the SDK's session: any command fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the SDK's session used its client ({name}) before refusing the item")


async def test_add_nothing_after_close_raises_like_the_sdk(
    redis_url: str, prefix: str, redis_store: Any, Ev: Any
) -> None:
    from agents.extensions.memory.redis_session import RedisSession

    sdk = RedisSession.from_url("c", url=redis_url)
    await sdk.close()
    with pytest.raises(RuntimeError, match="closed"):
        await sdk.add_items([])
    ours = Ev.from_url("c", url=redis_url, key_prefix=prefix)
    await ours.close()
    with pytest.raises(RuntimeError, match="closed"):
        await ours.add_items([])


async def test_built_as_the_sdk_users_build_it(redis_url: str, prefix: str, redis_store: Any, Ev: Any) -> None:
    """``from_url(session_id, *, url, redis_kwargs, key_prefix, ttl, session_settings)`` and a
    constructor taking a redis client, as the SDK's ``RedisSession`` is built."""
    import redis.asyncio as aioredis
    from agents.memory import SessionSettings

    s = Ev.from_url(
        "built",
        url=redis_url,
        redis_kwargs={"socket_timeout": 7, "client_name": "agents"},
        key_prefix=prefix,
        ttl=60,
        session_settings={"limit": 1},
    )
    try:
        assert s.session_settings == SessionSettings(limit=1) and s.ttl == 60
        assert s.store.prefix == prefix
        assert s.store._user_client.connection_pool.connection_kwargs["socket_timeout"] == 7
        await s.add_items(_items("a", "b"))
        assert await s.get_items() == _items("a", "b")[-1:]
        assert 0 < await redis_store.client.pttl(redis_store.keys.hdr("built")) <= 60_000
    finally:
        await s.close()

    client = aioredis.Redis.from_url(redis_url)
    try:
        t = Ev("built", redis_client=client, key_prefix=prefix)
        assert [i["content"] for i in await t.get_items(limit=None)] == ["a", "b"]
        await t.close()  # the caller's client: left open
        assert await client.ping()
        assert [i["content"] for i in await Ev("built", redis_store).get_items()] == ["a", "b"]
    finally:
        await client.aclose()
    with pytest.raises(TypeError):
        Ev("x")
    with pytest.raises(TypeError):
        Ev("x", redis_store, redis_client=client)
    with pytest.raises(TypeError):
        Ev("x", redis_client=object())
    with pytest.raises(TypeError):
        Ev("x", redis_store, key_prefix="p")


def test_one_session_from_several_event_loops(redis_url: str, prefix: str, Ev: Any) -> None:
    """``asyncio.run`` twice, then the SDK's ``Runner.run_sync`` (the thread's default loop), on
    one session and one store."""
    from agents import Agent, RunConfig, Runner
    from test_adapters import _scripted_model

    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        s = Ev("loops", store)

        async def turn(text: str) -> int:
            await s.add_items(_items(text))
            return len(await s.get_items())

        assert asyncio.run(turn("run-1")) == 1
        assert asyncio.run(turn("run-2")) == 2
        agent = Agent(name="t", model=_scripted_model(["sync-1", "sync-2"]))
        config = RunConfig(tracing_disabled=True)
        assert Runner.run_sync(agent, "q1", session=s, run_config=config).final_output == "sync-1"
        assert Runner.run_sync(agent, "q2", session=s, run_config=config).final_output == "sync-2"
        assert asyncio.run(turn("run-3")) == 7
    finally:
        _cleanup_sync(redis_url, prefix)


# =========================================================================== LangChain


@pytest.fixture
def History() -> Any:
    require_extra("langchain_core.messages", "langchain")
    from redis_session.adapters.langchain import RedisChatMessageHistory

    return RedisChatMessageHistory


def test_one_history_from_several_event_loops(redis_url: str, prefix: str, History: Any) -> None:
    """A sync call, then ``asyncio.run`` twice, then sync again, on ONE history and ONE store (as
    LangChain's own interface tests drive a history)."""
    from langchain_core.messages import AIMessage, HumanMessage

    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        h = History("loops", store)
        h.add_messages([HumanMessage("sync")])

        async def turn(text: str) -> list[Any]:
            await h.aadd_messages([AIMessage(text)])
            return await h.aget_messages()

        assert [m.content for m in asyncio.run(turn("run-1"))] == ["sync", "run-1"]
        assert [m.content for m in asyncio.run(turn("run-2"))] == ["sync", "run-1", "run-2"]
        assert [m.content for m in h.messages] == ["sync", "run-1", "run-2"]

        async def clear() -> None:
            await h.aclear()

        asyncio.run(clear())
        assert h.messages == []
    finally:
        _cleanup_sync(redis_url, prefix)


async def test_empty_messages_come_back_as_added(fstore: Any, History: Any) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    h = History("empty-msgs", fstore)
    msgs = [
        HumanMessage(""),
        AIMessage(""),
        HumanMessage("q"),
        AIMessage([]),
        ToolMessage("", tool_call_id="c"),
        AIMessage("a"),
    ]
    await h.aadd_messages(msgs)
    got = await h.aget_messages()
    assert [(type(m).__name__, m.content) for m in got] == [(type(m).__name__, m.content) for m in msgs]
    assert [(type(m).__name__, m.content) for m in await History("empty-msgs", fstore).aget_messages()] == [
        (type(m).__name__, m.content) for m in msgs
    ]
    await h.aclear()
    assert await h.aget_messages() == []
    await h.aadd_messages([AIMessage("")])
    assert [m.content for m in await h.aget_messages()] == [""]


def test_langchain_redis_accessors_ttl_and_long_prefixes(History: Any) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    from redis_session.errors import InvalidSessionIdError

    store = MemorySessionStore()
    long_prefix = "tenant-" + "x" * 90 + ":chat:"
    h = History("user123", store, key_prefix=long_prefix, ttl=3600)
    assert h.id == h.session_id == long_prefix + "user123" and h.ttl == 3600 and h.key_prefix == long_prefix
    assert len(h) == 0 and bool(h)
    h.add_messages([HumanMessage("Tell me about Machine Learning"), AIMessage("Machine learning is a subset of AI")])
    assert len(h) == 2
    assert [r["content"] for r in h.search_messages("LEARNING", limit=1)] == ["Tell me about Machine Learning"]
    assert h.search_messages("") == []
    with pytest.raises(InvalidSessionIdError, match="256 characters"):
        History("user123", store, key_prefix="p" * 300)
    with pytest.raises(InvalidSessionIdError, match="cluster slot"):
        History("user123", store, key_prefix="{tenant}:")
    h.delete()
    assert len(h) == 0


async def test_langchain_ttl_expires_the_session(fstore: Any, History: Any) -> None:
    from langchain_core.messages import HumanMessage

    h = History("lc-eph", fstore, ttl=2)  # long enough to be read back on a slow machine
    await h.aadd_messages([HumanMessage("gone soon")])
    assert len(await h.aget_messages()) == 1
    await let_pass(fstore, 2.2)
    assert await fstore.head("lc-eph") is None
    assert await h.aget_messages() == []


# --------------------------------------------------------------------------- LangChain, as its own suite expects


def test_langchain_session_ids_limit_zero_and_ttl_zero_as_langchain_redis(History: Any) -> None:
    from langchain_core.messages import HumanMessage

    store = MemorySessionStore()
    for bad in ("", None):
        with pytest.raises(ValueError, match="session_id must be a non-empty, valid string"):
            History(bad, store)
        with pytest.raises(ValueError, match="non-empty"):
            History(bad, store, key_prefix="chat:")  # the prefix does not make it a session id
    h = History("s", store, ttl=0)
    assert h.ttl == 0
    h.add_messages([HumanMessage("find me"), HumanMessage("find me too")])
    assert h.search_messages("find", limit=0) == []
    assert h.search_messages("find", limit=-1) == []
    assert len(h.search_messages("find", limit=1)) == 1
    with pytest.raises(ValueError):
        History("s", store, ttl=-1)


async def test_langchain_ttl_zero_never_expires(redis_store: Any, History: Any) -> None:
    from langchain_core.messages import HumanMessage

    h = History("forever", redis_store, ttl=0)
    await h.aadd_messages([HumanMessage("stays")])
    assert await redis_store.client.pttl(redis_store.keys.hdr("forever")) == -1  # no expiry


async def test_langchain_async_paths_do_not_block_the_loop(redis_url: str, prefix: str, History: Any) -> None:
    """No blocking call on the async paths, including the first connection on a loop (redis-py
    reads its own version from package metadata for every new connection unless told it); and a
    sync method called inside a running loop never waits on a lock for another thread."""
    blockbuster = pytest.importorskip("blockbuster")
    from langchain_core.messages import AIMessage, HumanMessage

    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        with blockbuster.blockbuster_ctx() as bb:  # every module, not only langchain_core
            for fn in bb.functions.values():  # the test's own cleanup and pytest's plumbing
                fn.can_block_in("_pytest/", {"__call__"})
            h = History("bb", store)
            await h.aadd_messages([HumanMessage("async")])
            h.add_messages([AIMessage("sync inside the loop")])  # in place: no other thread
            assert [m.content for m in h.messages] == ["async", "sync inside the loop"]
            assert [m.content for m in await h.aget_messages()] == ["async", "sync inside the loop"]
            await h.aclear()
            assert await h.aget_messages() == []
    finally:
        await store.aclose()
        await _cleanup_async(redis_url, prefix)


def test_close_of_a_from_url_session_used_on_several_loops(redis_url: str, prefix: str, Ev: Any) -> None:
    """``asyncio.run`` twice, then ``close()`` in a third: the store of the loop it runs on is
    closed, those of the loops that are gone went with them, and later calls raise."""
    s = Ev.from_url("closing-loops", url=redis_url, key_prefix=prefix)

    async def add(text: str) -> None:
        await s.add_items(_items(text))

    asyncio.run(add("a"))
    asyncio.run(add("b"))

    async def finish() -> None:
        assert len(await s.get_items()) == 2
        assert await s.store.delete("closing-loops")  # the store of this loop
        await s.close()
        with pytest.raises(RuntimeError, match="closed"):
            await s.get_items()

    try:
        asyncio.run(finish())
    finally:
        _cleanup_sync(redis_url, prefix)


# =========================================================================== lost replies, races, lives
# (the OpenAI Agents and LangChain adapters when a write's reply is lost, two pods or two threads write
# one session at once, or a compaction races another pod)


class _LosesReplies:
    """A store whose writes run for real, then lose their reply (`StoreUnavailableError`, as a
    cut connection does) while `lose` > 0: the write landed, the caller sees an error."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.vocabulary = inner.vocabulary
        self.lose = 0
        self.lose_creates = 0
        self.sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        from redis_session.errors import StoreUnavailableError

        self.sent += 1
        out = await self.inner.put(*args, **kwargs)
        if self.lose:
            self.lose -= 1
            raise StoreUnavailableError("reply lost")
        return out

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        from redis_session.errors import StoreUnavailableError

        out = await self.inner.create(*args, **kwargs)
        if self.lose_creates:
            self.lose_creates -= 1
            raise StoreUnavailableError("reply lost")
        return out


@pytest.fixture
def short_resends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resends give up after 0.3 s (the store's socket timeout otherwise: 10 s)."""
    from redis_session.adapters import _log

    monkeypatch.setattr(_log, "MAX_RESEND_WINDOW", 0.3)
    monkeypatch.setattr(_log, "DEFAULT_RESEND_WINDOW", 0.3)


def _texts_of(items: list[Any]) -> list[str]:
    return [x["content"] if isinstance(x["content"], str) else x["content"][0]["text"] for x in items]


async def test_a_short_outage_of_replies_is_outlasted_by_the_resends(fstore: Any, Ev: Any) -> None:
    """Four lost replies in a row (< 1 s): the adapter keeps re-sending with one key, the call
    returns, the item is stored once."""
    flaky = _LosesReplies(fstore)
    s = Ev("outage", flaky)
    await s.add_items(_items("m0"))
    flaky.lose = 4
    await s.add_items(_items("m1"))
    assert flaky.sent == 1 + 5
    assert _texts_of(await Ev("outage", fstore).get_items()) == ["m0", "m1"]


@pytest.mark.parametrize("op", ["add_items", "pop_item", "aadd_messages"])
async def test_the_callers_retry_after_the_resends_gave_up_lands_once(
    fstore: Any, Ev: Any, op: str, short_resends: None
) -> None:
    """The resends give up (the error says the write may have landed); the caller's retry of
    the same call is the same write: one add, one pop."""
    from redis_session.errors import StoreUnavailableError

    flaky = _LosesReplies(fstore)
    if op == "aadd_messages":
        require_extra("langchain_core", "langchain")
        from langchain_core.messages import HumanMessage

        from redis_session.adapters.langchain import RedisChatMessageHistory

        h = RedisChatMessageHistory("lost", flaky)
        await h.aadd_messages([HumanMessage("h0"), HumanMessage("h1")])
        call: Any = lambda: h.aadd_messages([HumanMessage("h2")])  # noqa: E731
    else:
        s = Ev("lost", flaky)
        await s.add_items(_items("m0", "m1", "m2"))
        call = (lambda: s.add_items(_items("m3"))) if op == "add_items" else s.pop_item
    flaky.lose = 10_000
    with pytest.raises(StoreUnavailableError, match="may have landed"):
        await call()
    flaky.lose = 0
    await call()  # the caller's retry, once the network is back
    if op == "aadd_messages":
        back = RedisChatMessageHistory("lost", fstore)
        assert [m.content for m in await back.aget_messages()] == ["h0", "h1", "h2"]
    else:
        want = ["m0", "m1", "m2", "m3"] if op == "add_items" else ["m0", "m1"]
        assert _texts_of(await Ev("lost", fstore).get_items()) == want
    # ... and the next call after the retry is a new write
    await call()
    n = (await fstore.head("lost")).n
    assert n == (4 if op == "aadd_messages" else 5)


async def test_a_retry_of_a_call_torn_between_batches_writes_each_batch_once(
    fstore: Any, Ev: Any, short_resends: None
) -> None:
    """add_items of 5 items in batches of 2: the second batch's reply stays lost; the caller's
    retry goes on from that batch (the first is not written again)."""
    from redis_session.errors import StoreUnavailableError

    flaky = _LosesReplies(fstore)
    flaky.max_batch = 2
    s = Ev("torn", flaky)
    texts = [f"m{i}" for i in range(5)]
    sent = 0

    async def put(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        out = await fstore.put(*args, **kwargs)
        if sent >= 2 and flaky.lose:
            raise StoreUnavailableError("reply lost")
        return out

    flaky.put = put  # type: ignore[method-assign]
    flaky.lose = 1
    with pytest.raises(StoreUnavailableError):
        await s.add_items(_items(*texts))
    flaky.lose = 0
    await s.add_items(_items(*texts))
    assert _texts_of(await Ev("torn", fstore).get_items()) == texts


async def test_a_retry_after_the_write_was_read_back_is_still_recognised(
    fstore: Any, Ev: Any, short_resends: None
) -> None:
    """The unknown add_items was read back (get_items folded it) before the caller retried:
    the retry is re-sent at its n with its key, and lands nothing new."""
    from redis_session.errors import StoreUnavailableError

    flaky = _LosesReplies(fstore)
    s = Ev("readback", flaky)
    await s.add_items(_items("m0"))
    flaky.lose = 10_000
    with pytest.raises(StoreUnavailableError):
        await s.add_items(_items("m1"))
    flaky.lose = 0
    assert _texts_of(await s.get_items()) == ["m0", "m1"]
    await s.add_items(_items("m1"))
    assert _texts_of(await s.get_items()) == ["m0", "m1"]


async def test_two_objects_adding_equal_items_at_one_n_both_land(fstore: Any, Ev: Any) -> None:
    """Keys are per object: pod B's equal item at the same n is not taken for A's retry."""
    a, b = Ev("equal", fstore), Ev("equal", fstore)
    await a.add_items(_items("m0"))
    await b.get_items()
    await a.add_items(_items("same"))
    await b.add_items(_items("same"))  # stale n: conflicts, catches up, lands after A's
    assert _texts_of(await Ev("equal", fstore).get_items()) == ["m0", "same", "same"]


@pytest.mark.parametrize("framework", ["openai", "langchain"])
async def test_the_creating_write_survives_a_lost_reply(fstore: Any, Ev: Any, framework: str) -> None:
    """The create's reply is lost (the session exists, empty): re-sent, it finds the empty life
    and the first write lands; also when the object's earlier life had ended."""
    flaky = _LosesReplies(fstore)
    flaky.lose_creates = 1
    if framework == "langchain":
        require_extra("langchain_core", "langchain")
        from langchain_core.messages import HumanMessage

        from redis_session.adapters.langchain import RedisChatMessageHistory

        h = RedisChatMessageHistory("first", flaky)
        add: Any = lambda t: h.aadd_messages([HumanMessage(t)])  # noqa: E731
    else:
        s = Ev("first", flaky)
        add = lambda t: s.add_items(_items(t))  # noqa: E731
    await add("one")
    assert [e.data.get("content") for e in await fstore.read("first")] == ["one"]
    assert await fstore.delete("first")  # the life ended: the next write starts a new one
    flaky.lose_creates = 1
    await add("two")
    assert [e.data.get("content") for e in await fstore.read("first")] == ["two"]


async def test_a_compaction_keeps_an_item_another_pod_added_during_the_request(fstore: Any, Ev: Any) -> None:
    from agents.memory import OpenAIResponsesCompactionSession

    a, b = Ev("race", fstore), Ev("race", fstore)
    await a.add_items(_items("m0", "m1", "m2", "m3"))
    summary = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "SUMMARY"}]}
    seen: list[Any] = []

    class Responses:
        async def compact(self, **kwargs: Any) -> Any:
            seen.append(kwargs.get("input"))
            if len(seen) == 1:
                await b.add_items(_items("B-new"))  # pod B, while the request is in flight
            return SimpleNamespace(output=[summary], usage=None)

    cs = OpenAIResponsesCompactionSession("race", a, client=SimpleNamespace(responses=Responses()), model="gpt-4.1")
    await cs.run_compaction({"compaction_mode": "input", "force": True})
    assert len(seen[0]) == 4
    assert _texts_of(await Ev("race", fstore).get_items()) == ["SUMMARY", "B-new"]
    assert _texts_of(await a.get_items()) == ["SUMMARY", "B-new"]
    # with nobody writing meanwhile, the compaction replaces the whole history
    await cs.run_compaction({"compaction_mode": "input", "force": True})
    assert _texts_of(await Ev("race", fstore).get_items()) == ["SUMMARY"]


async def test_two_concurrent_turns_keep_every_item_once_and_batches_whole(fstore: Any, Ev: Any) -> None:
    """What the README promises for two turns on one session at once (the SDK's Session has no
    conflict: the Runner's add_items must not fail): nothing lost, nothing doubled, each
    add_items batch contiguous; the order between the turns is the order the writes arrive."""
    await Ev("turns", fstore).add_items(_items("start"))
    gate = asyncio.Event()

    async def turn(k: int) -> None:
        s = Ev("turns", fstore)
        await s.get_items()
        await s.add_items([{"role": "user", "content": f"q{k}-a"}, {"role": "user", "content": f"q{k}-b"}])
        await gate.wait()
        await s.add_items([{"role": "assistant", "content": f"a{k}"}])

    tasks = [asyncio.create_task(turn(k)) for k in range(2)]
    await wait_for(lambda: _has(fstore.read("turns"), 5))  # both turns' first batches landed
    gate.set()
    await asyncio.gather(*tasks)
    got = _texts_of(await Ev("turns", fstore).get_items())
    assert sorted(got) == sorted(["start", "q0-a", "q0-b", "a0", "q1-a", "q1-b", "a1"])
    for k in range(2):
        i = got.index(f"q{k}-a")
        assert got[i + 1] == f"q{k}-b"
        assert got.index(f"a{k}") > i


async def test_ttl_applies_to_the_session_an_object_creates_only(fstore: Any, Ev: Any) -> None:
    """As documented: a session that exists keeps its own expiry (the store has no way to
    change it); a session the object creates expires `ttl` after its last write."""
    await Ev("kept", fstore).add_items(_items("a"))
    await Ev("kept", fstore, ttl=1).add_items(_items("b"))
    await let_pass(fstore, 1.5)
    assert (await fstore.head("kept")).n == 2
    assert "creates" in (Ev.__doc__ or "") and "exists" in (Ev.__init__.__doc__ or Ev.__doc__ or "")


def test_one_session_from_two_threads_at_once(redis_url: str, prefix: str, Ev: Any) -> None:
    """Each thread runs its own event loop on one object (an anyio.Lock of one loop deadlocked
    them): both finish, every item lands once, each batch whole; a LangChain history too."""
    import threading

    require_extra("langchain_core", "langchain")
    from langchain_core.messages import HumanMessage

    from redis_session.adapters.langchain import RedisChatMessageHistory

    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    s = Ev("threads", store)
    h = RedisChatMessageHistory("threads-lc", store)
    asyncio.run(s.add_items(_items("first")))
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(3):
                pair = [{"role": "user", "content": f"{k}-{i}-a"}, {"role": "user", "content": f"{k}-{i}-b"}]
                asyncio.run(s.add_items(pair))
                asyncio.run(s.get_items())
                asyncio.run(h.aadd_messages([HumanMessage(p["content"]) for p in pair]))
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts) and not errors
    fresh = RedisSessionStore.from_url(redis_url, prefix=prefix)
    got = _texts_of(asyncio.run(Ev("threads", fresh).get_items()))
    lc = [m.content for m in RedisChatMessageHistory("threads-lc", fresh).messages]
    assert len(got) == 13 and len(set(got)) == 13 and len(lc) == 12 and len(set(lc)) == 12
    for k in range(2):
        for i in range(3):
            assert got[got.index(f"{k}-{i}-a") + 1] == f"{k}-{i}-b"
            assert lc[lc.index(f"{k}-{i}-a") + 1] == f"{k}-{i}-b"
    _cleanup_sync(redis_url, prefix)


async def _has(entries: Any, count: int) -> bool:
    return len(await entries) == count
