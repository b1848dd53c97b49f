"""Drop-in adapters for agent frameworks, on a redis-session store.

- `RedisEventSession` (``redis_session.adapters.openai_agents``): the OpenAI Agents SDK
  ``Session`` protocol; needs the ``openai-agents`` extra.
- `RedisChatMessageHistory` (``redis_session.adapters.langchain``): a LangChain
  ``BaseChatMessageHistory``; needs the ``langchain`` extra.
- `RedisAdkSessionService` (``redis_session.adapters.adk``): a Google ADK ``BaseSessionService``;
  needs the ``adk`` extra.
- `RedisEventSaver` (``redis_session.adapters.langgraph``): a LangGraph checkpointer
  (``BaseCheckpointSaver``); needs the ``langgraph`` extra.
- `RedisNanobotStore` (``redis_session.adapters.nanobot_store``): nanobot 0.3.5's own
  ``SessionStore`` seam (``SessionManager(workspace, store=...)``); needs the ``nanobot`` extra.
  ``redis_session.adapters.nanobot.LegacySessionManager`` is a port of the older nanobot's
  manager (8656549), for deployments still on it.

Each is imported on first use, so this package imports without any framework installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adk import RedisAdkSessionService
    from .langchain import RedisChatMessageHistory
    from .langgraph import RedisEventSaver
    from .nanobot_store import RedisNanobotStore
    from .openai_agents import RedisEventSession

__all__ = [
    "RedisAdkSessionService",
    "RedisChatMessageHistory",
    "RedisEventSaver",
    "RedisEventSession",
    "RedisNanobotStore",
]


def __getattr__(name: str) -> Any:
    if name == "RedisEventSession":
        from .openai_agents import RedisEventSession

        return RedisEventSession
    if name == "RedisChatMessageHistory":
        from .langchain import RedisChatMessageHistory

        return RedisChatMessageHistory
    if name == "RedisAdkSessionService":
        from .adk import RedisAdkSessionService

        return RedisAdkSessionService
    if name == "RedisEventSaver":
        from .langgraph import RedisEventSaver

        return RedisEventSaver
    if name == "RedisNanobotStore":
        from .nanobot_store import RedisNanobotStore

        return RedisNanobotStore
    raise AttributeError(name)
