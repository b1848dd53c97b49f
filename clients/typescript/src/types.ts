/** The wire types of the redis-session gateway (docs/design.md §2). */

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json }
export type JsonObject = { [key: string]: Json }

/** dsh surface metadata of a message entry (absent: append). */
export interface Surface {
  surfaceOp?: 'append' | { op: 'replace'; start: number; end: number }
  sourceEventSeqs?: number[]
}

/** Content blocks, as dsh writes them. */
export type ContentBlock =
  | { type: 'text'; text: string }
  | { type: 'image'; url?: string; data?: string; mimeType?: string }
  | { type: 'reasoning'; text: string; signature?: string }
  | { type: 'tool-call'; id: string; name: string; arguments: string }
  | { type: 'tool-result'; toolCallId: string; content: string | ContentBlock[]; isError?: boolean }

/** A plain chat message (type `message`), as ChatLuna, nanobot and OpenAI write it. */
export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | 'tool'
  content: string | ContentBlock[] | null
  tool_calls?: { id: string; type: 'function'; function: { name: string; arguments: string } }[]
  tool_call_id?: string
  name?: string
  reasoning_content?: string
  [key: string]: unknown
}

/** An entry to append. `time` defaults to the server's clock. */
export interface NewEntry<D = JsonObject> {
  type: string
  data: D
  meta?: JsonObject | null
  surface?: Surface | null
  time?: number
}

/** A stored entry: `n` is 0-based and contiguous. */
export interface Entry<D = JsonObject> {
  n: number
  time: number
  type: string
  data: D
  meta?: JsonObject
  surface?: Surface
}

export interface SessionHeader {
  id: string
  format_version: number
  created_at: number
  parent: string | null
  at: number | null
  delegation_depth: number
  title: string | null
  origin: Json
  /** Unique per creation of the id: pin it to never write to a re-created session. */
  incarnation: string
}

export interface SessionHead {
  id: string
  header: SessionHeader
  n: number
  updated_at: number
  last_cut: number | null
}

export interface Page<T> {
  items: T[]
  /** null on the last page */
  cursor: string | null
}

export interface Written {
  /** the session's n after the write */
  n: number
  entries: Entry[]
}

export type MessageFormat = 'openai' | 'anthropic' | 'neutral'

export const MESSAGE_TYPES: ReadonlySet<string> = new Set([
  'user/message',
  'assistant/message',
  'tool/result',
  'context/message',
  'steering/message',
  'message',
])

export function kindOf(type: string): 'message' | 'cut' | 'mark' {
  return MESSAGE_TYPES.has(type) ? 'message' : type === 'cut' ? 'cut' : 'mark'
}
