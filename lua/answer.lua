-- answer.lua: the one protocol of a streamed answer (begin / delta batch / beat / end), with its
-- rules kept here, so every writer (Session.stream, the gateway's answer routes and through them
-- the TypeScript client) shares them (docs/design.md, "Streamed answers").
--
-- KEYS[1..8] hdr, log, idem, proj, draft, kids, lease, live of the session ({prefix}:{id}:*)
-- KEYS[9]    state  HASH  {prefix}:{id}:live:<answer>  the answer's state (expires with it):
--                         inc (the life it began in), n (the log's n at its begin), ln (the log's
--                         n after its own last row: "nobody else wrote since"), live / log (the
--                         next delta index on the live stream / in the log), t (server ms of its
--                         last write or beat), bid (its begin's live id), tu / st (its begin's turn / step), e (the closing n, -1 for
--                         none, once ended), r (the end's reason), sz (its logged deltas' content
--                         cost: the bytes they add to the closing message, at most)
-- KEYS[10]   feed   optional change-feed shard (standalone servers only)
-- (and, named from KEYS[8] as the states are: {prefix}:{id}:live:+open  HASH  answer -> "<begin's
--  live id> <life>" of every answer begun and not ended, so an end finds the open begins its trim
--  must keep without scanning the live stream; "+" is in no answer id; it expires with the states)
--
-- ARGV[1] op          "begin" | "deltas" | "beat" | "end"
-- ARGV[2] answer      the answer id
-- ARGV[3] incarnation the life the writer holds ("" = the current one: begin only takes it as it
--                     is; every later op is checked against the life the answer began in anyway)
-- ARGV[4] ttl_ms      expiry of the state and the live stream (the grace, for end); capped by an
--                     ephemeral session's own ttl
-- ARGV[5] live_maxlen approximate MAXLEN of the live stream
--
-- begin  ARGV[6] turn ("" none), ARGV[7] step, ARGV[8] n ("" = the log's n now)
--        -> {0, n, bid, inc} new | {1, n, bid, inc} this answer already began (a retry)
-- deltas ARGV[6] first index, ARGV[7] count, ARGV[8] row data ("" = no log row: live only),
--        ARGV[9] the row's content cost (projection.chunks.deltas_cost), ARGV[10] the answer's
--        budget ("" = none): a row that would take the answer's cost over it is refused, so its
--        closing message always fits the entry limit, ARGV[11] number of live records (0 = log
--        only), then per record: its field count, fields (the script adds 'l' <life>); or 0, the
--        kind code ('t' | 'r'), "<answer> <index>", the text: a text or reasoning delta, written
--        as one field <code> -> "<answer> <index> <life> <text>" (a life with a space: as fields)
--        The log row must start at the answer's next logged index, the live records at (or
--        before: a retry) its next live index; whatever landed already is skipped, so a retried
--        or concurrent copy lands nowhere twice.
--        -> {0, log_next, live_next, row_n (-1 none)} | {1, log_next, live_next, rn} all there (rn:
--        the n of the answer's last row, -1 none: a retried row learns where it landed)
-- beat   -> {0} (the writer is alive: t and the expiries are refreshed)
-- end    ARGV[6] deltas (how many the answer has), ARGV[7] reason (committed | interrupted |
--        conflict), ARGV[8] expected ("" none | "answer": nobody else wrote since the answer's
--        own last row | "<n>"), ARGV[9] row first, ARGV[10] row count, ARGV[11] row data (""
--        none), ARGV[12] closing type ("" = no entry), ARGV[13] closing data, ARGV[14] closing
--        meta (""), ARGV[15] stale_ms ("" = any; else refused while the writer wrote or beat
--        less than stale_ms ago: repair), ARGV[16] feed_maxlen, ARGV[17] session id, ARGV[18]
--        the row's content cost, ARGV[19] the budget ("" = none: a repair closes what went live)
--        -> {0, closing_n (-1 none), now} | {1, closing_n, reason} ended already (a retry)
--
-- Refusals (nothing written):
--   {3} session not found      {8} another life (the session was replaced)
--   {9} no such answer (never begun, or expired)   {10, closing_n} the answer has ended
--   {11, expected_index} a batch not at the answer's next index
--   {12, logged, deltas} end: the log holds deltas [0, logged) and the end names `deltas`
--   {2, n} end: conflict (expected)   {13} end with stale_ms: the writer is alive
--   {14, first} a row at `first` landed with other deltas than this one (a key reused)
--   {6, last_id} the stream is ahead of the header (corrupt)
--   {15} begin: this answer began with another turn / step (an idempotency key reused)
--   {16, cost, budget, logged} the row would take the answer's content cost over its budget
--   {17, field} the header's `field` (n, ttl_ms) is not what redis-session writes (nothing written)
-- The checks come in one order for every op: the session, the life the caller pinned, the answer,
-- the answer's own life, its end, then the batch (index, digest, size), the count, the fence.
local call, fmt = redis.call, string.format
local op, answer, want_inc = ARGV[1], ARGV[2], ARGV[3]
local ttl = tonumber(ARGV[4])
local maxlen = ARGV[5]
local hdr, log, live, state = KEYS[1], KEYS[2], KEYS[8], KEYS[9]

local h = call('HMGET', hdr, 'n', 'deleted', 'ttl_ms', 'incarnation', 'created_at')
if not h[1] and call('EXISTS', hdr) == 1 then return {17, 'n'} end
if not h[1] or h[2] then return {3} end
-- header fields edited outside redis-session: refused before anything is written
local function bad_count(s)
  return not (s == '0' or string.find(s, '^[1-9]%d*$')) or #s > 16 or tonumber(s) > 9007199254740991
end
if bad_count(h[1]) then return {17, 'n'} end
if h[3] and (h[3] == '0' or bad_count(h[3])) then return {17, 'ttl_ms'} end
local cur = h[4] or ('legacy-' .. (h[5] or '0'))
if want_inc ~= '' and want_inc ~= cur then return {8} end
local n = tonumber(h[1])
local sttl = h[3]
if sttl and tonumber(sttl) < ttl then ttl = tonumber(sttl) end
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local open = live .. ':+open'

local function expire(ms)
  call('PEXPIRE', state, ms)
  call('PEXPIRE', live, ms)
  call('PEXPIRE', open, ms)
end

-- a log write restarts an ephemeral session's clock (as append.lua does)
local function touch()
  if sttl and call('ZCARD', KEYS[6]) == 0 then
    for k = 1, 6 do call('PEXPIRE', KEYS[k], sttl) end
  end
end

local function add_entry(at, typ, data, meta, time)
  local id = fmt('%d-1', at)
  local tm = time or fmt('%d', now)
  local ok
  if meta ~= '' then
    ok = redis.pcall('XADD', log, id, 'type', typ, 'time', tm, 'data', data, 'meta', meta)
  else
    ok = redis.pcall('XADD', log, id, 'type', typ, 'time', tm, 'data', data)
  end
  if type(ok) == 'table' and ok.err then
    if not string.find(ok.err, 'equal or smaller', 1, true) then return ok end
    local last = call('XREVRANGE', log, '+', '-', 'COUNT', 1)[1]
    return {6, last and last[1] or ok.err}
  end
  return nil
end

if op == 'begin' then
  local s = call('HMGET', state, 'inc', 'n', 'bid', 'tu', 'st')
  if s[1] == cur then
    -- a retry names the same turn and step (a keyed begin with another body is another request)
    if (s[4] or '') ~= ARGV[6] or (s[5] or '') ~= ARGV[7] then return {15} end
    return {1, tonumber(s[2]), s[3], cur}
  end
  -- an answer is committed to the log (and the feed) at its end: either of them no stream
  -- (edited outside redis-session) refuses it now, before its live records are written for nothing
  for _, key in ipairs({log, KEYS[10]}) do  -- the log, and the feed shard its end writes
    local t = call('TYPE', key)['ok']
    if t ~= 'none' and t ~= 'stream' then
      return redis.error_reply('WRONGTYPE the log of this session or its feed holds another kind of value than a stream')
    end
  end
  local at = n
  if ARGV[8] ~= '' then at = tonumber(ARGV[8]) end
  local f = {'a', answer, 'k', 'b'}
  if ARGV[6] ~= '' then f[#f + 1] = 'turn'; f[#f + 1] = ARGV[6] end
  if ARGV[7] ~= '' then f[#f + 1] = 'step'; f[#f + 1] = ARGV[7] end
  f[#f + 1] = 'n'; f[#f + 1] = fmt('%d', at)
  f[#f + 1] = 'inc'; f[#f + 1] = cur
  local bid = call('XADD', live, 'MAXLEN', '~', maxlen, '*', unpack(f))
  call('DEL', state)  -- a state of another life under this id (a keyed begin) is not this one
  call('HSET', open, answer, bid .. ' ' .. cur)
  call('HSET', state, 'inc', cur, 'n', fmt('%d', at), 'ln', fmt('%d', at), 'live', 0, 'log', 0,
    't', fmt('%d', now), 'bid', bid, 'tu', ARGV[6], 'st', ARGV[7])
  expire(ttl)
  return {0, at, bid, cur}
end

local s = call('HMGET', state, 'inc', 'live', 'log', 'e', 'ln', 't', 'r', 'rn', 'sz')
if not s[1] then return {9} end
if s[1] ~= cur then return {8} end
if s[4] and op ~= 'end' then return {10, tonumber(s[4])} end
local live_next, log_next, ln = tonumber(s[2]), tonumber(s[3]), tonumber(s[5])

if op == 'beat' then
  call('HSET', state, 't', fmt('%d', now))
  expire(ttl)
  return {0}
end

-- the log part of a batch: {write?, refusal}
local function row_rule(first, count, data)
  if data == '' then return false, nil end
  if first > log_next then return false, {11, log_next} end
  if first < log_next then
    if first + count > log_next then return false, {11, log_next} end  -- straddles what landed
    -- a retry of a row that landed: the same row (its digest), or another batch at that index
    if call('HGET', state, 'd' .. first) ~= redis.sha1hex(data) then return false, {14, first} end
    return false, nil
  end
  return true, nil
end

-- the answer's content cost once a row of `cost` lands: {cost after, refusal}
local function size_rule(write, cost, budget)
  local sz = tonumber(s[9] or '0')
  if not write then return sz, nil end
  sz = sz + tonumber(cost)
  if budget ~= '' and sz > tonumber(budget) then return sz, {16, sz, tonumber(budget), log_next} end
  return sz, nil
end

if op == 'deltas' then
  local first, count, data = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
  local nrec = tonumber(ARGV[11])
  local write_row, refused = row_rule(first, count, data)
  if refused then return refused end
  local sz
  sz, refused = size_rule(write_row, ARGV[9], ARGV[10])
  if refused then return refused end
  if nrec > 0 and first > live_next then return {11, live_next} end
  -- the live records first, then the row: a reader blocked on both streams is woken by the key
  -- written first, and a server that serves it that key alone (Redis 7.0) must hand it the
  -- deltas before the row that holds them; a row refused after them takes them back
  local sent, added = 0, {}
  if nrec > 0 then
    local p = 12
    local one = not string.find(cur, ' ', 1, true)  -- a life with a space never goes in one field
    for i = 0, nrec - 1 do
      local nf = tonumber(ARGV[p])
      if nf == 0 then
        -- a text or reasoning delta: its kind code, "<answer> <index>", its text; one field
        -- "<answer> <index> <life> <text>" (projection.chunks.compact_value)
        if first + i >= live_next then
          local code, head, text = ARGV[p + 1], ARGV[p + 2], ARGV[p + 3]
          if one then
            added[#added + 1] = call('XADD', live, 'MAXLEN', '~', maxlen, '*', code, head .. ' ' .. cur .. ' ' .. text)
          else
            local a, at = string.match(head, '^(%S+) (%d+)$')
            if code == 't' then
              added[#added + 1] = call('XADD', live, 'MAXLEN', '~', maxlen, '*', 'a', a, 'i', at, 't', text, 'l', cur)
            else
              added[#added + 1] = call('XADD', live, 'MAXLEN', '~', maxlen, '*', 'a', a, 'k', code, 'i', at, 't', text, 'l', cur)
            end
          end
          sent = sent + 1
        end
        p = p + 4
      else
        if first + i >= live_next then
          local f = {unpack(ARGV, p + 1, p + nf)}
          f[#f + 1] = 'l'; f[#f + 1] = cur  -- every record names the answer's life
          added[#added + 1] = call('XADD', live, 'MAXLEN', '~', maxlen, '*', unpack(f))
          sent = sent + 1
        end
        p = p + 1 + nf
      end
    end
    if first + nrec > live_next then live_next = first + nrec end
  end
  local row_n = -1
  if write_row then
    -- the row's time is its last live record's (a record's id may be a ms past the TIME this
    -- script began with): readers order by time, and a row never goes before its own deltas
    local tm = nil
    if #added > 0 then tm = string.match(added[#added], '^(%d+)') end
    local err = add_entry(n, 'assistant/chunk', data, '', tm)
    if err then
      if #added > 0 then call('XDEL', live, unpack(added)) end  -- nothing written
      return err
    end
    row_n = n
    if ln == n then ln = n + 1 end
    call('HSET', hdr, 'n', fmt('%d', n + 1), 'updated_at', fmt('%d', now))
    log_next = first + count
    touch()
  end
  if not write_row and sent == 0 then
    call('HSET', state, 't', fmt('%d', now))
    return {1, log_next, live_next, tonumber(s[8] or '-1')}
  end
  if write_row then
    call('HSET', state, 'live', live_next, 'log', log_next, 'ln', fmt('%d', ln), 't', fmt('%d', now),
      'rn', fmt('%d', row_n), 'd' .. first, redis.sha1hex(data), 'sz', fmt('%d', sz))
  else
    call('HSET', state, 'live', live_next, 't', fmt('%d', now))
  end
  -- live records push the expiries forward (a log-only row leaves that to the writer's live
  -- sends and heartbeats, but for the open answers' index, which those sends do not name)
  if nrec > 0 then expire(ttl) else call('PEXPIRE', open, ttl) end
  return {0, log_next, live_next, row_n}
end

if op == 'end' then
  if s[4] then return {1, tonumber(s[4]), s[7]} end
  local deltas = tonumber(ARGV[6])
  local reason, expected = ARGV[7], ARGV[8]
  local first, count, data = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
  local ctype, cdata, cmeta = ARGV[12], ARGV[13], ARGV[14]
  local write_row, refused = row_rule(first, count, data)
  if refused then return refused end
  local sz
  sz, refused = size_rule(write_row, ARGV[18], ARGV[19])
  if refused then return refused end
  local logged = log_next
  if write_row then logged = first + count end
  if logged ~= deltas then return {12, logged, deltas} end
  if ARGV[15] ~= '' and now - tonumber(s[6]) < tonumber(ARGV[15]) then return {13} end
  local mine = ln
  if write_row and ln == n then mine = n + 1 end
  local at = n
  if write_row then at = n + 1 end
  if expected == 'answer' then
    if mine ~= at then return {2, n} end
  elseif expected ~= '' then
    if tonumber(expected) ~= n then return {2, n} end
  end
  -- the feed shard and the live stream are written after the log: either holding another kind
  -- of value than a stream (edited outside redis-session) is refused before any write
  for _, key in ipairs({live, ctype ~= '' and KEYS[10] or nil}) do
    local t = call('TYPE', key)['ok']
    if t ~= 'none' and t ~= 'stream' then
      return redis.error_reply('WRONGTYPE a stream of this session or its feed holds another kind of value')
    end
  end
  if write_row then
    local err = add_entry(n, 'assistant/chunk', data, '')
    if err then return err end
    call('HSET', state, 'd' .. first, redis.sha1hex(data), 'sz', fmt('%d', sz))
  end
  local closing = -1
  if ctype ~= '' then
    local err = add_entry(at, ctype, cdata, cmeta)
    if err then return err end
    closing = at
    at = at + 1
  end
  if at ~= n then
    call('HSET', hdr, 'n', fmt('%d', at), 'updated_at', fmt('%d', now))
    touch()
  end
  if closing >= 0 and KEYS[10] then
    call('XADD', KEYS[10], 'MAXLEN', '~', ARGV[16], '*', 's', ARGV[17], 'n', fmt('%d', at))
  end
  local f = {'a', answer, 'k', 'e', 'i', fmt('%d', deltas), 'l', cur}
  if closing >= 0 then f[#f + 1] = 'n'; f[#f + 1] = fmt('%d', closing) end
  f[#f + 1] = 'r'; f[#f + 1] = reason
  call('XADD', live, 'MAXLEN', '~', maxlen, '*', unpack(f))
  call('HSET', state, 'log', fmt('%d', logged), 'e', fmt('%d', closing), 'r', reason, 't', fmt('%d', now))
  -- records older than the grace go (a reader away longer is told it missed them: a gap), but
  -- never from the begin of an answer still open on: the trim stops at the oldest such begin (the
  -- open answers' index names them; one counts while its state, in the session's hash slot, has
  -- this life and no end), so one answer's end never cuts another
  call('HDEL', open, answer)
  local cut_ms, cut_seq = now - ttl, 0
  local base = string.sub(state, 1, #state - #answer)
  local others = call('HGETALL', open)
  for i = 1, #others, 2 do
    local who, v = others[i], others[i + 1]
    local bid, life = string.match(v, '^(%S+) (%S+)$')
    local o = call('HMGET', base .. who, 'inc', 'e')
    if life ~= cur or o[1] ~= cur or o[2] then
      call('HDEL', open, who)  -- another life's, ended, or gone with its expiry
    else
      local ms, seq = string.match(bid, '^(%d+)-(%d+)$')
      ms, seq = tonumber(ms), tonumber(seq)
      if ms and (ms < cut_ms or (ms == cut_ms and seq < cut_seq)) then cut_ms, cut_seq = ms, seq end
    end
  end
  call('XTRIM', live, 'MINID', fmt('%d-%d', cut_ms, cut_seq))
  expire(ttl)
  return {0, closing, now}
end

return redis.error_reply('answer.lua: unknown op ' .. tostring(op))
