import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import {
  AnswerTooLargeError,
  Delta,
  DeltaGap,
  InvalidEntryError,
  SessionClient,
  SessionConflictError,
  SessionNotFoundError,
  SessionReplacedError,
  sleep,
  type Entry,
  type JsonObject,
} from '../src/index.js'
import { ADMIN, skip, uid, URL } from './env.js'
import { openTurn as openTurnOf, replay } from './turns.js'

const client = new SessionClient({ url: URL, token: ADMIN })
const WORDS = Array.from({ length: 60 }, (_, i) => `w${i} `)

const openTurn = (id: string): Promise<void> => openTurnOf(client, id)

describe('streaming answers', { skip }, () => {
  it('streams deltas live to a tail, once and in order, and the log replays the text', async () => {
    const id = uid('ts/stream')
    await openTurn(id)
    const ac = new AbortController()
    const got: (Entry | Delta)[] = []
    const reading = (async () => {
      for await (const item of client.tail(id, { start: 3, deltas: true, signal: ac.signal })) {
        if (item instanceof DeltaGap) assert.fail(`a gap: ${JSON.stringify(item)}`)
        got.push(item)
        if (!(item instanceof Delta) && item.type === 'assistant/message') return
      }
    })()
    await sleep(100) // the tail is connected
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 20 })
    try {
      assert.equal(w.begunAt, 3)
      for (const word of WORDS) {
        w.delta(word)
        await sleep(2)
      }
      const written = await w.end({ expectedN: 'writer' })
      assert.equal(written.entries[0]?.type, 'assistant/message')
      const timeout = new AbortController()
      await Promise.race([reading, sleep(10_000, timeout.signal).then(() => assert.fail('the tail saw no message'))])
      timeout.abort()
    } finally {
      ac.abort()
      await reading.catch(() => undefined)
    }

    const deltas = got.filter((x): x is Delta => x instanceof Delta)
    assert.deepEqual(deltas.map((d) => d.index), WORDS.map((_, i) => i)) // every delta once, in order
    assert.deepEqual(deltas.map((d) => d.text), WORDS)
    assert.ok(deltas.every((d) => d.answer === w.answer && d.kind === 'text'))
    const entries = await client.read(id)
    const rows = entries.filter((e) => e.type === 'assistant/chunk')
    assert.ok(rows.length >= 2 && rows.length < WORDS.length, `${rows.length} rows`) // batched
    assert.equal(replay(entries, w.answer).map((c) => c.text).join(''), WORDS.join(''))
    const message = entries[entries.length - 1]
    assert.deepEqual(message?.data.content, [{ type: 'text', text: WORDS.join('') }])
    assert.deepEqual(message?.meta, { answer: w.answer })
  })

  it('resumes a tail after its last delta without gap or repeat', async () => {
    const id = uid('ts/resume')
    await openTurn(id)
    const w = await client.stream(id, { turn: 1, step: 1 })
    w.reasoning('hmm ')
    w.delta('Let me ')
    w.toolCallDelta('c1', 'bash', '{"cmd"')
    await w.flush()
    let last = -1
    let cursor: string | undefined
    const first: Delta[] = []
    const ac = new AbortController()
    for await (const item of client.tail(id, { start: 3, deltas: true, signal: ac.signal })) {
      if (item instanceof DeltaGap) assert.fail('a gap')
      if (item instanceof Delta) {
        first.push(item)
        cursor = item.cursor
        if (first.length === 2) break
      } else last = item.n
    }
    w.toolCallDelta('c1', null, ': "ls"}')
    w.delta('look.')
    await w.flush()
    // a reader coming back mid-answer: after its last delta, not from the answer's start
    const rest: Delta[] = []
    const inc = w.incarnation ?? undefined // a resume names the life it continues
    const options = { lastEventId: last, incarnation: inc, liveAfter: cursor, deltas: true as const, signal: ac.signal }
    try {
      for await (const item of client.tail(id, options)) {
        if (item instanceof Delta) rest.push(item)
        if (rest.length === 3) break
      }
    } finally {
      ac.abort()
    }
    const done = await w.end()
    assert.deepEqual([...first, ...rest].map((d) => [d.index, d.kind, d.text]), [
      [0, 'reasoning', 'hmm '],
      [1, 'text', 'Let me '],
      [2, 'tool-call', '{"cmd"'],
      [3, 'tool-call', ': "ls"}'],
      [4, 'text', 'look.'],
    ])
    assert.equal(rest[0]?.callId, 'c1')
    assert.deepEqual(done.entries[0]?.data.content, [
      { type: 'reasoning', text: 'hmm ' },
      { type: 'text', text: 'Let me look.' },
      { type: 'tool-call', id: 'c1', name: 'bash', arguments: '{"cmd": "ls"}' },
    ])
  })

  it('leaves the interrupted mark on abort, and a stale expected n ends nothing', async () => {
    const id = uid('ts/abort')
    await openTurn(id)
    const w = await client.stream(id, { turn: 1, step: 1 })
    w.delta('half ')
    w.delta('an answer')
    await w.flush()
    await client.append(id, { type: 'user/message', data: { content: 'stop' } })
    const before = (await client.head(id))?.n
    await assert.rejects(w.end({ expectedN: w.n }), SessionConflictError)
    assert.equal((await client.head(id))?.n, before) // nothing written
    const mark = (await w.abort()).entries[0]
    assert.equal(mark?.type, 'assistant/interrupted')
    assert.deepEqual(mark?.data, {
      turn: 1,
      step: 1,
      answer: w.answer,
      reason: 'cancelled',
      deltas: 2,
      content: [{ type: 'text', text: 'half an answer' }],
    })
    assert.throws(() => w.delta('more'), /closed/)
  })
  it('refuses half a surrogate pair at delta() and the answer goes on without it', async () => {
    const id = uid('ts/surrogate')
    await openTurn(id)
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 5 })
    w.delta('Hello ')
    assert.throws(() => w.delta('😀'.slice(0, 1)), (e: unknown) => e instanceof InvalidEntryError && /surrogate/.test(e.message))
    assert.throws(() => w.toolCallDelta('c\uDC00', 'bash', '{}'), InvalidEntryError)
    w.delta('world 😀')
    const message = (await w.end()).entries[0]
    assert.deepEqual(message?.data.content, [{ type: 'text', text: 'Hello world 😀' }])
  })

  it('a batch over what the answer may hold is AnswerTooLargeError, and end() commits what landed', async () => {
    const id = uid('ts/oversize')
    await openTurn(id)
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 5 })
    w.delta('kept ')
    await w.flush()
    w.delta('x'.repeat(1_100_000)) // over the answer's budget on its own (the entry limit is 1 MiB)
    await assert.rejects(w.flush(), (e: unknown) => e instanceof AnswerTooLargeError && e.nextIndex === 1)
    const message = (await w.end()).entries[0]
    assert.equal(message?.type, 'assistant/message')
    assert.deepEqual(message?.data.content, [{ type: 'text', text: 'kept ' }])
  })

  it('a writer whose session was deleted, then re-created, is told it was replaced', async () => {
    const id = uid('ts/relife')
    await openTurn(id)
    const w = await client.stream(id, { turn: 1, step: 1, intervalMs: 5 })
    w.delta('old life ')
    await w.flush()
    assert.equal(await client.delete(id), true)
    w.delta('lost ')
    await assert.rejects(w.flush(), SessionNotFoundError) // gone, for now
    await openTurn(id) // the id's next life
    await assert.rejects(w.flush(), SessionReplacedError)
    await assert.rejects(w.end(), SessionReplacedError)
    const entries = await client.read(id)
    assert.ok(entries.every((e) => e.type !== 'assistant/chunk' && e.type !== 'assistant/message'), 'nothing of the old life')
  })
})
