"""What the adapters with a sync and an async face share: a store per event loop, and one
private loop thread for the sync calls.

A ``redis.asyncio`` client is bound to the event loop that first used it: the same client on a
second loop fails ("Future attached to a different loop"), and after ``asyncio.run`` returns it
is dead ("Event loop is closed"). Frameworks call one history or checkpointer from several loops
(a sync call, then ``asyncio.run`` twice, as LangChain's own interface tests do), so:

- `LoopStores.get()` gives the store to use on the running loop: the caller's store on the first
  loop that uses it, and on every other loop a clone of it (same server, prefix, vocabulary and
  limits; a connection pool of its own), dropped with its loop. A store that is not bound to a
  loop (`MemorySessionStore`) is shared as it is.
- `run_sync(fn)` runs a coroutine function for a sync method: outside a running loop, on one
  private event loop (a daemon thread), waiting for it; called from inside a running loop (a sync
  method in async code), on a private loop of that thread, in place, so the loop's thread never
  waits on a lock for another thread (it blocks for the I/O, as any sync call does).

No call on an async path blocks on a lock or on the file system (a `RedisSessionStore` hands its
pools redis-py's driver info resolved once, at import: `redis_session.redis.wire.settle_client`).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ..store import SessionStore

T = TypeVar("T")

__all__ = ["LoopStores", "clone_store", "run_sync"]


def clone_store(store: Any) -> Any:
    """A store like `store` with a connection pool of its own (for another event loop); `store`
    itself when it is not bound to a loop."""
    from ..redis import RedisSessionStore

    if not isinstance(store, RedisSessionStore):
        return store
    from ..redis.wire import clone_client

    client = clone_client(store._user_client)
    return RedisSessionStore(
        client,
        prefix=store.prefix,
        vocabulary=store.vocabulary,
        max_entry_bytes=store.max_entry_bytes,
        max_batch=store.max_batch,
        feed=store.feed,
        feed_shards=store.keys.feed_shards,
        index_shards=store.keys.index_shards,
        feed_maxlen=store.feed_maxlen,
        block_ms=store.block_ms,
        durability=store.durability,
        wait_timeout_ms=store.wait_timeout_ms,
        owns_client=True,
    )


_homes: weakref.WeakKeyDictionary[Any, dict[str, weakref.ref[asyncio.AbstractEventLoop]]] = weakref.WeakKeyDictionary()
_homes_lock = threading.Lock()


def _home_of(store: Any) -> dict[str, weakref.ref[asyncio.AbstractEventLoop]]:
    """The home record of `store` (see `LoopStores`), shared by every `LoopStores` of it."""
    try:
        with _homes_lock:
            return _homes.setdefault(store, {})
    except TypeError:  # not weakly referenceable (or unhashable): a record of its own
        return {}


class LoopStores:
    """The store to use on each event loop (see the module docstring)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        # {"home": weakref to the store's loop}: set once, by dict.setdefault (atomic), so the
        # loops' threads agree on it without a lock; one per store, shared by every LoopStores
        # of it (two adapters on one store must agree on the loop its pool belongs to)
        self._home = _home_of(store)
        self._clones: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SessionStore] = weakref.WeakKeyDictionary()

    def get(self) -> SessionStore:
        loop = asyncio.get_running_loop()
        # The first caller's loop is the store's home for good (once that loop is gone, so is
        # the store's pool: later loops get clones). The private sync loops never are: the
        # caller may use their store on their own loop too.
        home = self._home.get("home")
        if home is None and not _is_private(loop):
            home = self._home.setdefault("home", weakref.ref(loop))
        if home is not None and home() is loop:
            return self.store
        # only the thread running `loop` gets or adds its clone: no other thread races for it
        clone = self._clones.get(loop)
        if clone is None:
            clone = clone_store(self.store)
            self._clones[loop] = clone
        return clone

    async def aclose(self) -> None:
        """Close the stores of the running loop (the given one, if this is its loop, and the
        clone made for it). A store bound to another loop cannot be closed from here: those of
        loops that are gone went with them."""
        loop = asyncio.get_running_loop()
        home = self._home.get("home")
        if home is None or home() is loop:  # never used on a loop, or on this one
            await self.store.aclose()
        clone = self._clones.pop(loop, None)
        if clone is not None:
            await clone.aclose()

    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the given store belongs to (its first caller's), None before any use or once
        that loop is gone."""
        home = self._home.get("home")
        return None if home is None else home()

    def loops(self) -> int:
        """How many loops hold a clone (for tests)."""
        return len(self._clones)


_portal: BlockingPortal | None = None
_portal_loop: asyncio.AbstractEventLoop | None = None
_portal_lock = threading.Lock()


def _shared_portal() -> BlockingPortal:
    """One background event loop (a daemon thread) for every adapter's sync calls."""
    global _portal
    with _portal_lock:
        if _portal is None:
            ready = threading.Event()
            box: list[BlockingPortal] = []

            async def serve() -> None:
                global _portal_loop
                _portal_loop = asyncio.get_running_loop()
                async with BlockingPortal() as portal:
                    box.append(portal)
                    ready.set()
                    await portal.sleep_until_stopped()

            threading.Thread(target=anyio.run, args=(serve,), name="redis-session-adapters", daemon=True).start()
            ready.wait()
            _portal = box[0]
        return _portal


_in_place = threading.local()  # .loop: the private loop of a thread that also runs a loop
_private_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _is_private(loop: asyncio.AbstractEventLoop) -> bool:
    return loop is _portal_loop or loop in _private_loops


def _run_in_place(outer: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[T]]) -> T:
    """Run `fn()` to its end on this thread's private loop while `outer` (this thread's running
    loop) is suspended, as any sync call suspends it: no other thread, so no lock to wait on."""
    loop = getattr(_in_place, "loop", None)
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        _private_loops.add(loop)
        _in_place.loop = loop

    async def call() -> T:
        return await fn()

    asyncio.events._set_running_loop(None)
    try:
        return loop.run_until_complete(call())
    finally:
        asyncio.events._set_running_loop(outer)


def run_sync(fn: Callable[[], Awaitable[T]]) -> T:
    """Run `fn()` for a sync method and return its result (or raise its error): on the private
    loop thread, or in place when this thread runs a loop (see the module docstring)."""
    try:
        outer = asyncio.get_running_loop()
    except RuntimeError:
        outer = None
    if outer is not None:
        if outer is getattr(_in_place, "loop", None):
            raise RuntimeError("a sync adapter call inside another one's I/O: use the async methods")
        return _run_in_place(outer, fn)

    async def call() -> T:
        return await fn()

    return _shared_portal().call(call)
