"""The wire: every reach into redis-py's internals on the standalone path, in one module.

`redis_session/redis/cluster.py` holds the cluster ones; nothing else in the package touches
redis-py below its public command API (tests/test_architecture.py checks it by name). What is
used here, checked against redis-py 8.1 (the version ``pyproject.toml`` pins):

- a pool's ``get_connection`` (its signature is sniffed: before 5.3 it wants a command name),
  ``release`` and ``disconnect(inuse_connections=)``, and ``connection_kwargs``;
- a connection's ``send_packed_command`` and ``read_response(disable_decoding=True)``: commands
  are packed to RESP here and replies come back from hiredis undecoded; a connected connection's
  ``_writer``, ``health_check_interval``, ``next_health_check``, ``socket_timeout`` and
  ``disconnect(nowait=)`` (`write_packed`: a write without a task of its own);
- a client's ``response_callbacks``, emptied for the commands whose raw replies we parse
  ourselves (msgspec decodes them), on a client wrapped around the caller's pool so that the
  caller's own client is untouched (a cluster client shares its callbacks with its nodes and is
  adjusted in place);
- ``NEVER_DECODE``, redis-py's per-command option to read a reply undecoded;
- ``RedisCluster.nodes_manager.connection_kwargs`` (the socket timeout) and the attributes a
  clone of a client for another event loop needs;
- ``redis.driver_info.DriverInfo``, resolved once and set in the pools' ``connection_kwargs``
  (`settle_client`): redis-py 8 otherwise reads package metadata for every new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import select
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any, TypeVar, cast

import anyio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# redis-py's per-command option to read a reply undecoded, whatever the client's decode_responses.
RAW: dict[str, Any] = {"NEVER_DECODE": True}

# Commands whose replies the store parses itself (`raw_client`).
STORE_COMMANDS = ("XRANGE", "XREVRANGE", "XREAD", "HGETALL", "HMGET", "ZRANGE", "EVALSHA", "EVAL", "GET")
# Commands whose replies the projector parses itself, in both RESP versions (`feed_client`).
FEED_COMMANDS = ("XREADGROUP", "XAUTOCLAIM", "XINFO GROUPS", "XINFO CONSUMERS", "XRANGE", "HGETALL")


# --------------------------------------------------------------------------- RESP, packed here

EVALSHA = b"$7\r\nEVALSHA\r\n"
EVAL = b"$4\r\nEVAL\r\n"


def as_bytes(a: bytes | str | int) -> bytes:
    """One argument as RESP sends it."""
    if isinstance(a, bytes):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, int):
        return b"%d" % a
    return bytes(a)


def bulks(args: Iterable[bytes | str | int]) -> bytes:
    """RESP bulk strings without the array header: ``$<len> CRLF <bytes> CRLF`` each."""
    return b"".join([b"$%d\r\n%b\r\n" % (len(a), a) for a in map(as_bytes, args)])


def pack(args: Sequence[bytes | str | int]) -> bytes:
    """One command as a RESP array."""
    return b"*%d\r\n%b" % (len(args), bulks(args))


# --------------------------------------------------------------------------- clients


def _strip(client: aioredis.Redis | RedisCluster, commands: Iterable[str]) -> None:
    for cmd in commands:
        client.response_callbacks.pop(cmd, None)


def raw_client(client: aioredis.Redis | RedisCluster) -> aioredis.Redis | RedisCluster:
    """A client whose replies to the store's commands skip redis-py's parsing: hiredis hands over
    nested lists of bytes and msgspec does the rest (twice as fast as redis-py's stream parsing).

    A standalone client is wrapped around the caller's connection pool, so the caller's own
    client is untouched. A cluster client shares its callbacks with its nodes, so it is adjusted
    in place (these commands then return raw replies on it too)."""
    raw: aioredis.Redis | RedisCluster
    raw = client if isinstance(client, RedisCluster) else aioredis.Redis(connection_pool=client.connection_pool)
    _strip(raw, STORE_COMMANDS)
    return raw


def feed_client(client: aioredis.Redis | RedisCluster) -> Any:
    """A client for the projector's feed commands whose replies skip redis-py's parsing (the
    projector parses both RESP versions). Standalone: a wrapper around `client`'s pool; a cluster
    client is used as it is (its parsed replies are understood too)."""
    if not isinstance(client, aioredis.Redis):
        return client
    raw = aioredis.Redis(connection_pool=client.connection_pool)
    _strip(raw, FEED_COMMANDS)
    return raw


def plain_replies(client: Any) -> Any:
    """`client` (a client of its own, sync or async) with every reply as the server sent it, not
    redis-py's Python shapes (what ``redis-cli`` prints, INFO as text)."""
    client.response_callbacks.clear()
    return client


def pool_size(client: Any) -> int | None:
    """How many connections the client's pool may open (None: unbounded, or not a pooled client)."""
    size = getattr(getattr(client, "connection_pool", None), "max_connections", None)
    return size if isinstance(size, int) and 0 < size < 1 << 30 else None


def socket_timeout(client: aioredis.Redis | RedisCluster) -> float | None:
    """The client's socket timeout in seconds (None: no timeout)."""
    try:
        if isinstance(client, RedisCluster):
            kwargs = client.nodes_manager.connection_kwargs
        else:
            kwargs = client.connection_pool.connection_kwargs
        value = kwargs.get("socket_timeout")
        return None if value is None else float(value)
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - an exotic client
        return None


def clone_client(client: aioredis.Redis | RedisCluster) -> aioredis.Redis | RedisCluster:
    """A client for the same server(s) with the same options and a connection pool of its own
    (a ``redis.asyncio`` client is bound to the event loop that first used it)."""
    from redis.asyncio import ConnectionPool
    from redis.asyncio.cluster import ClusterNode

    if isinstance(client, RedisCluster):
        nodes = [ClusterNode(n.host, n.port) for n in client.get_nodes()] or list(client.startup_nodes)
        cluster = RedisCluster(startup_nodes=nodes, **client.connection_kwargs)
        settle_client(cluster)
        return cluster
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    # from_pool: the clone owns its pool, so closing the clone disconnects it (a client given a
    # pool with connection_pool= leaves it open)
    clone = aioredis.Redis.from_pool(
        ConnectionPool(connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs)
    )
    settle_client(clone)
    return clone


def _resolve_driver_info() -> Any:
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py < 8: nothing is looked up per connection
        return None
    return DriverInfo()


#: redis-py's client name and version (CLIENT SETINFO), resolved once, at import
_DRIVER_INFO = _resolve_driver_info()
_PER_CONNECTION = ("driver_info", "lib_name", "lib_version")


def settle_client(client: Any) -> None:
    """Give `client`'s connection pools redis-py's driver info resolved once, at import. Without it
    redis-py 8 reads its own version from the package metadata (``importlib.metadata``: file system
    calls) for every connection a pool opens, that is on the event loop, in the middle of a
    command. Options the caller set stay as they are."""
    if _DRIVER_INFO is None:
        return
    kwargs_list: list[dict[str, Any]] = []
    pool_kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if isinstance(pool_kwargs, dict):
        kwargs_list.append(pool_kwargs)
    if isinstance(client, RedisCluster):  # the cluster's own options, and its nodes'
        kwargs_list.append(client.connection_kwargs)
        kwargs_list.extend(node.connection_kwargs for node in client.get_nodes())
    for kwargs in kwargs_list:
        if not any(k in kwargs for k in _PER_CONNECTION):
            kwargs["driver_info"] = _DRIVER_INFO


# --------------------------------------------------------------------------- connections


def connection_getter(pool: Any) -> Callable[[], Any]:
    """`pool.get_connection` as a no-argument call (redis-py < 5.3 wants a command name)."""
    try:
        param = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - an exotic pool
        param = None
    if param is not None and param.default is inspect.Parameter.empty:
        return lambda: pool.get_connection("_")
    return cast(Callable[[], Any], pool.get_connection)


async def write_packed(conn: Any, packed: bytes) -> None:
    """`conn.send_packed_command(packed)`, written to the socket at once.

    With a socket timeout, redis-py runs every write through ``asyncio.wait_for``, which before
    Python 3.12 wraps it in a task of its own: the bytes leave one event-loop iteration later
    (on a busy loop, milliseconds: a streamed delta's live record waited for it) and each command
    pays for a task. A connected connection is written here directly; the timeout still bounds a
    write that must wait for the socket (the transport's buffer full). Not connected, or due a
    health check: redis-py's own path. A failed write disconnects, as redis-py's does."""
    writer = getattr(conn, "_writer", None)
    if writer is None or getattr(conn, "_reader", None) is None:
        await conn.send_packed_command(packed)
        return
    interval = conn.health_check_interval
    if interval and asyncio.get_running_loop().time() > conn.next_health_check:
        await conn.send_packed_command(packed)
        return
    try:
        writer.write(packed)
        timeout = conn.socket_timeout
        if timeout and writer.transport.get_write_buffer_size() > 0:
            async with asyncio.timeout(timeout):
                await writer.drain()
        else:
            await writer.drain()  # returns at once unless the buffer is over its high-water mark
    except TimeoutError:
        await conn.disconnect(nowait=True)
        raise RedisTimeoutError("Timeout writing to socket") from None
    except OSError as e:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to socket: {e}") from e
    except BaseException:
        await conn.disconnect(nowait=True)  # a write cut short: the connection is out of step
        raise


async def read_replies(conn: Any, count: int, soft_tail: bool) -> tuple[list[Any], ResponseError | None]:
    """Read `count` raw replies, even past an error reply, so the connection stays in step.

    Returns the replies (error replies in place) and the first error to raise; with `soft_tail`
    an error of the last command (a durability wait) is only returned in place."""
    replies: list[Any] = []
    error: ResponseError | None = None
    for i in range(count):
        try:
            replies.append(await conn.read_response(disable_decoding=True))
        except ResponseError as e:
            replies.append(e)
            if not (soft_tail and i == count - 1):
                error = error or e
    return replies, error


T = TypeVar("T")


async def shielded(coro: Coroutine[Any, Any, T]) -> T:
    """``await coro`` where no cancellation can land: the pool's taking and giving back of a
    connection (a cancellation inside either would leave the connection counted as in use for
    ever, and a pool that leaks its last one answers "Too many connections" to every later call).

    A cancellation can only land where a coroutine suspends, and an uncontended pool never does:
    the coroutine is run up to its first suspension here, and only if it suspends is the rest
    awaited inside an anyio shield. An anyio cancel scope costs more than the pool call itself
    (about 6 µs, and two ``getpid`` system calls through ``asyncio.current_task`` on Python
    3.11): two of them were a tenth of a single append's time on the client."""
    try:
        first = coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    with anyio.CancelScope(shield=True):
        got = await _Rest(coro, first)
    return got


class _Rest(Awaitable[T]):
    """The rest of a coroutine that already ran to its first suspension (`shielded`): awaiting
    it hands what the coroutine yielded to the task, and the task's answers back to it."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro, self._first = coro, first

    def __await__(self) -> Generator[Any, Any, T]:
        coro, out = self._coro, self._first
        while True:
            try:
                sent = yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # a cancellation from outside anyio: the coroutine sees it
                try:
                    out = coro.throw(e)
                except StopIteration as done:
                    return cast(T, done.value)
            else:
                try:
                    out = coro.send(sent)
                except StopIteration as done:
                    return cast(T, done.value)


async def _release(pool: Any, conn: Any) -> None:
    await shielded(pool.release(conn))


def _stale(conn: Any) -> bool:
    """Whether a connection cannot carry the next call as it is, by what the event loop saw: not
    connected, closed by the server (EOF, or a reset), something unread waiting on it, or a
    reconnect asked for. (`_dead` asks the socket too.)"""
    reader = getattr(conn, "_reader", None)
    if reader is None or getattr(conn, "_writer", None) is None:
        return True
    if reader.at_eof() or getattr(reader, "_buffer", None) or reader.exception() is not None:
        return True
    should = getattr(conn, "should_reconnect", None)
    return bool(should is not None and should())


_POLL = getattr(select, "poll", None)


def _dead(conn: Any) -> bool:
    """`_stale`, or the socket beneath says so though the event loop has not seen it yet (a close
    or a reset that came while the loop was busy between two calls, or bytes nobody asked for):
    the socket of a connection at rest is readable only then. One ``poll`` with no wait, about a
    microsecond, where redis-py's own check costs a pass of the event loop. A connection that
    sat unused is asked before a command goes out on it."""
    if _stale(conn):
        return True
    if _POLL is None:  # pragma: no cover - a platform without poll
        return False
    writer = conn._writer
    known = getattr(conn, "_redis_session_fd", None)
    if known is not None and known[0] is writer:
        fd = known[1]
    else:  # once per connection: uvloop makes a new socket object at every ask
        sock = writer.transport.get_extra_info("socket")
        fd = -1 if sock is None else sock.fileno()
        with contextlib.suppress(AttributeError):
            conn._redis_session_fd = (writer, fd)
    if fd < 0:
        return True
    poll = _POLL()
    poll.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poll.poll(0))  # readable, hung up or in error: not as the last call left it


def _sound(conn: Any, pool: Any) -> bool:
    """Whether `conn` can be kept for the next call: not stale, and still counted in use by the
    pool (a pool reset forgets its connections)."""
    return not _stale(conn) and conn in getattr(pool, "_in_use_connections", ())


async def _renewed(pool: Any, conn: Any) -> Any:
    """`conn` connected afresh (the server closed it while it sat unused); given back to the
    pool if that fails."""
    try:
        await conn.disconnect()
        await conn.connect()
    except BaseException:
        await _release(pool, conn)
        raise
    return conn


def _spare(pool: Any) -> bool:
    """Whether the pool has room to spare: at most half its connections in use and no caller
    waiting for one (a blocking pool's waiters), so keeping one back costs no one a wait."""
    in_use = getattr(pool, "_in_use_connections", None)
    limit = getattr(pool, "max_connections", None)
    if in_use is None or not isinstance(limit, int) or len(in_use) > limit // 2:
        return False
    condition = getattr(pool, "_condition", None)
    return not getattr(condition, "_waiters", None)


_KEPT = "_redis_session_kept"
"""The pool attribute holding the one connection `PooledWire` keeps between calls (None: none)."""


def _take_kept(pool: Any) -> Any | None:
    """The kept connection of `pool`, taken (no longer kept): None when there is none, or when the
    pool was reset meanwhile (then it is not the pool's to hand out or take back). Synchronous, so
    two tasks never take the same one."""
    conn = getattr(pool, _KEPT, None)
    if conn is None:
        return None
    setattr(pool, _KEPT, None)
    return conn if conn in getattr(pool, "_in_use_connections", ()) else None


def _share_kept(pool: Any) -> Callable[[], Any]:
    """Make every taker of a connection from `pool` (redis-py's own commands on any client of the
    pool, a held tail, a pipeline, a pub/sub) get the kept one when the pool has no other to give
    at once. The kept connection is counted in use by the pool, so without this a pool filling up
    by other ways would make them wait for (or fail for want of) a connection that sits unused. Whatever they are handed
    is asked first (`_dead`) and connected again when the server closed it meanwhile. Returns
    the pool's own taking, for the kept connection's owner. Installed once per pool; a pool that
    takes no attribute keeps nothing (`PooledWire._give`)."""
    own = getattr(pool, "_redis_session_own_get", None)
    if own is not None:
        return cast(Callable[[], Any], own)
    own = connection_getter(pool)
    own_can = getattr(pool, "can_get_connection", None)

    async def get_connection(*args: Any, **kwargs: Any) -> Any:
        return await _hand_out(pool, own, own_can)

    def can_get_connection() -> bool:
        return getattr(pool, _KEPT, None) is not None or own_can is None or bool(own_can())

    try:
        pool._redis_session_own_can = own_can
        pool._redis_session_own_get = own
        pool.get_connection = get_connection
        if own_can is not None:
            pool.can_get_connection = can_get_connection
    except AttributeError:  # a pool that takes no attribute
        pass
    return own


async def _hand_out(pool: Any, own: Callable[[], Any], own_can: Callable[[], Any] | None) -> Any:
    """A connection for a taker other than the store's next call: the pool's own while it has one
    to give without waiting (the kept one stays for the store's next call: a caller's own
    commands between two puts would cost each put a pool round), the kept one when the pool would
    make the taker wait or fail. Whichever it is, asked first (`_dead`) and connected again if
    the server closed it: redis-py's own round hands out an idle connection the server closed as
    it is while maintenance notifications are on (its default), and a command sent on it fails
    (a SUBSCRIBE's messages meanwhile are lost)."""
    conn = None if own_can is None or own_can() else _take_kept(pool)
    if conn is None:
        conn = await shielded(own())
    return await _renewed(pool, conn) if _dead(conn) else conn


def kept(pool: Any) -> Any | None:
    """The connection of `pool` kept for the next call (None: none): the pool counts it in use,
    though no call holds it."""
    return getattr(pool, _KEPT, None)


def held(pool: Any) -> list[Any]:
    """The connections of `pool` that calls hold now: those in use, less the kept one."""
    spare = kept(pool)
    return [c for c in getattr(pool, "_in_use_connections", ()) if c is not spare]


class PooledWire:
    """Packed commands on a connection of a standalone client's pool, skipping redis-py's
    command layer.

    One connection is kept out of the pool between calls and taken back by the next call
    without the pool's round (its lock, its checks, its metrics: 22 µs a call on a plain pool,
    40 µs on a blocking one, most of a single append's client time): kept per pool, so every
    store on one client shares it; only while the pool has room to spare (at most half its
    connections in use and no one waiting for one), so a busy pool has every connection to
    hand out; and whoever asks the pool for a connection meanwhile (a tail, redis-py's own
    commands on any client of the pool) when it has no other to give at once is handed the kept
    one (`_share_kept`), so it never sits unused while another waits. A connection the server
    closed meanwhile is connected again before use. `aclose` gives it back."""

    __slots__ = ("_can", "_closed", "_connection", "pool")

    def __init__(self, client: aioredis.Redis) -> None:
        self.pool = client.connection_pool
        self._connection = _share_kept(self.pool)
        self._can = getattr(self.pool, "_redis_session_own_can", None)  # the pool's own can_get_connection
        self._closed = False  # `aclose`d: a call still in flight gives its connection back

    async def _get(self) -> Any:
        """A connection: the kept one when it is there and sound, else one from the pool."""
        pool = self.pool
        conn = _take_kept(pool)  # no await in between: no other task can take it too
        if conn is None:
            # shielded: a cancellation (a reader that hung up: anyio cancels again at every await
            # until the task leaves its scope) landing inside the pool's round would leave the
            # connection counted as in use for ever, and a pool that leaks its last one answers
            # "Too many connections" to every later command
            conn = await shielded(self._connection())
        # A connection the server closed while it sat unused (an idle timeout, CLIENT KILL, a
        # restart) is connected again before a command goes out on it: redis-py's pool skips its
        # own check while maintenance notifications are on ("auto" by default), and a script
        # sent on a dead connection is never sent again (its outcome would be unknown).
        return await _renewed(pool, conn) if _dead(conn) else conn

    async def _give(self, conn: Any) -> None:
        """`conn` back after a call that read every reply: kept for the next call, or to the pool."""
        pool = self.pool
        if not self._closed and getattr(pool, _KEPT, None) is None and _spare(pool) and _sound(conn, pool):
            try:
                setattr(pool, _KEPT, conn)
                return
            except AttributeError:  # a pool that takes no attribute: nothing is kept
                pass
        await _release(pool, conn)

    async def aclose(self) -> None:
        """Give the kept connection back to the pool (a store closing; the client may go on); a
        call of this store still in flight gives its own back when it ends, keeping none."""
        self._closed = True
        await self._drop_kept()

    async def _drop_kept(self) -> None:
        conn = getattr(self.pool, _KEPT, None)
        if conn is not None:
            setattr(self.pool, _KEPT, None)
            await _release(self.pool, conn)

    async def send(self, packed: bytes, count: int, *, retry: bool = False, soft_tail: bool = False) -> list[Any]:
        """Write `count` packed commands at once on one pooled connection; their raw replies.

        Every reply is read even when one is an error, so the connection goes back to the pool
        in step; the first error reply is raised after (as redis-py's `ResponseError`). With
        `retry` (commands that are safe to repeat), a connection the server closed while it sat
        idle in the pool costs one retry on a fresh connection instead of an error. With
        `soft_tail` an error reply of the last command is returned in place."""
        pool = self.pool
        for attempt in (0, 1):
            # The command itself stays cancellable (redis-py then drops the connection, which
            # goes back to the pool as closed, never kept).
            conn = await self._get()
            try:
                await write_packed(conn, packed)
                replies, error = await read_replies(conn, count, soft_tail)
            except RedisConnectionError:
                await _release(pool, conn)
                if not retry or attempt:
                    raise
                await pool.disconnect(inuse_connections=False)  # the other idle ones are stale too
                await self._drop_kept()  # and so is the kept one
                continue
            except BaseException:
                await _release(pool, conn)
                raise
            await self._give(conn)
            if error is not None:
                raise error
            return replies
        raise AssertionError("unreachable")

    def hold(self) -> HeldWire:
        """One pooled connection for a loop of calls (a tail's XREAD BLOCK), taken at its first
        call and kept until `HeldWire.release`: no pool round per call."""
        return HeldWire(self)

    def free(self) -> bool:
        """Whether a connection can be had without waiting (an idle one, or room for another)."""
        can = getattr(self.pool, "can_get_connection", None)
        return True if can is None else bool(can())

    async def begin(self, packed: bytes, count: int) -> Callable[[], Awaitable[list[Any]]]:
        """Write `count` packed commands now, on a pooled connection held until their replies are
        read: the call returned reads them (it must be awaited once, it gives the connection
        back). Never retried (for writes whose outcome the caller settles itself)."""
        pool = self.pool
        conn = await self._get()
        try:
            await write_packed(conn, packed)
        except BaseException:
            await _release(pool, conn)
            raise

        async def replies() -> list[Any]:
            try:
                got, error = await read_replies(conn, count, False)
            except BaseException:
                await _release(pool, conn)
                raise
            await self._give(conn)
            if error is not None:
                raise error
            return got

        return replies


class HeldWire:
    """A pooled connection held across calls (`PooledWire.hold`): a tail's XREAD BLOCK loop takes
    it once instead of once per call (the pool's lock, its idle-connection check and the release
    each time). Only for commands that are safe to repeat: a connection the server closed costs
    one retry on a fresh one, as `PooledWire.send` with `retry`. A call that fails otherwise (a
    timeout, a cancellation: redis-py drops the connection then) gives it back; the next call
    takes another. `release` (always, in a finally) gives it back to the pool."""

    __slots__ = ("_conn", "_wire")

    def __init__(self, wire: PooledWire) -> None:
        self._wire = wire
        self._conn: Any = None

    async def send(self, packed: bytes, count: int) -> list[Any]:
        for attempt in (0, 1):
            conn = self._conn
            if conn is None:
                wire = self._wire  # held for long: the kept one only when the pool has no other
                conn = self._conn = await _hand_out(wire.pool, wire._connection, wire._can)
            try:
                await write_packed(conn, packed)
                replies, error = await read_replies(conn, count, False)
            except RedisConnectionError:
                await self.release()
                if attempt:
                    raise
                await self._wire.pool.disconnect(inuse_connections=False)  # the idle ones are stale too
                continue
            except BaseException:
                await self.release()
                raise
            if error is not None:
                raise error  # the replies were all read: the connection is in step, still held
            return replies
        raise AssertionError("unreachable")

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await _release(self._wire.pool, conn)
