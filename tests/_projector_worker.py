"""A projector worker in its own process, for the kill and SIGTERM tests (not a test module).

    python tests/_projector_worker.py URL PREFIX CONSUMER [LOCK_MS]

It runs `Projector.run_forever()` folding one session at a time. Environment hooks make a test's
kill or signal land mid-batch deterministically:

- ``RS_TEST_PAUSE_AT=k``: pause inside the k-th session fold (after its lock is taken, before
  anything is read), so sessions 1..k-1 of the batch are written and acked, k is half done, and
  the rest are delivered but untouched;
- ``RS_TEST_PAUSE_FILE=path``: written (with the session id) when the pause begins;
- ``RS_TEST_PAUSE_SECONDS=s``: how long the pause lasts (default: until killed).
"""

from __future__ import annotations

import logging
import os
import sys

import anyio

from redis_session import RedisSessionStore
from redis_session.projector import Projector


async def main(url: str, prefix: str, consumer: str, lock_ms: int) -> None:
    pause_at = int(os.environ.get("RS_TEST_PAUSE_AT", "0"))
    pause_file = os.environ.get("RS_TEST_PAUSE_FILE")
    pause_seconds = os.environ.get("RS_TEST_PAUSE_SECONDS")
    seen = 0

    async def hook(session_id: str) -> None:
        nonlocal seen
        seen += 1
        if seen != pause_at:
            return
        if pause_file:
            await anyio.Path(pause_file).write_text(session_id)
        if pause_seconds is None:
            await anyio.sleep_forever()
        await anyio.sleep(float(pause_seconds))

    store = RedisSessionStore.from_url(url, prefix=prefix)
    try:
        worker = Projector(
            store,
            consumer=consumer,
            concurrency=1,
            lock_ms=lock_ms,
            claim_idle_ms=60_000,
            block_ms=200,
            on_session=hook,
        )
        await worker.run_forever()
    finally:
        await store.aclose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    lock = int(sys.argv[4]) if len(sys.argv) > 4 else 10_000
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], lock)
