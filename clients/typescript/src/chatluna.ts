/**
 * ChatLuna's `ctx.sessions` (`@chatluna/session`, seed 000) on the redis-session gateway.
 *
 * Two layers, as ChatLuna has them:
 *
 * - `ChatLunaSessionStore`: the `SessionStore` contract a pod swaps in.
 *
 *       head(id) → SessionHead | undefined
 *       read(id, from?) → entries
 *       put(id, expectedN, entries) → void          // SessionConflictError(sessionId, expectedN, actualN)
 *       create(header, entries?) → void             // SessionAlreadyExistsError; createdAt kept as given
 *       list({parent?, limit?}) → headers
 *       delete(id) → boolean                        // an `admin` token
 *
 * - `ChatLunaSessions`: the service (`ctx.sessions`): `open(id)` (implicit create, an independent
 *   snapshot per call), `create(id?, {parent, at, …})`, `branch(id, at, …)` (title, origin and
 *   delegationDepth from the parent unless given; emits `chatluna/session-branch {parent, session,
 *   at}`), `list`, `head`, `delete`, `define(mark, schema)`, `releaseIfEphemeral(id)` and
 *   `conversations` (conversation key → current SessionId). A `ChatLunaSession` queues its
 *   `write`, `commit` (assistant messages only; clears the draft), `mark` and `compact` in order,
 *   writes at the n it holds (a concurrent writer surfaces as `SessionConflictError`), projects
 *   `messages()` from the last cut (cached until the log grows), checks its invariants on demand
 *   (`checkInvariants`, never on every write) and rebuilds a past request (`reconstructRequest`).
 *
 * Entries keep ChatLuna's shape: `{n, time, kind: 'message', message, meta?}` (stored as type
 * `message`, data the chat message), `{n, time, kind: 'mark', name, data, meta?}` (type = the
 * mark's name) and `{n, time, kind: 'cut', data: {before, summary, reason, native?, meta?}}`
 * (type `cut`). Messages other writers stored under dsh types (`user/message`,
 * `assistant/message`, `tool/result`, `context/message`, `steering/message`) read back as
 * messages too, converted to chat messages (`type` says what was stored).
 */

import { createHash, randomUUID } from 'node:crypto'
import { EventEmitter } from 'node:events'

import { SessionClient, type ClientOptions } from './client.js'
import { InvalidEntryError, SessionAlreadyExistsError, SessionConflictError, SessionNotFoundError } from './errors.js'
import {
  kindOf,
  type ChatMessage,
  type ContentBlock,
  type Entry,
  type Json,
  type JsonObject,
  type NewEntry,
  type SessionHead,
  type SessionHeader,
} from './types.js'

export const CURRENT_SESSION_FORMAT = 1
/** The event `ChatLunaSessions` emits after a branch: `{ parent, session, at }`. */
export const SESSION_BRANCH_EVENT = 'chatluna/session-branch'

export interface ChatLunaSessionHeader {
  sessionId: string
  formatVersion: number
  createdAt: number
  parent?: string
  at?: number
  delegationDepth: number
  title?: string
  origin?: Json
}

export interface ChatLunaSessionHead extends ChatLunaSessionHeader {
  /** number of entries */
  n: number
  updatedAt: number
  lastCut?: number
  incarnation: string
}

export interface CutEntryData {
  before: number
  summary: ChatMessage[]
  reason: string
  native?: unknown
  meta?: Record<string, unknown>
}

interface Base {
  n: number
  time: number
  meta?: JsonObject
}
export type ChatLunaEntry =
  | (Base & { kind: 'message'; message: ChatMessage; /** the stored type when not `message` */ type?: string })
  | (Base & { kind: 'mark'; name: string; data: unknown })
  | (Base & { kind: 'cut'; data: CutEntryData })

/** An entry to `put`: `n` and `time` may be given (n is checked against expectedN + i). */
export type ChatLunaNewEntry =
  | { n?: number; time?: number; meta?: JsonObject; kind: 'message'; message: ChatMessage }
  | { n?: number; time?: number; meta?: JsonObject; kind: 'mark'; name: string; data: unknown }
  | { n?: number; time?: number; meta?: JsonObject; kind: 'cut'; data: CutEntryData }

export function toChatLunaHeader(h: SessionHeader): ChatLunaSessionHeader {
  return {
    sessionId: h.id,
    formatVersion: h.format_version,
    createdAt: h.created_at,
    ...(h.parent !== null ? { parent: h.parent } : {}),
    ...(h.at !== null ? { at: h.at } : {}),
    delegationDepth: h.delegation_depth,
    ...(h.title !== null ? { title: h.title } : {}),
    ...(h.origin !== null ? { origin: h.origin } : {}),
  }
}

