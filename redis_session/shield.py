"""Writes that finish before a cancellation: `finish_then_cancel`.

A write whose request was sent may land whatever the caller does next; cutting its await short
leaves its outcome unknown to the writer (an answer begun and never closed, a handle behind a
message that landed). `finish_then_cancel` runs the write in a task of its own, waits for it
through any number of cancellations (asyncio's ``task.cancel()`` as well as an anyio cancel scope,
which a shielded scope does not stop on asyncio), and then raises the first cancellation: the
caller still stops, knowing what its write did. The SDK adapters' writes and the streamed answer's
begin and close go through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_then_cancel(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` to its end even if this task is cancelled meanwhile; then raise the
    cancellation (its own error, if it failed, is retrieved and dropped: the caller was
    cancelled). Not cancelled: its result, or its error."""
    task = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError as e:
            cancelled = cancelled or e
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise cancelled
    return task.result()
