"""Fixtures of the reliability suite: private servers for destructive tests (kill, restart, ACL,
TLS), so the shared server of the run is never restarted, flushed or reconfigured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_session.redis.embedded import ServerProcess, start_server


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A valkey-server of this test alone (no persistence)."""
    server = start_server(tmp_path / "srv", appendonly=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A valkey-server of this test alone, AOF on with ``appendfsync always``: every acknowledged
    write is on disk before its reply."""
    server = start_server(tmp_path / "aof", appendonly=True, appendfsync="always")
    holder = [server]
    try:
        yield server
    finally:
        holder[0].stop()