function toHead(h: SessionHead): ChatLunaSessionHead {
  return {
    ...toChatLunaHeader(h.header),
    n: h.n,
    updatedAt: h.updated_at,
    ...(h.last_cut !== null ? { lastCut: h.last_cut } : {}),
    incarnation: h.header.incarnation,
  }
}

// --------------------------------------------------------------------------- dsh types as chat messages

function blocksOf(content: unknown): ContentBlock[] {
  if (typeof content === 'string') return content ? [{ type: 'text', text: content }] : []
  return Array.isArray(content) ? (content as ContentBlock[]) : []
}

function textOf(content: unknown): string {
  if (typeof content === 'string') return content
  return blocksOf(content)
    .filter((b) => b.type === 'text')
    .map((b) => (b as { text: string }).text)
    .join('\n')
}

/** A message stored under a dsh type, as the chat message ChatLuna works with. */
export function chatMessageOf(type: string, data: Record<string, unknown>): ChatMessage {
  switch (type) {
    case 'assistant/message': {
      const blocks = blocksOf(data.content)
      const calls = blocks.filter((b) => b.type === 'tool-call') as { id: string; name: string; arguments: string }[]
      const reasoning = blocks.filter((b) => b.type === 'reasoning').map((b) => (b as { text: string }).text)
      const text = textOf(blocks)
      const msg: ChatMessage = { role: 'assistant', content: text || (calls.length ? null : '') }
      if (calls.length) {
        msg.tool_calls = calls.map((c) => ({ id: c.id, type: 'function', function: { name: c.name, arguments: c.arguments } }))
      }
      if (reasoning.length) msg.reasoning_content = reasoning.join('\n')
      return msg
    }
    case 'tool/result':
      return { role: 'tool', tool_call_id: String(data.callId ?? ''), content: textOf(data.content) }
    case 'user/message':
    case 'context/message':
    case 'steering/message': {
      const content = data.content
      const parts = blocksOf(content)
      const msg: ChatMessage = {
        role: 'user',
        content: typeof content === 'string' || parts.every((b) => b.type === 'text') ? textOf(content) : parts,
      }
      if (data.source !== undefined) msg.source = data.source
      return msg
    }
    default:
      return data as unknown as ChatMessage
  }
}

export function toChatLunaEntry(e: Entry): ChatLunaEntry {
  const base: Base = { n: e.n, time: e.time, ...(e.meta !== undefined ? { meta: e.meta } : {}) }
  if (e.type === 'message') return { ...base, kind: 'message', message: e.data as unknown as ChatMessage }
  if (e.type === 'cut') return { ...base, kind: 'cut', data: e.data as unknown as CutEntryData }
  if (kindOf(e.type) === 'message') {
    return { ...base, kind: 'message', message: chatMessageOf(e.type, e.data), type: e.type }
  }
  return { ...base, kind: 'mark', name: e.type, data: e.data }
}

export function fromChatLunaEntry(e: ChatLunaNewEntry, index = 0): NewEntry<unknown> {
  const common = { ...(e.meta !== undefined ? { meta: e.meta } : {}), ...(e.time !== undefined ? { time: e.time } : {}) }
  switch (e.kind) {
    case 'message':
      return { type: 'message', data: e.message, ...common }
    case 'cut':
      return { type: 'cut', data: e.data, ...common }
    case 'mark':
      if (typeof e.data !== 'object' || e.data === null || Array.isArray(e.data)) {
        throw new InvalidEntryError(`entry ${index}: a mark's data must be a JSON object`)
      }
      return { type: e.name, data: e.data, ...common }
  }
}

// --------------------------------------------------------------------------- the store contract

export class ChatLunaSessionStore {
  readonly client: SessionClient

  constructor(options: ClientOptions | SessionClient) {
    this.client = options instanceof SessionClient ? options : new SessionClient(options)
  }

  async head(id: string): Promise<ChatLunaSessionHead | undefined> {
    const h = await this.client.head(id)
    return h === undefined ? undefined : toHead(h)
  }

  /** Entries from `from` (default 0) to the end; a branch reads its parent's prefix first. */
  async read(id: string, from = 0): Promise<readonly ChatLunaEntry[]> {
    return (await this.client.read(id, from)).map(toChatLunaEntry)
  }

