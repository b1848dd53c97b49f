"""`Gateway`: what the route handlers of one app share (the store, the projection source, the
open SSE streams and draft polls, the settings)."""

from __future__ import annotations

from dataclasses import dataclass

from ..store.memory import SessionStore
from .common import MessagesFn
from .sse import _Drafts, _Streams


@dataclass
class Gateway:
    store: SessionStore
    get_messages: MessagesFn
    custom_messages: bool  # `messages=` was given: it does not check the session exists itself
    streams: _Streams
    drafts: _Drafts
    heartbeat: float
    draft_interval: float
    auth: bool
