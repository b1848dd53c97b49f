-- proj.lua: write a session's projection snapshot, only forward.
--
-- KEYS[1] hdr   {prefix}:{id}:hdr    (the session must exist; its TTL is copied)
-- KEYS[2] proj  {prefix}:{id}:proj   HASH  n (entries covered), state (JSON), updated_at
-- ARGV[1] n      the snapshot covers entries [0, n)
-- ARGV[2] state  the serialized ProjectionState
--
-- Returns 1 written, 0 not newer than the stored snapshot (two workers never move it backwards
-- or apply a batch twice), -1 session not found (or deleted), -2 n beyond the header's n
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'ttl_ms')
if not h[1] or h[2] then return -1 end
local n = tonumber(ARGV[1])
if n > tonumber(h[1]) then return -2 end
-- A stored n that is not a number, or beyond the header (written around the API), is no
-- snapshot: it must never block the next honest write.
local cur = tonumber(redis.call('HGET', KEYS[2], 'n'))
if cur and cur >= n and cur <= tonumber(h[1]) then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], 'n', ARGV[1], 'state', ARGV[2],
           'updated_at', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
if h[3] then redis.call('PEXPIRE', KEYS[2], h[3]) end
return 1