  /** Append `entries` at `expectedN`, all or nothing; `SessionConflictError` when the log moved. */
  async put(id: string, expectedN: number, entries: readonly ChatLunaNewEntry[]): Promise<void> {
    await this.append(id, expectedN, entries)
  }

  /** `put`, answering the stored entries (their n and server time); `incarnation` pins the life. */
  async append(
    id: string,
    expectedN: number,
    entries: readonly ChatLunaNewEntry[],
    incarnation?: string,
  ): Promise<ChatLunaEntry[]> {
    const batch = entries.map((e, i) => {
      if (e.n !== undefined && e.n !== expectedN + i) {
        throw new InvalidEntryError(`entry ${i}: n=${e.n}, but it lands at n=${expectedN + i}`)
      }
      return fromChatLunaEntry(e, i)
    })
    if (batch.length === 0) return []
    const written = await this.client.appendMany(id, batch, {
      expectedN,
      idempotencyKey: writeKey(id, incarnation, expectedN, batch),
      ...(incarnation !== undefined ? { incarnation } : {}),
    })
    return written.entries.map(toChatLunaEntry)
  }

  /**
   * Create a session. A header with `parent` and `at` makes a branch holding the parent's entries
   * [0, at) (`delegationDepth`, `title` and `origin` default to the parent's); `entries` then
   * follow from n = at. A root's `createdAt` is kept as given (0: the server's clock).
   */
  async create(header: ChatLunaSessionHeader, entries: readonly ChatLunaNewEntry[] = [], ttl?: number): Promise<void> {
    if (header.parent !== undefined) {
      const at = header.at ?? 0
      await this.client.branch(header.parent, at, {
        id: header.sessionId,
        ...(header.title !== undefined ? { title: header.title } : {}),
        ...(header.origin !== undefined ? { origin: header.origin } : {}),
        ...(header.delegationDepth !== undefined ? { delegationDepth: header.delegationDepth } : {}),
      })
      await this.put(header.sessionId, at, entries)
      return
    }
    await this.client.create({
      id: header.sessionId,
      ...(header.title !== undefined ? { title: header.title } : {}),
      ...(header.origin !== undefined ? { origin: header.origin } : {}),
      ...(header.createdAt ? { createdAt: header.createdAt } : {}),
      ...(ttl !== undefined ? { ttl } : {}),
      delegationDepth: header.delegationDepth ?? 0,
      entries: entries.map((e, i) => {
        if (e.n !== undefined && e.n !== i) throw new InvalidEntryError(`entry ${i}: n=${e.n}, but it lands at n=${i}`)
        return fromChatLunaEntry(e, i)
      }),
    })
  }

  async list(options: { parent?: string; limit?: number } = {}): Promise<readonly ChatLunaSessionHeader[]> {
    const out: ChatLunaSessionHeader[] = []
    const limit = options.limit ?? Infinity
    for await (const h of this.client.listAll(options.parent !== undefined ? { parent: options.parent } : {})) {
      out.push(toChatLunaHeader(h))
      if (out.length >= limit) break
    }
    return out
  }

  async delete(id: string): Promise<boolean> {
    return this.client.delete(id)
  }
}

// --------------------------------------------------------------------------- marks and their schemas

/**
 * A mark's schema: called with the mark's data, it throws (as a Schemastery schema does) or
 * returns `false` / an error string when the data does not fit.
 */
export type MarkSchema = (data: unknown) => unknown

type Obj = Record<string, unknown>
const isObj = (d: unknown): d is Obj => typeof d === 'object' && d !== null && !Array.isArray(d)
const str = (d: Obj, k: string) => typeof d[k] === 'string'
const int = (d: Obj, k: string) => Number.isInteger(d[k])
const opt = (d: Obj, k: string, ok: (d: Obj, k: string) => boolean) => d[k] === undefined || ok(d, k)

function shape(name: string, fields: string, ok: (d: Obj) => boolean): MarkSchema {
  return (d) => (isObj(d) && ok(d) ? true : `${name} needs ${fields}`)
}

