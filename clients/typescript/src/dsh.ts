/**
 * `DshSessionStore`: a dsh (DeepSeek harness) session persistence backend on the redis-session
 * gateway, so a dsh pod swaps its store. It keeps dsh's event envelope `{type, seq, time, data,
 * surfaceOp?, sourceEventSeqs?}` (seq = the entry's n) and its persistence contract:
 *
 *     create(id?, {seed?, meta?}) → header           // seed events from seq 0; "already exists"
 *     load(id) → {header, events} | undefined       // closes a crashed writer's open turn first
 *     append(id, events)                             // first seq must be the stored next seq
 *     fork(source, boundary?, childSessionId?)       // SessionForkError(msg, code), nothing created
 *     list() → headers of sessions with events;  delete(id) → boolean
 *
 * The header is dsh's `{version: 0, id, createdAt, cwd?, parentSession?, seedLength?}`: `cwd` and
 * any other `meta` travel in the session's `origin`; a fork's child reads its parent's `cwd`.
 */

import { SessionClient, type ClientOptions } from './client.js'
import { InvalidEntryError, SessionError } from './errors.js'
import { MESSAGE_TYPES, type Entry, type JsonObject, type NewEntry, type SessionHead, type Surface } from './types.js'

export interface DshSessionHeader {
  version: 0
  id: string
  createdAt: number
  cwd?: string
  parentSession?: string
  seedLength?: number
}

export interface DshSessionEvent<D = unknown> {
  type: string
  seq: number
  time: number
  data: D
  surfaceOp?: Surface['surfaceOp']
  sourceEventSeqs?: number[]
}

export function toDshEvent(e: Entry): DshSessionEvent {
  const ev: DshSessionEvent = { type: e.type, seq: e.n, time: e.time, data: e.data }
  if (MESSAGE_TYPES.has(e.type) && e.type !== 'message') ev.surfaceOp = e.surface?.surfaceOp ?? 'append'
  if (e.surface?.sourceEventSeqs !== undefined) ev.sourceEventSeqs = e.surface.sourceEventSeqs
  return ev
}

export function fromDshEvent(ev: DshSessionEvent): NewEntry<unknown> {
  const surface: Surface = {}
  if (ev.surfaceOp !== undefined) surface.surfaceOp = ev.surfaceOp
  if (ev.sourceEventSeqs !== undefined) surface.sourceEventSeqs = ev.sourceEventSeqs
  return {
    type: ev.type,
    data: ev.data,
    time: ev.time,
    ...(Object.keys(surface).length > 0 ? { surface } : {}),
  }
}

function checkSeqs(events: readonly DshSessionEvent[], first: number): void {
  events.forEach((ev, i) => {
    if (ev.seq !== first + i) {
      throw new InvalidEntryError(`seq mismatch: event ${i} has seq ${ev.seq}, expected ${first + i}`)
    }
  })
}

export class DshSessionStore {
  readonly client: SessionClient

  constructor(options: ClientOptions | SessionClient) {
    this.client = options instanceof SessionClient ? options : new SessionClient(options)
  }

  private async header(h: SessionHead): Promise<DshSessionHeader> {
    const origin = (h.header.origin ?? {}) as JsonObject
    let cwd = typeof origin.cwd === 'string' ? origin.cwd : undefined
    if (cwd === undefined && h.header.parent !== null) {
      const parent = await this.client.head(h.header.parent)
      const po = (parent?.header.origin ?? {}) as JsonObject
      if (typeof po.cwd === 'string') cwd = po.cwd
    }
    return {
      version: 0,
      id: h.id,
      createdAt: h.header.created_at,
      ...(cwd !== undefined ? { cwd } : {}),
      ...(h.header.parent !== null ? { parentSession: h.header.parent, seedLength: h.header.at ?? 0 } : {}),
    }
  }

  /** A new session (default id `session-<hex>`), seeded with `seed` (seq 0, 1, … exactly). */
  async create(id?: string, options: { seed?: readonly DshSessionEvent[]; meta?: JsonObject } = {}): Promise<DshSessionHeader> {
    const seed = options.seed ?? []
    checkSeqs(seed, 0)
    const head = await this.client.create({
      ...(id !== undefined ? { id } : {}),
      ...(options.meta !== undefined ? { origin: options.meta } : {}),
      entries: seed.map(fromDshEvent),
    })
    return this.header(head)
  }

  /** The session's header and events, after closing a turn a crashed writer left open
   * (dsh `interruptedTurnClosers`); undefined when there is no such session. */
  async load(id: string): Promise<{ header: DshSessionHeader; events: DshSessionEvent[] } | undefined> {
    const head = await this.client.head(id)
    if (head === undefined) return undefined
    try {
      await this.client.repair(id)
    } catch (e) {
      if (!(e instanceof SessionError && e.code === 'lease_held')) throw e // a live writer: leave its turn open
    }
    const events = (await this.client.read(id)).map(toDshEvent)
    return { header: await this.header(head), events }
  }

  /** Append a batch whose first seq is the stored next seq (else `SessionConflictError`, "seq mismatch"). */
  async append(id: string, events: readonly DshSessionEvent[]): Promise<void> {
    const first = events[0]
    if (first === undefined) return
    checkSeqs(events, first.seq)
    await this.client.appendMany(id, events.map(fromDshEvent), { expectedN: first.seq })
  }

  /** dsh fork: a child holding the source's events [0, boundary] (boundary a `turn/end`,
   * default the last event); `SessionForkError` with its code, and no child, on any error. */
  async fork(source: string | { id: string }, boundary?: number, childSessionId?: string): Promise<DshSessionHeader> {
    const id = typeof source === 'string' ? source : source.id
    const head = await this.client.fork(id, {
      ...(boundary !== undefined ? { boundary } : {}),
      ...(childSessionId !== undefined ? { id: childSessionId } : {}),
    })
    return this.header(head)
  }

  /** Headers of the sessions that have events. */
  async list(): Promise<DshSessionHeader[]> {
    const out: DshSessionHeader[] = []
    for await (const h of this.client.listAll()) {
      const head = await this.client.head(h.id)
      if (head !== undefined && head.n > 0) out.push(await this.header(head))
    }
    return out
  }

  async delete(id: string): Promise<boolean> {
    return this.client.delete(id)
  }
}
