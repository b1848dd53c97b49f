/**
 * The flows the seed systems describe, run against a real gateway and server through the stores
 * a pod would swap in: ChatLuna's `ctx.sessions` store (seed 000) and dsh's session store (seed 001).
 */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import {
  ChatLunaSessionStore,
  DshSessionStore,
  SessionClient,
  SessionConflictError,
  SessionForkError,
  type ChatLunaNewEntry,
  type DshSessionEvent,
} from '../src/index.js'
import { ADMIN, skip, uid, URL } from './env.js'

const client = new SessionClient({ url: URL, token: ADMIN })

describe('ChatLuna ctx.sessions store (seed 000)', { skip }, () => {
  const store = new ChatLunaSessionStore(client)

  it('turns with tool calls, a cut, a branch, two writers on one session', async () => {
    const id = uid('chatluna/chat')
    await store.create({ sessionId: id, formatVersion: 1, createdAt: Date.now(), delegationDepth: 0, title: 'weather' })
    assert.equal((await store.head(id))?.n, 0)

    // turn 1: preset mark, user, assistant tool call, tool result, final answer; one put per step
    const turn1: ChatLunaNewEntry[] = [
      { kind: 'mark', name: 'preset/selected', data: { presetId: 'default', revision: 'r1' } },
      { kind: 'message', message: { role: 'user', content: 'Weather in Paris?' }, meta: { turn: 1 } },
      {
        kind: 'message',
        message: {
          role: 'assistant',
          content: null,
          tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'weather', arguments: '{"city":"Paris"}' } }],
        },
        meta: { turn: 1, step: 1, finish: 'tool_calls' },
      },
      { kind: 'message', message: { role: 'tool', tool_call_id: 'call_1', content: '18°C, sunny' }, meta: { turn: 1, step: 1 } },
    ]
    let n = 0
    for (const e of turn1) {
      await store.put(id, n, [{ ...e, n }])
      n++
    }
    await store.put(id, n, [
      { kind: 'message', message: { role: 'assistant', content: 'Sunny, 18°C.' }, meta: { turn: 1, step: 2, finish: 'stop' } },
      { kind: 'mark', name: 'request/context', data: { provider: 'openai', model: 'gpt-4o', contextWindow: 128000 } },
    ])
    n += 2
    const entries = await store.read(id)
    assert.deepEqual(entries.map((e) => e.kind), ['mark', 'message', 'message', 'message', 'message', 'mark'])
    assert.deepEqual(entries.map((e) => e.n), [0, 1, 2, 3, 4, 5])
    const first = entries[2]
    assert.ok(first?.kind === 'message' && first.message.tool_calls?.[0]?.id === 'call_1')
    const openai = (await client.messages(id)) as { role: string; tool_call_id?: string }[]
    assert.deepEqual(openai.map((m) => m.role), ['user', 'assistant', 'tool', 'assistant'])

    // a cut: the projection is the summary followed by the messages from `before`
    await store.put(id, n, [
      { kind: 'message', message: { role: 'user', content: 'And tomorrow?' }, meta: { turn: 2 } },
      { kind: 'cut', data: { before: 6, summary: [{ role: 'user', content: 'Earlier: Paris is sunny, 18°C.' }], reason: 'token_limit' } },
    ])
    n += 2
    const after = (await client.messages(id)) as { role: string; content: string }[]
    assert.deepEqual(after.map((m) => m.content), ['Earlier: Paris is sunny, 18°C.', 'And tomorrow?'])
    assert.equal((await store.head(id))?.lastCut, 7)
    assert.ok((await store.read(id)).some((e) => e.kind === 'cut'))

    // a branch at 4: the parent's [0, 4), then its own; delegationDepth copied unless given
    const branchId = `${id}:branch:retry`
    await store.create(
      { sessionId: branchId, formatVersion: 1, createdAt: Date.now(), parent: id, at: 4, delegationDepth: 1 },
      [{ kind: 'message', message: { role: 'assistant', content: 'Let me check again.' } }],
    )
    const branch = await store.read(branchId)
    assert.deepEqual(branch.map((e) => e.n), [0, 1, 2, 3, 4])
    const bh = await store.head(branchId)
    assert.equal(bh?.parent, id)
    assert.equal(bh?.at, 4)
    assert.equal(bh?.delegationDepth, 1)
    assert.ok((await store.list({ parent: id })).some((h) => h.sessionId === branchId))

    // two writers read the same n; one put wins, the other gets the conflict, reloads and retries
    const head = await store.head(id)
    assert.ok(head)
    const put = (who: string) =>
      store.put(id, head.n, [{ kind: 'message', message: { role: 'user', content: `from ${who}` } }])
    const results = await Promise.allSettled([put('pod-a'), put('pod-b')])
    const lost = results.filter((r) => r.status === 'rejected')
    assert.equal(lost.length, 1)
    const reason = (lost[0] as PromiseRejectedResult).reason
    assert.ok(reason instanceof SessionConflictError)
    assert.equal(reason.sessionId, id)
    assert.equal(reason.expectedN, head.n)
    assert.equal(reason.actualN, head.n + 1)
    const reloaded = await store.head(id)
    await store.put(id, reloaded?.n ?? 0, [{ kind: 'message', message: { role: 'user', content: 'retried' } }])
    assert.equal((await store.head(id))?.n, head.n + 2)
    assert.equal(await store.delete(branchId), true)
    assert.equal(await store.head(branchId), undefined)
  })
})

