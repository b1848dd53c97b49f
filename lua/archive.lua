-- archive.lua: move an archived range out of the hot stream (archive), or bring every archived
-- entry back into it (restore). One slot; the header's `cold` field lists the archived segments.
--
-- KEYS[1] hdr      HASH    {prefix}:{id}:hdr
-- KEYS[2] log      STREAM  {prefix}:{id}:log
-- KEYS[3] restore  STREAM  {prefix}:{id}:restore:<token>  restore only: this restore's staged
--                          archived entries (PEXPIRE'd by the caller: a dead restorer's vanish)
-- KEYS[4] pending  ZSET    {prefix}:{id}:coldpending  archive only: the uploads not yet committed
--
-- ARGV[1] mode         "archive" | "restore"
-- ARGV[2] incarnation  the life the archiver read: another one is refused
-- ARGV[3] cold         the header's `cold` field as the archiver read it ("" = none); it must be
--                      unchanged (compare-and-set: two archivers never both commit one range)
-- archive: ARGV[4] the new `cold` field (ARGV[3]'s list plus the segment [lo, hi) just written,
--          read back and verified), ARGV[5] lo, ARGV[6] hi; entries [lo, hi) leave the stream;
--          ARGV[7] the object's name in KEYS[4]: it must still be pending (a sweep that released
--          it may delete the object), and is pending no more
-- restore: ARGV[4] hot start (the end of the archived range), ARGV[5] own start (the branch
--          point): KEYS[3] must hold exactly the entries [own start, hot start)
--
-- Returns {0, entries moved}     done
--         {3}                    session not found (or deleted)
--         {8}                    the session has another incarnation (replaced)
--         {9}                    the `cold` field changed meanwhile (another archiver or a restore)
--         {2, n}                 hi is beyond the header's n
--         {10, id or ""}         the hot stream does not hold [lo, hi) (archive) or the staged
--                                stream does not end at hot start (restore): nothing changed
--         {11}                   the upload is pending no more (a sweep released it): nothing changed
local call = redis.call
local h = call('HMGET', KEYS[1], 'n', 'deleted', 'incarnation', 'created_at', 'cold')
if not h[1] or h[2] then return {3} end
if ARGV[2] ~= (h[3] or ('legacy-' .. (h[4] or '0'))) then return {8} end
if (h[5] or '') ~= ARGV[3] then return {9} end

if ARGV[1] == 'archive' then
  local lo, hi = tonumber(ARGV[5]), tonumber(ARGV[6])
  if hi > tonumber(h[1]) then return {2, tonumber(h[1])} end
  local first = call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)[1]
  if not first or first[1] ~= string.format('%d-1', lo) then return {10, first and first[1] or ''} end
  local last_id = string.format('%d-1', hi - 1)
  if not call('XRANGE', KEYS[2], last_id, last_id)[1] then return {10, ''} end
  if call('ZREM', KEYS[4], ARGV[7]) == 0 then return {11} end
  -- the header names the segment before the entries leave: never neither
  call('HSET', KEYS[1], 'cold', ARGV[4])
  local removed = call('XTRIM', KEYS[2], 'MINID', string.format('%d-1', hi))
  -- XTRIM frees whole stream nodes only: the entries it takes from a node that keeps others
  -- still hold their memory. A short hot tail is rewritten compactly (same IDs and fields).
  local left = call('XLEN', KEYS[2])
  if left <= 100 then
    local rows = call('XRANGE', KEYS[2], '-', '+')
    call('DEL', KEYS[2])
    for _, row in ipairs(rows) do call('XADD', KEYS[2], row[1], unpack(row[2])) end
  end
  return {0, removed}
end

-- restore: the staged archived entries, then the hot ones, become the stream. The staged stream
-- must hold exactly [own start, hot start): its IDs only increase, so its length, first and last
-- IDs prove it (a restore never renames a stream with a hole onto the log)
local hot, own = tonumber(ARGV[4]), tonumber(ARGV[5])
local first = call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)[1]
local last = call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
if not first or first[1] ~= string.format('%d-1', own) or last[1] ~= string.format('%d-1', hot - 1)
    or call('XLEN', KEYS[3]) ~= hot - own then
  return {10, last and last[1] or ''}
end
local rows = call('XRANGE', KEYS[2], '-', '+')
for _, row in ipairs(rows) do call('XADD', KEYS[3], row[1], unpack(row[2])) end
call('RENAME', KEYS[3], KEYS[2])
call('PERSIST', KEYS[2])  -- the staging stream's expiry must not follow it onto the log
call('HDEL', KEYS[1], 'cold')
return {0, #rows}
