/** Typed errors: one class per failure a caller can act on, all under `SessionError`. */

export class SessionError extends Error {
  /** HTTP status of the gateway's answer (0: no answer) */
  readonly status: number
  /** the gateway's error code (`conflict`, `not_found`, …) */
  readonly code: string
  readonly body: Record<string, unknown>
  constructor(message: string, status = 0, code = 'error', body: Record<string, unknown> = {}) {
    super(message)
    this.name = new.target.name
    this.status = status
    this.code = code
    this.body = body
  }
}

/** A stale expected n (412): another writer appended first. Nothing was written. */
export class SessionConflictError extends SessionError {
  constructor(
    readonly sessionId: string,
    readonly expectedN: number,
    readonly actualN: number,
    body: Record<string, unknown> = {},
  ) {
    super(`session ${JSON.stringify(sessionId)}: expected n=${expectedN}, but the log is at n=${actualN}`, 412, 'conflict', body)
  }
}

/** No such session (404) — or one outside the token's tenant. */
export class SessionNotFoundError extends SessionError {
  constructor(readonly sessionId: string, message?: string, body: Record<string, unknown> = {}) {
    super(message ?? `session ${JSON.stringify(sessionId)} not found`, 404, 'not_found', body)
  }
}

/** The id was deleted and created again since the incarnation this write pinned (409). */
export class SessionReplacedError extends SessionNotFoundError {
  constructor(sessionId: string, message?: string, body: Record<string, unknown> = {}) {
    super(sessionId, message ?? `session ${JSON.stringify(sessionId)} was replaced`, body)
    Object.assign(this, { status: 409, code: 'session_replaced' })
  }
}

/** A tail was past its log's end: a failover took back entries it had been given (SSE
 * `event: rewound`). What it read from `n` on is no longer the log's: re-read the session. */
export class SessionRewoundError extends SessionError {
  constructor(readonly sessionId: string, readonly cursor: number, readonly n: number) {
    super(`session ${JSON.stringify(sessionId)}: the reader was at n=${cursor}, the log ends at n=${n} (a failover rolled it back): re-read it`)
  }
}

export class SessionAlreadyExistsError extends SessionError {
  constructor(readonly sessionId: string, message?: string, body: Record<string, unknown> = {}) {
    super(message ?? `session ${JSON.stringify(sessionId)} already exists`, 409, 'already_exists', body)
  }
}

/** An entry (or batch, or body) the store refuses (422, or 413 over a limit); nothing was written. */
export class InvalidEntryError extends SessionError {
  /** JSON path of the field at fault, e.g. `$.entries[2].data.content` */
  readonly path: string | undefined
  readonly index: number | undefined
  constructor(message: string, status = 422, code = 'invalid', body: Record<string, unknown> = {}) {
    super(message, status, code, body)
    this.path = typeof body.path === 'string' ? body.path : undefined
    this.index = typeof body.index === 'number' ? body.index : undefined
  }
}

/** The idempotency key already landed a different batch (422). */
export class IdempotencyKeyReusedError extends SessionError {}

/** dsh fork errors: `forkCode` is INVALID_BOUNDARY, OPEN_TURN, SESSION_NOT_FOUND or SESSION_ALREADY_EXISTS. */
export class SessionForkError extends SessionError {
  constructor(message: string, readonly forkCode: string, status: number, body: Record<string, unknown> = {}) {
    super(message, status, forkCode.toLowerCase(), body)
  }
}

/** A live writer holds the session's lease (409 on repair). */
export class LeaseHeldError extends SessionError {}

/** 401 (no or unknown token) and 403 (the token lacks the scope, or the id is outside its tenant). */
export class AuthError extends SessionError {}

/** The gateway or the store is unreachable (503, or no answer): retry later. */
export class UnavailableError extends SessionError {}

/** A streamed answer's protocol refused a write (nothing was written); `answer` names it. */
export class AnswerError extends SessionError {
  get answer(): string {
    return String(this.body.answer ?? '')
  }
}

/** A delta batch did not start at the answer's next index (`expectedIndex`): refused, never reordered. */
export class AnswerOrderError extends AnswerError {
  get expectedIndex(): number {
    return Number(this.body.expected_index)
  }
}

/** The end was refused: the log lacks deltas `missing[0]` .. `missing[1] - 1` of the answer. */
export class AnswerIncompleteError extends AnswerError {
  get missing(): [number, number] {
    const m = this.body.missing as number[]
    return [Number(m[0]), Number(m[1])]
  }
}

/** The batch would take the answer's content over what its closing message can hold (413
 * `answer_too_large`): nothing of it was written. The answer stays open with the deltas before
 * `nextIndex`: `end()` commits them (or `abort()`). */
export class AnswerTooLargeError extends AnswerError {
  /** the content bytes the answer would have had */
  get size(): number {
    return Number(this.body.size)
  }
  /** the most content bytes an answer may hold (the entry limit less 16 KiB) */
  get limit(): number {
    return Number(this.body.limit)
  }
  /** how many deltas the answer holds */
  get nextIndex(): number {
    return Number(this.body.next_index)
  }
}

/** The answer has ended (committed, interrupted, or closed by `repair`). */
export class AnswerClosedError extends AnswerError {}

/** No such answer (never begun, or ended longer ago than its grace). */
export class AnswerNotFoundError extends AnswerError {}

/** The error for a gateway answer that is not a success. */
export function errorFor(status: number, body: Record<string, unknown>, sessionId: string): SessionError {
  const code = typeof body.error === 'string' ? body.error : 'error'
  const message = typeof body.message === 'string' ? body.message : `HTTP ${status}`
  if (status === 412 && code === 'conflict') {
    return new SessionConflictError(sessionId, Number(body.expected_n), Number(body.actual_n), body)
  }
  if (typeof body.code === 'string' && /^[A-Z_]+$/.test(body.code)) {
    return new SessionForkError(message, body.code, status, body)
  }
  switch (code) {
    case 'not_found':
      return new SessionNotFoundError(sessionId, message, body)
    case 'session_replaced':
      return new SessionReplacedError(sessionId, message, body)
    case 'already_exists':
      return new SessionAlreadyExistsError(sessionId, message, body)
    case 'idempotency_key_reused':
      return new IdempotencyKeyReusedError(message, status, code, body)
    case 'lease_held':
      return new LeaseHeldError(message, status, code, body)
    case 'out_of_order':
      return new AnswerOrderError(message, status, code, body)
    case 'incomplete':
      return new AnswerIncompleteError(message, status, code, body)
    case 'answer_too_large':
      return new AnswerTooLargeError(message, status, code, body)
    case 'answer_ended':
      return new AnswerClosedError(message, status, code, body)
    case 'answer_not_found':
      return new AnswerNotFoundError(message, status, code, body)
    case 'batch_mismatch':
      return new AnswerError(message, status, code, body)
  }
  if (status === 401 || status === 403) return new AuthError(message, status, code, body)
  if (status === 422 || status === 413) return new InvalidEntryError(message, status, code, body)
  if (status === 503 || status === 502 || status === 504) return new UnavailableError(message, status, code, body)
  return new SessionError(message, status, code, body)
}