/** ChatLuna's marks as its doc writes them (checked with `strict`; `define` replaces one). */
export const CHATLUNA_MARKS: Readonly<Record<string, MarkSchema>> = {
  prompt: shape('prompt', '{header: ChatEpochHeader, turn?, step?, reason?, sources?}', (d) => d.header === undefined || isObj(d.header)),
  'preset/selected': shape('preset/selected', '{presetId: string, revision: string}', (d) => str(d, 'presetId') && str(d, 'revision')),
  'request/context': shape(
    'request/context',
    '{provider: string, model: string, contextWindow?: number}',
    (d) => str(d, 'provider') && str(d, 'model') && opt(d, 'contextWindow', int),
  ),
  'agent/input-enqueued': shape(
    'agent/input-enqueued',
    "{messageId: string, message: any, target: 'next-turn' | 'next-step', wakeup: boolean, enqueuedAt: number}",
    (d) =>
      str(d, 'messageId') &&
      'message' in d &&
      (d.target === 'next-turn' || d.target === 'next-step') &&
      typeof d.wakeup === 'boolean' &&
      typeof d.enqueuedAt === 'number',
  ),
  'agent/input-admitted': shape('agent/input-admitted', '{messageId: string, n: number}', (d) => str(d, 'messageId') && int(d, 'n')),
  'agent/input-discarded': shape('agent/input-discarded', '{messageId: string, reason: string}', (d) => str(d, 'messageId') && str(d, 'reason')),
  'turn-skip': shape(
    'turn-skip',
    '{reason: string, detail?: string, turn?: number}',
    (d) => str(d, 'reason') && opt(d, 'detail', str) && opt(d, 'turn', int),
  ),
}

// --------------------------------------------------------------------------- projection, invariants, requests

function usableNative(native: unknown): ChatMessage[] | undefined {
  const isMessages = (v: unknown): v is ChatMessage[] =>
    Array.isArray(v) && v.every((m) => isObj(m) && typeof m.role === 'string')
  if (isMessages(native)) return native
  if (isObj(native) && native.unusable !== true && isMessages(native.messages)) return native.messages
  return undefined
}

/** ChatLuna's projection: the last cut's summary (or its usable `native`), then every message from its `before`. */
export function projectMessages(entries: readonly ChatLunaEntry[]): ChatMessage[] {
  let start = 0
  let out: ChatMessage[] = []
  for (let i = entries.length - 1; i >= 0; i--) {
    const e = entries[i]
    if (e?.kind === 'cut') {
      out = [...(usableNative(e.data.native) ?? e.data.summary)]
      start = e.data.before
      break
    }
  }
  for (const e of entries) if (e.kind === 'message' && e.n >= start) out.push(e.message)
  return out
}

function jsonSafe(value: unknown, path: string, seen: Set<unknown>): string | undefined {
  if (value === null || typeof value === 'string' || typeof value === 'boolean') return undefined
  if (typeof value === 'number') return Number.isFinite(value) ? undefined : `${path} is ${value}`
  if (typeof value !== 'object') return `${path} is a ${typeof value}`
  if (seen.has(value)) return `${path} is a cycle`
  seen.add(value)
  try {
    if (Array.isArray(value)) {
      for (let i = 0; i < value.length; i++) {
        const bad = jsonSafe(value[i], `${path}[${i}]`, seen)
        if (bad) return bad
      }
      return undefined
    }
    for (const [k, v] of Object.entries(value)) {
      if (v === undefined) return `${path}.${k} is undefined`
      const bad = jsonSafe(v, `${path}.${k}`, seen)
      if (bad) return bad
    }
    return undefined
  } finally {
    seen.delete(value)
  }
}

/**
 * The log invariants `doctor` and exports check (ChatLuna runs them on demand, never on every
 * write): n strictly contiguous from 0, each cut's `before` an integer in [0, its n], every payload
 * safe to serialise as JSON. An empty list means none is broken.
 */
export function checkInvariants(entries: readonly ChatLunaEntry[]): string[] {
  const problems: string[] = []
  entries.forEach((e, i) => {
    if (e.n !== i) problems.push(`entry ${i}: n=${e.n}, expected ${i} (n is contiguous from 0)`)
    if (e.kind === 'cut') {
      const b = e.data.before
      if (!Number.isInteger(b) || b < 0 || b > e.n) problems.push(`entry ${i}: cut.before=${String(b)} is not an integer in [0, ${e.n}]`)
    }
    const payload = e.kind === 'message' ? e.message : e.data
    const bad = jsonSafe(payload, e.kind === 'message' ? 'message' : 'data', new Set()) ?? jsonSafe(e.meta ?? null, 'meta', new Set())
    if (bad) problems.push(`entry ${i}: ${bad}`)
  })
  return problems
}

/** The fields of a prompt's header that decide its epoch (and `promptDigest`). */
export const DIGEST_FIELDS = ['provider', 'model', 'reasoningEffort', 'temperature', 'maxTokens', 'stop', 'system', 'prelude', 'tools'] as const

