/**
 * A writer in a process of its own, for the failover test (tests/test_typescript_failover.py): it
 * begins an answer in session `argv[2]`, sends deltas t0..t7 in two batches, says `ready <answer>`
 * on stdout, waits for a line on stdin (meanwhile the test rolls the server back as a promoted
 * replica that lacks the second batch has it), sends `argv[3]` more deltas in batches of four,
 * ends the answer and says `ended <n>`.
 */
import { createInterface } from 'node:readline'

import { SessionClient } from '../src/index.js'

const [, , id, moreArg] = process.argv
const more = Number(moreArg ?? 8)
const client = new SessionClient({ url: process.env.REDIS_SESSION_URL ?? '', token: process.env.RS_TOKEN_ADMIN })
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]()
const w = await client.stream(id ?? '', { turn: 1, step: 1, intervalMs: 60_000 })
for (let i = 0; i < 8 + more; i++) {
  if (i === 8) {
    process.stdout.write(`ready ${w.answer}\n`)
    await lines.next()
  }
  w.delta(`t${i} `)
  if (i % 4 === 3) await w.flush()
}
if (more === 0) {
  process.stdout.write(`ready ${w.answer}\n`)
  await lines.next()
}
const closing = await w.end()
process.stdout.write(`ended ${closing.n}\n`)
process.exit(0)
