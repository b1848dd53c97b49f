/**
 * `SessionClient`: the redis-session gateway over HTTP, with the Python API's guarantees.
 *
 * Every append can carry the expected n (`If-Match`): a stale one throws `SessionConflictError`
 * with the expected and actual n and writes nothing. An `idempotencyKey` makes a retry of the
 * same request return the first answer instead of writing twice. `transact` runs the reload /
 * rebuild / retry loop with jittered backoff; `tail` follows a session over SSE and resumes after
 * a dropped connection with `Last-Event-ID`, without gap or repeat.
 */

import { errorFor, SessionError, SessionNotFoundError, SessionReplacedError, SessionRewoundError, UnavailableError } from './errors.js'
import { parseSse } from './sse.js'
import { AnswerWriter, type AnswerBegun, type DeltaKind, type Post, type StreamOptions } from './stream.js'
import type {
  Entry,
  Json,
  JsonObject,
  MessageFormat,
  NewEntry,
  Page,
  SessionHead,
  SessionHeader,
  Written,
} from './types.js'

export interface ClientOptions {
  /** the gateway's base URL, e.g. `http://127.0.0.1:8765` */
  url: string
  /** bearer token */
  token?: string
  /** a fetch implementation (default: the global one) */
  fetch?: typeof fetch
}

export interface WriteOptions {
  /** the n the log must be at (`If-Match`); undefined or null: append at the end whatever n is */
  expectedN?: number | null
  /** a retry with the same key and body returns the first answer, never writes twice */
  idempotencyKey?: string
  /** only write to this life of the id (`header.incarnation`); else `SessionReplacedError` */
  incarnation?: string
  signal?: AbortSignal
}

export interface CreateOptions {
  id?: string
  title?: string | null
  origin?: Json
  delegationDepth?: number
  /** seconds: an ephemeral session, expiring that long after its last write */
  ttl?: number
  /** ms since the epoch, kept as given (default: the server's clock) */
  createdAt?: number
  entries?: NewEntry<unknown>[]
  idempotencyKey?: string
}

export interface BranchOptions {
  /** the branch's id (default `<parent>:branch:<hex>`) */
  id?: string
  title?: string | null
  origin?: Json
  delegationDepth?: number
  idempotencyKey?: string
  /** only branch this life of the parent (`header.incarnation`); else `SessionReplacedError` */
  incarnation?: string
}

export interface ForkOptions {
  /** the boundary entry, a `turn/end` (default: the last entry) */
  boundary?: number
  /** the child's id (default `<parent>:branch:<hex>`) */
  id?: string
  idempotencyKey?: string
  /** only fork this life of the source (`header.incarnation`); else `SessionReplacedError` */
  incarnation?: string
}

/** `incarnation`: only this life of the id (`header.incarnation`); another one (the id deleted
 * and created again) is `SessionReplacedError` (409), and nothing is read or written. */
export interface LifeOptions {
  incarnation?: string
}

export interface TailOptions {
  /** first n to deliver (default 0) */
  start?: number
  /** resume after this event: the id as the gateway sent it (`<incarnation>:<n>`, or
   * `<incarnation>:<n>/<live id>` with deltas), or an entry n together with `incarnation`; the
   * resume is refused with `SessionReplacedError` when the id now names another life (takes
   * precedence over `start`) */
  lastEventId?: number | string
  /** the life of the session to follow (`header.incarnation`): another one throws
   * `SessionReplacedError` (default: the one the first event names) */
  incarnation?: string
  signal?: AbortSignal
  /** called with the streaming draft when it changes (null when cleared) */
  onDraft?: (draft: JsonObject | null) => void
  /** reconnect attempts in a row before giving up (default: unlimited) */
  maxRetries?: number
  /** the deltas of streamed answers too (`Delta`, SSE `?deltas=1`), as they are streamed */
  deltas?: boolean
  /** with `deltas`: resume right after this delta (`Delta.cursor`), with `lastEventId` */
  liveAfter?: string
}

