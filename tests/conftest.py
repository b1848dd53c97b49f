"""Test fixtures: a real server always.

The server is `$REDIS_URL` when set; else a testcontainers Redis when a Docker engine answers;
else an embedded valkey-server on a free port. Every test gets its own key prefix and removes
only its own keys, so a shared server is never flushed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_session import MemorySessionStore, RedisSessionStore
from redis_session.redis.embedded import start_server, stop_server

from support import SkewClock, cleanup_cluster_prefix, cleanup_prefix

# Never the user's embedded server: every test (and every subprocess a test starts) gets a
# private data dir, and a server started there takes a free port instead of the default 6390.
_HOME = tempfile.mkdtemp(prefix="rs-home-")
os.environ["REDIS_SESSION_HOME"] = _HOME
os.environ.pop("REDIS_SESSION_DIR", None)
os.environ["REDIS_SESSION_PORT"] = "0"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_server(_HOME)
    import shutil

    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that talks to a server `redis`, so CI can rerun just those on another one."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("store") if callspec is not None else None
        if "redis_url" in names and backend != "memory":
            item.add_marker(pytest.mark.redis)
        if "cluster_url" in names or backend == "cluster":
            item.add_marker(pytest.mark.cluster)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _docker_redis() -> tuple[str, Any] | None:
    if os.environ.get("RS_NO_DOCKER"):
        return None
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:
        return None
    from testcontainers.redis import RedisContainer  # type: ignore[import-untyped]

    c = RedisContainer("valkey/valkey:8")
    c.start()
    return f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0", c


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    found = _docker_redis()
    if found is not None:
        yield found[0]
        found[1].stop()
        return
    with tempfile.TemporaryDirectory(prefix="rs-test-") as d:
        server = start_server(d, appendonly=False)
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[Any]:
    """A real 3-master + 3-replica cluster from the embedded valkey-server, for the whole run."""
    from redis_session.testing.localcluster import start_cluster

    cluster = start_cluster(masters=3, replicas_per_master=1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster_url(local_cluster: Any) -> str:
    return str(local_cluster.url)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def redis_store(redis_url: str, prefix: str) -> AsyncIterator[RedisSessionStore]:
    # its connections carry the test's prefix as their name: a test waits on the server's own word
    # (support.wait_blocked_in_xread) instead of a sleep for "the tail is live now"
    store = RedisSessionStore.from_url(redis_url, prefix=prefix, client_options={"client_name": prefix})
    try:
        yield store
    finally:
        await store.aclose()
        await cleanup_prefix(redis_url, prefix)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest, redis_url: str, prefix: str) -> AsyncIterator[Any]:
    """The contract fixture: every store backend, one test body (memory, a server, a cluster)."""
    if request.param == "memory":
        yield MemorySessionStore(clock=SkewClock())
        return
    if request.param == "cluster":
        url = request.getfixturevalue("cluster_url")
        cs = RedisSessionStore.from_url(url, prefix=prefix, cluster=True)
        try:
            yield cs
        finally:
            await cs.aclose()
            await cleanup_cluster_prefix(url, prefix)
        return
    s = RedisSessionStore.from_url(redis_url, prefix=prefix, client_options={"client_name": prefix})
    try:
        yield s
    finally:
        await s.aclose()
        await cleanup_prefix(redis_url, prefix)


@pytest.fixture
async def raw_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield r
    finally:
        await r.aclose()
