"""One identity across surfaces, model-based: seeded random programs of handle, adapter, HTTP
and lossy-store writers, follow and SSE readers, cancellations and lost replies, against delete +
re-create of the id with as many entries as before (`identity_model.Run`). After each program:
every acknowledged write is in its own life exactly once, nothing refused landed, and no reader
saw another life. CI runs a few short programs; ``-m slow`` (and bench/identity_soak.py) many."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from redis_session import RedisSessionStore

from ._proxy import FaultProxy
from .identity_model import Run, http_client

pytestmark = pytest.mark.anyio

pytest.importorskip("agents")
pytest.importorskip("langchain_core")


async def _program(redis_url: str, prefix: str, seed: int, steps: int, kinds: list[str] | None = None) -> Run:
    from support import running_gateway

    port = urlsplit(redis_url).port or 6379
    db = urlsplit(redis_url).path.lstrip("/") or "0"
    store = RedisSessionStore.from_url(redis_url, prefix=prefix)
    with FaultProxy(port, seed=seed) as proxy:
        lossy = RedisSessionStore.from_url(f"redis://127.0.0.1:{proxy.port}/{db}", prefix=prefix)
        try:
            async with running_gateway(store) as base, http_client(base) as http:
                run = Run(store, lossy, proxy, http, seed)
                if kinds is not None:
                    run.writer_kinds = kinds
                await run.go(steps)
        finally:
            await lossy.aclose()
            await store.aclose()
    return run


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_one_identity_across_surfaces(redis_url: str, prefix: str, seed: int) -> None:
    run = await _program(redis_url, prefix, seed, steps=60)
    problems = run.check()
    assert not problems, "\n".join(problems[:20])
    assert run.stats.recreations >= 1 and run.stats.writes["ack"] >= 10, run.stats


@pytest.mark.parametrize("seed", [5, 6])
async def test_one_identity_core_surfaces(redis_url: str, prefix: str, seed: int) -> None:
    """The handle and HTTP writers alone (no adapters), so a regression names its surface."""
    run = await _program(redis_url, prefix, seed, steps=60, kinds=["handle", "http"])
    problems = run.check()
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
async def test_one_identity_across_surfaces_long(redis_url: str, prefix: str, seed: int) -> None:
    run = await _program(redis_url, prefix, seed, steps=400)
    problems = run.check()
    assert not problems, "\n".join(problems[:20])
