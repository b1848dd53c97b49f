-- lease.lua: the writer lease of a session (one agent pod holds a turn at a time).
--
-- KEYS[1] hdr    {prefix}:{id}:hdr
-- KEYS[2] lease  {prefix}:{id}:lease   STRING token, with a PX expiry
-- ARGV[1] op     "acquire" (also renews a lease this token holds) | "release"
-- ARGV[2] token
-- ARGV[3] ttl_ms (acquire only)
-- ARGV[4] the incarnation the holder means ("" or absent = any; acquire only): a handle of an
--         earlier life of the id never holds the lease of the life that took its id
--
-- Returns 1 held / released, 0 held by another token (acquire) or not ours (release),
--         -1 session not found (or deleted), -2 another incarnation (acquire: nothing set)
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'incarnation', 'created_at')
if not h[1] or h[2] then return -1 end
local cur = redis.call('GET', KEYS[2])
if ARGV[1] == 'acquire' then
  local inc = ARGV[4]
  if inc and inc ~= '' and inc ~= (h[3] or ('legacy-' .. (h[4] or '0'))) then return -2 end
  if cur and cur ~= ARGV[2] then return 0 end
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return 1
end
if cur == ARGV[2] then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
