-- proj.lua: write a session's projection snapshot, only forward, only for its incarnation.
--
-- KEYS[1] hdr   {prefix}:{id}:hdr    (the session must exist; its TTL is copied)
-- KEYS[2] proj  {prefix}:{id}:proj   HASH  n (entries covered), state (JSON), updated_at,
--                                          incarnation (the header's, when it was written)
-- ARGV[1] n      the snapshot covers entries [0, n)
-- ARGV[2] state  the serialized ProjectionState
-- ARGV[3] incarnation  the incarnation the snapshot was folded from ("" = the current one)
--
-- Returns 1 written, 0 not newer than the stored snapshot (two workers never move it backwards
-- or apply a batch twice), -1 session not found (or deleted), -2 n beyond the header's n,
-- -3 the session has another incarnation (deleted and created again while the fold ran)
local h = redis.call('HMGET', KEYS[1], 'n', 'deleted', 'ttl_ms', 'incarnation', 'created_at')
if not h[1] or h[2] then return -1 end
local inc = h[4] or ('legacy-' .. (h[5] or '0'))
if ARGV[3] and ARGV[3] ~= '' and ARGV[3] ~= inc then return -3 end
local n = tonumber(ARGV[1])
if n > tonumber(h[1]) then return -2 end
-- A stored n that is not a number, beyond the header (written around the API), or of another
-- incarnation (or none: written before incarnations) is no snapshot: it must never block the
-- next honest write.
local cur = redis.call('HMGET', KEYS[2], 'n', 'incarnation')
local cur_n = tonumber(cur[1])
if cur_n and cur[2] == inc and cur_n >= n and cur_n <= tonumber(h[1]) then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[2], 'n', ARGV[1], 'state', ARGV[2], 'incarnation', inc,
           'updated_at', string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
if h[3] then redis.call('PEXPIRE', KEYS[2], h[3]) end
return 1
