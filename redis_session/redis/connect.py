"""Connecting to a server: a URL, ``$REDIS_URL``, or the embedded server; standalone or cluster."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .store import RedisSessionStore

Announce = Callable[[str], None]


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_url(url: str | None = None, *, announce: Announce | None = _to_stderr) -> str:
    """`url`, else ``$REDIS_URL``, else the embedded server (started on first use).

    When this call starts the embedded server it says so once through `announce` (default: a line
    on stderr; None: silent): where it listens and where its data is."""
    if url:
        return url
    env = os.environ.get("REDIS_URL")
    if env:
        return env
    from .embedded import ensure_server

    server = ensure_server()
    if server.started and announce is not None:
        if server.note:
            announce(server.note)
        announce(f"started the embedded server at {server.url}, data in {server.data_dir}")
    return server.url


def is_cluster(url: str, timeout: float = 3.0) -> bool:
    """Does `url` point at a Redis Cluster node? (``INFO cluster``; False when unreachable.)"""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.info("cluster").get("cluster_enabled"))
        finally:
            client.close()
    except redis.RedisError:
        return False


def open_store(
    url: str | None = None,
    *,
    prefix: str = "rs",
    cluster: bool | None = None,
    announce: Announce | None = _to_stderr,
    **kwargs: Any,
) -> RedisSessionStore:
    """A `RedisSessionStore` for `url` (see `resolve_url`).

    `cluster=None` reads ``$REDIS_SESSION_CLUSTER`` (true/false) and otherwise asks the server."""
    resolved = resolve_url(url, announce=announce)
    if cluster is None:
        env = os.environ.get("REDIS_SESSION_CLUSTER", "").strip().lower()
        cluster = (
            env in ("1", "true", "yes") if env in ("1", "true", "yes", "0", "false", "no") else is_cluster(resolved)
        )
    return RedisSessionStore.from_url(resolved, prefix=prefix, cluster=cluster, **kwargs)
