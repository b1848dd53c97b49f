/** Where the tests find the gateway: `npm test` (test/run.ts) starts one and sets these, or
 * tests/test_typescript_client.py passes its own. Without one the tests fail, never skip. */
import { randomBytes } from 'node:crypto'

export const URL = process.env.REDIS_SESSION_URL ?? ''
export const ADMIN = process.env.RS_TOKEN_ADMIN ?? ''
export const READER = process.env.RS_TOKEN_READ ?? ''
export const TENANT = process.env.RS_TOKEN_TENANT ?? ''
export const TENANT_PREFIX = process.env.RS_TENANT_PREFIX ?? 'tenant/'
if (!URL) {
  throw new Error(
    'REDIS_SESSION_URL is not set: run the tests with `npm test` (it starts a gateway on an embedded ' +
      'server itself), or point REDIS_SESSION_URL at a running gateway (`redis-session gateway`)',
  )
}
/** Suites are never skipped: kept for the `{ skip }` option the suites pass. */
export const skip = false

export function uid(prefix: string): string {
  return `${prefix}-${randomBytes(4).toString('hex')}`
}
