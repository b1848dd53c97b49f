"""Connecting to a server: a URL, ``$REDIS_URL``, or the embedded server; standalone or cluster."""

from __future__ import annotations

import os
from typing import Any

from .store import RedisSessionStore


def resolve_url(url: str | None = None) -> str:
    """`url`, else ``$REDIS_URL``, else the embedded server (started on first use)."""
    if url:
        return url
    env = os.environ.get("REDIS_URL")
    if env:
        return env
    from .embedded import ensure_server

    return ensure_server().url


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
    url: str | None = None, *, prefix: str = "rs", cluster: bool | None = None, **kwargs: Any
) -> RedisSessionStore:
    """A `RedisSessionStore` for `url` (see `resolve_url`).

    `cluster=None` reads ``$REDIS_SESSION_CLUSTER`` (true/false) and otherwise asks the server."""
    resolved = resolve_url(url)
    if cluster is None:
        env = os.environ.get("REDIS_SESSION_CLUSTER", "").strip().lower()
        cluster = (
            env in ("1", "true", "yes") if env in ("1", "true", "yes", "0", "false", "no") else is_cluster(resolved)
        )
    return RedisSessionStore.from_url(resolved, prefix=prefix, cluster=cluster, **kwargs)
