-- swap.lua: make a complete staged session the session of another id, atomically (import's
-- --on-exists replace). Both sessions' keys are in one slot: the importer picks a staging id whose
-- hash slot is the target's.
--
-- KEYS[1..8]  hdr, log, idem, proj, draft, kids, lease, live of the target  ({prefix}:{id}:*)
-- KEYS[9..16] the same keys of the staged session
-- KEYS[17]    gone of the target: the create key of the life replaced is remembered there (SET), as
--             delete.lua remembers a deleted life's (a keyed create retried after it is refused)
-- ARGV[1]     the incarnation of the target the importer saw (another one is refused)
-- ARGV[2]     the target id (written into the header that moves)
-- ARGV[3]     the staged session's incarnation ("" = not known): a retry whose swap already
--             landed (a lost reply) finds the target holding it and answers 11
-- ARGV[4]     how long the replaced life's create key is remembered (ms)
--
-- The staged session was created expiring (a crashed import leaks nothing): the swap makes the
-- keys that move lasting and drops its ttl_ms. The caller unlinks the old session from its
-- parent (another slot) when it was a branch: unlink.lua, which purges a hidden parent whose
-- last branch this was.
--
-- Returns {0, old created_at, staged created_at, staged n, old parent or ""}
--                                                             swapped: the old session is gone
--         {3}                                                 the target is absent (or deleted)
--         {8}                                                 the target has another incarnation
--         {9}                                                 the target has live branches
--         {10}                                                the staged session is absent
--         {11, created_at, n}                                 already swapped (the target holds the
--                                                             staged incarnation, the staged id is gone)
local call = redis.call
local t = call('HMGET', KEYS[1], 'n', 'deleted', 'incarnation', 'created_at', 'parent', 'create_key')
if not t[1] or t[2] then return {3} end
local inc = t[3] or ('legacy-' .. (t[4] or '0'))
if ARGV[3] ~= '' and inc == ARGV[3] and call('EXISTS', KEYS[9]) == 0 then return {11, t[4] or '0', t[1]} end
if inc ~= ARGV[1] then return {8} end
if call('ZCARD', KEYS[6]) > 0 then return {9} end
local s = call('HMGET', KEYS[9], 'n', 'created_at', 'deleted')
if not s[1] or s[3] then return {10} end
if t[6] then call('SADD', KEYS[17], string.match(t[6], '^[^.]*')) end  -- the key's part
call('PEXPIRE', KEYS[17], ARGV[4])
call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
if call('EXISTS', KEYS[10]) == 1 then call('RENAME', KEYS[10], KEYS[2]) end
if call('EXISTS', KEYS[11]) == 1 then call('RENAME', KEYS[11], KEYS[3]) end
call('DEL', KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16])
call('RENAME', KEYS[9], KEYS[1])
call('HSET', KEYS[1], 'id', ARGV[2])
call('HDEL', KEYS[1], 'ttl_ms')
call('PERSIST', KEYS[1])
call('PERSIST', KEYS[2])
call('PERSIST', KEYS[3])
return {0, t[4] or '0', s[2] or '0', s[1], t[5] or ''}
