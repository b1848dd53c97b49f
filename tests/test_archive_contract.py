"""The store contract over a store with an archived prefix: every case runs with all but the
last entry of each session in the cold tier (a local folder), on the memory store, a server and
the cluster. Archived and hot sessions must be indistinguishable to every reader and writer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from redis_session import MemorySessionStore, RedisSessionStore
from redis_session.cold import ColdTier
from redis_session.testing.contract import ArchivedPrefixStore, SessionStoreContract

from support import SkewClock, cleanup_cluster_prefix, cleanup_prefix


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest, redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[Any]:
    tier = ColdTier(str(tmp_path / "cold"), prefix=prefix)
    if request.param == "memory":
        yield ArchivedPrefixStore(MemorySessionStore(clock=SkewClock(), cold=tier))
        return
    url = redis_url if request.param == "redis" else request.getfixturevalue("cluster_url")
    s = RedisSessionStore.from_url(url, prefix=prefix, cluster=request.param == "cluster", cold=tier)
    try:
        yield ArchivedPrefixStore(s)
    finally:
        await s.aclose()
        await (cleanup_prefix(url, prefix) if request.param == "redis" else cleanup_cluster_prefix(url, prefix))


class TestArchivedPrefixContract(SessionStoreContract):
    """Every contract case, with an archived prefix, once per backend."""
