/** Helpers the answer tests share: a session opened at a turn's first step, and the deltas its
 * log holds for an answer. */
import type { Entry, JsonObject, SessionClient } from '../src/index.js'

/** A session `id` with a turn begun and its first step open, ready for an answer. */
export async function openTurn(client: SessionClient, id: string): Promise<void> {
  await client.create({
    id,
    entries: [
      { type: 'turn/start', data: { turn: 1 } },
      { type: 'user/message', data: { content: 'hi' } },
      { type: 'step/start', data: { turn: 1, step: 1 } },
    ],
  })
}

/** Every delta of `answer` the log holds, in order (its packed chunk rows, as Python's `replay`). */
export function replay(entries: Entry[], answer: string): JsonObject[] {
  const out: JsonObject[] = []
  for (const e of entries) {
    if (e.type !== 'assistant/chunk' || e.data.answer !== answer) continue
    for (const c of e.data.chunks as (string | JsonObject)[]) out.push(typeof c === 'string' ? { type: 'text-delta', text: c } : c)
  }
  return out
}
