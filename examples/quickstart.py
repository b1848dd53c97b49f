"""The README's quick start, as a file: ``python examples/quickstart.py``, then
``redis-session doctor chat-1`` (clean) and ``redis-session show chat-1``.

With no ``$REDIS_URL`` it runs on the embedded server (started on first use, one per user).
"""

import asyncio

import redis_session


async def main() -> None:
    sessions = await redis_session.connect()  # $REDIS_URL, else the embedded server
    async with sessions:
        s = await sessions.open("chat-1")  # implicit create
        await s.append("user/message", {"content": "What is on my calendar?"})
        await s.commit({"content": "Two meetings."})  # an assistant/message; clears the draft
        messages = await s.messages()  # the projection (neutral Message structs)
        openai_messages = redis_session.to_openai(messages)
        print(openai_messages[-2:])


if __name__ == "__main__":
    asyncio.run(main())
