"""Streamed answers over HTTP (``/sessions/{id}/answers``, docs/design.md §8.2) on a real uvicorn
server and a real Redis: begin, delta batches and end land the same live records and log rows as
`Session.stream`, so `follow_deltas`, SSE ``?deltas=1``, the draft view and `repair` read them the
same; a retried batch lands nowhere twice; a stale If-Match writes nothing; scopes and tenants."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
from test_gateway import sse

from redis_session import Delta, RedisSessionStore, SessionHeader, Sessions
from redis_session.gateway.auth import parse_tokens
from redis_session.live import follow_deltas
from redis_session.projection.chunks import CHUNK, INTERRUPTED, replay

from support import running_gateway

pytestmark = pytest.mark.anyio

WORDS = [f"w{i} " for i in range(40)]


def path(session_id: str, sub: str = "") -> str:
    return "/sessions/" + quote(session_id, safe="") + (f"/{sub}" if sub else "")


@pytest.fixture
async def client(redis_store: RedisSessionStore) -> AsyncIterator[httpx.AsyncClient]:
    async with running_gateway(redis_store) as base, httpx.AsyncClient(base_url=base, timeout=20) as c:
        yield c


async def _session(store: RedisSessionStore, sid: str) -> None:
    await store.create(
        SessionHeader(id=sid),
        [("turn/start", {"turn": 1}), ("user/message", {"content": "hi"}), ("step/start", {"turn": 1, "step": 1})],
    )


async def _begin(client: httpx.AsyncClient, sid: str, **headers: str) -> dict[str, Any]:
    r = await client.post(path(sid, "answers"), json={"turn": 1, "step": 1}, headers=headers)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _batch(first: int, texts: list[str]) -> dict[str, Any]:
    return {"first_index": first, "turn": 1, "step": 1, "deltas": [{"text": t} for t in texts]}


async def test_begin_deltas_end_reach_a_live_reader_and_the_log(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await _session(redis_store, "h1")
    got: list[Any] = []
    listening = anyio.Event()

    async def reader() -> None:
        listening.set()
        async for item in follow_deltas(redis_store, "h1", 3):
            got.append(item)
            if not isinstance(item, Delta) and item.type == "assistant/message":
                return

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await listening.wait()
            a = await _begin(client, "h1")
            assert a["n"] == 3 and len(a["answer"]) == 10 and a["begin_id"]
            assert a["incarnation"] == (await redis_store.head("h1")).header.incarnation  # type: ignore[union-attr]
            answer = a["answer"]
            for i in range(0, len(WORDS), 8):  # five batches of eight, as a client batching every ~75 ms
                r = await client.post(path("h1", f"answers/{answer}/deltas"), json=_batch(i, WORDS[i : i + 8]))
                assert r.status_code == 201, r.text
                assert r.json()["next_index"] == i + 8
                if i == 16:  # the draft is a view of the live stream: the answer so far
                    draft = (await client.get(path("h1", "draft"))).json()["draft"]
                    assert draft == {"answer": answer, "turn": 1, "step": 1, "content": "".join(WORDS[:24])}
            end = {"reason": "committed", "begun_at": a["n"], "begin_id": a["begin_id"], "turn": 1, "step": 1}
            r = await client.post(path("h1", f"answers/{answer}/end"), json=end, headers={"If-Match": '"8"'})
            assert r.status_code == 201, r.text
            assert r.headers["etag"] == '"9"' and r.json()["n"] == 9
    deltas = [d for d in got if isinstance(d, Delta)]
    assert [d.index for d in deltas] == list(range(len(WORDS)))  # every delta once, in order
    assert [d.text for d in deltas] == WORDS and {d.answer for d in deltas} == {answer}

    entries = await redis_store.read("h1")
    assert [e.type for e in entries[3:]] == [CHUNK] * 5 + ["assistant/message"]
    assert [e.data["seq"] for e in entries[3:8]] == [0, 8, 16, 24, 32]
    assert all(e.data["answer"] == answer and e.data["turn"] == 1 for e in entries[3:8])
    assert "".join(c["text"] for c in replay(entries)[answer]) == "".join(WORDS)
    message = entries[-1]
    assert message.data == {"turn": 1, "step": 1, "content": [{"type": "text", "text": "".join(WORDS)}]}
    assert message.meta == {"answer": answer}
    # the live stream: begin, the deltas, an end naming the message (as AnswerStream leaves it)
    live = await redis_store.read_live("h1")
    assert live[0].kind == "begin" and (live[0].turn, live[0].step, live[0].n) == (1, 1, 3)
    assert [r.index for r in live if r.is_delta] == list(range(len(WORDS)))
    assert (live[-1].kind, live[-1].n, live[-1].index, live[-1].reason) == ("end", 8, len(WORDS), "committed")
    # repair closes the turn the test left open, but no answer: this one was closed
    assert INTERRUPTED not in [e.type for e in await Sessions(redis_store).repair("h1", stale_after=0)]
    assert (await client.get(path("h1", "draft"))).json()["draft"] is None


async def test_reasoning_tool_calls_and_sse_deltas(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    await _session(redis_store, "h2")
    a = await _begin(client, "h2")
    answer = a["answer"]
    batch = {
        "first_index": 0,
        "deltas": [
            {"kind": "reasoning", "text": "think"},
            {"text": "Let me look."},
            {"kind": "tool-call", "callId": "c1", "name": "bash", "text": '{"cmd"'},
            {"kind": "tool-call", "callId": "c1", "text": ': "ls"}'},
        ],
    }
    assert (await client.post(path("h2", f"answers/{answer}/deltas"), json=batch)).status_code == 201
    # a reader of SSE ?deltas=1 gets the answer so far as `event: delta`
    seen: list[dict[str, Any]] = []
    with anyio.fail_after(60):
        async with client.stream("GET", path("h2", "events"), params={"deltas": "1", "start": "3"}) as r:
            async for ev in sse(r):
                if ev.get("event") == "delta":
                    seen.append(ev["data"])
                    inc = a["incarnation"]
                    # <life>:<last n>/<live id>: the deltas landed with their row (n=3) in one
                    # script, and an answer's own deltas come before its row (`merge_live`)
                    assert re.fullmatch(inc + r":2/[0-9]+-[0-9]+", ev["id"])
                if len(seen) == 4:
                    break
    assert [(d["kind"], d["index"], d.get("callId")) for d in seen] == [
        ("reasoning", 0, None),
        ("text", 1, None),
        ("tool-call", 2, "c1"),
        ("tool-call", 3, "c1"),
    ]
    r = await client.post(path("h2", f"answers/{answer}/end"), json={"reason": "committed", "begun_at": 3})
    assert r.status_code == 201, r.text
    assert r.json()["entries"][0]["data"]["content"] == [
        {"type": "reasoning", "text": "think"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool-call", "id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'},
    ]


async def test_a_retried_batch_or_end_is_not_written_twice(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await _session(redis_store, "h3")
    a = await _begin(client, "h3")
    url = path("h3", f"answers/{a['answer']}/deltas")
    first = await client.post(url, json=_batch(0, ["a", "b"]))
    again = await client.post(url, json=_batch(0, ["a", "b"]))  # the reply was lost: the client retries
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json() and first.headers["etag"] == again.headers["etag"]
    assert (await client.post(url, json=_batch(2, ["c"]))).status_code == 201
    # the same first index with other deltas is another batch under a used key: refused, nothing written
    r = await client.post(url, json=_batch(0, ["x"]))
    assert r.status_code == 422 and r.json()["error"] == "batch_mismatch"
    entries = await redis_store.read("h3")
    assert [e.data["seq"] for e in entries if e.type == CHUNK] == [0, 2]
    assert [c["text"] for c in replay(entries)[a["answer"]]] == ["a", "b", "c"]
    live = await redis_store.read_live("h3")
    assert [(r.index, r.text) for r in live if r.is_delta] == [(0, "a"), (1, "b"), (2, "c")]

    end = {"reason": "committed", "begun_at": a["n"], "begin_id": a["begin_id"]}
    url = path("h3", f"answers/{a['answer']}/end")
    first = await client.post(url, json=end, headers={"If-Match": '"5"'})
    again = await client.post(url, json=end, headers={"If-Match": '"5"'})  # stale now, but a retry
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    assert [e.type for e in await redis_store.read("h3", 5)] == ["assistant/message"]
    assert [r.kind for r in await redis_store.read_live("h3")].count("end") == 1


async def test_a_stale_if_match_ends_nothing(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    await _session(redis_store, "h4")
    a = await _begin(client, "h4")
    answer = a["answer"]
    assert (await client.post(path("h4", f"answers/{answer}/deltas"), json=_batch(0, ["x", "y"]))).status_code == 201
    await redis_store.put("h4", None, [("user/message", {"content": "meanwhile"})])
    before = (await redis_store.read("h4"), await redis_store.read_live("h4"))
    end = {"reason": "committed", "begun_at": a["n"]}
    r = await client.post(path("h4", f"answers/{answer}/end"), json=end, headers={"If-Match": '"4"'})
    assert r.status_code == 412 and r.json()["actual_n"] == 5 and r.headers["etag"] == '"5"'
    r = await client.post(path("h4", f"answers/{answer}/end"), json={**end, "expected_n": 4})
    assert r.status_code == 412
    assert (await redis_store.read("h4"), await redis_store.read_live("h4")) == before
    # the answer is still open: the writer gives up on it, and the interrupted mark closes it
    r = await client.post(path("h4", f"answers/{answer}/end"), json={**end, "reason": "interrupted"})
    assert r.status_code == 201, r.text
    mark = r.json()["entries"][0]
    assert mark["type"] == INTERRUPTED and mark["meta"] == {"answer": answer}
    assert mark["data"] == {
        "answer": answer,
        "reason": "cancelled",
        "deltas": 2,
        "content": [{"type": "text", "text": "xy"}],
    }
    live = await redis_store.read_live("h4")
    assert (live[-1].kind, live[-1].reason, live[-1].n, live[-1].index) == ("end", "interrupted", 5, 2)


async def test_bad_requests_write_nothing(client: httpx.AsyncClient, redis_store: RedisSessionStore) -> None:
    await _session(redis_store, "h5")
    a = await _begin(client, "h5")
    url = path("h5", f"answers/{a['answer']}/deltas")
    before = (await redis_store.read("h5"), await redis_store.read_live("h5"))
    for body, where in [
        ({"first_index": -1, "deltas": [{"text": "a"}]}, "$.first_index"),
        ({"first_index": 0, "deltas": [{"text": 1}]}, "$.deltas[0].text"),
        ({"first_index": 0, "deltas": [{"kind": "tool-call", "text": "{"}]}, "$.deltas[0].callId"),
        ({"first_index": 0, "deltas": [{"text": "a"}, {"text": "b", "callId": "c"}]}, "$.deltas[1].callId"),
        ({"first_index": 0, "deltas": [{"kind": "image", "text": "a"}]}, "$.deltas[0].kind"),
        ({"first_index": 0, "deltas": [{"text": "a"}], "extra": 1}, "$.extra"),
    ]:
        r = await client.post(url, json=body)
        assert r.status_code == 422 and r.json()["path"] == where, (body, r.text)
    r = await client.post(url, json={"first_index": 0, "deltas": [{"text": "a"}] * 4097})
    assert r.status_code == 413 and r.json()["error"] == "batch_too_large"
    r = await client.post(url, json={"first_index": 0, "deltas": [{"text": "x" * (1 << 20)}] * 20})
    assert r.status_code == 413  # the body cap, or the entry limit
    end = path("h5", f"answers/{a['answer']}/end")
    assert (await client.post(end, json={"reason": "done", "begun_at": 3})).status_code == 422
    r = await client.post(end, json={"reason": "committed", "deltas": 2})  # none were sent
    assert r.status_code == 409 and r.json()["error"] == "incomplete" and r.json()["missing"] == [0, 2]
    r = await client.post(end, json={"reason": "committed", "begun_at": 3, "begin_id": "x"})
    assert r.status_code == 422
    r = await client.post(
        end, json={"reason": "committed", "begun_at": 3, "expected_n": 4}, headers={"If-Match": '"3"'}
    )
    assert r.status_code == 400
    assert (await client.post(path("h5", "answers/a%20b/deltas"), json=_batch(0, ["a"]))).status_code == 400
    assert (await client.post(path("h5", f"answers/{a['answer']}/nope"), json={})).status_code == 404
    assert (await client.get(url)).status_code == 405
    assert (await client.post(path("h5", "answers"), content=b"{not json")).status_code == 400
    assert (await redis_store.read("h5"), await redis_store.read_live("h5")) == before
    assert (await client.post(path("nobody", "answers"), json={})).status_code == 404
    assert (await client.post(path("nobody", "answers/abc/deltas"), json=_batch(0, ["a"]))).status_code == 404
    r = await client.post(path("h5", "answers"), json={}, headers={"X-Session-Incarnation": "other"})
    assert r.status_code == 409


async def test_a_keyed_begin_retried_gets_the_same_answer(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await _session(redis_store, "h6")
    a = await _begin(client, "h6", **{"Idempotency-Key": "turn-1-step-1"})
    b = await _begin(client, "h6", **{"Idempotency-Key": "turn-1-step-1"})
    c = await _begin(client, "h6", **{"Idempotency-Key": "turn-1-step-2"})
    assert a["answer"] == b["answer"] != c["answer"]


async def test_a_dead_http_writer_is_closed_by_repair(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    await _session(redis_store, "h7")
    a = await _begin(client, "h7")
    url = path("h7", f"answers/{a['answer']}/deltas")
    assert (await client.post(url, json=_batch(0, ["one ", "two"]))).status_code == 201
    # the writer dies here, without an end
    appended = await Sessions(redis_store).repair("h7", stale_after=0)
    assert appended[0].type == INTERRUPTED and appended[0].data["reason"] == "crashed"
    assert appended[0].data["deltas"] == 2 and appended[0].data["content"] == [{"type": "text", "text": "one two"}]


async def test_an_empty_batch_is_a_heartbeat_that_keeps_a_quiet_writer_alive(
    client: httpx.AsyncClient, redis_store: RedisSessionStore
) -> None:
    """A writer that is alive but quiet (a model thinking before a tool call) beats with an empty
    batch: `repair` leaves its answer open, while one whose writer went just as quiet without
    beating is closed. The beat writes nothing and is refused for an answer that ended, or one of
    another life of the id."""
    for sid in ("h8", "h9"):
        await _session(redis_store, sid)
    alive, dead = await _begin(client, "h8"), await _begin(client, "h9")
    for sid, a in (("h8", alive), ("h9", dead)):
        r = await client.post(path(sid, f"answers/{a['answer']}/deltas"), json=_batch(0, ["think", "ing "]))
        assert r.status_code == 201, r.text
    before = (await redis_store.read("h8"), await redis_store.read_live("h8"))
    # both writers are quiet longer than the repairer's stale_after below: time passing is what is
    # tested. A quiet writer is stale once it is (it cannot come early); `stale_after` is long, so
    # the beat is still fresh when the repair looks, however slow the machine is in between.
    await anyio.sleep(3.1)
    beat = await client.post(path("h8", f"answers/{alive['answer']}/deltas"), json={"first_index": 2, "deltas": []})
    assert beat.status_code == 200, beat.text
    assert beat.json()["next_index"] == 2 and beat.json()["n"] == 4 and beat.json()["entries"] == []
    assert (await redis_store.read("h8"), await redis_store.read_live("h8")) == before  # nothing written
    assert await Sessions(redis_store).repair("h8", stale_after=3.0) == []  # it beat: alive
    repaired = await Sessions(redis_store).repair("h9", stale_after=3.0)  # it did not: dead
    assert [e.type for e in repaired][:1] == [INTERRUPTED] and repaired[0].data["reason"] == "crashed"
    r = await client.post(path("h8", f"answers/{alive['answer']}/deltas"), json=_batch(2, ["done"]))
    assert r.status_code == 201, r.text
    end = await client.post(path("h8", f"answers/{alive['answer']}/end"), json={"reason": "committed"})
    assert end.status_code == 201 and end.json()["entries"][0]["data"]["content"] == [
        {"type": "text", "text": "thinking done"}
    ]
    for sid, a in (("h8", alive), ("h9", dead)):  # ended (committed, or closed by the repair)
        r = await client.post(path(sid, f"answers/{a['answer']}/deltas"), json={"first_index": 0, "deltas": []})
        assert r.status_code == 409 and r.json()["error"] == "answer_ended", r.text
    # another life of the id: the old answer's beat never reaches it
    await _session(redis_store, "h10")
    old = await _begin(client, "h10")
    await redis_store.delete("h10")
    await _session(redis_store, "h10")
    r = await client.post(path("h10", f"answers/{old['answer']}/deltas"), json={"first_index": 0, "deltas": []})
    assert r.status_code == 409 and r.json()["error"] == "session_replaced", r.text
    assert await redis_store.read_live("h10") == []


TOKENS = """
wri-0123456789 write
rea-0123456789 read
acme-w-0123456 write   acme/
"""


async def test_scopes_and_tenants(redis_store: RedisSessionStore) -> None:
    for sid in ("acme/1", "globex/1"):
        await _session(redis_store, sid)
    tokens = parse_tokens(TOKENS, "test")

    def as_(base: str, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=20)

    with anyio.fail_after(60):
        async with running_gateway(redis_store, tokens=tokens) as base:
            async with as_(base, "wri-0123456789") as writer, as_(base, "rea-0123456789") as reader:
                a = await _begin(writer, "globex/1")
                before = (await redis_store.read("globex/1"), await redis_store.read_live("globex/1"))
                for sub, body in [
                    ("answers", {}),
                    (f"answers/{a['answer']}/deltas", _batch(0, ["x"])),
                    (f"answers/{a['answer']}/end", {"reason": "committed", "begun_at": 3}),
                ]:
                    r = await reader.post(path("globex/1", sub), json=body)
                    assert r.status_code == 403 and r.json()["error"] == "forbidden", (sub, r.text)
                async with as_(base, "acme-w-0123456") as acme:
                    assert (await acme.post(path("acme/1", "answers"), json={})).status_code == 201
                    for sub, body in [
                        ("answers", {}),
                        (f"answers/{a['answer']}/deltas", _batch(0, ["x"])),
                        (f"answers/{a['answer']}/end", {"reason": "committed", "begun_at": 3}),
                    ]:
                        r = await acme.post(path("globex/1", sub), json=body)
                        assert r.status_code == 404, (sub, r.text)
                assert (await redis_store.read("globex/1"), await redis_store.read_live("globex/1")) == before
