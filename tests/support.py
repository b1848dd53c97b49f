"""Small helpers shared by the test modules (imported as ``support``: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from redis_session import NewEntry


def um(text: str) -> NewEntry:
    """A dsh user message."""
    return NewEntry("user/message", {"content": text})


def am(text: str) -> NewEntry:
    """A dsh assistant message."""
    return NewEntry("assistant/message", {"content": text})


@contextlib.asynccontextmanager
async def running_gateway(store: Any, **options: Any) -> AsyncIterator[str]:
    """The gateway on a free port of 127.0.0.1, for the duration of the block; yields its base URL."""
    from redis_session.gateway import serve

    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve(store, "127.0.0.1", 0, task_status=task_status, **options))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()
