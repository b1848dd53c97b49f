/**
 * An answer belongs to the life of the id it began in: once the session is deleted and created
 * again, every write of the old writer is `SessionReplacedError` (409 `session_replaced`), checked
 * before anything else the request gets wrong — never `AnswerIncompleteError` because the new
 * life's log does not hold the old answer's rows. And an answer that would outgrow what its message
 * can hold is refused at the batch (`AnswerTooLargeError`), so it can still end with what it has.
 */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import { AnswerIncompleteError, AnswerTooLargeError, InvalidEntryError, SessionClient, SessionReplacedError } from '../src/index.js'
import { ADMIN, skip, uid, URL } from './env.js'
import { openTurn as openTurnOf } from './turns.js'

const client = new SessionClient({ url: URL, token: ADMIN })

describe('an answer of an earlier life', { skip }, () => {
  it('ends, aborts and sends as replaced, never incomplete', async () => {
    const id = uid('ts/lives')
    await openTurnOf(client, id) // three entries: the answer begins at n=3
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 10_000 })
    w.delta('a')
    w.delta('b')
    await w.flush()
    assert.ok(await client.delete(id))
    await client.create({ id }) // the new life: an empty log
    const ended = await w.end().then(
      () => assert.fail('the end of an old life answer succeeded'),
      (e: unknown) => e,
    )
    assert.ok(ended instanceof SessionReplacedError, `${String(ended)}`)
    assert.ok(!(ended instanceof AnswerIncompleteError))
    assert.equal((ended as SessionReplacedError).status, 409)
    await assert.rejects(w.abort(), SessionReplacedError)
    const w2 = await client.stream(id, { turn: 1, step: 1, intervalMs: 10_000 })
    assert.notEqual(w2.incarnation, w.incarnation)
    assert.deepEqual(await client.read(id), [])
    w2.delta('new')
    assert.equal((await w2.end()).entries[0]?.type, 'assistant/message')
  })
})

describe('an answer too large for its message', { skip }, () => {
  it('is refused at the batch that would outgrow it, and ends with what landed', async () => {
    const id = uid('ts/big')
    await openTurnOf(client, id)
    const piece = 'y'.repeat(200 * 1024)
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 10_000 })
    for (let i = 0; i < 4; i++) w.delta(piece)
    await w.flush() // 800 KiB: it fits
    w.delta(piece)
    w.delta(piece)
    const err = await w.flush().then(
      () => assert.fail('the batch over the budget landed'),
      (e: unknown) => e,
    )
    assert.ok(err instanceof AnswerTooLargeError && !(err instanceof InvalidEntryError), `${String(err)}`)
    assert.equal(err.status, 413)
    assert.equal(err.nextIndex, 4)
    assert.ok(err.size > err.limit && err.limit > 1000 * 1024, `${err.size} ${err.limit}`)
    assert.throws(() => w.delta('more'), AnswerTooLargeError)
    const done = await w.end({ expectedN: 'writer' })
    assert.equal(done.entries[0]?.type, 'assistant/message')
    assert.deepEqual(done.entries[0]?.data.content, [{ type: 'text', text: piece.repeat(4) }])
  })
})

describe('calls pinned to a life of the id', { skip }, () => {
  it('branch, fork, repair and the draft refuse a life that is gone, and change nothing', async () => {
    const id = uid('ts/pin')
    const first = await client.create({ id, entries: [{ type: 'turn/end', data: { turn: 1, reason: { kind: 'completed' } } }] })
    const old = first.header.incarnation
    assert.ok(await client.delete(id))
    const now = await client.create({ id, title: 'new life' }) // the id's next life: an empty log
    const refused = async (what: string, call: Promise<unknown>): Promise<void> => {
      const e = await call.then(
        () => assert.fail(`${what} pinned to the old life succeeded`),
        (err: unknown) => err,
      )
      assert.ok(e instanceof SessionReplacedError, `${what}: ${String(e)}`)
      assert.equal((e as SessionReplacedError).status, 409)
    }
    await refused('branch', client.branch(id, 0, { id: `${id}-b`, incarnation: old }))
    await refused('fork', client.fork(id, { id: `${id}-f`, incarnation: old }))
    await refused('repair', client.repair(id, { incarnation: old }))
    await refused('setDraft', client.setDraft(id, { text: 'old' }, { incarnation: old }))
    await refused('draft', client.draft(id, { incarnation: old }))
    assert.equal(await client.head(`${id}-b`), undefined)
    assert.equal(await client.head(`${id}-f`), undefined)
    assert.equal(await client.draft(id), null)
    // the current life: as without a pin
    const inc = now.header.incarnation
    await client.setDraft(id, { text: 'new' }, { incarnation: inc })
    assert.deepEqual(await client.draft(id, { incarnation: inc }), { text: 'new' })
    assert.equal((await client.branch(id, 0, { id: `${id}-b2`, incarnation: inc })).header.parent, id)
    assert.equal((await client.fork(id, { id: `${id}-f2`, incarnation: inc })).header.parent, id)
    assert.deepEqual((await client.repair(id, { incarnation: inc })).entries, [])
  })
})
