"""The one retry rule for optimistic concurrency: full jitter, doubling from a base up to a cap.

Writers that lost a race (`SessionConflictError`) refresh and try again; sleeping a random time in
[0, min(cap, base * 2**attempt)] keeps contending writers from colliding in lockstep (the AWS
"full jitter" schedule). `Session.transact`, the adapters' shared log and the demo all use it.
"""

from __future__ import annotations

import random

import anyio

DEFAULT_BASE = 0.005
DEFAULT_CAP = 0.5


def conflict_delay(attempt: int, *, base: float = DEFAULT_BASE, cap: float = DEFAULT_CAP) -> float:
    """Seconds to wait before retry number `attempt` (0-based)."""
    return random.uniform(0, min(cap, base * (2 ** min(attempt, 30))))


async def conflict_backoff(attempt: int, *, base: float = DEFAULT_BASE, cap: float = DEFAULT_CAP) -> None:
    """Sleep `conflict_delay(attempt)`."""
    await anyio.sleep(conflict_delay(attempt, base=base, cap=cap))
