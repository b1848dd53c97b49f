"""Typed replies (`redis_session.redis.replies`): a connection closed under a write is
`StoreUnavailableError` even where redis-py leaks the transport's AttributeError/TypeError
(redis/redis-py#4287: seen here in a feed worker's read during a cluster failover), while an
AttributeError of anyone else's code stays what it is."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from redis_session import StoreUnavailableError
from redis_session.redis.replies import io_guard, leaked_close_race

pytestmark = pytest.mark.anyio


async def test_a_write_on_a_connection_whose_transport_closed_is_unavailable(redis_url: str) -> None:
    pool = aioredis.ConnectionPool.from_url(redis_url, socket_timeout=5)
    conn = await pool.get_connection()
    ping = b"*1\r\n$4\r\nPING\r\n"

    async def write_while_it_closes() -> None:
        # the write passed its "connected" check; the transport closes before the bytes go out
        # (redis-py's timed write runs in a task of its own, so the close gets in between)
        write = asyncio.ensure_future(conn.send_packed_command(ping, check_health=False))
        await asyncio.sleep(0)
        conn._writer = None  # what a concurrent disconnect leaves while the write is scheduled
        await write

    try:
        await conn.send_command("PING")
        assert await conn.read_response() in (b"PONG", "PONG", True)
        with pytest.raises(AttributeError) as leaked:
            await write_while_it_closes()
        assert leaked_close_race(leaked.value)
        await conn.disconnect()
        await conn.connect()
        with pytest.raises(StoreUnavailableError, match="closed under a write"), io_guard():
            await write_while_it_closes()
    finally:
        await pool.disconnect()


async def test_an_attribute_error_of_other_code_is_not_a_lost_connection() -> None:
    class Thing:
        pass

    with pytest.raises(AttributeError), io_guard():
        Thing().missing  # type: ignore[attr-defined]  # noqa: B018
    try:
        None.upper()  # type: ignore[union-attr]
    except AttributeError as e:
        assert not leaked_close_race(e)
