-- link.lua: step one of a branch, in the PARENT's slot: check the parent and the branch point,
-- and record the child in the parent's `kids` (so deleting the parent keeps what the child reads).
--
-- KEYS[1] hdr   {prefix}:{parent}:hdr
-- KEYS[2] kids  {prefix}:{parent}:kids
-- KEYS[3..6] log, idem, proj, draft of the parent: an ephemeral parent stops expiring while it
--            has branches (they read its entries); unlink.lua restores its TTL after the last one
-- ARGV[1] at    the branch point (0 <= at <= parent n)
-- ARGV[2] the child's kids member ("<inverted created_at>:<child id>")
-- ARGV[3] the parent's incarnation the branch was decided on ("" or absent = any): a parent
--         deleted and created again since is refused here, atomically with the link (once
--         linked, a delete only hides the parent, so its id cannot take another life meanwhile)
--
-- Returns {0, added (1|0), parent_at or "", segments or "", delegation_depth, ttl_ms or ""}   linked
--         {3}                       parent not found (or deleted)
--         {4, n}                    at is beyond the parent's n
--         {8, incarnation}          the parent is another incarnation than ARGV[3]: not linked
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'at', 'segments', 'delegation_depth', 'ttl_ms',
  'incarnation', 'created_at')
if not h[1] or h[2] then return {3} end
local inc = ARGV[3]
if inc and inc ~= '' then
  local cur = h[7] or ('legacy-' .. (h[8] or '0'))
  if inc ~= cur then return {8, cur} end
end
-- the parent's n and ttl_ms as the scripts write them, else none is made (a header edited outside
-- redis-session: the client reads the error as the corruption one, nothing linked)
if not string.find(h[1], '^%d+$') or #h[1] > 16 or (h[6] and not string.find(h[6], '^[1-9]%d*$')) then
  return redis.error_reply('WRONGTYPE the header of the parent holds an n or ttl_ms that is no count')
end
if tonumber(ARGV[1]) > tonumber(h[1]) then return {4, tonumber(h[1])} end
-- the branch reads the parent's log: one that is no stream (edited outside redis-session) makes
-- a branch every read of which fails, so none is made
local lt = redis.call('TYPE', KEYS[3])['ok']
if lt ~= 'none' and lt ~= 'stream' then
  return redis.error_reply('WRONGTYPE the log of the parent holds another kind of value than a stream')
end
local added = redis.call('ZADD', KEYS[2], 0, ARGV[2])
if h[6] then
  for k = 1, #KEYS do redis.call('PERSIST', KEYS[k]) end
end
return {0, added, h[3] or '', h[4] or '', h[5] or '0', h[6] or ''}
