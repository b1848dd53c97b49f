"""Long-lived commands (`tail`, the workers, `gateway`, `up`) on the embedded server: its
``server.json`` is watched, and the command follows the server when it moves, or ends when it is gone."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from .common import CliError, announce, err, opened


async def supervised(url: str | None, prefix: str, body: Callable[[Any], Awaitable[None]], **options: Any) -> None:
    """Run a long-lived command's `body(store)`.

    On the embedded server (no ``--url``/``$REDIS_URL``) its ``server.json`` is watched: when the
    server is replaced by one at another address, `body` is restarted on the new one; when none
    replaces it within `GONE_GRACE` seconds, the command ends with a one-line error instead of
    retrying a dead port forever."""
    if url:
        async with opened(url, prefix, **options) as store:
            await body(store)
        return
    from ..redis.connect import resolve_url
    from ..redis.embedded import default_data_dir

    data_dir = default_data_dir()
    current = resolve_url(None, announce=announce)
    while True:
        moved: list[str] = []
        async with opened(current, prefix, **options) as store, anyio.create_task_group() as tg:

            async def watch(moved: list[str] = moved, url: str = current, scope: Any = tg.cancel_scope) -> None:
                moved.append(await _watch_embedded(data_dir, url))
                scope.cancel()

            tg.start_soon(watch)
            await body(store)
            tg.cancel_scope.cancel()
        if not moved:
            return
        current = moved[0]
        err.print(f"the embedded server moved to {current}; reconnected", highlight=False, markup=False)


GONE_GRACE = float(os.environ.get("REDIS_SESSION_GONE_GRACE") or 10.0)
WATCH_INTERVAL = float(os.environ.get("REDIS_SESSION_WATCH_INTERVAL") or 1.0)  # seconds between looks


async def _watch_embedded(data_dir: Path, url: str) -> str:
    """Wait until the embedded server of `data_dir` answers at another URL than `url`; return it.
    Raises `CliError` when no server answers there for `GONE_GRACE` seconds."""
    from ..redis.embedded import running_server

    gone_since: float | None = None
    while True:
        await anyio.sleep(WATCH_INTERVAL)
        found = await anyio.to_thread.run_sync(running_server, data_dir)
        now = anyio.current_time()
        if found is not None:
            if gone_since is not None and found.url == url:
                err.print(f"the embedded server is back at {url}", highlight=False, markup=False)
            gone_since = None
            if found.url != url:
                return found.url
            continue
        if gone_since is None:
            gone_since = now
            err.print(
                f"the embedded server at {url} stopped; waiting {GONE_GRACE:.0f}s for it to come back",
                highlight=False,
                markup=False,
            )
        elif now - gone_since >= GONE_GRACE:
            raise CliError(
                f"the embedded server at {url} stopped (data in {data_dir}); "
                "start it again (`redis-session server start`) and rerun this command"
            )
