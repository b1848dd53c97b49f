"""langchain-core's own tests (copied, see tests/frameworks/README.md), run on redis-session and,
as the control, on langchain-core's `InMemoryChatMessageHistory`, with langchain-core's
blockbuster fixture: a blocking call (file system, lock, socket) under langchain-core's async
paths fails the test, as it does in langchain-core's own CI."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("langchain_core", reason="needs the langchain extra")
blockbuster_mod = pytest.importorskip("blockbuster", reason="needs the langchain-test extra")


@pytest.fixture(autouse=True)
def blockbuster() -> Iterator[Any]:
    # langchain-core 1.8.3's tests/unit_tests/conftest.py, as it is
    with blockbuster_mod.blockbuster_ctx("langchain_core") as bb:
        for func in ["os.stat", "os.path.abspath"]:
            (
                bb.functions[func]
                .can_block_in("langchain_core/_api/internal.py", "is_caller_internal")
                .can_block_in("langchain_core/runnables/base.py", "__repr__")
            )
        for func in ["os.stat", "io.TextIOWrapper.read"]:
            bb.functions[func].can_block_in("langsmith/client.py", "_default_retry_config")
        for bb_function in bb.functions.values():
            bb_function.can_block_in("freezegun/api.py", "_get_cached_module_attributes")
        yield bb


@pytest.fixture(autouse=True)
def _redis_session_store(redis_url: str, prefix: str) -> Iterator[None]:
    """The server every `InMemoryChatMessageHistory` of the copied tests lives on."""
    import redis

    from redis_session import RedisSessionStore

    from ._ours import CURRENT

    CURRENT["store"] = RedisSessionStore.from_url(redis_url, prefix=prefix)
    try:
        yield
    finally:
        CURRENT.clear()
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """langchain-core runs its coroutine tests with pytest-asyncio's auto mode; here, anyio
    (marked before they are parametrized)."""
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        pytest.mark.anyio(obj)
        pytest.mark.usefixtures("anyio_backend")(obj)  # as anyio's own hook does for a marked test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "frameworks/langchain/" in str(item.path):
            item.add_marker(pytest.mark.redis)  # every history lives on the test server