function canonical(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(canonical)
  if (isObj(value)) {
    const out: Obj = {}
    for (const k of Object.keys(value).sort()) if (value[k] !== undefined) out[k] = canonical(value[k])
    return out
  }
  return value
}

/**
 * SHA-256 (hex) of the canonical JSON (sorted keys, no spaces) of the header's provider, model,
 * reasoningEffort, temperature, maxTokens, stop, system, prelude and tools — each from the header,
 * else its `config`; absent, null and empty alike. The same digest as the Python
 * `redis_session.projection.request.prompt_digest`.
 */
export function promptDigest(header: Record<string, unknown>): string {
  const config = isObj(header.config) ? header.config : {}
  const picked: Obj = {}
  for (const key of DIGEST_FIELDS) {
    let value = key in header ? header[key] : config[key]
    if (key === 'prelude' && (value === undefined || value === null)) value = header.messagePrefix
    if (value === undefined || value === '' || (Array.isArray(value) && value.length === 0)) value = null
    picked[key] = value
  }
  return createHash('sha256').update(JSON.stringify(canonical(picked))).digest('hex')
}

export interface ReconstructedRequest {
  /** the n the request was made at */
  at: number
  /** the prompt mark in force (at `at`, else the last one before it), or undefined */
  prompt?: { n: number; data: Record<string, unknown> }
  /** its header (ChatEpochHeader), or undefined */
  header?: Record<string, unknown>
  /** the history the model saw: the projection of entries [0, at) */
  history: ChatMessage[]
  /** what was sent: the system prompt, the prelude, then the history */
  messages: ChatMessage[]
  /** `promptDigest(header)`, or undefined without a prompt mark */
  promptDigest?: string
}

/** Rebuild the request made at entry `atN` from the prompt mark there (or the last one before it). */
export function reconstructRequest(entries: readonly ChatLunaEntry[], atN: number): ReconstructedRequest {
  if (!Number.isInteger(atN) || atN < 0 || atN > entries.length) {
    throw new InvalidEntryError(`reconstructRequest: atN=${atN} is outside [0, ${entries.length}]`)
  }
  let prompt: { n: number; data: Record<string, unknown> } | undefined
  for (let i = Math.min(atN, entries.length - 1); i >= 0; i--) {
    const e = entries[i]
    if (e?.kind === 'mark' && e.name === 'prompt' && isObj(e.data)) {
      prompt = { n: e.n, data: e.data }
      break
    }
  }
  const history = projectMessages(entries.slice(0, atN))
  const header = prompt ? (isObj(prompt.data.header) ? prompt.data.header : prompt.data) : undefined
  const system = header && typeof header.system === 'string' && header.system ? [{ role: 'system' as const, content: header.system }] : []
  const prelude = header && Array.isArray(header.prelude) ? (header.prelude as ChatMessage[]) : []
  return {
    at: atN,
    ...(prompt ? { prompt } : {}),
    ...(header ? { header, promptDigest: promptDigest(header) } : {}),
    history,
    messages: [...system, ...prelude, ...history],
  }
}

// --------------------------------------------------------------------------- the service

export interface ChatLunaCreateOptions {
  parent?: string
  at?: number
  title?: string
  origin?: Json
  delegationDepth?: number
  createdAt?: number
  /** an ephemeral session: it expires `ephemeralTtl` seconds after its last write, and
   * `releaseIfEphemeral` deletes it */
  ephemeral?: boolean
  entries?: readonly ChatLunaNewEntry[]
}

export interface ChatLunaSessionsOptions {
  /** refuse marks without a schema, and check ChatLuna's own marks with every documented field */
  strict?: boolean
  /** seconds an ephemeral session lives after its last write (default 3600) */
  ephemeralTtl?: number
}

/** `ctx.sessions`: sessions as ChatLuna's service hands them out. */
export class ChatLunaSessions extends EventEmitter {
  readonly store: ChatLunaSessionStore
  readonly strict: boolean
  readonly ephemeralTtl: number
  readonly conversations: ChatLunaConversations
  private readonly schemas = new Map<string, MarkSchema>(Object.entries(CHATLUNA_MARKS))
  private readonly ephemeral = new Set<string>()

  constructor(store: ChatLunaSessionStore | SessionClient | ClientOptions, options: ChatLunaSessionsOptions = {}) {
    super()
    this.store = store instanceof ChatLunaSessionStore ? store : new ChatLunaSessionStore(store)
    this.strict = options.strict ?? false
    this.ephemeralTtl = options.ephemeralTtl ?? 3600
    this.conversations = new ChatLunaConversations(this.store.client)
  }

