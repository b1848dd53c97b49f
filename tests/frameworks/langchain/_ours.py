"""The one mapping the copied langchain-core tests use: `InMemoryChatMessageHistory` names a
redis-session `RedisChatMessageHistory` on the test's server (a fresh session per object).

It is constructed as the upstream class is: ``InMemoryChatMessageHistory()`` (an empty history),
or ``InMemoryChatMessageHistory(messages=[...])`` (the tests' expected values: a history holding
them). Upstream compares histories with ``==`` (pydantic compares their fields); ours compares
what both hold, read through the history's own API.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from redis_session.adapters.langchain import RedisChatMessageHistory

#: the store of the running test (set by conftest.py)
CURRENT: dict[str, Any] = {}


class InMemoryChatMessageHistory(RedisChatMessageHistory):
    def __init__(self, messages: Sequence[BaseMessage] | None = None) -> None:
        super().__init__(f"lc-{uuid.uuid4().hex[:12]}", CURRENT["store"])
        if messages:
            self.add_messages(messages)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RedisChatMessageHistory):
            return NotImplemented
        return self.messages == other.messages

    __hash__ = None  # type: ignore[assignment]