/** A tail could not be given deltas `start` .. `stop - 1` of `answer` (SSE `event: gap`): the live
 * stream no longer holds them; the log's `assistant/chunk` rows hold every delta of the answer, in
 * order. `stop` null: up to the answer's end; `answer` empty: the resume cursor itself was gone,
 * so deltas of answers it cannot name may be missing. */
export class DeltaGap {
  constructor(
    readonly answer: string,
    readonly start: number,
    readonly stop: number | null,
  ) {}
}

const EVENT_ID = /^(?:([0-9A-Za-z_.-]{1,64}):)?(-1|[0-9]{1,15})(?:\/([0-9]{1,20}-[0-9]{1,20}))?$/

/** One delta of a streamed answer, as `tail(id, {deltas: true})` yields it between the entries. */
export class Delta {
  constructor(
    /** the answer's id (its chunk rows and its closing entry carry it too) */
    readonly answer: string,
    /** the delta's place in its answer: 0, 1, 2 … */
    readonly index: number,
    readonly kind: DeltaKind,
    /** a piece of text, of reasoning, or of a tool call's JSON arguments */
    readonly text: string,
    /** its live stream id: resume after it (`liveAfter`) */
    readonly cursor: string,
    readonly callId?: string,
    readonly name?: string,
  ) {}
}

export interface TransactOptions {
  retries?: number
  baseDelayMs?: number
  maxDelayMs?: number
}

const READ_PAGE = 10_000

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason)
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort)
      resolve()
    }, ms)
    const onAbort = () => {
      clearTimeout(timer)
      reject(signal?.reason)
    }
    signal?.addEventListener('abort', onAbort, { once: true })
  })
}

/** Full-jitter exponential backoff: a random wait in [0, min(max, base * 2^attempt)). */
export function backoff(attempt: number, baseMs = 5, maxMs = 500): number {
  return Math.random() * Math.min(maxMs, baseMs * 2 ** attempt)
}

export class SessionClient {
  readonly url: string
  private readonly token: string | undefined
  private readonly fetchFn: typeof fetch

