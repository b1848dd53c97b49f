"""The change feed's consumer side, shared by every worker that reads it (the projector and the
compactor): consumer-group names, consumer ids, and parsing of XREADGROUP / XAUTOCLAIM replies
(RESP2 or RESP3) read undecoded through `redis.wire.feed_client`.
"""

from __future__ import annotations

import builtins
import os
import secrets
import socket
from typing import Any

from .keys import validate_prefix
from .redis.store import RedisSessionStore
from .redis.wire import feed_client

__all__ = [
    "as_map",
    "as_str",
    "default_consumer",
    "entry_rows",
    "feed_client_of",
    "stream_rows",
    "validate_group",
]


def validate_group(group: str) -> str:
    validate_prefix(group)  # same alphabet: no braces, whitespace or control characters
    return group


def as_str(b: Any) -> str:
    return b.decode() if isinstance(b, bytes | bytearray) else str(b)


def as_map(raw: Any) -> dict[str, Any]:
    """A RESP2 flat list or a RESP3 map as a dict with str keys."""
    if isinstance(raw, dict):
        return {as_str(k): v for k, v in raw.items()}
    if not raw:
        return {}
    return {as_str(k): v for k, v in zip(raw[::2], raw[1::2], strict=False)}


def stream_rows(raw: Any) -> builtins.list[tuple[str, str, dict[str, str] | None]]:
    """``(stream key, entry id, fields or None)`` from an XREADGROUP reply (RESP2 or RESP3)."""
    if not raw:
        return []
    pairs = raw.items() if isinstance(raw, dict) else ((p[0], p[1]) for p in raw)
    out: builtins.list[tuple[str, str, dict[str, str] | None]] = []
    for key, rows in pairs:
        k = as_str(key)
        for rid, fields in entry_rows(rows):
            out.append((k, rid, fields))
    return out


def entry_rows(rows: Any) -> builtins.list[tuple[str, dict[str, str] | None]]:
    if not rows:
        return []
    if isinstance(rows, dict):  # RESP3 attribute-free map form (some servers)
        rows = builtins.list(rows.items())
    out: builtins.list[tuple[str, dict[str, str] | None]] = []
    for row in rows:
        rid, fields = row[0], row[1]
        out.append((as_str(rid), None if fields is None else {k: as_str(v) for k, v in as_map(fields).items()}))
    return out


def default_consumer() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(2)}"


def feed_client_of(store: RedisSessionStore) -> Any:
    """The store's client for the feed commands, replies unparsed (`wire.feed_client`)."""
    return feed_client(store.client)
