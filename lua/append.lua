-- append.lua: create a session and/or append a batch of entries, atomically, in one slot.
--
-- KEYS[1] hdr    HASH    {prefix}:{id}:hdr   header fields, n, updated_at, last_cut
-- KEYS[2] log    STREAM  {prefix}:{id}:log   entry n at ID "<n>-1"
-- KEYS[3] idem   ZSET    {prefix}:{id}:idem  idempotency key -> first_n * 65536 + batch length, and
--                                            "<key>\0<digest>" at the same score (the batch it names)
-- KEYS[4..7]     proj, draft, kids, lease    (only touched to refresh a session TTL)
-- KEYS[8] live   STREAM  {prefix}:{id}:live  streamed answers in flight (deleted on create; an
--                                            ephemeral session's TTL caps its expiry)
-- KEYS[9] gone   SET     {prefix}:{id}:gone  the keys of deleted lives' create keys (delete.lua,
--                                            swap.lua: the part before "."): a create with one is refused
-- KEYS[10] feed  STREAM  optional change-feed shard (standalone servers only: another slot)
--
-- ARGV[1] mode         "append" | "create"
-- ARGV[2] expected_n   "" = append at the end whatever n is
-- ARGV[3] idem         "" = none, else "<window>:<digest>:<key>": keep the last <window> keys;
--                      <digest> (hex) identifies the batch, so a key reused for another one is refused
-- ARGV[4] count        number of entries in the batch
-- ARGV[5] feed_maxlen  approximate MAXLEN of the feed shard
-- ARGV[6] session_id   written to the feed
-- ARGV[7] ttl_ms       create only: "" = no expiry
-- ARGV[8] nhdr         create only: number of header field/value pairs (after ARGV[9])
-- ARGV[9] incarnation  append only: the incarnation the writer saw ("" = any); another one is
--                      refused. A header without one (older) has "legacy-<created_at>"
-- ARGV[10 .. 9+2*nhdr] create only: header fields ("created_at" "" = server time); "at" gives
--                      first n; "incarnation" (fresh per create) is one of them
-- then per entry, 6 values: type, time ("" = server time), data, meta (""), surface (""),
--                            bound ("" = none): the largest n the entry refers to, exclusive (a cut's
--                            before; a surface's max(sourceEventSeqs) + 1 and a replace's end + 1);
--                            it must not exceed the entry's own n
--                  or 3 values: type, time, data, when no entry of the batch has meta, surface or a
--                            bound (the layout is read off the number of ARGV: fewer arguments are
--                            the cheapest server time an append can save)
--
-- The short layout (a plain append: no idempotency key, no meta, surface or bound; the client
-- picks it, and the number of KEYS tells it apart):
-- KEYS[1] hdr, KEYS[2] log, KEYS[3] feed (optional, standalone only)
-- ARGV[1] expected_n ("" = any), ARGV[2] incarnation ("" = any), with a feed ARGV[3] session_id
--         and ARGV[4] feed_maxlen; then 3 values per entry: type, time ("" = server time), data.
-- It does what the long layout does for such a batch, in the fewest calls: the feed XADD comes
-- first and its entry ID ("<ms>-<seq>", the server's clock) is the batch's time, instead of a
-- TIME call; a batch that gives no hint (chunk rows only), or a server without the feed, asks
-- TIME. An ephemeral session (a header with ttl_ms) answers {9}: its TTL refresh needs every key,
-- so the client sends the batch again in the long layout (nothing was written).
--
-- Returns {0, first_n, now_ms}             written
--         {1, first_n, count}               idempotent retry: that batch (count entries) already landed
--         {2, actual_n}                     conflict: header n ~= expected_n
--         {3}                               session not found (or deleted)
--         {4, index, own_n}                 entry `index` refers beyond its own n (its bound)
--         {5}                               create: the session already exists
--         {6, last_id}                      the stream is ahead of the header (corrupt; nothing written)
--         {7}                               the idempotency key landed a different batch (nothing written)
--         {8}                               the session has another incarnation (it was replaced)
--         {9}                               short layout only: the session is ephemeral (use the long one)
--         {10}                              create: its create key made a session that was deleted since
--         {11, field}                       the header's `field` (n, ttl_ms) is not what redis-session writes

-- The hot path (a plain append, the short layout) is kept to four redis.call()s: HMGET, the feed
-- XADD (trimmed on every 32nd n only: an approximate trim frees whole nodes, so asking on each
-- append costs time and frees nothing more), XADD and HSET; the long layout adds TIME. Numbers are
-- formatted once (an n below 2^53 prints exactly with %d).
local call, fmt = redis.call, string.format

-- A header field edited outside redis-session (an n that is no count, a ttl_ms that is no
-- positive duration) is refused before anything is written: {11, field}. Used as it is, it failed
-- the script half-way with rows written, or expired the session's keys at once. A count is what
-- the scripts write: digits, no leading zero, at most 2^53 - 1.
if #KEYS < 8 then
  -- the short layout (see above): HMGET, the feed XADD (else TIME), XADD, HSET
  local hdr, log, feed = KEYS[1], KEYS[2], KEYS[3]
  local h = call('HMGET', hdr, 'n', 'deleted', 'ttl_ms', 'incarnation')
  local ns = h[1]
  if not ns and call('EXISTS', hdr) == 1 then return {11, 'n'} end
  if not ns or h[2] then return {3} end
  local n = tonumber(ns)
  if not string.find(ns, '^%d+$') or #ns > 16 or n > 9007199254740991 or (#ns > 1 and string.byte(ns) == 48) then
    return {11, 'n'}
  end
  local inc = ARGV[2]
  if inc ~= '' and inc ~= (h[4] or ('legacy-' .. (call('HGET', hdr, 'created_at') or '0'))) then return {8} end
  if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= n then return {2, n} end
  if h[3] then return {9} end
  local base = feed and 5 or 3
  local count = (#ARGV - base + 1) / 3
  local new_n_s = fmt('%d', n + count)
  local hint = false  -- a batch of chunk rows only changes no projection: no feed hint for it
  for i = 0, count - 1 do
    if ARGV[base + 3 * i] ~= 'assistant/chunk' then hint = true; break end
  end
  local now_s, fid
  if feed and hint then
    if (n + count) % 32 < count then
      fid = call('XADD', feed, 'MAXLEN', '~', ARGV[4], '*', 's', ARGV[3], 'n', new_n_s)
    else
      fid = call('XADD', feed, '*', 's', ARGV[3], 'n', new_n_s)
    end
    now_s = string.sub(fid, 1, string.find(fid, '-', 1, true) - 1)
  else
    local t = call('TIME')
    now_s = fmt('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  end
  local last_cut = nil
  for i = 0, count - 1 do
    local p = base + 3 * i
    local typ, tm = ARGV[p], ARGV[p + 1]
    if tm == '' then tm = now_s end
    if i == 0 then
      -- the consistency check, as below; the feed entry written first is taken back
      local ok = redis.pcall('XADD', log, ns .. '-1', 'type', typ, 'time', tm, 'data', ARGV[p + 2])
      if type(ok) == 'table' and ok.err then
        if fid then call('XDEL', feed, fid) end
        if not string.find(ok.err, 'equal or smaller', 1, true) then return ok end
        local last = call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
        return {6, last and last[1] or ok.err}
      end
    else
      call('XADD', log, fmt('%d-1', n + i), 'type', typ, 'time', tm, 'data', ARGV[p + 2])
    end
    if typ == 'cut' then last_cut = n + i end
  end
  if last_cut then
    call('HSET', hdr, 'n', new_n_s, 'updated_at', now_s, 'last_cut', fmt('%d', last_cut))
  else
    call('HSET', hdr, 'n', new_n_s, 'updated_at', now_s)
  end
  return {0, n, now_s}
end

local function bad_count(s)
  return not (s == '0' or string.find(s, '^[1-9]%d*$')) or #s > 16 or tonumber(s) > 9007199254740991
end

local hdr, log, idem = KEYS[1], KEYS[2], KEYS[3]
local mode, expected = ARGV[1], ARGV[2]
local idem_key, digest, window = '', '', 0
if ARGV[3] ~= '' then
  local w, d, k = string.match(ARGV[3], '^(%d+):(%x+):(.*)$')
  idem_key, digest, window = k, d, tonumber(w)
end
local count = tonumber(ARGV[4])
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = fmt('%d', now)
local n, ttl
local base

-- The feed shard is written after the log here: holding another kind of value than a stream
-- (edited outside redis-session), it would fail the script half-way with the entries written.
-- Refused before any write instead (the idempotency set is read before any write already).
if KEYS[10] then
  local t = call('TYPE', KEYS[10])['ok']
  if t ~= 'none' and t ~= 'stream' then
    return redis.error_reply('WRONGTYPE the change feed shard holds another kind of value than a stream')
  end
end

if mode == 'create' then
  local nhdr = tonumber(ARGV[8])
  -- a create key of a life that ended (deleted, or replaced by an import) is refused first: its
  -- retry must say so whether the id is free now or another life holds it
  for i = 0, nhdr - 1 do
    -- the key's part of it (before "."): the same key with another request body is refused too
    if ARGV[10 + 2 * i] == 'create_key' and call('SISMEMBER', KEYS[9], string.match(ARGV[11 + 2 * i], '^[^.]*')) == 1 then
      return {10}
    end
  end
  if call('EXISTS', hdr) == 1 then return {5} end
  local fields = {}
  n = 0
  for i = 0, nhdr - 1 do
    local k, v = ARGV[10 + 2 * i], ARGV[11 + 2 * i]
    if k == 'created_at' and v == '' then v = now_s end
    if k == 'at' then n = tonumber(v) end
    fields[#fields + 1] = k
    fields[#fields + 1] = v
  end
  -- leftovers of an expired or half-purged session must not leak into the new one
  call('DEL', log, idem, KEYS[4], KEYS[5], KEYS[7], KEYS[8])
  ttl = ARGV[7]
  if ttl ~= '' then fields[#fields + 1] = 'ttl_ms'; fields[#fields + 1] = ttl end
  fields[#fields + 1] = 'n'; fields[#fields + 1] = fmt('%d', n)
  fields[#fields + 1] = 'updated_at'; fields[#fields + 1] = now_s
  call('HSET', hdr, unpack(fields))
  base = 10 + 2 * nhdr
else
  local h = call('HMGET', hdr, 'n', 'deleted', 'ttl_ms', 'incarnation')
  if not h[1] and call('EXISTS', hdr) == 1 then return {11, 'n'} end
  if not h[1] or h[2] then return {3} end
  if bad_count(h[1]) then return {11, 'n'} end
  if h[3] and (h[3] == '0' or bad_count(h[3])) then return {11, 'ttl_ms'} end
  local inc = ARGV[9]
  if inc ~= '' and inc ~= (h[4] or ('legacy-' .. (call('HGET', hdr, 'created_at') or '0'))) then return {8} end
  n = tonumber(h[1])
  ttl = h[3] or ''
  base = 10
  if idem_key ~= '' then
    local first = call('ZSCORE', idem, idem_key)
    if first then
      if not call('ZSCORE', idem, idem_key .. '\0' .. digest) then
        -- another digest at that score: the key was reused for another batch (a key written
        -- before digests were kept has none and is taken as a retry)
        for _, m in ipairs(call('ZRANGEBYSCORE', idem, first, first)) do
          if m ~= idem_key then return {7} end
        end
      end
      first = tonumber(first)
      return {1, math.floor(first / 65536), first % 65536}
    end
  end
  if expected ~= '' and tonumber(expected) ~= n then return {2, n} end
end

local stride = 6
if count > 0 and #ARGV - base + 1 == 3 * count then stride = 3 end
if stride == 6 then
  for i = 0, count - 1 do
    local b = ARGV[base + 6 * i + 5]
    if b ~= '' and tonumber(b) > n + i then return {4, i, n + i} end
  end
end

local last_cut = nil
local hint = false  -- a batch of chunk rows only changes no projection: no feed hint for it
for i = 0, count - 1 do
  local p = base + stride * i
  local typ, tm, meta, surface = ARGV[p], ARGV[p + 1], '', ''
  if stride == 6 then meta, surface = ARGV[p + 3], ARGV[p + 4] end
  if typ ~= 'assistant/chunk' then hint = true end
  if tm == '' then tm = now_s end
  local id = fmt('%d-1', n + i)
  local ok
  if i == 0 then
    -- The first XADD is the consistency check: XADD refuses an ID at or below the stream's last
    -- one, which only happens when the stream is ahead of the header. Nothing is written then.
    if meta == '' and surface == '' then
      ok = redis.pcall('XADD', log, id, 'type', typ, 'time', tm, 'data', ARGV[p + 2])
    else
      local f = {'type', typ, 'time', tm, 'data', ARGV[p + 2]}
      if meta ~= '' then f[#f + 1] = 'meta'; f[#f + 1] = meta end
      if surface ~= '' then f[#f + 1] = 'surface'; f[#f + 1] = surface end
      ok = redis.pcall('XADD', log, id, unpack(f))
    end
    if type(ok) == 'table' and ok.err then
      if not string.find(ok.err, 'equal or smaller', 1, true) then return ok end  -- e.g. an ACL refusal
      local last = call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
      return {6, last and last[1] or ok.err}
    end
  elseif meta == '' and surface == '' then
    call('XADD', log, id, 'type', typ, 'time', tm, 'data', ARGV[p + 2])
  else
    local f = {'type', typ, 'time', tm, 'data', ARGV[p + 2]}
    if meta ~= '' then f[#f + 1] = 'meta'; f[#f + 1] = meta end
    if surface ~= '' then f[#f + 1] = 'surface'; f[#f + 1] = surface end
    call('XADD', log, id, unpack(f))
  end
  if typ == 'cut' then last_cut = n + i end
end

local new_n = n + count
local new_n_s = fmt('%d', new_n)
if mode ~= 'create' then
  if count > 0 then
    if last_cut then
      call('HSET', hdr, 'n', new_n_s, 'updated_at', now_s, 'last_cut', fmt('%d', last_cut))
    else
      call('HSET', hdr, 'n', new_n_s, 'updated_at', now_s)
    end
  end
else
  if last_cut then
    call('HSET', hdr, 'n', new_n_s, 'last_cut', fmt('%d', last_cut))
  elseif count > 0 then
    call('HSET', hdr, 'n', new_n_s)
  end
end

if idem_key ~= '' and count > 0 then
  local score = n * 65536 + count
  call('ZADD', idem, score, idem_key, score, idem_key .. '\0' .. digest)
  call('ZREMRANGEBYRANK', idem, 0, -2 * window - 1)
end

-- An ephemeral session's keys expire together; every write restarts the clock. The lease keeps
-- its own (shorter) expiry, and a session with live branches is kept for them (see link.lua).
-- Kept for branches, it reports how many (the client checks whether they still live: a branch
-- that expired never unlinks itself).
local kept = 0
if ttl ~= '' then
  kept = call('ZCARD', KEYS[6])
end
if ttl ~= '' and kept == 0 then
  for k = 1, 6 do call('PEXPIRE', KEYS[k], ttl) end
  -- the live stream keeps its own short expiry; it never outlives the session
  local live_ttl = call('PTTL', KEYS[8])
  if live_ttl == -1 or live_ttl > tonumber(ttl) then call('PEXPIRE', KEYS[8], ttl) end
end

if KEYS[10] and hint then
  if new_n % 32 < count then
    call('XADD', KEYS[10], 'MAXLEN', '~', ARGV[5], '*', 's', ARGV[6], 'n', new_n_s)
  else
    call('XADD', KEYS[10], '*', 's', ARGV[6], 'n', new_n_s)
  end
end

return {0, n, now, kept}
