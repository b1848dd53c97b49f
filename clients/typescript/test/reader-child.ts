/**
 * A reader in a process of its own, for the failover test (tests/test_typescript_failover.py): it
 * tails session `argv[2]` with deltas through the gateway at `REDIS_SESSION_URL` (a proxy the test
 * cuts), printing each delta's index and each gap as a JSON line, until the answer's message lands.
 */
import { Delta, DeltaGap, SessionClient } from '../src/index.js'

const [, , id] = process.argv
const client = new SessionClient({ url: process.env.REDIS_SESSION_URL ?? '', token: process.env.RS_TOKEN_ADMIN })
for await (const item of client.tail(id ?? '', { deltas: true })) {
  if (item instanceof Delta) process.stdout.write(`${JSON.stringify({ index: item.index })}\n`)
  else if (item instanceof DeltaGap) process.stdout.write(`${JSON.stringify({ gap: [item.start, item.stop] })}\n`)
  else if (item.type === 'assistant/message') break
}
process.stdout.write('done\n')
process.exit(0)
