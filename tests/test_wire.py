"""The pool's taking and giving back of a connection can never be cut by a cancellation
(`redis_session.redis.wire.shielded`), at the price of nothing when the pool does not wait; and
the one connection kept between calls (`PooledWire`) never costs another caller a connection."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from typing import Any
from urllib.parse import urlparse

import anyio
import anyio.lowlevel
import pytest
import redis
import redis.asyncio as aioredis

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.redis.wire import held, kept, shielded

from support import wait_for

pytestmark = pytest.mark.anyio


async def _no_suspension(log: list[str]) -> int:
    log.append("ran")
    return 7


async def _two_suspensions(log: list[str]) -> int:
    log.append("start")
    await anyio.sleep(0.01)
    log.append("middle")
    await anyio.sleep(0.01)
    log.append("end")
    return 8


async def _fails(after_suspending: bool) -> None:
    if after_suspending:
        await anyio.lowlevel.checkpoint()
    raise LookupError("from inside")


async def test_a_call_that_never_waits_runs_even_in_a_cancelled_scope() -> None:
    log: list[str] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        got = await shielded(_no_suspension(log))
        assert (got, log) == (7, ["ran"])
        await anyio.lowlevel.checkpoint()  # the scope's cancellation lands at the next await, outside
        pytest.fail("the cancellation was lost")
    assert scope.cancelled_caught


async def test_a_call_that_waits_finishes_when_its_scope_is_cancelled_meanwhile() -> None:
    log: list[str] = []
    result: list[int] = []
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            result.append(await shielded(_two_suspensions(log)))
            await anyio.sleep(1)  # cancelled here, not inside the shielded call
            result.append(-1)

        tg.start_soon(call)
        await anyio.sleep(0.005)  # inside the first suspension
        assert log == ["start"]
        tg.cancel_scope.cancel()
    assert log == ["start", "middle", "end"]
    assert result == [8]


@pytest.mark.parametrize("after_suspending", [False, True])
async def test_errors_come_out_as_they_are(after_suspending: bool) -> None:
    with pytest.raises(LookupError, match="from inside"):
        await shielded(_fails(after_suspending))


async def test_cancelled_writes_and_reads_on_a_contended_pool_leak_no_connection(redis_url: str, prefix: str) -> None:
    """Many callers on a pool of two, each cancelled at a random moment (waiting for a
    connection, writing, reading the reply, giving it back): afterwards no connection is counted
    as in use, and the pool still serves every caller."""
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"max_connections": 2, "pool_timeout": 10}
    )
    try:
        await store.create(SessionHeader(id="s"))
        rng = random.Random(27)
        cancelled = [0]

        async def caller(i: int) -> None:
            for j in range(30):
                with anyio.move_on_after(rng.uniform(0, 0.002)) as scope:
                    if (i + j) % 2:
                        await store.put("s", None, [NewEntry("user/message", {"content": f"{i}.{j}"})])
                    else:
                        await store.read("s", 0, 5)
                cancelled[0] += scope.cancelled_caught

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(caller, i)
        assert cancelled[0] > 10, "the test never cancelled a call"
        pool = store.client.connection_pool
        assert held(pool) == []  # in use: at most the one kept for the next call
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 2
        with anyio.fail_after(10):  # every connection is usable again: the pool's limit is whole
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(store.head, "s")
        head = await store.head("s")
        assert head is not None
        assert [e.n for e in await store.read("s")] == list(range(head.n))
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- the kept connection


async def test_one_connection_is_kept_between_calls_and_given_back_on_close(redis_url: str, prefix: str) -> None:
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    other = RedisSessionStore(store.client, prefix=prefix)  # a second store on the same client
    pool: Any = store.client.connection_pool
    try:
        await store.create(SessionHeader(id="k"))
        first = kept(pool)
        assert first is not None and held(pool) == []  # counted in use by the pool, held by no call
        for i in range(5):
            await store.put("k", i, [NewEntry("user/message", {"content": str(i)})])
            await other.head("k")
            assert kept(pool) is first  # the same connection every time: no pool round
        assert len(pool._in_use_connections) == 1 and not pool._available_connections
        await other.aclose()  # a store closing gives it back (its client goes on)
        assert kept(pool) is None and not pool._in_use_connections
        assert (await store.head("k")).n == 5  # type: ignore[union-attr]
    finally:
        await store.aclose()
    assert not pool._in_use_connections


async def test_a_kept_connection_the_server_closed_is_not_used(redis_url: str, prefix: str) -> None:
    """A write (never re-sent) after the server closed the kept connection goes out on a new
    one: it lands, instead of failing on the dead one."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    admin = aioredis.Redis.from_url(redis_url)
    pool: Any = store.client.connection_pool
    try:
        await store.create(SessionHeader(id="k"))
        killed = await _client_id(store)
        assert kept(pool) is not None
        await admin.execute_command("CLIENT", "KILL", "ID", killed)
        await anyio.sleep(0.2)  # the close reaches the event loop
        await store.put("k", 0, [NewEntry("user/message", {"content": "after"})])
        assert await _client_id(store) != killed
        assert [e.data["content"] for e in await store.read("k")] == ["after"]
    finally:
        await store.aclose()
        await admin.aclose()


