/**
 * `npm test`'s runner: `node --test` over every compiled `*.test.js`, always against a real
 * gateway, never skipping.
 *
 * - `REDIS_SESSION_URL` set (tests/test_typescript_client.py does): the tests use that gateway
 *   (and `RS_TOKEN_ADMIN`, `RS_TOKEN_READ`, `RS_TOKEN_TENANT`, `RS_TENANT_PREFIX`).
 * - unset: this runner starts one itself — `python -m redis_session.cli gateway` on a free port,
 *   over an embedded server of its own (a temporary `REDIS_SESSION_HOME`), with three tokens —
 *   runs the tests, then stops both. The Python is `$REDIS_SESSION_PYTHON`, else the checkout's
 *   `.venv/bin/python`, else `python3`; the checkout's `redis_session` comes first on its path.
 *   When none can start a gateway the run fails, saying how to run the tests.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { delimiter, dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const HERE = dirname(fileURLToPath(import.meta.url)) // dist/test
const PACKAGE = resolve(HERE, '..', '..') // clients/typescript
const REPO = resolve(PACKAGE, '..', '..')
const HOW =
  'The TypeScript tests need a gateway. Either run `npm test` with a Python that has redis_session ' +
  '(set REDIS_SESSION_PYTHON=/path/to/python, or create the checkout\'s .venv: ' +
  '`python3 -m venv .venv && .venv/bin/pip install -e .`), and it starts one itself; or start one ' +
  '(`redis-session gateway --port 8765`) and run `REDIS_SESSION_URL=http://127.0.0.1:8765 npm test`.'

function testFiles(): string[] {
  return readdirSync(HERE)
    .filter((f) => f.endsWith('.test.js'))
    .sort()
    .map((f) => join(HERE, f))
}

function runTests(env: NodeJS.ProcessEnv): Promise<number> {
  const files = testFiles()
  if (files.length === 0) throw new Error(`no *.test.js files in ${HERE}: run tsc first`)
  return new Promise((done) => {
    const child = spawn(process.execPath, ['--test', ...files], { env, stdio: 'inherit' })
    child.on('exit', (code, signal) => done(code ?? (signal ? 1 : 0)))
  })
}

function pythonCandidates(): string[] {
  const out: string[] = []
  if (process.env.REDIS_SESSION_PYTHON) out.push(process.env.REDIS_SESSION_PYTHON)
  const venv = join(REPO, '.venv', 'bin', 'python')
  if (existsSync(venv)) out.push(venv)
  out.push('python3')
  return out
}

function pythonEnv(home: string): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, REDIS_SESSION_HOME: home, REDIS_SESSION_PORT: '0' }
  delete env.REDIS_URL // the embedded server of this run, never someone's Redis
  env.PYTHONPATH = [REPO, process.env.PYTHONPATH].filter(Boolean).join(delimiter)
  return env
}

function findPython(home: string): string {
  const tried: string[] = []
  for (const py of pythonCandidates()) {
    const r = spawnSync(py, ['-c', 'import redis_session.cli'], { env: pythonEnv(home), encoding: 'utf8' })
    if (r.status === 0) return py
    tried.push(`${py}: ${(r.error?.message ?? r.stderr ?? '').trim().split('\n').pop() ?? ''}`)
  }
  throw new Error(`no Python with redis_session found (tried ${tried.join('; ')}).\n${HOW}`)
}

function freePort(): Promise<number> {
  return new Promise((done, fail) => {
    const srv = createServer()
    srv.once('error', fail)
    srv.listen(0, '127.0.0.1', () => {
      const addr = srv.address()
      const port = typeof addr === 'object' && addr ? addr.port : 0
      srv.close(() => done(port))
    })
  })
}

async function waitReady(url: string, child: ChildProcess, log: () => string, ms: number): Promise<void> {
  const deadline = Date.now() + ms
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`the gateway exited (${child.exitCode}):\n${log()}\n${HOW}`)
    try {
      const res = await fetch(`${url}/healthz`)
      if (res.ok) return
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100))
  }
  throw new Error(`the gateway did not answer ${url}/healthz within ${ms / 1000} s:\n${log()}\n${HOW}`)
}

function stop(child: ChildProcess, ms: number): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((done) => {
    const kill = setTimeout(() => child.kill('SIGKILL'), ms)
    child.once('exit', () => {
      clearTimeout(kill)
      done()
    })
    child.kill('SIGTERM')
  })
}

async function withOwnGateway(): Promise<number> {
  const home = mkdtempSync(join(tmpdir(), 'rs-ts-tests-'))
  const python = findPython(home)
  const port = await freePort()
  const url = `http://127.0.0.1:${port}`
  const tok = (name: string) => `ts-${name}-${randomBytes(12).toString('hex')}`
  const admin = tok('admin')
  const reader = tok('read')
  const tenant = tok('tenant')
  const env = pythonEnv(home)
  env.REDIS_SESSION_TOKENS = `${admin} admin\n${reader} read\n${tenant} write tenant/`
  delete env.REDIS_SESSION_TOKEN
  let output = ''
  const gateway = spawn(python, ['-m', 'redis_session.cli', 'gateway', '--host', '127.0.0.1', '--port', String(port)], {
    env,
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  const keep = (b: Buffer) => {
    output = (output + b.toString()).slice(-8000)
  }
  gateway.stdout?.on('data', keep)
  gateway.stderr?.on('data', keep)
  try {
    await waitReady(url, gateway, () => output, 90_000)
    console.log(`# started a gateway at ${url} (python ${python}, embedded server in ${home})`)
    return await runTests({
      ...process.env,
      REDIS_SESSION_URL: url,
      RS_TOKEN_ADMIN: admin,
      RS_TOKEN_READ: reader,
      RS_TOKEN_TENANT: tenant,
      RS_TENANT_PREFIX: 'tenant/',
    })
  } finally {
    await stop(gateway, 10_000)
    spawnSync(python, ['-m', 'redis_session.cli', 'server', 'stop'], { env, encoding: 'utf8' })
    rmSync(home, { recursive: true, force: true })
  }
}

async function main(): Promise<number> {
  if (process.env.REDIS_SESSION_URL) return runTests(process.env)
  return withOwnGateway()
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    console.error(err instanceof Error ? err.message : err)
    process.exit(1)
  },
)
