/**
 * An answer belongs to the life of the id it began in: once the session is deleted and created
 * again, every write of the old writer is `SessionReplacedError` (409 `session_replaced`), checked
 * before anything else the request gets wrong — never `AnswerIncompleteError` because the new
 * life's log does not hold the old answer's rows.
 */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import { AnswerIncompleteError, SessionClient, SessionReplacedError } from '../src/index.js'
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