  /** Register (or replace) the schema a mark's data is checked against before it is written. */
  define(markName: string, schema: MarkSchema): void {
    if (!markName || markName === 'message' || markName === 'cut') throw new InvalidEntryError(`cannot define a mark named ${JSON.stringify(markName)}`)
    this.schemas.set(markName, schema)
  }

  /** Check a batch before it is written: marks against their schemas (`InvalidEntryError`). */
  check(entries: readonly ChatLunaNewEntry[]): void {
    entries.forEach((e, i) => {
      if (e.kind !== 'mark') return
      const schema = this.schemas.get(e.name)
      if (schema === undefined) {
        if (this.strict) throw new InvalidEntryError(`entry ${i}: unknown mark ${JSON.stringify(e.name)} (strict: define() it first)`)
        return
      }
      const builtin = CHATLUNA_MARKS[e.name] === schema
      if (builtin && !this.strict) return // ChatLuna's marks are checked field by field in strict mode only
      let verdict: unknown
      try {
        verdict = schema(e.data)
      } catch (err) {
        throw new InvalidEntryError(`entry ${i}: mark ${e.name}: ${err instanceof Error ? err.message : String(err)}`)
      }
      if (verdict === false || typeof verdict === 'string') {
        throw new InvalidEntryError(`entry ${i}: mark ${e.name}: ${typeof verdict === 'string' ? verdict : 'data does not fit its schema'}`)
      }
    })
  }

  async head(sessionId: string): Promise<ChatLunaSessionHead | undefined> {
    return this.store.head(sessionId)
  }

  async list(options: { parent?: string; limit?: number } = {}): Promise<readonly ChatLunaSessionHeader[]> {
    return this.store.list(options)
  }

  /** Delete a session and all its entries (`admin` token); true when there was one. */
  async delete(sessionId: string): Promise<boolean> {
    this.ephemeral.delete(sessionId)
    return this.store.delete(sessionId)
  }

  /**
   * The session `sessionId` as a new, independent snapshot: read whole when it exists, else
   * created (implicitly). Two `open`s of one id are two instances; their writes meet at the store,
   * where the later one gets `SessionConflictError`.
   */
  async open(sessionId: string): Promise<ChatLunaSession> {
    for (let attempt = 0; ; attempt++) {
      const head = await this.store.client.head(sessionId)
      if (head !== undefined) {
        const entries = await this.store.read(sessionId)
        return new ChatLunaSession(this, head, entries)
      }
      try {
        return await this.create(sessionId)
      } catch (e) {
        // another pod created it first: open that one
        if (!(e instanceof SessionAlreadyExistsError) || attempt >= 2) throw e
      }
    }
  }

  /**
   * Create a session (`id` default `session-<uuid>`). With `parent` and `at` it is a branch
   * holding the parent's entries [0, at); `delegationDepth`, `origin` and `title` not given are the
   * parent's. `createdAt` is kept as given.
   */
  async create(id?: string, options: ChatLunaCreateOptions = {}): Promise<ChatLunaSession> {
    const sessionId = id ?? `session-${randomUUID()}`
    if (options.parent !== undefined) return this.branch(options.parent, options.at ?? 0, { ...options, id: sessionId })
    const entries = options.entries ?? []
    this.check(entries)
    await this.store.create(
      {
        sessionId,
        formatVersion: CURRENT_SESSION_FORMAT,
        createdAt: options.createdAt ?? 0,
        delegationDepth: options.delegationDepth ?? 0,
        ...(options.title !== undefined ? { title: options.title } : {}),
        ...(options.origin !== undefined ? { origin: options.origin } : {}),
      },
      entries,
      options.ephemeral ? this.ephemeralTtl : undefined,
    )
    if (options.ephemeral) this.ephemeral.add(sessionId)
    return this.open(sessionId)
  }

