-- draft.lua: set or clear the streaming assistant draft of a live session.
--
-- KEYS[1] hdr    {prefix}:{id}:hdr
-- KEYS[2] draft  {prefix}:{id}:draft   STRING (JSON)
-- ARGV[1] the draft as JSON, or "" to clear it
--
-- Returns 1 done, 0 session not found (or deleted)
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'ttl_ms')
if not h[1] or h[2] then return 0 end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[2])
elseif h[3] then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', h[3])
else
  redis.call('SET', KEYS[2], ARGV[1])
end
return 1
