"""Script routing on Redis Cluster: the one module that touches redis-py's cluster internals.

The store sends its Lua scripts as pre-packed RESP on a connection of the node that owns the
session's slot (`ClusterRouter.send`), skipping redis-py's command layer. That path must follow the
cluster the way redis-py's own `execute_command` does, sharing redis-py's slot table so reads and
writes always agree on the owner:

- **MOVED** (the script did not run): the slot's new owner is written into redis-py's slot table
  (`NodesManager.move_slot`) and the script is resent there.
- **ASK** (a migration in progress, the keys already moved): ``ASKING`` and the script are packed
  into one write on one connection of the target, so the permission covers exactly that command;
  both replies are read. The slot table is not changed (the source still owns the slot).
- **TRYAGAIN** (a multi-key command on a slot whose keys are split, or missing, mid-migration) and
  **CLUSTERDOWN**: wait with backoff and resend (CLUSTERDOWN reloads the topology first).
  Valkey/Redis answer TRYAGAIN to a multi-key command in a migrating or importing slot whenever one
  of its keys does not exist, so an append (whose KEYS name keys that usually don't exist) waits
  until the migration of its slot is finished (``CLUSTER SETSLOT … NODE``), within the budget.
- **A connection that could not be opened** (a dead master, refused or timed out), or a pooled one
  the server had already closed: nothing was sent, so the topology is reloaded for real
  (`NodesManager.initialize`, the failed node asked last) and the script resent, with backoff,
  until the promoted replica shows up or the budget runs out.
- **A connection lost after the script was written**: the script may have run, so it is never
  resent (the caller retries with its idempotency key); the node's connections are recycled and
  the topology is reloaded before the next send, so the next call goes to the new owner.

Every resend above happens only when the server certainly did not run the script. All of them
share one time budget per call (`budget`, 5 s by default); after it the error surfaces
(`StoreUnavailableError`, or the connection error).

Checked against redis-py 8.1.0 (``redis.asyncio.cluster``): ``RedisCluster.initialize`` /
``_initialize``, ``NodesManager.slots_cache`` / ``nodes_cache`` / ``initialize(last_failed_node_name=)``
/ ``move_slot`` / ``move_node_to_end_of_cached_nodes`` / ``_epoch``, ``ClusterNode.acquire_connection``
/ ``release`` / ``disconnect_if_needed``, ``Connection.connect`` / ``send_packed_command`` /
``mark_for_reconnect`` / ``_reader``. Members missing in other releases are looked up with
``getattr`` and fall back to a full topology reload (e.g. no ``move_slot``), which is slower but
still correct.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MaxConnectionsError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import StoreUnavailableError

T = TypeVar("T")
ReadReplies = Callable[[Any, int, bool], Awaitable[tuple[list[Any], ResponseError | None]]]

_ASKING = b"*1\r\n$6\r\nASKING\r\n"
_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)


class _NotSent(Exception):
    """A connection could not be opened: nothing of the call reached the server."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _SendState:
    """One `ClusterRouter.send` call's retry state: its budget and what it has used of it."""

    deadline: float
    hops: int = 0  # redirects followed without a pause
    sleeps: int = 0
    last: BaseException | None = None


