/**
 * A writer in a process of its own, for the heartbeat test (answers.test.ts): it begins an answer
 * in session `argv[2]`, sends two deltas, says `ready <answer>` on stdout, then keeps the answer
 * open (beating) until it is killed — a writer that dies for real, its beats with it.
 */
import { SessionClient } from '../src/index.js'

const [, , id, heartbeatMs] = process.argv
const client = new SessionClient({ url: process.env.REDIS_SESSION_URL ?? '', token: process.env.RS_TOKEN_ADMIN })
const w = await client.stream(id ?? '', { turn: 1, step: 1, heartbeatMs: Number(heartbeatMs) })
w.delta('about to ')
w.delta('die')
await w.flush()
process.stdout.write(`ready ${w.answer}\n`)
setInterval(() => undefined, 60_000) // alive (and beating) until killed
