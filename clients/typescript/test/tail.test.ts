/** `tail()` and `stream()` against another life of the id, and the answer protocol's refusals
 * (issues 21 §2 and 22), against a real gateway. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import {
  AnswerIncompleteError,
  AnswerOrderError,
  Delta,
  DeltaGap,
  SessionClient,
  SessionReplacedError,
  SessionRewoundError,
  type Entry,
} from '../src/index.js'
import { ADMIN, skip, uid, URL } from './env.js'

const client = new SessionClient({ url: URL, token: ADMIN })
const um = (content: string) => ({ type: 'user/message', data: { content } })

describe('tail and stream across lives', { skip }, () => {
  it('a tail resumed into another life of the id throws SessionReplacedError', async () => {
    const id = uid('ts/life')
    await client.create({ id, entries: [um('OLD-0'), um('OLD-1'), um('OLD-2')] })
    const inc = (await client.head(id))?.header.incarnation ?? undefined
    const seen: string[] = []
    for await (const e of client.tail(id)) {
      seen.push(String(e.data.content))
      if (e.n === 2) break
    }
    await client.delete(id)
    await client.create({ id, entries: [0, 1, 2, 3, 4].map((i) => um(`NEW-${i}`)) })
    // resumed with the life it followed: refused, never NEW-3, NEW-4
    await assert.rejects(async () => {
      for await (const e of client.tail(id, { lastEventId: 2, incarnation: inc })) seen.push(String(e.data.content))
    }, SessionReplacedError)
    // with the event id as the gateway sent it (it names the life)
    await assert.rejects(async () => {
      for await (const e of client.tail(id, { lastEventId: `${inc}:2` })) seen.push(String(e.data.content))
    }, SessionReplacedError)
    // a plain n names no life: it is never read as the new one's
    await assert.rejects(async () => {
      for await (const e of client.tail(id, { lastEventId: 2 })) seen.push(String(e.data.content))
    }, SessionReplacedError)
    assert.deepEqual(seen, ['OLD-0', 'OLD-1', 'OLD-2'])
  })

  it('a tail resumed past the end of its log throws SessionRewoundError; a fresh tail started ahead waits', async () => {
    // a reader given n=0..9 by a server that a failover then rolled back to n=3 must not wait
    // silently for entries 10.. while 3..9 land again with other content
    const id = uid('ts/rewound')
    await client.create({ id, entries: [um('A'), um('B'), um('C')] })
    const inc = (await client.head(id))?.header.incarnation ?? undefined
    await assert.rejects(
      async () => {
        for await (const _ of client.tail(id, { lastEventId: `${inc}:9` })) assert.fail('nothing is given')
      },
      (e: unknown) => e instanceof SessionRewoundError && e.sessionId === id && e.n === 3,
    )
    // resumed exactly at the end: nothing was rolled back, it waits for entry 3
    const atEnd = new AbortController()
    const waited = (async () => {
      for await (const e of client.tail(id, { lastEventId: `${inc}:2`, signal: atEnd.signal })) return e
      return undefined
    })()
    // a fresh tail from n=5 on a log at n=3: "wait for entry 5", never a rollback
    const ahead = new AbortController()
    const first = (async () => {
      for await (const e of client.tail(id, { start: 5, signal: ahead.signal })) return e
      return undefined
    })()
    await client.appendMany(id, [um('D'), um('E'), um('F')])
    const [e3, e5] = await Promise.all([waited, first])
    assert.equal(e3?.n, 3)
    assert.equal(e3?.data.content, 'D')
    assert.equal(e5?.n, 5)
    assert.equal(e5?.data.content, 'F')
  })

  it('a live tail never reads the next life of its id: it throws SessionReplacedError, or ends at the deletion', async () => {
    // the gateway sees either the re-created id (`event: replaced`) or, when it looks between the
    // two requests, the deletion (`event: end`); which one is a matter of timing, never NEW entries
    const id = uid('ts/life2')
    await client.create({ id, entries: [um('OLD-0')] })
    const seen: Entry[] = []
    let outcome = 'ended'
    try {
      for await (const e of client.tail(id)) {
        seen.push(e)
        await client.delete(id)
        await client.create({ id, entries: [um('NEW-0'), um('NEW-1')] })
      }
    } catch (e) {
      if (!(e instanceof SessionReplacedError)) throw e
      outcome = 'replaced'
    }
    assert.ok(['ended', 'replaced'].includes(outcome))
    assert.deepEqual(seen.map((e) => e.data.content), ['OLD-0'])
    // a fresh tail follows the new life from its start
    const fresh: unknown[] = []
    for await (const e of client.tail(id)) {
      fresh.push(e.data.content)
      if (e.n === 1) break
    }
    assert.deepEqual(fresh, ['NEW-0', 'NEW-1'])
  })

  it('an answer of the old life never writes into the new one', async () => {
    const id = uid('ts/life3')
    await client.create({ id })
    const w = await client.stream(id, { intervalMs: 5 })
    w.delta('old ')
    await w.flush()
    await client.delete(id)
    await client.create({ id, entries: [um('new')] })
    w.delta('more')
    await assert.rejects(() => w.flush(), SessionReplacedError)
    assert.deepEqual((await client.read(id)).map((e) => e.type), ['user/message'])
  })

  it('the gateway refuses batches out of order and an end with deltas missing', async () => {
    const id = uid('ts/order')
    await client.create({ id })
    const begun = (await (await client.request('POST', `/sessions/${encodeURIComponent(id)}/answers`, { body: {}, sessionId: id })).json()) as { answer: string }
    const url = `/sessions/${encodeURIComponent(id)}/answers/${begun.answer}`
    const batch = (first: number, text: string) => ({ first_index: first, deltas: [...text].map((t) => ({ text: t })) })
    await assert.rejects(
      () => client.request('POST', `${url}/deltas`, { body: batch(3, 'def'), sessionId: id }),
      (e: unknown) => e instanceof AnswerOrderError && e.expectedIndex === 0,
    )
    await client.request('POST', `${url}/deltas`, { body: batch(0, 'abc'), sessionId: id })
    await assert.rejects(
      () => client.request('POST', `${url}/end`, { body: { reason: 'committed', deltas: 6 }, sessionId: id }),
      (e: unknown) => e instanceof AnswerIncompleteError && e.missing[0] === 3 && e.missing[1] === 6,
    )
    const ac = new AbortController()
    const items: (Entry | Delta | DeltaGap)[] = []
    for await (const item of client.tail(id, { deltas: true, signal: ac.signal })) {
      items.push(item)
      if (item instanceof Delta && item.index === 2) break
    }
    ac.abort()
    assert.deepEqual(items.filter((x) => x instanceof Delta).map((d) => (d as Delta).text), ['a', 'b', 'c'])
  })
})
