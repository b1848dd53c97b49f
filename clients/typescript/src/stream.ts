/**
 * `AnswerWriter`: one assistant answer streamed over HTTP, as `Session.stream` streams it in Python.
 *
 * `delta`, `reasoning` and `toolCallDelta` only queue; a timer (`intervalMs`, default 75 ms) sends
 * what is queued as one batch (`POST …/answers/{answer}/deltas`): the gateway appends it to the log
 * as one packed `assistant/chunk` row and puts each delta on the session's live stream, where
 * tailing readers (`tail(id, {deltas: true})`, SSE `?deltas=1`) get it at once. One batch is in
 * flight at a time, so deltas land in order; a batch whose answer was lost is sent again as it was
 * (same `first_index`): the gateway writes it nowhere twice and its deltas reach the live stream
 * once. The rules are the gateway's (one answer protocol, `lua/answer.lua`, shared with Python's
 * `Session.stream`): a batch elsewhere than the answer's next index is refused
 * (`AnswerOrderError`), an end while any delta is missing too (`AnswerIncompleteError`), and every
 * write is checked against the life the answer began in (`SessionReplacedError`). `end()` sends the
 * rest and commits the `assistant/message`; `abort()` sends the rest and leaves the
 * `assistant/interrupted` mark.
 */

import { SessionError, UnavailableError } from './errors.js'
import type { Json, JsonObject, Written } from './types.js'

export type DeltaKind = 'text' | 'reasoning' | 'tool-call'

/** One delta as the gateway takes it (and as SSE `event: delta` gives it, with `answer` and `index`). */
export interface DeltaIn {
  text: string
  kind?: DeltaKind
  callId?: string
  name?: string
}

/** What `POST /sessions/{id}/answers` answers. */
export interface AnswerBegun {
  answer: string
  /** the log's n when the answer began */
  n: number
  incarnation: string | null
  begin_id: string | null
}

export interface StreamOptions {
  turn?: number
  step?: number
  /** how long deltas queue before they are sent as one batch (default 75 ms) */
  intervalMs?: number
  /** a retried `stream()` with the same key gets the same answer id */
  idempotencyKey?: string
  /** attempts per batch when the gateway is unreachable (default 5) */
  retries?: number
}

export interface EndOptions {
  /** the n the log must be at (`If-Match`); `'writer'`: this writer's n after its last batch (the
   * message lands only if nothing else was appended since, as Python's `s.stream` commits) */
  expectedN?: number | null | 'writer'
  /** the message content (default: assembled by the gateway from the deltas in the log) */
  content?: JsonObject[]
  usage?: JsonObject
  meta?: JsonObject
}

/** How a writer reaches the gateway (`SessionClient.request`, bound). */
export type Post = (path: string, body: unknown, headers: Record<string, string | undefined>) => Promise<Response>

const MAX_BATCH = 4096

export class AnswerWriter {
  readonly sessionId: string
  readonly answer: string
  /** the log's n when the answer began */
  readonly begunAt: number
  readonly incarnation: string | null
  /** the session's n after this writer's last write */
  n: number
  /** the closing entry once `end()` or `abort()` returned */
  closing: Written | undefined
  /** the begin's live stream id */
  readonly beginId: string | null
  private readonly turn: number | undefined
  private readonly step: number | undefined
  private readonly intervalMs: number
  private readonly retries: number
  private readonly post: Post
  private readonly base: string
  private queue: DeltaIn[] = []
  private sent = 0 // deltas [0, sent) are in the log
  private timer: ReturnType<typeof setTimeout> | undefined
  private inFlight: Promise<void> = Promise.resolve()
  private failure: unknown
  private closed = false

  constructor(post: Post, base: string, sessionId: string, begun: AnswerBegun, options: StreamOptions) {
    this.post = post
    this.base = base
    this.sessionId = sessionId
    this.answer = begun.answer
    this.begunAt = begun.n
    this.n = begun.n
    this.incarnation = begun.incarnation
    this.beginId = begun.begin_id
    this.turn = options.turn
    this.step = options.step
    this.intervalMs = options.intervalMs ?? 75
    this.retries = options.retries ?? 5
    this.closing = undefined
  }

  /** Deltas so far (sent or queued). */
  get count(): number {
    return this.sent + this.queue.length
  }

  /** A piece of the answer's text. */
  delta(text: string): void {
    this.add({ text })
  }

  /** A piece of the model's reasoning. */
  reasoning(text: string): void {
    this.add({ kind: 'reasoning', text })
  }