class ClusterRouter:
    """Sends packed commands to the owner of a key's slot and follows the cluster (see module)."""

    def __init__(
        self,
        client: RedisCluster,
        read_replies: ReadReplies,
        *,
        budget: float = 5.0,
        max_backoff: float = 0.25,
    ) -> None:
        self.client = client
        self.budget = budget
        self.max_backoff = max_backoff
        self._read_replies = read_replies
        self._init_lock = anyio.Lock()
        # After a connection was lost mid-call: (the node's name, the topology epoch seen then);
        # the next send reloads the topology first (unless another reload happened since).
        self._stale: tuple[str, int | None] | None = None

    # ------------------------------------------------------------------ topology

    async def ready(self) -> None:
        """Load the topology once (and again whenever redis-py's own commands asked for it),
        under a lock: redis-py fails when many first commands race to initialise a fresh client."""
        if not getattr(self.client, "_initialize", True):
            return
        async with self._init_lock:
            if getattr(self.client, "_initialize", True):
                await self.client.initialize()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run a command through redis-py's own routing (reads, index upkeep: safe to repeat).

        When one of redis-py's cluster pipelines hits a connection error it closes every
        connection of the client (``RedisCluster.aclose``), also those other tasks are using at
        that moment; such a call then fails with AttributeError mid-handshake or mid-read, with no
        reply. It is retried once, then raised as a connection error."""
        for attempt in (0, 1):
            await self.ready()
            try:
                return await fn()
            except AttributeError as e:
                if attempt:
                    raise RedisConnectionError("connection closed during the call by a client-wide close") from e
        raise AssertionError("unreachable")

    def _epoch(self) -> int | None:
        epoch = getattr(self.client.nodes_manager, "_epoch", None)
        return epoch if isinstance(epoch, int) else None

    async def reload(self, failed: str | None = None, seen_epoch: int | None = None) -> None:
        """Reload the slot table from the cluster for real (``RedisCluster.initialize`` is a no-op
        once initialised). `failed` is asked last; with `seen_epoch`, skipped when another task
        reloaded since that epoch was seen. Concurrent reloads are coalesced by redis-py."""
        if seen_epoch is not None and self._epoch() not in (None, seen_epoch):
            return
        nm = self.client.nodes_manager
        mover = getattr(nm, "move_node_to_end_of_cached_nodes", None)
        if failed is not None and mover is not None:
            mover(failed)
        try:
            await nm.initialize(last_failed_node_name=failed)
        except TypeError:  # pragma: no cover - a release without last_failed_node_name
            await nm.initialize()

    async def _reload_quietly(self, failed: str | None, seen_epoch: int | None) -> BaseException | None:
        try:
            await self.reload(failed, seen_epoch)
        except (RedisError, OSError) as e:  # no node answered: keep the old table, back off
            return e
        return None

    def _owner(self, slot: int) -> Any:
        nodes = self.client.nodes_manager.slots_cache.get(slot)
        return nodes[0] if nodes else None

    async def _moved(self, e: MovedError) -> None:
        nm = self.client.nodes_manager
        move_slot = getattr(nm, "move_slot", None)
        if move_slot is not None and e.slot_id in nm.slots_cache:
            await move_slot(e)
        else:  # a release without move_slot, or a slot the table does not cover yet
            await self.reload()

    @staticmethod
    def _recycle(node: Any) -> None:
        """Every connection of `node` reconnects before its next use (a dead master's pooled
        connections, or ones a CLIENT KILL closed, would each lose one call otherwise)."""
        for conn in list(getattr(node, "_connections", ())):
            mark = getattr(conn, "mark_for_reconnect", None)
            if mark is not None:
                mark()

    # ------------------------------------------------------------------ send

    async def send(self, route_key: str | bytes, packed: bytes, count: int, soft_tail: bool = False) -> list[Any]:
        """Send `packed` (`count` commands) to the owner of `route_key`'s slot; the raw replies.

        Resends only what the server certainly did not run (see the module docstring); a
        connection lost after the write raises (the topology is reloaded before the next call)."""
        await self.ready()
        if self._stale is not None:
            failed, epoch = self._stale
            self._stale = None
            await self._reload_quietly(failed, epoch)
        slot = key_slot(route_key.encode() if isinstance(route_key, str) else route_key)
        state = _SendState(deadline=time.monotonic() + self.budget)
        asking: Any = None  # the ASK target for the next attempt only
        while True:
            if asking is not None:
                node, payload, n = asking, _ASKING + packed, count + 1
                asking = None
            else:
                node, payload, n = self._owner(slot), packed, count
            if node is None:  # no owner known for the slot (mid-failover): reload and wait
                state.last = await self._reload_quietly(None, None) or state.last
                await self._pause(state)
                continue
            try:
                replies, error = await self._write(node, payload, n, count, soft_tail)
            except _NotSent as ns:
                state.last = ns.error
                await self._pause(state)
                state.last = await self._reload_quietly(node.name, None) or state.last
                continue
            if not isinstance(error, _REDIRECTS):
                if error is not None:
                    raise error
                return replies
            state.last = error
            asking = await self._follow(error, state)

    async def _write(self, node: Any, payload: bytes, n: int, count: int, soft_tail: bool) -> tuple[list[Any], Any]:
        """One `_attempt` on `node`: the replies of the caller's `count` commands and the error to
        act on (ASKING's own reply is dropped; its error, if any, wins). A connection that could
        not be opened recycles the node's connections and raises `_NotSent`; a reply lost after
        the write marks the topology stale and raises as is (never resent)."""
        try:
            replies, error = await self._attempt(node, payload, n, soft_tail)
        except _NotSent:
            self._recycle(node)
            raise
        except MaxConnectionsError:
            raise  # the client's own pool limit: nothing was sent, the node is fine
        except Exception:
            # The reply may be lost after the script ran: never resent here (the caller
            # retries with its idempotency key). Reload before the next send. (A
            # cancelled call only drops its own connection, in `_attempt`.)
            self._recycle(node)
            self._stale = (node.name, self._epoch())
            raise
        if n != count:  # drop ASKING's own reply
            first = replies[0]
            replies = replies[1:]
            if isinstance(first, ResponseError):
                error = first
        return replies, error

    async def _follow(self, error: ResponseError, state: _SendState) -> Any:
        """Follow a MOVED, ASK, TRYAGAIN or CLUSTERDOWN reply (the script did not run) before the
        resend; the ASK target for the next attempt, or None."""
        asking: Any = None
        pause = True
        if isinstance(error, MovedError):
            await self._moved(error)
            pause = state.hops >= 2
            state.hops += 1
        elif isinstance(error, AskError):
            asking = self.client.nodes_manager.get_node(host=error.host, port=error.port)
            if asking is None:  # a node the table does not know yet
                await self._reload_quietly(None, None)
            pause = state.hops >= 2
            state.hops += 1
        elif isinstance(error, ClusterDownError):
            await self._pause(state)
            state.last = await self._reload_quietly(None, None) or state.last
            return None
        if pause:
            await self._pause(state)
        elif time.monotonic() >= state.deadline:
            self._give_up(state.last)
        return asking

    async def _pause(self, state: _SendState) -> None:
        await self._backoff(state.sleeps, state.deadline, state.last)
        state.sleeps += 1

    async def _backoff(self, sleeps: int, deadline: float, last: BaseException | None) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            self._give_up(last)
        await anyio.sleep(min(0.05 * 2**sleeps, self.max_backoff, left))

    @staticmethod
    def _give_up(last: BaseException | None) -> None:
        if isinstance(last, RedisConnectionError | RedisTimeoutError | OSError | RedisClusterException):
            raise last
        raise StoreUnavailableError(f"the cluster kept redirecting this session's slot ({last})")

    async def _attempt(self, node: Any, payload: bytes, n: int, soft_tail: bool) -> tuple[list[Any], Any]:
        """One write of `payload` on a connection of `node` and its `n` replies. Raises `_NotSent`
        when the connection could not be opened (nothing was sent)."""
        conn = node.acquire_connection()
        try:
            disconnect_if_needed = getattr(node, "disconnect_if_needed", None)
            if disconnect_if_needed is not None:
                await disconnect_if_needed(conn)
            if conn.is_connected and _peer_closed(conn):
                await conn.disconnect()  # the server closed it while it sat in the pool
            if not conn.is_connected:
                try:
                    await conn.connect()
                except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                    raise _NotSent(e) from e
                except AttributeError as e:
                    # a client-wide close (redis-py's aclose, e.g. after a pipeline's connection
                    # error) dropped the socket during the handshake: our command was not sent
                    raise _NotSent(RedisConnectionError(f"connection to {node.name} closed")) from e
            try:
                # no health-check PING first: the write itself fails on a dead socket
                await conn.send_packed_command(payload, check_health=False)
                return await self._read_replies(conn, n, soft_tail)
            except BaseException as e:
                mark = getattr(conn, "mark_for_reconnect", None)
                if mark is not None:
                    mark()  # out of step: never reused as is, even if the disconnect below is cut
                with anyio.CancelScope(shield=True):
                    try:
                        await conn.disconnect()
                    except Exception:
                        pass
                if isinstance(e, AttributeError):
                    # a client-wide close (redis-py's aclose) dropped this connection under us
                    raise RedisConnectionError(f"connection to {node.name} closed during the call") from e
                raise
        finally:
            node.release(conn)


def _peer_closed(conn: Any) -> bool:
    """Whether the server already closed this idle connection (its EOF is in the reader)."""
    reader = getattr(conn, "_reader", None)
    at_eof = getattr(reader, "at_eof", None)
    try:
        return bool(at_eof()) if at_eof is not None else False
    except Exception:  # pragma: no cover - an exotic transport
        return False