  /**
   * Branch `sessionId` at `at` (0 <= at <= its n): a new session holding its entries [0, at), id
   * `<parent>:branch:<8 hex>` unless given; title, origin and delegationDepth are the parent's
   * unless given. Emits `chatluna/session-branch` with `{ parent, session, at }`.
   */
  async branch(
    sessionId: string,
    at: number,
    options: { id?: string; title?: string; origin?: Json; delegationDepth?: number; entries?: readonly ChatLunaNewEntry[] } = {},
  ): Promise<ChatLunaSession> {
    const parent = await this.store.head(sessionId)
    if (parent === undefined) throw new SessionNotFoundError(sessionId)
    if (!Number.isInteger(at) || at < 0 || at > parent.n) {
      throw new InvalidEntryError(`branch point at=${at} is outside [0, ${parent.n}]`)
    }
    const entries = options.entries ?? []
    this.check(entries)
    const head = await this.store.client.branch(sessionId, at, {
      ...(options.id !== undefined ? { id: options.id } : {}),
      title: options.title ?? parent.title ?? null,
      ...(options.origin !== undefined || parent.origin !== undefined ? { origin: options.origin ?? parent.origin ?? null } : {}),
      delegationDepth: options.delegationDepth ?? parent.delegationDepth,
    })
    if (entries.length) await this.store.put(head.id, at, entries)
    this.emit(SESSION_BRANCH_EVENT, { parent: sessionId, session: head.id, at })
    return this.open(head.id)
  }

  /**
   * Release a session this service created ephemeral (ChatLuna calls this when only memory backs
   * its sessions): delete it now instead of waiting for its expiry. True when it was released;
   * false for a session that is not ephemeral (it stays).
   */
  async releaseIfEphemeral(sessionId: string): Promise<boolean> {
    if (!this.ephemeral.has(sessionId)) return false
    this.ephemeral.delete(sessionId)
    await this.store.delete(sessionId)
    return true
  }

  /** Whether this service created `sessionId` ephemeral (and has not released it). */
  isEphemeral(sessionId: string): boolean {
    return this.ephemeral.has(sessionId)
  }
}

/** One session, as `ChatLunaSessions.open` hands it out: a snapshot that writes in order. */
export class ChatLunaSession {
  readonly id: string
  readonly header: ChatLunaSessionHeader
  /** the life of the id this instance belongs to: it never writes to a re-created session */
  readonly incarnation: string
  private list: ChatLunaEntry[]
  private queue: Promise<unknown> = Promise.resolve()
  private cachedAt = -1
  private cached: ChatMessage[] = []

  constructor(
    readonly sessions: ChatLunaSessions,
    head: SessionHead,
    entries: readonly ChatLunaEntry[],
  ) {
    this.id = head.id
    this.header = toChatLunaHeader(head.header)
    this.incarnation = head.header.incarnation
    this.list = [...entries]
  }

  /** The entries this instance holds (what it read, then what it wrote). */
  get entries(): readonly ChatLunaEntry[] {
    return this.list
  }

  /** The next entry's n (the expected n of the next write). */
  get n(): number {
    return this.list.length
  }

  private enqueue<T>(job: () => Promise<T>): Promise<T> {
    const run = this.queue.then(job, job)
    this.queue = run.catch(() => undefined)
    return run
  }

  /**
   * Append `entries` at this instance's n, after every earlier write of it. A concurrent writer
   * makes it throw `SessionConflictError` (reopen to see its entries); nothing is written then.
   */
  write(entries: readonly ChatLunaNewEntry[]): Promise<ChatLunaEntry[]> {
    return this.enqueue(async () => {
      this.sessions.check(entries)
      const stored = await this.sessions.store.append(this.id, this.list.length, entries, this.incarnation)
      this.list.push(...stored)
      return stored
    })
  }

  /** Write one mark. */
  async mark(name: string, data: unknown, meta?: JsonObject): Promise<ChatLunaEntry> {
    const [e] = await this.write([{ kind: 'mark', name, data, ...(meta !== undefined ? { meta } : {}) }])
    return e as ChatLunaEntry
  }

  /** Commit the model's answer: an `assistant` message only; the draft is cleared after it lands. */
  commit(message: ChatMessage, meta?: JsonObject): Promise<ChatLunaEntry> {
    if (message.role !== 'assistant') {
      return Promise.reject(new InvalidEntryError(`commit takes an assistant message, got role ${JSON.stringify(message.role)}`))
    }
    return this.enqueue(async () => {
      const stored = await this.sessions.store.append(
        this.id,
        this.list.length,
        [{ kind: 'message', message, ...(meta !== undefined ? { meta } : {}) }],
        this.incarnation,
      )
      this.list.push(...stored)
      await this.sessions.store.client.setDraft(this.id, null)
      return stored[0] as ChatLunaEntry
    })
  }