async def _client_id(store: RedisSessionStore) -> int:
    return int(await store._raw("CLIENT", "ID"))


async def test_a_busy_pool_keeps_nothing_back(redis_url: str, prefix: str) -> None:
    """With more than half the pool in use, every connection goes back to the pool: keeping one
    would make another caller wait for it."""
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"max_connections": 2, "pool_timeout": 5}
    )
    pool: Any = store.client.connection_pool
    try:
        await store.create(SessionHeader(id="b"))
        assert kept(pool) is not None
        blocker = await pool.get_connection()  # another caller holds one of the two
        try:
            await store.head("b")  # takes the kept one: two in use, more than half
            assert kept(pool) is None and len(pool._in_use_connections) == 1
            with anyio.fail_after(5):  # so a third caller gets one without waiting
                third = await pool.get_connection()
                await pool.release(third)
        finally:
            await pool.release(blocker)
    finally:
        await store.aclose()


async def test_the_kept_connection_is_handed_to_whoever_asks_the_pool(redis_url: str, prefix: str) -> None:
    """The kept connection counts as in use for the pool, but never sits unused while another
    caller needs one: redis-py's own commands on the store's client, a held tail, anyone taking
    from the pool gets it first. With a pool of 2 that a put left one kept in, two blocking
    commands of the caller's own still run at once (they waited out the pool's timeout)."""
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"max_connections": 2, "pool_timeout": 2}
    )
    pool: Any = store.client.connection_pool
    admin = aioredis.Redis.from_url(redis_url)
    key = f"{prefix}q"
    try:
        await store.create(SessionHeader(id="h"))
        assert kept(pool) is not None
        assert pool.can_get_connection()
        got: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def pop() -> None:
                got.append(await store.client.blpop([key], timeout=5))

            # a pop that finds no connection fails after the pool's 2 s: "No connection available"
            tg.start_soon(pop)
            tg.start_soon(pop)
            await wait_for(lambda: len(held(pool)) == 2)  # both blocked on the server, the kept one among them
            assert kept(pool) is None
            await admin.rpush(key, "a", "b")
        assert sorted(v for _, v in got) == [b"a", b"b"]
        await store.put("h", 0, [NewEntry("user/message", {"content": "after"})])
        assert (await store.head("h")).n == 1  # type: ignore[union-attr]
    finally:
        await store.aclose()
        await admin.delete(key)
        await admin.aclose()
    assert not pool._in_use_connections


async def test_held_tails_take_the_kept_connection(redis_url: str, prefix: str) -> None:
    """Two live tails on a pool of 2 that a put left one connection kept in: between them they
    hold both connections, the kept one included, and each gets every entry."""
    store = RedisSessionStore.from_url(
        redis_url, prefix=prefix, client_options={"max_connections": 2, "pool_timeout": 2}
    )
    writer = RedisSessionStore.from_url(redis_url, prefix=prefix)
    pool: Any = store.client.connection_pool
    try:
        await store.create(SessionHeader(id="t"))
        assert kept(pool) is not None
        seen: list[list[int]] = [[], []]
        async with anyio.create_task_group() as tg:

            async def follow(mine: list[int]) -> None:
                async for entry in store.tail("t", start=0):
                    mine.append(entry.n)
                    if entry.n == 1:
                        return

            for mine in seen:
                tg.start_soon(follow, mine)
            await wait_for(lambda: len(held(pool)) == 2)  # both tails reading, the kept one among them
            for i in range(2):
                await writer.put("t", i, [NewEntry("user/message", {"content": str(i)})])
        assert seen == [[0, 1], [0, 1]]
    finally:
        await store.aclose()
        await writer.aclose()
    assert not pool._in_use_connections


