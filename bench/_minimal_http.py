"""The floor of an HTTP hop in Python, for bench/gateway_http.py: a bare asyncio server on
httptools and uvloop with one write route, ``POST /sessions/{id}/entries`` (``If-Match: "<n>"``,
an entry or a list of entries as JSON), making the same store call the gateway makes and answering ``201`` with the
``etag``; ``GET /readyz`` and ``/healthz`` answer ``200``. No ASGI, no routing, no checks, no
auth: not a server to deploy, a measure of what the gateway's stack (uvicorn, Starlette, the
gateway's own checks) adds on top of the hop itself.

    python bench/_minimal_http.py REDIS_URL PREFIX PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httptools
import msgspec
import uvloop

from redis_session import NewEntry, RedisSessionStore

_decode = msgspec.json.Decoder()


class _Protocol(asyncio.Protocol):
    def __init__(self, store: RedisSessionStore) -> None:
        self.store = store
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url, self.body, self.if_match = b"", b"", b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's TCPTransport: a transport, not asyncio.Transport's subclass

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"if-match":
            self.if_match = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        url, body, if_match = self.url, self.body, self.if_match
        self.url, self.body, self.if_match = b"", b"", b""
        asyncio.get_running_loop().create_task(self._answer(url, body, if_match))

    async def _answer(self, url: bytes, body: bytes, if_match: bytes) -> None:
        assert self.transport is not None
        if not body:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        sid = url.split(b"/")[2].decode()
        d = _decode.decode(body)
        entries = [NewEntry(x["type"], x["data"]) for x in (d if isinstance(d, list) else [d])]
        stored = await self.store.put(sid, int(if_match.strip(b'"')), entries)
        n = stored[-1].n + 1
        out = msgspec.json.encode({"n": n})
        head = b'HTTP/1.1 201 Created\r\netag: "%d"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n'
        self.transport.write(head % (n, len(out)) + out)


async def _serve(url: str, prefix: str, port: int) -> None:
    store = RedisSessionStore.from_url(url, prefix=prefix)
    server = await asyncio.get_running_loop().create_server(lambda: _Protocol(store), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
