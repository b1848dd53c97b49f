"""The TypeScript writer through a failover that lost rows: replication is asynchronous, so a
promoted replica may lack the last delta batch whose reply came back. Emulated on one server as in
the Python writer's test (tests/test_answer_edges.py): the log, the header's n and the answer's
state go back to what the replica holds; the writer (a node process of its own) must send the lost
batch again when the gateway refuses its next batch or its end, so every delta lands once, in order."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from anyio.streams.text import TextReceiveStream

from redis_session import Delta, RedisSessionStore, SessionHeader
from redis_session.gateway.auth import Token
from redis_session.projection.chunks import LiveRecord, deltas_cost, replay

from support import running_gateway

pytestmark = pytest.mark.anyio

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
ADMIN = "ts-failover-admin-0123456789"


def _node_missing() -> str | None:
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (CI installs Debian's nodejs and npm)"
    return None


async def _build(env: dict[str, str]) -> None:
    if not (PACKAGE / "node_modules" / "typescript").is_dir():
        ci = await anyio.run_process(["npm", "ci"], cwd=PACKAGE, env=env, check=False)
        assert ci.returncode == 0, (ci.stdout + ci.stderr).decode()[-4000:]
    tsc = await anyio.run_process(["npx", "tsc", "-p", "tsconfig.json"], cwd=PACKAGE, env=env, check=False)
    assert tsc.returncode == 0, (tsc.stdout + tsc.stderr).decode()[-4000:]


@pytest.mark.skipif(_node_missing() is not None, reason=_node_missing() or "")
@pytest.mark.parametrize("found_by", ["a later batch", "the end"])
async def test_the_typescript_writer_sends_again_what_a_failover_lost(
    redis_store: RedisSessionStore, redis_url: str, found_by: str
) -> None:
    more = 8 if found_by == "a later batch" else 0
    sent = [f"t{i} " for i in range(8 + more)]
    env = {**os.environ, "RS_TOKEN_ADMIN": ADMIN, "npm_config_audit": "false", "npm_config_fund": "false"}
    sid = f"tsfo-{found_by.replace(' ', '-')}"
    await redis_store.create(SessionHeader(id=sid))
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with anyio.fail_after(300):
            await _build(env)
            async with running_gateway(redis_store, tokens=[Token.make(ADMIN, ["admin"], name="ts")]) as base:
                env["REDIS_SESSION_URL"] = base
                child = await anyio.open_process(
                    ["node", str(PACKAGE / "dist" / "test" / "failover-child.js"), sid, str(more)], env=env
                )
                async with child:
                    assert child.stdout is not None and child.stdin is not None
                    lines = TextReceiveStream(child.stdout)
                    out = ""
                    while "\n" not in out:
                        out += await lines.receive()
                    assert out.startswith("ready "), out
                    answer = out.split()[1]
                    # two rows landed (t0..t3, t4..t7); the replica has the first only
                    assert (await redis_store.head(sid)).n == 2  # type: ignore[union-attr]
                    log_key = redis_store.keys.log(sid)
                    [(_, first_row)] = await raw.xrange(log_key, "0-1", "0-1")
                    await raw.delete(log_key)
                    await raw.xadd(log_key, first_row, id="0-1")
                    await raw.hset(redis_store.keys.hdr(sid), "n", 1)
                    first = [Delta(answer=answer, index=i, kind="text", text=t) for i, t in enumerate(sent[:4])]
                    cost = deltas_cost(first)
                    state = f"{redis_store.keys.live(sid)}:{answer}"
                    await raw.hset(state, mapping={"log": 4, "ln": 1, "sz": cost, "rn": 0})
                    await child.stdin.send(b"go\n")
                    rest = ""
                    async for chunk in lines:
                        rest += chunk
                    assert await child.wait() == 0, out + rest
                    assert "ended " in rest, rest
    finally:
        await raw.aclose()
    entries = await redis_store.read(sid)
    assert [e.n for e in entries] == list(range(len(entries)))
    assert "".join(c["text"] for c in replay(entries)[answer]) == "".join(sent)  # once each, in order
    messages = [e for e in entries if e.type == "assistant/message"]
    assert len(messages) == 1 and messages[0].data["content"] == [{"type": "text", "text": "".join(sent)}]


class _Proxy:
    """A TCP proxy to the gateway whose open connections `cut` closes (a dropped SSE stream)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.streams: list[anyio.abc.SocketStream] = []
        self.port = 0

    async def serve(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def pipe(a: anyio.abc.SocketStream, b: anyio.abc.SocketStream) -> None:
            try:
                async for chunk in a:
                    await b.send(chunk)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                pass
            finally:
                await b.aclose()

        async def handle(down: anyio.abc.SocketStream) -> None:
            up = await anyio.connect_tcp("127.0.0.1", self.target_port)
            self.streams += [down, up]
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe, down, up)
                tg.start_soon(pipe, up, down)

        task_status.started()
        await listener.serve(handle)

    async def cut(self) -> None:
        streams, self.streams = self.streams, []
        for s in streams:
            await s.aclose()


@pytest.mark.skipif(_node_missing() is not None, reason=_node_missing() or "")
async def test_the_typescript_tail_never_gives_a_resent_delta_twice(
    redis_store: RedisSessionStore, redis_url: str
) -> None:
    # the tail got delta 9; a failover lost its live record and the writer sent it again under a
    # later id; the tail's connection dropped meanwhile: resumed, it must not give 9 again
    from urllib.parse import urlsplit

    from redis_session import Sessions

    env = {**os.environ, "RS_TOKEN_ADMIN": ADMIN, "npm_config_audit": "false", "npm_config_fund": "false"}
    sid = "tsfo-reader"
    await redis_store.create(SessionHeader(id=sid))
    s = await Sessions(redis_store).open(sid)
    raw = aioredis.Redis.from_url(redis_url, decode_responses=True)
    got: list[str] = []
    try:
        with anyio.fail_after(300):
            await _build(env)
            async with (
                running_gateway(redis_store, tokens=[Token.make(ADMIN, ["admin"], name="ts")]) as base,
                anyio.create_task_group() as tg,
            ):
                proxy = _Proxy(urlsplit(base).port or 0)
                await tg.start(proxy.serve)
                env["REDIS_SESSION_URL"] = f"http://127.0.0.1:{proxy.port}"
                child = await anyio.open_process(
                    ["node", str(PACKAGE / "dist" / "test" / "reader-child.js"), sid], env=env
                )
                async with child:
                    assert child.stdout is not None
                    lines = TextReceiveStream(child.stdout)
                    buf = ""

                    async def until(pred: Any) -> None:
                        nonlocal buf
                        while not pred():
                            buf += await lines.receive()
                            *done, buf = buf.split("\n")
                            got.extend(done)

                    async with s.stream(turn=1, step=1, flush_interval=5, max_chunks=100) as w:
                        for i in range(10):
                            await w.delta(f"d{i} ")
                        await until(lambda: '{"index":9}' in got)
                        live = redis_store.keys.live(sid)
                        [(rid, fields)] = await raw.xrevrange(live, count=1)
                        assert LiveRecord.from_fields(rid, fields).index == 9, fields
                        await raw.xdel(live, rid)
                        await raw.xadd(live, fields)  # sent again, under a later id
                        await proxy.cut()
                        for i in range(10, 14):
                            await w.delta(f"d{i} ")
                    await until(lambda: "done" in got)
                    assert await child.wait() == 0
                tg.cancel_scope.cancel()
    finally:
        await raw.aclose()
    deltas = [line for line in got if line.startswith("{")]
    assert deltas == [f'{{"index":{i}}}' for i in range(14)], deltas
