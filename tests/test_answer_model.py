"""The answer protocol, model-based (`redis_session.testing.answer_model`): random batches,
retries, two copies at once, reorders and holes, lost replies, readers that drop and resume, a
second answer, delete + re-create; every reader saw exactly the sent text or an explicit gap, and
the log replays every answer. Short here (a few seeds); `bench/answer_model.py` runs it long."""

from __future__ import annotations

from typing import Any

import pytest

from redis_session.testing.answer_model import run_model

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_answer_protocol_holds_under_random_interleavings(store: Any, seed: int) -> None:
    stats = await run_model(store, seed, steps=50, sid=f"model-{seed}")
    assert stats.batches > 5 and stats.deltas_read > 0