describe('dsh session store (seed 001)', { skip }, () => {
  const store = new DshSessionStore(client)
  const t = 1_760_000_000_000
  const turn1: DshSessionEvent[] = [
    { type: 'turn/start', seq: 0, time: t, data: { turn: 1, trigger: { kind: 'message', source: { kind: 'user' } } } },
    { type: 'user/message', seq: 1, time: t, data: { content: [{ type: 'text', text: 'list files' }], source: { kind: 'user' } }, surfaceOp: 'append' },
    { type: 'step/start', seq: 2, time: t, data: { turn: 1, step: 1 } },
    {
      type: 'assistant/message',
      seq: 3,
      time: t,
      data: { turn: 1, step: 1, content: [{ type: 'tool-call', id: 'c1', name: 'ls', arguments: '{}' }] },
      surfaceOp: 'append',
    },
    { type: 'tool/call', seq: 4, time: t, data: { turn: 1, step: 1, callId: 'c1', name: 'ls', arguments: '{}' } },
    {
      type: 'tool/result',
      seq: 5,
      time: t,
      data: { turn: 1, step: 1, callId: 'c1', content: [{ type: 'text', text: 'a.txt' }], isError: false },
      surfaceOp: 'append',
      sourceEventSeqs: [4],
    },
    { type: 'step/end', seq: 6, time: t, data: { turn: 1, step: 1 } },
    { type: 'turn/end', seq: 7, time: t, data: { turn: 1, reason: { kind: 'completed' } } },
  ]

  it('seeded create, appends by seq, fork at a turn/end, crash repair on load, two writers', async () => {
    const id = uid('dsh/s')
    const header = await store.create(id, { seed: turn1, meta: { cwd: '/work/repo' } })
    assert.deepEqual(header, { version: 0, id, createdAt: header.createdAt, cwd: '/work/repo' })

    // turn 2 starts and its writer crashes with a tool call unanswered
    const turn2: DshSessionEvent[] = [
      { type: 'turn/start', seq: 8, time: t, data: { turn: 2, trigger: { kind: 'message' } } },
      { type: 'user/message', seq: 9, time: t, data: { content: 'run tests' }, surfaceOp: 'append' },
      { type: 'step/start', seq: 10, time: t, data: { turn: 2, step: 1 } },
      {
        type: 'assistant/message',
        seq: 11,
        time: t,
        data: { turn: 2, step: 1, content: [{ type: 'tool-call', id: 'c2', name: 'sh', arguments: '{"cmd":"npm test"}' }] },
        surfaceOp: 'append',
      },
    ]
    await store.append(id, turn2)
    await assert.rejects(store.append(id, [{ ...turn2[0]!, seq: 3 }]), SessionConflictError) // seq mismatch

    // fork: the default boundary (the last event) is an open turn; an explicit turn/end works
    const open = await store.fork(id).catch((e: unknown) => e)
    assert.ok(open instanceof SessionForkError && open.forkCode === 'OPEN_TURN')
    const bad = await store.fork(id, 99).catch((e: unknown) => e)
    assert.ok(bad instanceof SessionForkError && bad.forkCode === 'INVALID_BOUNDARY')
    const child = await store.fork(id, 7, `${id}-fork`)
    assert.deepEqual(child, { version: 0, id: `${id}-fork`, createdAt: child.createdAt, cwd: '/work/repo', parentSession: id, seedLength: 8 })
    const dup = await store.fork(id, 7, `${id}-fork`).catch((e: unknown) => e)
    assert.ok(dup instanceof SessionForkError && dup.forkCode === 'SESSION_ALREADY_EXISTS')
    const forked = await store.load(`${id}-fork`)
    assert.deepEqual(forked?.events.map((e) => e.seq), [0, 1, 2, 3, 4, 5, 6, 7])
    assert.deepEqual(forked?.events[5], turn1[5])

    // load closes the crashed turn: a synthetic error result for c2, step/end, turn/end interrupted
    const loaded = await store.load(id)
    assert.ok(loaded)
    const tail = loaded.events.slice(12)
    assert.deepEqual(tail.map((e) => e.type), ['tool/result', 'step/end', 'turn/end'])
    const result = tail[0]!.data as { callId: string; isError: boolean; error: { code: string } }
    assert.equal(result.callId, 'c2')
    assert.equal(result.isError, true)
    assert.equal(result.error.code, 'interrupted')
    assert.equal(tail[0]!.surfaceOp, 'append')
    assert.deepEqual((tail[2]!.data as { reason: { kind: string } }).reason.kind, 'interrupted')

    // the next append continues at the next seq; two writers with the same seq: one conflicts
    const next = loaded.events.length
    const turn3 = (who: string): DshSessionEvent[] => [
      { type: 'turn/start', seq: next, time: t, data: { turn: 3, trigger: { kind: 'message' } } },
      { type: 'user/message', seq: next + 1, time: t, data: { content: who }, surfaceOp: 'append' },
    ]
    const both = await Promise.allSettled([store.append(id, turn3('a')), store.append(id, turn3('b'))])
    assert.equal(both.filter((r) => r.status === 'fulfilled').length, 1)
    const reason = (both.find((r) => r.status === 'rejected') as PromiseRejectedResult).reason
    assert.ok(reason instanceof SessionConflictError && reason.expectedN === next && reason.actualN === next + 2)

    const messages = (await client.messages(id)) as { role: string }[]
    assert.deepEqual(messages.map((m) => m.role), ['user', 'assistant', 'tool', 'user', 'assistant', 'tool', 'user'])
    assert.ok((await store.list()).some((h) => h.id === id))
    assert.equal(await store.delete(`${id}-fork`), true)
  })
})
