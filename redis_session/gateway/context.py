"""`Gateway`: what the route handlers of one app share (the store, the projection source, the
open SSE streams, their shared tails and draft polls, the settings)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sessions import Sessions
from ..store import SessionStore
from .common import MessagesFn
from .sse import _Drafts, _Streams
from .tails import Notifications, Tails


@dataclass
class Gateway:
    store: SessionStore
    get_messages: MessagesFn
    custom_messages: bool  # `messages=` was given: it does not check the session exists itself
    streams: _Streams
    drafts: _Drafts
    tails: Tails  # one live tail per followed session, shared by its SSE streams
    notifications: Notifications  # the store's notifications, one subscription for every /events stream
    heartbeat: float
    draft_interval: float
    auth: bool
    sessions: Sessions  # the writes go through the same service as Python code
    max_body: int  # request bodies over this many bytes answer 413 before they are parsed
    max_batch: int  # entries per append (the store's own limit)
