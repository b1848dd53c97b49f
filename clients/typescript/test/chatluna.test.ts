/**
 * ChatLuna's `ctx.sessions` (seed 000), flow by flow, against a real gateway and server: each test
 * asserts what the doc says.
 */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'

import {
  ChatLunaSessions,
  ChatLunaSessionStore,
  checkInvariants,
  InvalidEntryError,
  promptDigest,
  SESSION_BRANCH_EVENT,
  SessionClient,
  SessionAlreadyExistsError,
  SessionConflictError,
  SessionError,
  type ChatLunaEntry,
} from '../src/index.js'
import { ADMIN, uid, URL } from './env.js'

const client = new SessionClient({ url: URL, token: ADMIN })
const HEADER = {
  provider: 'openai',
  model: 'gpt-4o',
  temperature: 0.7,
  system: 'You are helpful.',
  tools: [{ type: 'function', function: { name: 'weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }],
  maxTokens: 1024,
  prelude: [{ role: 'user', content: 'Answer briefly.' }],
}
/** what Python's redis_session.projection.request.prompt_digest gives for HEADER (and the second epoch) */
const PY_DIGEST = 'e31fc1ee0cdbf78c8af7a13f9d7e49aea5bb12dad6b809ce1383797bddd01278'
const PY_DIGEST_2 = 'd25ded3aae7648f6eb66d532541d3fb6daddf58b8bd1c100995ce2c3876cf71d'

describe('ChatLuna ctx.sessions service (seed 000)', () => {
  const sessions = new ChatLunaSessions(client)

  it('the header keeps a given createdAt (formatVersion 1, delegationDepth 0)', async () => {
    const store = new ChatLunaSessionStore(client)
    const id = uid('cl/created')
    await store.create({ sessionId: id, formatVersion: 1, createdAt: 1_700_000_000_123, delegationDepth: 0 })
    const head = await store.head(id)
    assert.equal(head?.createdAt, 1_700_000_000_123)
    assert.equal(head?.formatVersion, 1)
    const s = await sessions.create(uid('cl/created'), { createdAt: 1_600_000_000_000 })
    assert.equal(s.header.createdAt, 1_600_000_000_000)
  })

  it('dsh-style message types written by another writer read back as messages, not marks', async () => {
    const id = uid('cl/dsh')
    await client.create({ id })
    await client.appendMany(id, [
      { type: 'user/message', data: { content: [{ type: 'text', text: 'list files' }], source: { kind: 'user' } } },
      {
        type: 'assistant/message',
        data: { content: [{ type: 'text', text: 'looking' }, { type: 'tool-call', id: 'c1', name: 'ls', arguments: '{}' }] },
      },
      { type: 'tool/result', data: { callId: 'c1', content: [{ type: 'text', text: 'a.txt' }] } },
      { type: 'turn/end', data: { turn: 1, reason: 'completed' } },
    ])
    const s = await sessions.open(id)
    assert.deepEqual(s.entries.map((e) => e.kind), ['message', 'message', 'message', 'mark'])
    const [user, assistant, tool] = s.entries as ChatLunaEntry[]
    assert.ok(user?.kind === 'message' && user.type === 'user/message')
    assert.deepEqual(user.message.content, 'list files')
    assert.ok(assistant?.kind === 'message')
    assert.equal(assistant.message.content, 'looking')
    assert.deepEqual(assistant.message.tool_calls, [{ id: 'c1', type: 'function', function: { name: 'ls', arguments: '{}' } }])
    assert.ok(tool?.kind === 'message')
    assert.deepEqual(tool.message, { role: 'tool', tool_call_id: 'c1', content: 'a.txt' })
    assert.deepEqual(s.messages().map((m) => m.role), ['user', 'assistant', 'tool'])
  })

  it('open() creates a missing session implicitly and hands out independent snapshots', async () => {
    const id = uid('cl/open')
    assert.equal(await sessions.head(id), undefined)
    const a = await sessions.open(id) // implicit create
    assert.equal((await sessions.head(id))?.n, 0)
    const b = await sessions.open(id)
    assert.notEqual(a, b)
    await a.write([{ kind: 'message', message: { role: 'user', content: 'from a' } }])
    assert.equal(a.n, 1)
    assert.equal(b.n, 0) // b is its own snapshot: a's write does not move it
    await assert.rejects(
      b.write([{ kind: 'message', message: { role: 'user', content: 'from b' } }]),
      (e: unknown) => e instanceof SessionConflictError && e.expectedN === 0 && e.actualN === 1,
    )
    assert.equal(b.n, 0)
    const c = await sessions.open(id) // reopened: sees a's entry
    assert.deepEqual(c.messages(), [{ role: 'user', content: 'from a' }])
    // the serial queue: writes issued together land in issue order
    await Promise.all([c.mark('turn-skip', { reason: 'x' }), c.write([{ kind: 'message', message: { role: 'user', content: 'next' } }])])
    assert.deepEqual(c.entries.map((e) => e.n), [0, 1, 2])
    assert.equal(c.entries[1]?.kind, 'mark')
  })

  it('commit takes only an assistant message, and clears the draft', async () => {
    const s = await sessions.open(uid('cl/commit'))
    await s.write([{ kind: 'message', message: { role: 'user', content: 'hi' } }])
    await client.setDraft(s.id, { content: 'Hel' })
    assert.deepEqual(await client.draft(s.id), { content: 'Hel' })
    await assert.rejects(s.commit({ role: 'user', content: 'not mine' }), InvalidEntryError)
    assert.equal((await sessions.head(s.id))?.n, 1) // nothing written
    const e = await s.commit({ role: 'assistant', content: 'Hello!' }, { finish: 'stop' })
    assert.equal(e.n, 1)
    assert.equal(await client.draft(s.id), null)
    assert.deepEqual(s.messages().at(-1), { role: 'assistant', content: 'Hello!' })
  })

  it('checkInvariants runs on demand: contiguous n, cut.before in [0, n], JSON-safe payloads', async () => {
    const s = await sessions.open(uid('cl/inv'))
    await s.write([
      { kind: 'message', message: { role: 'user', content: 'q' } },
      { kind: 'message', message: { role: 'assistant', content: 'a' } },
    ])
    await s.compact({ before: 2, summary: [{ role: 'user', content: 'summary' }], reason: 'manual' })
    assert.deepEqual(s.checkInvariants(), [])
    // a broken log (as a doctor may meet one): each rule reports
    const bad: ChatLunaEntry[] = [
      { n: 0, time: 1, kind: 'message', message: { role: 'user', content: 'q' } },
      { n: 2, time: 2, kind: 'cut', data: { before: 5, summary: [], reason: 'x' } },
      { n: 2, time: 3, kind: 'mark', name: 'm', data: { x: Number.NaN } },
    ]
    const problems = checkInvariants(bad)
    assert.equal(problems.length, 3, problems.join('\n'))
    assert.ok(problems.some((p) => p.includes('n=2, expected 1')))
    assert.ok(problems.some((p) => p.includes('cut.before=5')))
    assert.ok(problems.some((p) => p.includes('NaN')))
  })

  it('reconstructRequest(atN) rebuilds the request from the prompt mark, with its promptDigest', async () => {
    const s = await sessions.open(uid('cl/request'))
    await s.mark('prompt', { header: HEADER, turn: 1, step: 1, reason: 'user', sources: [] })
    await s.write([{ kind: 'message', message: { role: 'user', content: 'Weather in Paris?' } }])
    await s.commit({ role: 'assistant', content: 'Sunny.' })
    const second = { ...HEADER, model: 'gpt-4o-mini', config: { x: 1 } }
    await s.mark('prompt', { header: second, turn: 2, step: 1, reason: 'user', sources: [] })
    await s.write([{ kind: 'message', message: { role: 'user', content: 'And tomorrow?' } }])
    const first = s.reconstructRequest(2) // the model call that answered n=1
    assert.equal(first.prompt?.n, 0)
    assert.equal(first.promptDigest, PY_DIGEST)
    assert.equal(promptDigest(HEADER), PY_DIGEST)
    assert.deepEqual(first.messages, [
      { role: 'system', content: 'You are helpful.' },
      { role: 'user', content: 'Answer briefly.' },
      { role: 'user', content: 'Weather in Paris?' },
    ])
    const later = s.reconstructRequest(5)
    assert.equal(later.prompt?.n, 3)
    assert.equal(later.promptDigest, PY_DIGEST_2) // another epoch: another digest
    assert.deepEqual(later.history.map((m) => m.content), ['Weather in Paris?', 'Sunny.', 'And tomorrow?'])
    const start = s.reconstructRequest(0) // the prompt mark at n=0 is the request made there
    assert.deepEqual(start.history, [])
    assert.equal(start.promptDigest, PY_DIGEST)
    // fields outside the digest (turn, reason, sources) and key order do not change it
    const reordered = Object.fromEntries(Object.entries(HEADER).reverse())
    assert.equal(promptDigest({ ...reordered, extra: 'x' }), PY_DIGEST)
  })

  it('define(mark, schema) checks a mark before anything is written; strict refuses undefined marks', async () => {
    const local = new ChatLunaSessions(client)
    local.define('plugin/rating', (d) => {
      const v = (d as { stars?: unknown }).stars
      if (!Number.isInteger(v) || (v as number) < 1 || (v as number) > 5) throw new Error('stars must be 1..5')
      return true
    })
    const s = await local.open(uid('cl/define'))
    await assert.rejects(s.mark('plugin/rating', { stars: 9 }), /stars must be 1\.\.5/)
    assert.equal((await local.head(s.id))?.n, 0)
    await s.mark('plugin/rating', { stars: 4 })
    await s.mark('plugin/other', { free: true }) // lenient: an undefined mark is any object
    const strict = new ChatLunaSessions(client, { strict: true })
    const t = await strict.open(uid('cl/define-strict'))
    await assert.rejects(t.mark('plugin/other', { free: true }), /unknown mark/)
    strict.define('plugin/other', () => true)
    await t.mark('plugin/other', { free: true })
    assert.equal((await strict.head(t.id))?.n, 1)
  })

  it('strict: preset/selected needs its revision, agent/input-enqueued every documented field', async () => {
    const strict = new ChatLunaSessions(client, { strict: true })
    const s = await strict.open(uid('cl/strict'))
    await assert.rejects(s.mark('preset/selected', { presetId: 'default' }), /revision/)
    await assert.rejects(s.mark('agent/input-enqueued', { messageId: 'm1', message: { role: 'user', content: 'hi' } }), /target/)
    assert.equal((await strict.head(s.id))?.n, 0)
    await s.mark('preset/selected', { presetId: 'default', revision: 'r3' })
    await s.mark('agent/input-enqueued', {
      messageId: 'm1',
      message: { role: 'user', content: 'hi' },
      target: 'next-turn',
      wakeup: true,
      enqueuedAt: Date.now(),
    })
    await s.mark('agent/input-admitted', { messageId: 'm1', n: 2 })
    assert.equal((await strict.head(s.id))?.n, 3)
    // lenient (the default): older writers that left fields out still write
    const lenient = await sessions.open(uid('cl/lenient'))
    await lenient.mark('preset/selected', { presetId: 'default' })
  })

  it('a branch copies [0, at), inherits title, origin and delegationDepth, and emits chatluna/session-branch', async () => {
    const parentId = uid('cl/parent')
    const parent = await sessions.create(parentId, { title: 'weather', origin: { platform: 'discord', guild: 42 }, delegationDepth: 2 })
    await parent.write([
      { kind: 'message', message: { role: 'user', content: 'q1' } },
      { kind: 'message', message: { role: 'assistant', content: 'a1' } },
      { kind: 'message', message: { role: 'user', content: 'q2' } },
    ])
    const events: unknown[] = []
    sessions.on(SESSION_BRANCH_EVENT, (e) => events.push(e))
    const child = await sessions.branch(parentId, 2)
    assert.match(child.id, new RegExp(`^${parentId}:branch:[0-9a-f]{8}$`))
    assert.deepEqual(child.header.title, 'weather')
    assert.deepEqual(child.header.origin, { platform: 'discord', guild: 42 })
    assert.equal(child.header.delegationDepth, 2)
    assert.equal(child.header.parent, parentId)
    assert.equal(child.header.at, 2)
    assert.deepEqual(child.messages().map((m) => m.content), ['q1', 'a1'])
    assert.deepEqual(events, [{ parent: parentId, session: child.id, at: 2 }])
    // given fields win; create(id, {parent, at}) is a branch too
    const sub = await sessions.create(uid('cl/sub'), { parent: parentId, at: 1, title: 'sub', delegationDepth: 3 })
    assert.equal(sub.header.title, 'sub')
    assert.deepEqual(sub.header.origin, { platform: 'discord', guild: 42 })
    assert.equal(sub.header.delegationDepth, 3)
    assert.equal(events.length, 2)
    await assert.rejects(sessions.branch(parentId, 4), InvalidEntryError)
  })

  it('compact writes a cut: messages() restart from its summary; the cache follows the log', async () => {
    const s = await sessions.open(uid('cl/cut'))
    await s.write([
      { kind: 'message', message: { role: 'user', content: 'q1' } },
      { kind: 'message', message: { role: 'assistant', content: 'a1' } },
      { kind: 'message', message: { role: 'user', content: 'q2' } },
    ])
    assert.equal(s.messages().length, 3)
    await s.compact({ before: 2, summary: [{ role: 'user', content: 'earlier: q1/a1' }], reason: 'token_limit' })
    assert.deepEqual(s.messages().map((m) => m.content), ['earlier: q1/a1', 'q2'])
    await s.commit({ role: 'assistant', content: 'a2' })
    assert.deepEqual(s.messages().map((m) => m.content), ['earlier: q1/a1', 'q2', 'a2'])
    // an unusable native block falls back to the summary; a usable one is used
    await s.compact({ before: 4, summary: [{ role: 'user', content: 'sum' }], reason: 'x', native: { unusable: true } })
    assert.deepEqual(s.messages().map((m) => m.content), ['sum', 'a2'])
    await s.compact({ before: 5, summary: [{ role: 'user', content: 'sum' }], reason: 'x', native: [{ role: 'user', content: 'native' }] })
    assert.deepEqual(s.messages().map((m) => m.content), ['native'])
    // the gateway's projection agrees (entries before the cut stay in the log)
    const reopened = await sessions.open(s.id)
    assert.deepEqual(reopened.messages(), s.messages())
    assert.equal(reopened.entries.length, 7)
  })

  it('conversations map a key to its current SessionId', async () => {
    const key = `discord:guild 42 {general} ${uid('k')}`
    assert.equal(await sessions.conversations.get(key), undefined)
    const first = await sessions.open(uid('cl/conv'))
    await sessions.conversations.set(key, first.id, null)
    assert.equal(await sessions.conversations.get(key), first.id)
    const second = await sessions.open(uid('cl/conv'))
    await assert.rejects(sessions.conversations.set(key, second.id, 'someone-else'), SessionConflictError)
    await sessions.conversations.set(key, second.id, first.id) // /new: the key moves on
    assert.equal(await sessions.conversations.get(key), second.id)
    assert.equal(await sessions.conversations.delete(key), true)
    assert.equal(await sessions.conversations.get(key), undefined)
  })

  it('conversation keys with invisible format characters or C1 controls are escaped, not refused', async () => {
    // a channel title may hold a zero-width joiner, a bidi mark or a soft hyphen: new ids refuse
    // them (two ids would look the same), so the key's session id holds them as %XX
    for (const c of ['\u200d', '\u202e', '\u00ad', '\ufeff', '\u0085']) {
      const key = `telegram:${c}${uid('k')}`
      const plain = key.replace(c, '')
      const s = await sessions.open(uid('cl/conv'))
      await sessions.conversations.set(key, s.id, null)
      assert.equal(await sessions.conversations.get(key), s.id)
      assert.equal(await sessions.conversations.get(plain), undefined) // another key, another session
    }
  })

  it('releaseIfEphemeral deletes an ephemeral session and keeps any other', async () => {
    const temp = await sessions.create(uid('cl/temp'), { ephemeral: true })
    const kept = await sessions.create(uid('cl/kept'))
    assert.equal(sessions.isEphemeral(temp.id), true)
    assert.equal(await sessions.releaseIfEphemeral(kept.id), false)
    assert.ok(await sessions.head(kept.id))
    assert.equal(await sessions.releaseIfEphemeral(temp.id), true)
    assert.equal(await sessions.head(temp.id), undefined)
    assert.equal(await sessions.releaseIfEphemeral(temp.id), false)
  })

  it('after delete, open(id) starts a new, empty session', async () => {
    const id = uid('cl/gone')
    const s = await sessions.open(id)
    await s.write([{ kind: 'message', message: { role: 'user', content: 'old' } }])
    assert.equal(await sessions.delete(id), true)
    const again = await sessions.open(id)
    assert.equal(again.n, 0)
    assert.notEqual(again.incarnation, s.incarnation)
    // the old handle never writes into the new life
    await assert.rejects(s.write([{ kind: 'message', message: { role: 'user', content: 'stale' } }]))
    assert.equal((await sessions.head(id))?.n, 0)
  })

  it('a retry after a lost reply gets the entries that landed, not a conflict (seed: idempotency key per write)', async () => {
    let drop = 0
    const lossy: typeof fetch = async (url, init) => {
      const r = await fetch(url, init)
      if (drop > 0 && init?.method === 'POST' && String(url).includes('/entries')) {
        drop--
        await r.text()
        throw new TypeError('fetch failed') // the write landed; its reply is lost
      }
      return r
    }
    const S = new ChatLunaSessions(new SessionClient({ url: URL, token: ADMIN, fetch: lossy }))
    const id = uid('cl/lost')
    const s = await S.open(id)
    await s.write([{ kind: 'message', message: { role: 'user', content: 'Weather in Paris?' } }])
    drop = 1
    await assert.rejects(s.commit({ role: 'assistant', content: 'Sunny.' }))
    assert.equal(s.n, 1) // the handle does not know yet
    const e = await s.commit({ role: 'assistant', content: 'Sunny.' }) // the caller retries
    assert.equal(e.n, 1)
    assert.equal(s.n, 2)
    assert.deepEqual(s.messages().map((m) => m.content), ['Weather in Paris?', 'Sunny.'])
    assert.deepEqual((await client.read(id)).map((x) => (x.data as { content: string }).content), ['Weather in Paris?', 'Sunny.'])
    // a lost write() is the same; another batch at a taken n is still a conflict
    drop = 1
    await assert.rejects(s.write([{ kind: 'message', message: { role: 'user', content: 'And Rome?' } }]))
    await s.write([{ kind: 'message', message: { role: 'user', content: 'And Rome?' } }])
    assert.equal(s.n, 3)
    const other = await S.open(id)
    await other.write([{ kind: 'message', message: { role: 'user', content: 'from another pod' } }])
    await assert.rejects(s.write([{ kind: 'message', message: { role: 'user', content: 'late' } }]), SessionConflictError)
    assert.equal((await client.read(id)).length, 4)
  })

  it('open(id) of a deleted parent with a live branch says why the id is taken (seed)', async () => {
    const id = uid('cl/hidden')
    const p = await sessions.open(id)
    await p.write([{ kind: 'message', message: { role: 'user', content: 'q' } }])
    const b = await sessions.branch(id, 1)
    await sessions.delete(id)
    assert.equal(await sessions.head(id), undefined)
    await assert.rejects(sessions.open(id), (e: Error) => {
      assert.ok(e instanceof SessionAlreadyExistsError, String(e))
      assert.match(e.message, /was deleted, but its branches/)
      assert.ok(e.message.includes(b.id), e.message)
      return true
    })
    // the branch still reads the parent's entries; once it is gone the id is free
    assert.deepEqual((await sessions.open(b.id)).messages().map((m) => m.content), ['q'])
    await sessions.delete(b.id)
    assert.equal((await sessions.open(id)).n, 0)
  })

  it("ids '.' and '..' are refused when created (URL parsers drop such path segments) (seed)", async () => {
    for (const id of ['.', '..']) {
      await assert.rejects(client.create({ id }), (e: Error) => {
        assert.ok(e instanceof SessionError && e.status === 400, String(e))
        assert.match(e.message, /dots/)
        return true
      })
      for (const call of [() => sessions.open(id), () => client.head(id), () => client.read(id), () => client.delete(id)]) {
        await assert.rejects(call(), (e: Error) => e instanceof SessionError && e.status === 400 && /dots/.test(e.message))
      }
    }
  })
})