  constructor(options: ClientOptions) {
    this.url = options.url.replace(/\/+$/, '')
    this.token = options.token
    this.fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis)
  }

  // ------------------------------------------------------------------ plumbing

  private path(id: string, sub = ''): string {
    // fetch drops a "." or ".." path segment (/sessions/./entries is /sessions/entries): the
    // gateway refuses such ids, and no request for one may reach another route
    if (id === '.' || id === '..') {
      throw new SessionError(`session id ${JSON.stringify(id)} is not allowed: a URL path segment of only dots is removed by URL parsers`, 400, 'bad_request')
    }
    return `/sessions/${encodeURIComponent(id)}${sub ? `/${sub}` : ''}`
  }

  /**
   * An id this call creates (create, branch, fork): no invisible format character (Unicode
   * category Cf: zero-width ones, bidirectional controls, the BOM), the gateway's rule for new
   * ids, so two ids that look the same name one session. Sessions created under such an id
   * before the rule are still read, written and deleted by their id.
   */
  private newId(id: string | undefined): void {
    const bad = id === undefined ? null : /\p{Cf}/u.exec(id)
    if (bad !== null) {
      const code = bad[0].codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0')
      throw new SessionError(
        `session id ${JSON.stringify(id)} contains U+${code}: a new session id may not hold invisible format characters (Unicode category Cf)`,
        400,
        'bad_request',
      )
    }
  }

  private headers(extra: Record<string, string | undefined> = {}): Record<string, string> {
    const h: Record<string, string> = { accept: 'application/json' }
    if (this.token !== undefined) h.authorization = `Bearer ${this.token}`
    for (const [k, v] of Object.entries(extra)) if (v !== undefined) h[k] = v
    return h
  }

  private writeHeaders(opts: WriteOptions = {}): Record<string, string | undefined> {
    const h: Record<string, string | undefined> = { 'content-type': 'application/json' }
    if (opts.expectedN !== undefined && opts.expectedN !== null) h['if-match'] = `"${opts.expectedN}"`
    if (opts.incarnation !== undefined) h['x-session-incarnation'] = opts.incarnation
    if (opts.idempotencyKey !== undefined) h['idempotency-key'] = opts.idempotencyKey
    return h
  }

  /** One request; a non-2xx answer becomes the typed error. */
  async request(
    method: string,
    path: string,
    options: { body?: unknown; headers?: Record<string, string | undefined>; sessionId?: string; signal?: AbortSignal } = {},
  ): Promise<Response> {
    let response: Response
    try {
      response = await this.fetchFn(this.url + path, {
        method,
        headers: this.headers(options.headers),
        ...(options.body !== undefined ? { body: JSON.stringify(options.body) } : {}),
        ...(options.signal ? { signal: options.signal } : {}),
      })
    } catch (e) {
      if (options.signal?.aborted) throw e
      throw new UnavailableError(`the gateway at ${this.url} did not answer: ${(e as Error).message}`)
    }
    if (response.ok) return response
    let body: Record<string, unknown> = {}
    try {
      body = (await response.json()) as Record<string, unknown>
    } catch {
      body = { message: `HTTP ${response.status}` }
    }
    throw errorFor(response.status, body, options.sessionId ?? '')
  }

  private async json<T>(method: string, path: string, options: Parameters<SessionClient['request']>[2] = {}): Promise<T> {
    const r = await this.request(method, path, options)
    try {
      return (await r.json()) as T
    } catch (e) {
      if (options.signal?.aborted) throw e
      // the connection was cut while the answer came back: as lost as one that never came
      throw new UnavailableError(`the gateway's answer to ${method} ${path} was cut short: ${(e as Error).message}`)
    }
  }

  // ------------------------------------------------------------------ lifecycle

  /** Create a session (201), optionally with its first entries; `SessionAlreadyExistsError` if the id is taken. */
  async create(options: CreateOptions = {}): Promise<SessionHead> {
    this.newId(options.id)
    const body: Record<string, unknown> = {}
    if (options.id !== undefined) body.id = options.id
    if (options.title !== undefined) body.title = options.title
    if (options.origin !== undefined) body.origin = options.origin
    if (options.delegationDepth !== undefined) body.delegation_depth = options.delegationDepth
    if (options.ttl !== undefined) body.ttl = options.ttl
    if (options.createdAt !== undefined) body.created_at = options.createdAt
    if (options.entries !== undefined) body.entries = options.entries
    return this.json<SessionHead>('POST', '/sessions', {
      body,
      headers: { 'content-type': 'application/json', 'idempotency-key': options.idempotencyKey },
      sessionId: options.id ?? '',
    })
  }

  /** The head (header, n, last cut), or undefined when there is no such session. */
  async head(id: string, signal?: AbortSignal): Promise<SessionHead | undefined> {
    try {
      return await this.json<SessionHead>('GET', this.path(id), { sessionId: id, ...(signal ? { signal } : {}) })
    } catch (e) {
      if (e instanceof SessionNotFoundError) return undefined
      throw e
    }
  }

  async list(options: { parent?: string; limit?: number; cursor?: string | null } = {}): Promise<Page<SessionHeader>> {
    const q = new URLSearchParams()
    if (options.parent !== undefined) q.set('parent', options.parent)
    if (options.limit !== undefined) q.set('limit', String(options.limit))
    if (options.cursor) q.set('cursor', options.cursor)
    const qs = q.toString()
    return this.json<Page<SessionHeader>>('GET', `/sessions${qs ? `?${qs}` : ''}`)
  }

  /** Every session header (newest first), page after page. */
  async *listAll(options: { parent?: string } = {}): AsyncGenerator<SessionHeader> {
    let cursor: string | null = null
    do {
      const page: Page<SessionHeader> = await this.list({ ...options, limit: 1000, cursor })
      yield* page.items
      cursor = page.cursor
    } while (cursor !== null)
  }

  /** Delete a session: true, or false when there was none. Needs an `admin` token. */
  async delete(id: string, options: { expectedN?: number; incarnation?: string } = {}): Promise<boolean> {
    try {
      await this.request('DELETE', this.path(id), { headers: this.writeHeaders(options), sessionId: id })
      return true
    } catch (e) {
      if (e instanceof SessionNotFoundError && !(e instanceof SessionReplacedError)) return false
      throw e
    }
  }

  /** A new session holding entries [0, at) of `id`, then its own (nothing is copied). */
  async branch(id: string, at: number, options: BranchOptions = {}): Promise<SessionHead> {
    this.newId(options.id)
    const body: Record<string, unknown> = { at }
    if (options.id !== undefined) body.id = options.id
    if (options.title !== undefined) body.title = options.title
    if (options.origin !== undefined) body.origin = options.origin
    if (options.delegationDepth !== undefined) body.delegation_depth = options.delegationDepth
    return this.json<SessionHead>('POST', this.path(id, 'branch'), {
      body,
      headers: {
        'content-type': 'application/json',
        'idempotency-key': options.idempotencyKey,
        'x-session-incarnation': options.incarnation,
      },
      sessionId: id,
    })
  }

  /** dsh fork: a child holding [0, boundary], the boundary a `turn/end` (default: the last entry). */
  async fork(id: string, options: ForkOptions = {}): Promise<SessionHead> {
    this.newId(options.id)
    const body: Record<string, unknown> = {}
    if (options.boundary !== undefined) body.boundary = options.boundary
    if (options.id !== undefined) body.id = options.id
    return this.json<SessionHead>('POST', this.path(id, 'fork'), {
      body,
      headers: {
        'content-type': 'application/json',
        'idempotency-key': options.idempotencyKey,
        'x-session-incarnation': options.incarnation,
      },
      sessionId: id,
    })
  }

  /** Close a turn a crashed writer left open; the entries appended ([] when nothing was open). */
  async repair(id: string, options: LifeOptions = {}): Promise<Written> {
    return this.json<Written>('POST', this.path(id, 'repair'), {
      headers: { 'x-session-incarnation': options.incarnation },
      sessionId: id,
    })
  }

  // ------------------------------------------------------------------ writes

  /** Append one entry. */
  async append<D>(id: string, entry: NewEntry<D>, options: WriteOptions = {}): Promise<Written> {
    return this.appendMany(id, [entry], options)
  }

  /** Append a batch, all or nothing. */
  async appendMany<D>(id: string, entries: NewEntry<D>[], options: WriteOptions = {}): Promise<Written> {
    return this.json<Written>('POST', this.path(id, 'entries'), {
      body: { entries },
      headers: this.writeHeaders(options),
      sessionId: id,
      ...(options.signal ? { signal: options.signal } : {}),
    })
  }

  async draft(id: string, options: LifeOptions = {}): Promise<JsonObject | null> {
    const headers = { 'x-session-incarnation': options.incarnation }
    return (await this.json<{ draft: JsonObject | null }>('GET', this.path(id, 'draft'), { headers, sessionId: id })).draft
  }

  /** Publish the streaming draft other readers see (null clears it). */
  async setDraft(id: string, draft: JsonObject | null, options: LifeOptions = {}): Promise<void> {
    await this.request('PUT', this.path(id, 'draft'), {
      body: draft,
      headers: { 'content-type': 'application/json', 'x-session-incarnation': options.incarnation },
      sessionId: id,
    })
  }

  /**
   * Run `fn` with the session's current head; when it throws `SessionConflictError` (its write's
   * expected n went stale), wait (full jitter), reload the head and run it again, at most
   * `retries` more times. `fn` must rebuild what it writes from the head it is given.
   */
  async transact<T>(id: string, fn: (head: SessionHead) => Promise<T>, options: TransactOptions = {}): Promise<T> {
    const retries = options.retries ?? 8
    for (let attempt = 0; ; attempt++) {
      const head = await this.head(id)
      if (head === undefined) throw new SessionNotFoundError(id)
      try {
        return await fn(head)
      } catch (e) {
        if (!(e instanceof SessionError && e.code === 'conflict') || attempt >= retries) throw e
      }
      await sleep(backoff(attempt, options.baseDelayMs ?? 5, options.maxDelayMs ?? 500))
    }
  }

  // ------------------------------------------------------------------ streaming

  /**
   * Begin streaming an assistant answer: `w.delta(text)` (also `reasoning`, `toolCallDelta`) queues,
   * a timer sends the queue every ~75 ms as one batch (live for readers at once, one packed
   * `assistant/chunk` row in the log), `await w.end()` commits the `assistant/message`,
   * `await w.abort()` leaves the `assistant/interrupted` mark.
   */
  async stream(id: string, options: StreamOptions = {}): Promise<AnswerWriter> {
    const body: Record<string, unknown> = {}
    if (options.turn !== undefined) body.turn = options.turn
    if (options.step !== undefined) body.step = options.step
    // keyed, so a begin whose answer was lost is sent again and gets the same answer (never a
    // second one left open)
    const key = options.idempotencyKey ?? `ts-stream-${globalThis.crypto.randomUUID()}`
    let begun: AnswerBegun
    for (let attempt = 0; ; attempt++) {
      try {
        begun = await this.json<AnswerBegun>('POST', this.path(id, 'answers'), {
          body,
          headers: { 'content-type': 'application/json', 'idempotency-key': key },
          sessionId: id,
        })
        break
      } catch (e) {
        if (!(e instanceof UnavailableError) || attempt + 1 >= (options.retries ?? 5)) throw e
        await sleep(backoff(attempt, 25, 1000))
      }
    }
    const post: Post = (path, payload, headers) =>
      this.request('POST', path, { body: payload, headers: { 'content-type': 'application/json', ...headers }, sessionId: id })
    return new AnswerWriter(post, this.path(id, 'answers'), id, begun, options)
  }

  // ------------------------------------------------------------------ reads

  /** Entries [start, stop) (default: to the end), paged under the hood. */
  async read(id: string, start = 0, stop?: number): Promise<Entry[]> {
    const out: Entry[] = []
    let next: number | null = start
    while (next !== null) {
      const q = new URLSearchParams({ start: String(next), limit: String(READ_PAGE) })
      if (stop !== undefined) q.set('stop', String(stop))
      const page: { n: number; entries: Entry[]; next: number | null } = await this.json(
        'GET',
        `${this.path(id, 'entries')}?${q}`,
        { sessionId: id },
      )
      out.push(...page.entries)
      next = page.next
    }
    return out
  }

  /** The projection: what the model sees (`openai`: chat messages; `anthropic`: {system, messages}). */
  async messages(id: string, format: MessageFormat = 'openai'): Promise<unknown> {
    const r = await this.json<{ messages: unknown }>('GET', `${this.path(id, 'messages')}?format=${format}`, {
      sessionId: id,
    })
    return r.messages
  }

  /**
   * The session's entries from `start`, then each new one as it lands (SSE). A dropped connection
   * is retried with backoff and resumed with `Last-Event-ID`: every entry once, in order. Ends when
   * the session is deleted; throws `SessionReplacedError` when its id was deleted and created again.
   */
  tail(id: string, options: TailOptions & { deltas: true }): AsyncGenerator<Entry | Delta | DeltaGap>
  tail(id: string, options?: TailOptions): AsyncGenerator<Entry>
  async *tail(id: string, options: TailOptions = {}): AsyncGenerator<Entry | Delta | DeltaGap> {
    let last = (options.start ?? 0) - 1
    let cursor = options.liveAfter // the last delta's live id (`?deltas=1`)
    // the life this tail follows: every resume token names it, so a resume into another life of
    // the id is refused by the gateway (`event: replaced`) instead of continuing on it
    let inc = options.incarnation
    let resumed = false
    if (typeof options.lastEventId === 'string') {
      const m = EVENT_ID.exec(options.lastEventId)
      if (m === null) throw new TypeError(`lastEventId ${JSON.stringify(options.lastEventId)} is not an event id`)
      if (m[1] !== undefined) inc = m[1]
      last = Number(m[2])
      if (m[3] !== undefined) cursor = m[3]
      resumed = true
    } else if (options.lastEventId !== undefined) {
      last = options.lastEventId
      resumed = true
    }
    let failures = 0
    let connected = false
    // answer -> the next delta index owed, across reconnects: a delta a failover lost from the
    // live stream and its writer sent again (under a later live id than this tail's cursor) is
    // not given twice
    const owed = new Map<string, number>()
    for (;;) {
      let response: Response
      // before any event names the life, a fresh tail starts with `?start=` (a bare n in
      // Last-Event-ID names no life: the gateway refuses it)
      const fresh = inc === undefined && !resumed
      const base = inc !== undefined ? `${inc}:${last}` : String(last)
      const lastId = fresh ? undefined : cursor !== undefined ? `${base}/${cursor}` : base
      const query = [options.deltas ? 'deltas=1' : '', fresh && last >= 0 ? `start=${last + 1}` : ''].filter(Boolean)
      const url = this.path(id, 'events') + (query.length > 0 ? `?${query.join('&')}` : '')
      try {
        response = await this.request('GET', url, {
          headers: {
            accept: 'text/event-stream',
            'last-event-id': lastId,
            'x-session-incarnation': inc,
          },
          sessionId: id,
          ...(options.signal ? { signal: options.signal } : {}),
        })
      } catch (e) {
        // deleted while this tail was away: the end, as `event: end` would have said
        if (connected && e instanceof SessionNotFoundError && !(e instanceof SessionReplacedError)) return
        if (!(e instanceof UnavailableError)) throw e // auth, bad input …: not a dropped connection
        failures = await this.retryWait(failures, options, e)
        continue
      }
      connected = true
      try {
        for await (const ev of parseSse(response.body as unknown as AsyncIterable<Uint8Array>)) {
          const m = ev.id !== undefined ? EVENT_ID.exec(ev.id) : null
          if (m !== null && m[1] !== undefined) {
            if (inc !== undefined && m[1] !== inc) throw new SessionReplacedError(id)
            inc = m[1]
            resumed = true
          }
          if (ev.event === 'delta' && m !== null) {
            const d = JSON.parse(ev.data) as { answer: string; index: number; kind: DeltaKind; text: string; callId?: string; name?: string }
            cursor = m[3] ?? cursor
            failures = 0
            if (d.index < (owed.get(d.answer) ?? 0)) continue
            owed.set(d.answer, d.index + 1)
            yield new Delta(d.answer, d.index, d.kind, d.text, cursor ?? '', d.callId, d.name)
          } else if (ev.event === 'gap') {
            const g = JSON.parse(ev.data) as { answer: string; start: number; stop: number | null }
            if (m !== null && m[3] !== undefined) cursor = m[3]
            yield new DeltaGap(g.answer, g.start, g.stop)
          } else if (ev.event === 'message' && ev.id !== undefined) {
            const entry = JSON.parse(ev.data) as Entry
            if (entry.n <= last) continue
            last = entry.n
            failures = 0
            yield entry
          } else if (ev.event === 'draft') {
            options.onDraft?.((JSON.parse(ev.data) as { draft: JsonObject | null }).draft)
          } else if (ev.event === 'replaced') {
            throw new SessionReplacedError(id)
          } else if (ev.event === 'rewound') {
            const r = JSON.parse(ev.data) as { cursor: number; n: number }
            throw new SessionRewoundError(id, r.cursor, r.n)
          } else if (ev.event === 'end') {
            return
          }
        }
      } catch (e) {
        if (e instanceof SessionError || options.signal?.aborted) throw e
        failures = await this.retryWait(failures, options, e)
        continue
      }
      failures = await this.retryWait(failures, options, new Error('the stream ended early'))
    }
  }

  private async retryWait(failures: number, options: TailOptions, cause: unknown): Promise<number> {
    if (options.maxRetries !== undefined && failures >= options.maxRetries) throw cause
    await sleep(Math.max(50, backoff(failures, 100, 5000)), options.signal)
    return failures + 1
  }
}
