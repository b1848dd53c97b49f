"""The mapping the copied OpenAI Agents SDK tests use: `RedisSession` names redis-session's
`RedisEventSession` (built as the SDK's is: ``RedisSession(session_id=..., redis_client=...,
key_prefix=...)`` or ``RedisSession.from_url(session_id, url=..., key_prefix=..., ttl=...)``), and
`server_url()` the test server (``$REDIS_URL``, else an embedded server for this run) in place of
the SDK's hard-coded ``redis://localhost:6379/15``."""

from __future__ import annotations

import atexit
import os
import tempfile
from typing import Any

from redis_session.adapters.openai_agents import RedisEventSession as RedisSession

__all__ = ["RedisSession", "server_url"]

_server: dict[str, Any] = {}


def server_url() -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    if "url" not in _server:
        from redis_session.redis.embedded import start_server

        folder = tempfile.TemporaryDirectory(prefix="rs-sdk-tests-")
        server = start_server(folder.name, appendonly=False)
        _server.update(url=server.url, server=server, folder=folder)

        def stop() -> None:
            server.stop()
            folder.cleanup()

        atexit.register(stop)
    return str(_server["url"])
