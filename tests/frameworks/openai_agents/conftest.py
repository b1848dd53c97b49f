"""The OpenAI Agents SDK's own session tests (copied, see tests/frameworks/README.md), run on
redis-session's `RedisEventSession` and, as the control (`test_redis_session.py[control]`, derived
from the same file by ../_control.py), on the SDK's own `RedisSession`, both on the test server.
The tests that do not apply to ours (they test the SDK's Redis commands, not the Session protocol)
are listed in `NOT_FOR_OURS`, each with why."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from .._control import is_control

pytest.importorskip("agents", reason="needs the openai-agents extra")

#: tests of the SDK's RedisSession internals: its keys, its WATCH/MULTI pipeline, its connection
#: handling and its RedisCluster refusal. Ours has none of those (an expected-n Lua append on a
#: stream); the Session-protocol behaviour they guard is covered by the rest of the file.
NOT_FOR_OURS: dict[str, str] = {
    "test_redis_session_rejects_cluster_transactions_before_pipeline": (
        "the SDK refuses writes on a RedisCluster client before connecting; ours writes on a cluster"
    ),
    "test_mutation_cancellation_waits_for_authoritative_outcome": (
        "patches the SDK's RPOP and MULTI pipeline (`_redis`); ours: tests/test_adapters_frameworks.py"
        "::test_a_cancelled_write_completes_before_the_cancellation"
    ),
    "test_add_items_preserves_created_at_metadata": (
        "reads the SDK's metadata hash (`_session_key`) and pushes raw JSON into its list (`_messages_key`)"
    ),
    "test_internal_client_ownership": (
        "the SDK's `_owns_client` flag; ours: tests/test_adapters_frameworks.py"
        "::test_close_of_a_from_url_session_makes_later_calls_raise"
    ),
    "test_get_next_id_method": "the SDK's message counter key (`_get_next_id`); ours numbers entries by n",
    "test_atomic_replacement_preserves_clear_add_metadata": "the SDK's metadata hash and counter key",
    "test_atomic_replacement_rejects_colliding_counter_key": (
        "the SDK's legacy key names can overlap across ids; ours are one hash tag per id"
    ),
    "test_compaction_replaces_redis_history_atomically": (
        "observes the SDK's MULTI pipeline; ours: tests/test_adapters_frameworks.py"
        "::test_atomic_replacement_is_one_batch_seen_whole_by_a_concurrent_reader"
    ),
    "test_cancelled_redis_compaction_handoff_remains_resumable": "patches the SDK's MULTI pipeline (`_redis`)",
    "test_compaction_cancel_after_redis_commit_invalidates_cached_history": (
        "patches the SDK's MULTI pipeline (`_redis`)"
    ),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "asyncio: the SDK's tests' marker (run here with anyio)")
    config.addinivalue_line("markers", "serial: the SDK's tests' marker (no xdist here)")


def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """The SDK runs its coroutine tests with pytest-asyncio; here, anyio (marked before they are
    parametrized)."""
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        pytest.mark.anyio(obj)
        pytest.mark.usefixtures("anyio_backend")(obj)  # as anyio's own hook does for a marked test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "frameworks/openai_agents/" in str(item.path):
            item.add_marker(pytest.mark.redis)  # both sides talk to the test server
        name = getattr(item, "originalname", item.name)
        if item.path.name == "test_redis_session.py" and name in NOT_FOR_OURS and not is_control(item):
            item.add_marker(pytest.mark.skip(reason=f"does not apply to redis-session: {NOT_FOR_OURS[name]}"))


def _clean_test_keys() -> None:
    """Remove what the copied tests write under their key prefixes (``test:``, and the SDK's
    default ``agents:session``): on a shared server (CI's second run) an earlier run's keys would
    otherwise meet the next run's (upstream's tests expect a clean database)."""
    import redis

    from ._ours import server_url

    r = redis.Redis.from_url(server_url())
    try:
        for pattern in ("test:*", "agents:session:*"):
            keys = list(r.scan_iter(match=pattern, count=1000))
            for i in range(0, len(keys), 500):
                r.delete(*keys[i : i + 500])
    finally:
        r.close()


@pytest.fixture(autouse=True, scope="module")
def _clean_around_each_file() -> Iterator[None]:
    _clean_test_keys()
    yield
    _clean_test_keys()