  /** A piece of a tool call's JSON arguments (`name` on the first one of the call is enough). */
  toolCallDelta(callId: string, name: string | null | undefined, text: string): void {
    if (!callId) throw new TypeError('a tool-call delta names its call (a non-empty callId)')
    this.add({ kind: 'tool-call', callId, ...(name ? { name } : {}), text })
  }

  /** Send what is queued now (the timer does it on its own); resolves when it is in the log. */
  async flush(): Promise<void> {
    this.clearTimer()
    this.inFlight = this.inFlight.then(() => this.sendQueued())
    await this.inFlight
    if (this.failure !== undefined) throw this.failure
  }

  /** Send the rest and commit the `assistant/message` (`SessionConflictError` on a stale `expectedN`:
   * nothing is written, the answer stays open, `end` or `abort` may be called again). */
  async end(options: EndOptions = {}): Promise<Written> {
    return this.close('committed', options)
  }

  /** Send the rest and close the answer with the `assistant/interrupted` mark. */
  async abort(cause: 'cancelled' | 'error' = 'cancelled', options: EndOptions = {}): Promise<Written> {
    return this.close('interrupted', options, cause)
  }

  // ------------------------------------------------------------------ internals

  private add(d: DeltaIn): void {
    if (typeof d.text !== 'string') throw new TypeError('a delta is a string')
    if (this.closed) throw new Error('this answer is closed')
    if (this.failure !== undefined) throw this.failure
    this.queue.push(d)
    if (this.timer === undefined) {
      this.timer = setTimeout(() => {
        this.timer = undefined
        this.inFlight = this.inFlight.then(() => this.sendQueued())
      }, this.intervalMs)
    }
  }

  private clearTimer(): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    this.timer = undefined
  }

  private async sendQueued(): Promise<void> {
    while (this.queue.length > 0 && this.failure === undefined) {
      const batch = this.queue.slice(0, MAX_BATCH)
      const body: Record<string, unknown> = { first_index: this.sent, deltas: batch }
      if (this.turn !== undefined) body.turn = this.turn
      if (this.step !== undefined) body.step = this.step
      try {
        const written = await this.send(`${this.base}/${encodeURIComponent(this.answer)}/deltas`, body, {})
        this.n = Math.max(this.n, written.n)
      } catch (e) {
        this.failure = e // the deltas stay queued: `abort` still closes the answer with what landed
        return
      }
      this.queue = this.queue.slice(batch.length)
      this.sent += batch.length
    }
  }

  /** POST, again with the same body while the gateway is unreachable (the gateway dedupes). */
  private async send(path: string, body: unknown, headers: Record<string, string | undefined>): Promise<Written> {
    for (let attempt = 0; ; attempt++) {
      try {
        const r = await this.post(path, body, { 'x-session-incarnation': this.incarnation ?? undefined, ...headers })
        return (await r.json()) as Written
      } catch (e) {
        if (!(e instanceof UnavailableError) || attempt + 1 >= this.retries) throw e
        await new Promise((resolve) => setTimeout(resolve, Math.random() * Math.min(1000, 25 * 2 ** attempt)))
      }
    }
  }

  private async close(reason: 'committed' | 'interrupted', options: EndOptions, cause?: string): Promise<Written> {
    if (this.closing !== undefined) return this.closing
    this.clearTimer()
    this.inFlight = this.inFlight.then(() => this.sendQueued())
    await this.inFlight
    if (this.failure !== undefined && reason === 'committed') throw this.failure
    this.closed = true
    const body: Record<string, Json | undefined> = {
      reason,
      // how many deltas this writer sent: the gateway refuses the end (`AnswerIncompleteError`,
      // naming the missing range) while the log lacks any of them
      deltas: this.sent,
      ...(this.turn !== undefined ? { turn: this.turn } : {}),
      ...(this.step !== undefined ? { step: this.step } : {}),
      ...(cause !== undefined ? { cause } : {}),
      ...(options.content !== undefined ? { content: options.content } : {}),
      ...(options.usage !== undefined ? { usage: options.usage } : {}),
      ...(options.meta !== undefined ? { meta: options.meta } : {}),
    }
    const expected = options.expectedN === 'writer' ? this.n : options.expectedN
    const ifMatch = expected !== undefined && expected !== null ? `"${expected}"` : undefined
    try {
      this.closing = await this.send(`${this.base}/${encodeURIComponent(this.answer)}/end`, body, { 'if-match': ifMatch })
    } catch (e) {
      if (e instanceof SessionError && e.code === 'conflict') this.closed = false // still open: end or abort again
      throw e
    }
    this.n = this.closing.n
    return this.closing
  }
}
