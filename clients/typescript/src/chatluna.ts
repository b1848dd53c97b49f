/**
 * `ChatLunaSessionStore`: ChatLuna's `SessionStore` (the `ctx.sessions` store contract of
 * `@chatluna/session`) on the redis-session gateway, so a ChatLuna pod swaps its store.
 *
 *     head(id) → SessionHead | undefined
 *     read(id, from?) → entries
 *     put(id, expectedN, entries) → void          // SessionConflictError(sessionId, expectedN, actualN)
 *     create(header, entries?) → void             // SessionAlreadyExistsError
 *     list({parent?, limit?}) → headers
 *     delete(id) → boolean                        // an `admin` token
 *
 * Entries keep ChatLuna's shape: `{n, time, kind: 'message', message, meta?}` (stored as type
 * `message`, data the chat message), `{n, time, kind: 'mark', name, data, meta?}` (type = the
 * mark's name) and `{n, time, kind: 'cut', data: {before, summary, reason, native?, meta?}}`
 * (type `cut`). Entries other writers stored under dsh types read back as marks named by type.
 */

import { SessionClient, type ClientOptions } from './client.js'
import { InvalidEntryError } from './errors.js'
import type { ChatMessage, Entry, Json, JsonObject, NewEntry, SessionHead, SessionHeader } from './types.js'

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
  | (Base & { kind: 'message'; message: ChatMessage })
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

export function toChatLunaEntry(e: Entry): ChatLunaEntry {
  const base: Base = { n: e.n, time: e.time, ...(e.meta !== undefined ? { meta: e.meta } : {}) }
  if (e.type === 'message') return { ...base, kind: 'message', message: e.data as unknown as ChatMessage }
  if (e.type === 'cut') return { ...base, kind: 'cut', data: e.data as unknown as CutEntryData }
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
    const batch = entries.map((e, i) => {
      if (e.n !== undefined && e.n !== expectedN + i) {
        throw new InvalidEntryError(`entry ${i}: n=${e.n}, but it lands at n=${expectedN + i}`)
      }
      return fromChatLunaEntry(e, i)
    })
    if (batch.length === 0) return
    await this.client.appendMany(id, batch, { expectedN })
  }

  /**
   * Create a session. A header with `parent` and `at` makes a branch holding the parent's entries
   * [0, at) (`delegationDepth` defaults to the parent's); `entries` then follow from n = at.
   * `createdAt` is the server's clock.
   */
  async create(header: ChatLunaSessionHeader, entries: readonly ChatLunaNewEntry[] = []): Promise<void> {
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
