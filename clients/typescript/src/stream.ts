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
 * `assistant/interrupted` mark. A batch that would take the answer's content over what its message
 * can hold (the entry limit less 16 KiB) is refused (`AnswerTooLargeError`, thrown by `flush()` and
 * by every later `delta`): its deltas and those queued after it are dropped, and `end()` still
 * commits the deltas that landed. A delta no JSON body can carry (half of a surrogate pair) is
 * refused by `delta()` itself (`InvalidEntryError`), before it is queued; the answer goes on.
 * After the gateway said the session is gone, `flush()` and `end()` ask again: a writer whose id
 * has a new life by then gets `SessionReplacedError`.
 *
 * A request whose answer is lost (the gateway unreachable, a connection cut before or while the
 * reply comes back, a 502/503/504) is sent again as it was, `retries` times: a batch carries its
 * `first_index`, so a copy of one that landed is a no-op; an end that landed answers its entry
 * again. When the attempts run out the deltas stay queued (the next send, `flush()` or `end()` tries
 * them again) and `flush()`/`end()` throw `UnavailableError` — never a bare `TypeError` of fetch.
 *
 * Replication is asynchronous: after a failover the promoted replica may lack the last batches
 * whose replies came back. The gateway then refuses the next batch (`AnswerOrderError`, naming the
 * index it expects) or the end (`AnswerIncompleteError`, naming the missing range); the writer keeps
 * the batches it sent, so it sends the lost ones again, with their own bounds, and goes on: every
 * delta lands once, in order (a reader that got a lost delta before the failover is not given it
 * twice: `tail` keeps what it delivered per answer).
 *
 * While the answer is open and nothing was sent for `heartbeatMs` (a model thinking, a long tool
 * call) the writer beats: an empty batch, which refreshes the answer's lease in the server, so
 * `repair` tells it from a writer that died (whose answer it closes once it is quiet for its
 * `stale_after`, 30 s). The beats stop at `end()`/`abort()`, and never keep the process alive.
 */

