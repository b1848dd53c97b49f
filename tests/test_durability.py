"""Durability modes on a private embedded server: the wait runs after the script, in the same round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from redis_session import NewEntry, RedisSessionStore, SessionHeader
from redis_session.errors import DurabilityError
from redis_session.redis.embedded import start_server

pytestmark = pytest.mark.anyio


async def test_aof_durability_waits_for_the_fsync(tmp_path: Path) -> None:
    server = start_server(tmp_path, appendonly=True, appendfsync="everysec")
    store = RedisSessionStore.from_url(server.url, prefix="d", durability="aof")
    try:
        await store.create(SessionHeader(id="s"), [NewEntry("custom/mark", {"i": 0})])
        out = await store.put("s", 1, [NewEntry("custom/mark", {"i": 1})])
        assert [e.n for e in out] == [1]
        # an idempotent retry waits again and returns the same entries
        a = await store.put("s", None, [NewEntry("custom/mark", {"i": 2})], idempotency_key="k")
        b = await store.put("s", None, [NewEntry("custom/mark", {"i": 2})], idempotency_key="k")
        assert a == b
    finally:
        await store.aclose()
        server.stop()


async def test_a_refused_wait_reports_the_landed_entries(tmp_path: Path) -> None:
    server = start_server(tmp_path, appendonly=False)
    store = RedisSessionStore.from_url(server.url, prefix="d", durability="aof")
    plain = RedisSessionStore.from_url(server.url, prefix="d")
    try:
        with pytest.raises(DurabilityError) as ei:
            await store.create(SessionHeader(id="s"), [NewEntry("custom/mark", {"i": 0})])
        assert "refused" in str(ei.value)
        head = await plain.head("s")
        assert head is not None and head.n == 1  # it landed; only the fsync wait was refused
        with pytest.raises(DurabilityError) as ei2:
            await store.put("s", 1, [NewEntry("custom/mark", {"i": 1})])
        assert [e.n for e in ei2.value.entries] == [1]  # type: ignore[attr-defined]
        assert (await plain.head("s")).n == 2  # type: ignore[union-attr]
    finally:
        await store.aclose()
        await plain.aclose()
        server.stop()


async def test_replica_durability_without_a_replica_times_out(tmp_path: Path) -> None:
    server = start_server(tmp_path, appendonly=False)
    store = RedisSessionStore.from_url(server.url, prefix="d", durability="replica", wait_timeout_ms=50)
    try:
        with pytest.raises(DurabilityError, match="not confirmed within 50 ms"):
            await store.create(SessionHeader(id="s"))
    finally:
        await store.aclose()
        server.stop()


def test_unknown_durability_is_rejected() -> None:
    with pytest.raises(ValueError):
        RedisSessionStore.from_url("redis://127.0.0.1:1/0", durability="fsync")
