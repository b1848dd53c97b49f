-- draft.lua: set or clear the streaming assistant draft of a live session.
--
-- KEYS[1] hdr    {prefix}:{id}:hdr
-- KEYS[2] draft  {prefix}:{id}:draft   STRING (JSON)
-- ARGV[1] the draft as JSON, or "" to clear it
-- ARGV[2] the incarnation the writer means ("" or absent = any): another life of the id is
--         refused here, with the write, so a draft meant for a deleted session never lands in
--         the one that took its id (a header without one is "legacy-<created_at>")
--
-- Returns 1 done, 0 session not found (or deleted), 2 another incarnation (nothing written),
--         3 the header's ttl_ms is no positive count (edited outside redis-session; nothing written)
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'ttl_ms', 'incarnation', 'created_at')
if not h[1] or h[2] then return 0 end
if h[3] and (not string.find(h[3], '^[1-9]%d*$') or #h[3] > 15) then return 3 end
local inc = ARGV[2]
if inc and inc ~= '' and inc ~= (h[4] or ('legacy-' .. (h[5] or '0'))) then return 2 end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[2])
elseif h[3] then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', h[3])
else
  redis.call('SET', KEYS[2], ARGV[1])
end
return 1
