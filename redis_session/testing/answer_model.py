"""A model-based check of the answer protocol (``lua/answer.lua``), for any store.

`run_model(store, seed, steps)` drives random interleavings against one session id: answers
begun and streamed in batches of random size, batches sent twice (a retry), twice at once (two
copies), out of order and with holes, replies dropped on purpose (the write ran, the writer does
not know: it retries), the same through the plain live path, answers ended (some with deltas
missing first), a second answer, and the id deleted and created again while an answer of the old
life is still writing. Readers follow the session live (`tail_deltas`), drop at random and resume
from their cursor.

It checks, and raises `AssertionError` on the first violation:

- every refusal is the one the model predicts (an out-of-order batch names the expected index,
  an incomplete end the missing range, another life is refused);
- the log of each life replays every committed answer exactly (its rows, by index, are the text
  sent, once), and holds nothing of another life;
- every reader saw, per answer, exactly a prefix of that answer's text, once and in order, or an
  explicit `DeltaGap` before what it missed — never a delta of another life.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import (
    AnswerIncompleteError,
    AnswerOrderError,
    SessionNotFoundError,
    SessionReplacedError,
    StoreUnavailableError,
)
from ..model import SessionHeader
from ..projection.chunks import Delta, DeltaGap, replay
from ..streaming import tail_deltas

TTL = 60_000


@dataclass
class _Answer:
    id: str
    life: str
    text: list[str]  # every delta the writer means to send
    sent: int = 0  # deltas [0, sent) are acknowledged in the log
    batches: list[tuple[int, int]] = field(default_factory=list)  # (first, count) of each row
    ended: bool = False
    committed: bool = False


@dataclass
class _Reader:
    life: str
    cursor: str | None = None
    got: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    gaps: dict[str, int] = field(default_factory=dict)
    drops: int = 0


@dataclass
class ModelStats:
    ops: int = 0
    batches: int = 0
    retries: int = 0
    refusals: int = 0
    lives: int = 1
    answers: int = 0
    reader_drops: int = 0
    deltas_read: int = 0
    gaps: int = 0


async def run_model(store: Any, seed: int, steps: int = 60, sid: str = "model") -> ModelStats:  # noqa: C901 (one op table)
    rng = random.Random(seed)
    stats = ModelStats()
    await store.create(SessionHeader(id=sid))
    head = await store.head(sid)
    assert head is not None
    life = head.header.incarnation
    answers: list[_Answer] = []
    readers: list[_Reader] = []
    stop = anyio.Event()

    async def read(r: _Reader) -> None:
        while not stop.is_set():
            budget = rng.randint(1, 30)
            try:
                with anyio.move_on_after(rng.uniform(0.05, 0.3)):
                    async for item in tail_deltas(store, sid, 0, incarnation=r.life, live_after=r.cursor):
                        if isinstance(item, Delta):
                            r.got.setdefault(item.answer, []).append((item.index, item.text))
                            r.cursor = item.cursor
                            stats.deltas_read += 1
                            budget -= 1
                        elif isinstance(item, DeltaGap):
                            r.gaps[item.answer] = r.gaps.get(item.answer, 0) + 1
                            r.cursor = item.cursor or r.cursor
                            stats.gaps += 1
                        if budget <= 0:
                            break
            except (SessionReplacedError, SessionNotFoundError):
                return
            r.drops += 1
            stats.reader_drops += 1

    def new_answer() -> _Answer:
        n = rng.randint(1, 40)
        a = _Answer(id=f"a{seed}x{len(answers)}", life=life, text=[f"{len(answers)}.{i} " for i in range(n)])
        answers.append(a)
        stats.answers += 1
        return a

    async def batch(a: _Answer, first: int, count: int, *, live_path: bool = False) -> None:
        ds = [Delta(answer=a.id, index=first + i, kind="text", text=a.text[first + i]) for i in range(count)]
        stats.batches += 1
        if live_path:
            await store.answer_live(sid, a.id, first, ds, incarnation=a.life)
            return
        await store.answer_deltas(sid, a.id, first, ds, ttl_ms=TTL)

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            r = _Reader(life=life)
            readers.append(r)
            tg.start_soon(read, r)
        current = new_answer()
        await store.answer_begin(sid, current.id, ttl_ms=TTL)
        for _ in range(steps):
            stats.ops += 1
            roll = rng.random()
            a = current
            if a.ended or roll < 0.05:
                if not a.ended and rng.random() < 0.5:
                    pass  # leave it open (a writer that went away): a new one begins
                current = a = new_answer()
                await store.answer_begin(sid, a.id, ttl_ms=TTL)
                continue
            left = len(a.text) - a.sent
            if roll < 0.55 and left > 0:  # the next batch, maybe sent twice, maybe its reply "lost"
                count = rng.randint(1, min(left, 8))
                if rng.random() < 0.2:  # two copies at once
                    async with anyio.create_task_group() as two:
                        two.start_soon(batch, a, a.sent, count)
                        two.start_soon(batch, a, a.sent, count)
                    stats.retries += 1
                else:
                    await batch(a, a.sent, count)
                    if rng.random() < 0.2:  # the reply was lost: the writer sends it again
                        await batch(a, a.sent, count)
                        stats.retries += 1
                a.batches.append((a.sent, count))
                a.sent += count
            elif roll < 0.65 and left > 1:  # out of order: a later batch first, or a hole
                skip = rng.randint(1, left - 1)
                try:
                    await batch(a, a.sent + skip, 1)
                    raise AssertionError("a batch past the next index was accepted")
                except AnswerOrderError as e:
                    assert e.expected == a.sent, (e.expected, a.sent)
                    stats.refusals += 1
            elif roll < 0.72 and a.batches:  # a late retry of an earlier batch: a no-op
                first, count = rng.choice(a.batches)
                await batch(a, first, count)
                stats.retries += 1
            elif roll < 0.85:  # the end, maybe before every delta was sent
                total = len(a.text) if rng.random() < 0.3 else a.sent
                try:
                    await store.answer_end(
                        sid, a.id, deltas=total, reason="committed",
                        closing=("assistant/message", {"content": "".join(a.text[:total])}),
                        grace_ms=TTL,
                    )  # fmt: skip
                    assert total == a.sent, "an end with deltas missing was accepted"
                    a.ended = a.committed = True
                    if rng.random() < 0.3:  # its reply lost: the end again is a retry
                        again = await store.answer_end(sid, a.id, deltas=total, reason="committed", grace_ms=TTL)
                        assert again.retry
                except AnswerIncompleteError as e:
                    assert total != a.sent and e.missing == (a.sent, total), (e.missing, a.sent, total)
                    stats.refusals += 1
            elif roll < 0.9:  # delete and create again: the open answer belongs to the old life
                old = a
                await store.delete(sid)
                await store.create(SessionHeader(id=sid))
                head = await store.head(sid)
                assert head is not None
                life = head.header.incarnation
                stats.lives += 1
                r = _Reader(life=life)
                readers.append(r)
                tg.start_soon(read, r)
                if not old.ended and len(old.text) > old.sent:
                    try:
                        await batch(old, old.sent, 1)
                        raise AssertionError("a batch of the old life was accepted")
                    except SessionReplacedError:
                        stats.refusals += 1
                    try:
                        await batch(old, old.sent, 1, live_path=True)  # lands inert: tagged old life
                    except (SessionReplacedError, StoreUnavailableError):
                        pass
                old.ended = True
                current = new_answer()
                await store.answer_begin(sid, current.id, ttl_ms=TTL)
            else:
                await anyio.sleep(rng.uniform(0, 0.02))
        await anyio.sleep(0.3)  # let the readers catch up
        stop.set()
        tg.cancel_scope.cancel()

    # the log of the last life replays its committed answers exactly, and holds no other life's
    entries = await store.read(sid)
    logged = replay(entries)
    mine = {a.id: a for a in answers if a.life == life}
    for aid, chunks in logged.items():
        assert aid in mine, f"an answer of another life in the log: {aid}"
        a = mine[aid]
        assert [c["text"] for c in chunks] == a.text[: len(chunks)], aid
        assert len(chunks) == a.sent, (aid, len(chunks), a.sent)
    # every reader: per answer, a prefix of its text once and in order, or a gap before a jump
    by_id = {a.id: a for a in answers}
    for r in readers:
        for aid, got in r.got.items():
            a = by_id[aid]
            assert a.life == r.life, f"a reader of one life got a delta of another: {aid}"
            indexes = [i for i, _ in got]
            assert indexes == sorted(set(indexes)), (aid, indexes)
            for i, t in got:
                assert t == a.text[i], (aid, i, t)
            expected = list(range(indexes[0], indexes[0] + len(indexes))) if indexes else []
            if indexes != expected or (indexes and indexes[0] != 0):
                assert r.gaps.get(aid) or r.gaps.get(""), f"reader missed deltas of {aid} silently: {indexes}"
    return stats


__all__ = ["ModelStats", "run_model"]
