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
- `run_sync(fn)` runs a coroutine function on one private event loop (a daemon thread) and waits;
  sync methods go through it, so they work inside and outside a running loop.
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


class LoopStores:
    """The store to use on each event loop (see the module docstring)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._home: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self._clones: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SessionStore] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> SessionStore:
        loop = asyncio.get_running_loop()
        with self._lock:
            # The first caller's loop is the store's home for good (once that loop is gone, so is
            # the store's pool: later loops get clones). The private sync loop never is: the
            # caller may use their store on their own loop too.
            if self._home is None and loop is not _portal_loop:
                self._home = weakref.ref(loop)
            if self._home is not None and self._home() is loop:
                return self.store
            clone = self._clones.get(loop)
            if clone is None:
                clone = clone_store(self.store)
                self._clones[loop] = clone
            return clone

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


def run_sync(fn: Callable[[], Awaitable[T]]) -> T:
    """Run `fn()` on the private loop thread and return its result (or raise its error)."""

    async def call() -> T:
        return await fn()

    return _shared_portal().call(call)