  /** Write a cut (compaction): the projection becomes `summary` (or a usable `native`) + messages from `before`. */
  compact(data: CutEntryData): Promise<ChatLunaEntry> {
    return this.enqueue(async () => {
      if (!Number.isInteger(data.before) || data.before < 0 || data.before > this.list.length) {
        throw new InvalidEntryError(`cut.before=${data.before} is outside [0, ${this.list.length}]`)
      }
      const stored = await this.sessions.store.append(this.id, this.list.length, [{ kind: 'cut', data }], this.incarnation)
      this.list.push(...stored)
      return stored[0] as ChatLunaEntry
    })
  }

  /** The model's context: the last cut's summary, then the messages from its `before`. Recomputed
   * only when the log grew (`cachedAt !== entries.length`); a new cut recomputes it whole. */
  messages(): ChatMessage[] {
    if (this.cachedAt !== this.list.length) {
      const fresh = this.list.slice(Math.max(this.cachedAt, 0))
      if (this.cachedAt < 0 || fresh.some((e) => e.kind === 'cut')) {
        this.cached = projectMessages(this.list)
      } else {
        for (const e of fresh) if (e.kind === 'message') this.cached.push(e.message)
      }
      this.cachedAt = this.list.length
    }
    return [...this.cached]
  }

  /** `checkInvariants` of the entries this instance holds (for doctor and exports). */
  checkInvariants(): string[] {
    return checkInvariants(this.list)
  }

  /** The request made at entry `atN`: the prompt mark there (or before it), its digest, the messages. */
  reconstructRequest(atN: number): ReconstructedRequest {
    return reconstructRequest(this.list, atN)
  }
}

/**
 * The idempotency key of a write: the same for the same batch at the same n of the same life, so
 * a retry after a lost reply (the caller writes the same entries again, or the handle's queue
 * re-runs it) gets the entries that landed instead of a `SessionConflictError` from its own first
 * attempt; another batch at that n gets another key, and so the conflict.
 */
function writeKey(id: string, incarnation: string | undefined, expectedN: number, batch: readonly unknown[]): string {
  const digest = createHash('sha256').update(JSON.stringify([id, incarnation ?? '', expectedN, batch])).digest('hex')
  return `chatluna:${expectedN}:${digest.slice(0, 40)}`
}

// --------------------------------------------------------------------------- conversations

/**
 * The session id a conversation key is stored under: characters ids forbid, invisible format
 * characters (Unicode Cf, refused in new ids) and `%`, as %XX (the Python `escape_key`).
 */
function keySessionId(key: string): string {
  const mapped = key.replace(/[{}%\s\u0000-\u001f\u007f\u0085\p{Cf}]/gu, (c) =>
    [...Buffer.from(c, 'utf8')].map((b) => `%${b.toString(16).toUpperCase().padStart(2, '0')}`).join(''),
  )
  return `chatluna/conversation/${mapped}`
}

const CURRENT = 'conversation/current'

/**
 * `conversations`: a conversation key (a channel, a user) → the SessionId it currently uses. Each
 * key is a small log of `conversation/current {sessionId}` marks (so its history is kept, and two
 * pods switching one key at once see a conflict instead of losing one switch).
 */
export class ChatLunaConversations {
  constructor(readonly client: SessionClient) {}

  /** The SessionId `key` maps to, or undefined. */
  async get(key: string): Promise<string | undefined> {
    const id = keySessionId(key)
    const head = await this.client.head(id)
    if (head === undefined || head.n === 0) return undefined
    const [last] = await this.client.read(id, head.n - 1)
    const sid = last?.data.sessionId
    return typeof sid === 'string' ? sid : undefined
  }

  /**
   * Map `key` to `sessionId`. With `expected` (the SessionId the caller last saw, or null for
   * none) the switch only happens when the mapping is still that: else `SessionConflictError`.
   */
  async set(key: string, sessionId: string, expected?: string | null): Promise<void> {
    const id = keySessionId(key)
    let head = await this.client.head(id)
    if (head === undefined) {
      try {
        head = await this.client.create({ id, title: key })
      } catch (e) {
        if (!(e instanceof SessionAlreadyExistsError)) throw e
        head = await this.client.head(id)
        if (head === undefined) throw e
      }
    }
    if (expected !== undefined) {
      const current = await this.get(key)
      if ((current ?? null) !== expected) {
        throw new SessionConflictError(id, head.n, head.n, { conversation: key, current: current ?? null, expected })
      }
    }
    await this.client.append(id, { type: CURRENT, data: { sessionId } }, { expectedN: head.n, incarnation: head.header.incarnation })
  }

  /** Forget `key` (its log is deleted; an `admin` token). */
  async delete(key: string): Promise<boolean> {
    return this.client.delete(keySessionId(key))
  }
}
