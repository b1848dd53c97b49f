"""The store layer: the `SessionStore` contract, the rules every store runs before a write, and
the in-process `MemorySessionStore`."""

from .memory import (
    MAX_READ_RANGE,
    MemorySessionStore,
    Segment,
    SessionStore,
    StoreRules,
    check_header,
    check_read_range,
    lineage_for,
    plan_read,
)

__all__ = [
    "MAX_READ_RANGE",
    "MemorySessionStore",
    "Segment",
    "SessionStore",
    "StoreRules",
    "check_header",
    "check_read_range",
    "lineage_for",
    "plan_read",
]