class _Relay:
    """A TCP relay in front of the server, on threads (it works while the test's event loop is
    blocked), that can drop its client connections abortively (RST), as a proxy or a cloud load
    balancer closing an idle connection does."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.clients: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.clients.append(client)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.close()

    def reset_all(self) -> None:
        for client in self.clients:
            with contextlib.suppress(OSError):  # one its pump closed already
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # wakes its pump's recv, which then closes it: with a zero linger, an RST, not a
                # FIN (a close while another thread is in recv on it would send nothing)
                client.shutdown(socket.SHUT_RD)
        self.clients.clear()

    def close(self) -> None:
        self.listener.close()
        self.reset_all()


@pytest.mark.parametrize("loop_sees_it", [False, True], ids=["while-the-loop-is-busy", "after-the-loop-saw-it"])
async def test_a_kept_connection_reset_while_unused_is_not_used(
    redis_url: str, prefix: str, loop_sees_it: bool
) -> None:
    """A write after the kept connection was reset (RST) while unused goes out on a new one,
    whether the event loop saw the reset (asyncio records it as an error, not an end of file) or
    was busy when it came (only the socket knows)."""
    url = urlparse(redis_url)
    relay = _Relay(url.hostname or "127.0.0.1", url.port or 6379)
    store = RedisSessionStore.from_url(f"redis://127.0.0.1:{relay.port}{url.path}", prefix=prefix)
    try:
        await store.create(SessionHeader(id="r"))
        assert kept(store.client.connection_pool) is not None
        relay.reset_all()
        if loop_sees_it:
            await anyio.sleep(0.3)
        else:
            time.sleep(0.3)  # noqa: ASYNC251 - the loop busy, as between two calls of an app's own work
        await store.put("r", 0, [NewEntry("user/message", {"content": "after the reset"})])
        assert [e.data["content"] for e in await store.read("r")] == ["after the reset"]
    finally:
        await store.aclose()
        relay.close()


@pytest.mark.parametrize("how", ["client-kill", "idle-timeout"])
async def test_a_kept_connection_closed_while_the_loop_was_busy_is_not_used(
    redis_url: str, prefix: str, how: str
) -> None:
    """The server closes the kept connection (CLIENT KILL from another process, its idle
    timeout) while the event loop is busy with the app's own work: the loop has not seen the
    close when the next write goes out, but the socket has, and the write goes on a new one."""
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    admin = redis.Redis.from_url(redis_url)
    old_timeout = admin.config_get("timeout")["timeout"]
    try:
        await store.create(SessionHeader(id="c"))
        killed = await _client_id(store)
        if how == "client-kill":
            admin.client_kill_filter(_id=killed)
            time.sleep(0.3)  # noqa: ASYNC251 - the loop busy while the close arrives
        else:
            admin.config_set("timeout", 1)
            time.sleep(2.5)  # noqa: ASYNC251 - the server's clock: it closes idle clients once a second
        await store.put("c", 0, [NewEntry("user/message", {"content": "after the close"})])
        assert await _client_id(store) != killed
        assert [e.data["content"] for e in await store.read("c")] == ["after the close"]
    finally:
        admin.config_set("timeout", old_timeout)
        admin.close()
        await store.aclose()


async def test_redis_py_commands_on_the_client_never_get_a_closed_kept_connection(redis_url: str, prefix: str) -> None:
    """The kept connection handed to redis-py's own commands (a plain command, a pipeline, a
    SUBSCRIBE) after the server closed it is connected again first: redis-py's pool would hand
    it out as it is, and the command would fail (a subscription's messages meanwhile lost)."""
    client = aioredis.Redis.from_url(redis_url, max_connections=2)  # one kept while the other is free
    store = RedisSessionStore(client, prefix=prefix)
    admin = redis.Redis.from_url(redis_url)
    pool: Any = client.connection_pool
    key = f"{prefix}plain"
    try:
        await store.create(SessionHeader(id="k"))

        async def kill_kept() -> None:
            conn = kept(pool)
            assert conn is not None
            admin.client_kill_filter(_id=await _client_id(store))
            assert kept(pool) is conn  # the id was read on it, and it was kept again
            time.sleep(0.2)  # noqa: ASYNC251 - the close arrives while the loop is busy

        await kill_kept()
        await client.set(key, "1")
        assert admin.get(key) == b"1"
        await store.head("k")  # kept again
        await kill_kept()
        async with client.pipeline(transaction=True) as pipe:
            assert await pipe.incr(key).incr(key).execute() == [2, 3]
        await store.head("k")
        await kill_kept()
        pubsub = client.pubsub()
        await pubsub.subscribe(f"{prefix}ch")  # handed the kept connection, killed meanwhile
        try:
            assert (await pubsub.get_message(timeout=5))["type"] == "subscribe"  # type: ignore[index]
            admin.publish(f"{prefix}ch", "hello")
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            assert msg is not None and msg["data"] == b"hello"
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
    finally:
        admin.delete(key)
        admin.close()
        await store.aclose()
        await client.aclose()


async def test_a_closed_store_keeps_no_connection_from_a_call_still_in_flight(redis_url: str, prefix: str) -> None:
    """`store.aclose()` while one of its calls is in flight: the call ends, and its connection
    goes back to the pool instead of being kept by a store that is closed."""
    client = aioredis.Redis.from_url(redis_url)
    store = RedisSessionStore(client, prefix=prefix)
    pool: Any = client.connection_pool
    try:
        await store.create(SessionHeader(id="f"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(store._raw, "BLPOP", f"{prefix}never", "0.3")  # in flight for 0.3 s
            await wait_for(lambda: len(held(pool)) == 1)
            await store.aclose()
        assert kept(pool) is None and not pool._in_use_connections
    finally:
        await client.aclose()
