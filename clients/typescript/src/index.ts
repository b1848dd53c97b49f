export * from './types.js'
export * from './errors.js'
export { SessionClient, Delta, DeltaGap, backoff, sleep } from './client.js'
export { AnswerWriter, type AnswerBegun, type DeltaIn, type DeltaKind, type EndOptions, type StreamOptions } from './stream.js'
export type {
  ClientOptions,
  WriteOptions,
  CreateOptions,
  BranchOptions,
  ForkOptions,
  LifeOptions,
  TailOptions,
  TransactOptions,
} from './client.js'
export { parseSse, type SseEvent } from './sse.js'
export * from './chatluna.js'
export { DshSessionStore, toDshEvent, fromDshEvent, type DshSessionEvent, type DshSessionHeader } from './dsh.js'