import {
  AnswerIncompleteError,
  AnswerOrderError,
  AnswerTooLargeError,
  InvalidEntryError,
  SessionError,
  SessionNotFoundError,
  SessionReplacedError,
  UnavailableError,
} from './errors.js'
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
  /** the heartbeat while the answer is open and idle: an empty batch after this many ms with
   * nothing sent (default 5000; keep it well under the repairer's `stale_after`, 30 s) */
  heartbeatMs?: number
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
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/

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
  private readonly heartbeatMs: number
  private readonly post: Post
  private readonly base: string
  private queue: DeltaIn[] = []
  private sent = 0 // deltas [0, sent) are in the log
  private landed: Array<{ first: number; deltas: DeltaIn[] }> = [] // the batches sent, in order
  private bounds: number[] = [] // sizes of the batches queued again after a failover lost them
  private timer: ReturnType<typeof setTimeout> | undefined
  private beatTimer: ReturnType<typeof setTimeout> | undefined
  private inFlight: Promise<void> = Promise.resolve()
  private failure: unknown // the gateway refused: the answer cannot go on
  private full: AnswerTooLargeError | undefined // the answer is full: no more deltas, but it can end
  private unsent: UnavailableError | undefined // the last send ran out of attempts: its deltas stay queued
  private unsentCount = 0 // how many deltas that batch had
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
    this.heartbeatMs = options.heartbeatMs ?? 5000
    if (!(this.heartbeatMs > 0)) throw new RangeError('heartbeatMs must be > 0')
    this.closing = undefined
    this.armBeat()
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
    this.inFlight = this.inFlight.then(() => this.askAgain()).then(() => this.sendQueued())
    await this.inFlight
    if (this.failure !== undefined) throw this.failure
    if (this.full !== undefined) throw this.full
    if (this.unsent !== undefined) throw this.unsent
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
    // refused here, before it is queued, as Python's writer refuses it: a string no JSON body
    // can carry (half of a surrogate pair, e.g. an emoji cut by a UTF-16 slice) would make the
    // gateway refuse its whole batch, the deltas around it included
    for (const [field, value] of [['text', d.text], ['callId', d.callId], ['name', d.name]] as const) {
      if (value !== undefined && LONE_SURROGATE.test(value)) {
        throw new InvalidEntryError(`a delta's ${field} must be valid Unicode text (it holds half of a surrogate pair)`, 422, 'invalid', {
          path: `$.deltas[${this.count}].${field === 'callId' ? 'call_id' : field}`,
        })
      }
    }
    if (this.failure !== undefined) throw this.failure
    if (this.full !== undefined) throw this.full
    this.queue.push(d)
    if (this.timer === undefined) {
      this.timer = setTimeout(() => {
        this.timer = undefined
        this.inFlight = this.inFlight.then(() => this.sendQueued())
      }, this.intervalMs)
    }
  }

  /** After the gateway said the session is gone, ask again before answering from it: the id
   * may have a new life by now, and a writer of the old one is then told so
   * (`SessionReplacedError`), not that the session is gone. An empty batch asks (it writes
   * nothing in any life: every request of this writer is pinned to the life it began in). */
  private async askAgain(): Promise<void> {
    if (!(this.failure instanceof SessionNotFoundError) || this.failure instanceof SessionReplacedError) return
    try {
      await this.send(this.deltasPath(), { first_index: this.sent, deltas: [] }, {}, 1)
      this.failure = undefined // there after all (a failover's replica lacked it for a moment)
    } catch (e) {
      if (!(e instanceof UnavailableError)) this.failure = e
    }
  }

  private clearTimer(): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    this.timer = undefined
  }

  private async sendQueued(): Promise<void> {
    while (this.queue.length > 0 && this.failure === undefined) {
      // a batch whose answer was lost goes again as it was (the same bounds: a copy of one that
      // landed is a no-op; a longer one would straddle it and be refused)
      const batch = this.queue.slice(0, this.unsentCount || this.bounds[0] || MAX_BATCH)
      const body: Record<string, unknown> = { first_index: this.sent, deltas: batch }
      if (this.turn !== undefined) body.turn = this.turn
      if (this.step !== undefined) body.step = this.step
      try {
        const written = await this.send(this.deltasPath(), body, {})
        this.n = Math.max(this.n, written.n)
      } catch (e) {
        // the deltas stay queued; a lost answer is tried again with the next send (the same
        // `first_index`: a no-op if it landed); a refusal ends the writing (`abort` still closes
        // the answer with what landed)
        if (e instanceof UnavailableError) {
          this.unsent = e
          this.unsentCount = batch.length
        } else if (e instanceof AnswerOrderError && this.rewind(e.expectedIndex)) {
          continue // a failover lost batches that had landed: they go again first
        } else if (e instanceof AnswerTooLargeError) {
          // nothing of the batch landed, and nothing more fits: the answer ends with what it has
          this.full = e
          this.queue = []
          this.unsent = undefined
          this.unsentCount = 0
        } else this.failure = e
        return
      }
      this.unsent = undefined
      this.unsentCount = 0
      if (this.bounds.length > 0 && this.bounds[0] === batch.length) this.bounds.shift()
      this.queue = this.queue.slice(batch.length)
      this.landed.push({ first: this.sent, deltas: batch })
      this.sent += batch.length
      this.armBeat()
    }
  }

  /** The log holds deltas [0, `next`) only, though batches after it had landed (a failover to a
   * replica that lacked them): queue those batches again, in front, each with its own bounds.
   * False when `next` is not where a batch of this writer began (not a loss it can repair). */
  private rewind(next: number): boolean {
    if (!(next < this.sent)) return false
    const at = this.landed.findIndex((b) => b.first === next)
    if (at < 0) return false
    const lost = this.landed.splice(at)
    this.queue = [...lost.flatMap((b) => b.deltas), ...this.queue]
    this.bounds = [...lost.map((b) => b.deltas.length), ...this.bounds]
    this.unsent = undefined
    this.unsentCount = 0
    this.sent = next
    return true
  }

  private deltasPath(): string {
    return `${this.base}/${encodeURIComponent(this.answer)}/deltas`
  }

  /** The next heartbeat, `heartbeatMs` from now (each send moves it). */
  private armBeat(): void {
    if (this.beatTimer !== undefined) clearTimeout(this.beatTimer)
    this.beatTimer = undefined
    if (this.closed || this.failure !== undefined) return
    this.beatTimer = setTimeout(() => {
      this.beatTimer = undefined
      this.inFlight = this.inFlight.then(() => this.beat())
    }, this.heartbeatMs)
    this.beatTimer.unref?.() // a writer its process forgot is a dead one: its beats never keep it running
  }

  /** An empty batch: the writer is alive (the server refreshes the answer's lease; nothing is
   * written). Refused for an answer that ended (closed by `repair`) or of another life: then the
   * writer stops, as a refused batch stops it. */
  private async beat(): Promise<void> {
    if (this.closed || this.failure !== undefined) return
    if (this.queue.length > 0) {
      await this.sendQueued() // deltas waiting (a batch whose answers were lost): they are the beat
    } else {
      try {
        await this.send(this.deltasPath(), { first_index: this.sent, deltas: [] }, {}, 1)
      } catch (e) {
        if (!(e instanceof UnavailableError)) {
          if (!this.closed) this.failure = e
          return
        }
      }
    }
    this.armBeat()
  }

  /** POST, again with the same body while its answer is lost (the gateway dedupes). A connection
   * cut while the answer's body is read is a lost answer too: `UnavailableError`, never a bare
   * `TypeError` of fetch. */
  private async send(
    path: string,
    body: unknown,
    headers: Record<string, string | undefined>,
    attempts = this.retries,
  ): Promise<Written> {
    for (let attempt = 0; ; attempt++) {
      try {
        const r = await this.post(path, body, { 'x-session-incarnation': this.incarnation ?? undefined, ...headers })
        try {
          return (await r.json()) as Written
        } catch (e) {
          throw new UnavailableError(`the gateway's answer to ${path} was cut short: ${(e as Error).message}`)
        }
      } catch (e) {
        if (!(e instanceof UnavailableError) || attempt + 1 >= attempts) throw e
        await new Promise((resolve) => setTimeout(resolve, Math.random() * Math.min(1000, 25 * 2 ** attempt)))
      }
    }
  }

  private async close(reason: 'committed' | 'interrupted', options: EndOptions, cause?: string): Promise<Written> {
    if (this.closing !== undefined) return this.closing
    this.clearTimer()
    this.inFlight = this.inFlight.then(() => this.askAgain()).then(() => this.sendQueued())
    await this.inFlight
    if (this.failure !== undefined && reason === 'committed') throw this.failure
    if (this.unsent !== undefined && reason === 'committed') throw this.unsent // still open: end or abort again
    this.closed = true
    if (this.beatTimer !== undefined) clearTimeout(this.beatTimer)
    this.beatTimer = undefined
    // a batch whose every answer was lost may have landed: an abort then closes with what the log
    // holds, however many that is
    const unsure = this.unsent !== undefined && this.queue.length > 0
    const body: Record<string, Json | undefined> = {
      reason,
      // how many deltas this writer sent: the gateway refuses the end (`AnswerIncompleteError`,
      // naming the missing range) while the log lacks any of them
      ...(unsure ? {} : { deltas: this.sent }),
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
      try {
        this.closing = await this.send(`${this.base}/${encodeURIComponent(this.answer)}/end`, body, {
          'if-match': ifMatch,
        })
      } catch (e) {
        // a failover lost batches that had landed: send them again, then end once more
        if (!(e instanceof AnswerIncompleteError) || !this.rewind(e.missing[0])) throw e
        this.inFlight = this.inFlight.then(() => this.sendQueued())
        await this.inFlight
        if (this.failure !== undefined) throw this.failure
        if (this.unsent !== undefined) throw this.unsent
        this.closing = await this.send(`${this.base}/${encodeURIComponent(this.answer)}/end`, body, {
          'if-match': ifMatch,
        })
      }
    } catch (e) {
      // still open: end or abort again (a lost end is a no-op to retry: it answers its entry)
      if (e instanceof SessionError && (e.code === 'conflict' || e instanceof UnavailableError)) {
        this.closed = false
        this.armBeat()
      }
      throw e
    }
    this.n = this.closing.n
    return this.closing
  }
}
