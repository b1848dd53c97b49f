"""The gateway as a module-level ASGI app for granian (``granian --interface asgi
_granian_app:app``), configured by ``RS_BENCH_URL`` and ``RS_BENCH_PREFIX``: bench/gateway_http.py
measures it next to uvicorn."""

from __future__ import annotations

import os

from redis_session import RedisSessionStore
from redis_session.gateway import create_app

store = RedisSessionStore.from_url(os.environ["RS_BENCH_URL"], prefix=os.environ["RS_BENCH_PREFIX"])
app = create_app(store)
