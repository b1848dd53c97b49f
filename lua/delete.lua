-- delete.lua: delete one session, or hide it (a tombstone) while live branches still read it.
--
-- KEYS[1..8] hdr, log, idem, proj, draft, kids, lease, live of the session  ({prefix}:{id}:*)
-- KEYS[9]    gone: the create keys of deleted lives (SET; kept ARGV[2] ms after the last delete)
-- ARGV[1]    the incarnation to delete, or "" (whichever is current)
-- ARGV[2]    how long the life's create key is remembered (ms)
--
-- Returns {0}                                  absent (or already hidden)
--         {3, incarnation}                      another life than ARGV[1]: nothing deleted
--         {1, created_at}                       hidden: its branches keep reading its entries
--         {2, created_at, parent or "", incarnation or "", cold or ""}
--                                               deleted: every key gone (the caller deletes the
--                                               archived segments `cold` names, else the sweep does)
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'created_at', 'parent', 'incarnation', 'cold', 'create_key')
-- absent, or hidden already; a header without its n (edited outside redis-session) is deleted too
if h[2] or (not h[1] and redis.call('EXISTS', KEYS[1]) == 0) then return {0} end
if ARGV[1] and ARGV[1] ~= '' then
  local inc = h[5] or ('legacy-' .. (h[3] or ''))
  if inc ~= ARGV[1] then return {3, inc} end
end
-- a keyed create of this life, retried after its reply was lost, must not make it again
-- (append.lua refuses a create whose key is here): remembered first, so a refused DEL (ACL)
-- leaves at worst a key remembered for a session still there, never a deleted one forgotten
-- (every delete of the id restarts the clock: each key is remembered ARGV[2] ms after the last one)
if h[7] then redis.call('SADD', KEYS[9], string.match(h[7], '^[^.]*')) end  -- the key's part
redis.call('PEXPIRE', KEYS[9], ARGV[2])
if redis.call('ZCARD', KEYS[6]) > 0 then
  -- the tombstone is written last: a Redis user refused a DEL or PERSIST here (ACL) leaves the
  -- session visible, never hidden with half its keys
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[7], KEYS[8])
  redis.call('PERSIST', KEYS[2])
  redis.call('PERSIST', KEYS[1])
  redis.call('HSET', KEYS[1], 'deleted', '1')
  return {1, h[3]}
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
return {2, h[3], h[4] or '', h[5] or '', h[6] or ''}
