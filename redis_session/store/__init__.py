"""The store layer: the `SessionStore` contract (`protocol`), the rules every store runs
(`rules`), and the in-process `MemorySessionStore` (`memory`)."""

from .memory import MemorySessionStore
from .protocol import (
    IDEMPOTENCY_WINDOW,
    MAX_READ_RANGE,
    InspectableStore,
    SessionStore,
    StorageCheck,
)
from .rules import (
    Segment,
    StoreRules,
    check_header,
    check_list,
    check_read,
    check_read_range,
    lineage_for,
    plan_read,
    sequence_problems,
)

__all__ = [
    "IDEMPOTENCY_WINDOW",
    "MAX_READ_RANGE",
    "InspectableStore",
    "MemorySessionStore",
    "Segment",
    "SessionStore",
    "StorageCheck",
    "StoreRules",
    "check_header",
    "check_list",
    "check_read",
    "check_read_range",
    "lineage_for",
    "plan_read",
    "sequence_problems",
]
