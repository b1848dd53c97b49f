/** Where the tests find the gateway (set by tests/test_typescript_client.py). */
import { randomBytes } from 'node:crypto'

export const URL = process.env.REDIS_SESSION_URL ?? ''
export const ADMIN = process.env.RS_TOKEN_ADMIN ?? ''
export const READER = process.env.RS_TOKEN_READ ?? ''
export const TENANT = process.env.RS_TOKEN_TENANT ?? ''
export const TENANT_PREFIX = process.env.RS_TENANT_PREFIX ?? 'tenant/'
/** node --test skips a suite with this reason when no gateway was given */
export const skip = URL ? false : 'REDIS_SESSION_URL is not set (run through tests/test_typescript_client.py)'

export function uid(prefix: string): string {
  return `${prefix}-${randomBytes(4).toString('hex')}`
}
