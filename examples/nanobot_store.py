"""nanobot 0.3.5's own agent loop with its sessions on redis-session:
``pip install "redis-agent-session[nanobot]"``, then ``python examples/nanobot_store.py``, then
``redis-session show "telegram:12345"``.

With no ``$REDIS_URL`` it runs on the embedded server (started on first use, one per user), as
every other example does. The provider here echoes (no API key needed); use your own nanobot
provider instead.
"""

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from nanobot.agent.loop import AgentLoop
from nanobot.bus.queue import MessageBus
from nanobot.providers.base import LLMProvider, LLMResponse
from nanobot.session.manager import SessionManager

from redis_session.adapters.nanobot_store import RedisNanobotStore


class Echo(LLMProvider):
    def __init__(self) -> None:
        super().__init__(provider_name="echo")

    def get_default_model(self) -> str:
        return "echo"

    async def chat(self, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> LLMResponse:
        return LLMResponse(content=f"you said: {messages[-1]['content']}")


async def main() -> None:
    workspace = Path(tempfile.mkdtemp(prefix="nanobot-"))
    store = RedisNanobotStore()  # $REDIS_URL, else the embedded server
    sessions = SessionManager(workspace, store=store)  # nanobot's own manager, our store behind it
    agent = AgentLoop(bus=MessageBus(), provider=Echo(), workspace=workspace, session_manager=sessions)
    await agent.process_direct("hello", session_key="telegram:12345")
    await agent.process_direct("what did I say?", session_key="telegram:12345")

    # another pod: its own manager on the same Redis sees the same session
    other = SessionManager(workspace, store=RedisNanobotStore())
    for message in other.get_or_create("telegram:12345").get_history(max_messages=10):
        print(message["role"], "·", message["content"])


if __name__ == "__main__":
    asyncio.run(main())
