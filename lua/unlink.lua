-- unlink.lua: a branch is gone; drop it from its parent's `kids` and purge the parent if it
-- was hidden (deleted while branches still read it) and this was its last branch.
--
-- KEYS[1..8] hdr, log, idem, proj, draft, kids, lease, live of the PARENT  ({prefix}:{parent}:*)
-- ARGV[1]    the child's kids member ("<inverted created_at>:<child id>")
--
-- Returns {0, kids left, 1|0}                        parent kept (1: it is hidden or ephemeral, so a
--                                                    stale link among those left would keep it for nothing)
--         {1, grandparent or "", created_at or "0", incarnation or "", cold or ""}
--                                                    parent purged: its own parent must be unlinked in
--                                                    turn; created_at names the parent's member in the
--                                                    grandparent's kids; the caller deletes the archived
--                                                    segments `cold` names (as delete.lua's caller does)
redis.call('ZREM', KEYS[6], ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'deleted', 'parent', 'created_at', 'ttl_ms', 'incarnation', 'cold')
local left = redis.call('ZCARD', KEYS[6])
if left == 0 then
  if h[1] then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
    return {1, h[2] or '', h[3] or '0', h[5] or '', h[6] or ''}
  end
  if h[4] then  -- an ephemeral parent kept for its branches expires again
    for k = 1, 5 do redis.call('PEXPIRE', KEYS[k], h[4]) end
  end
end
return {0, left, (h[1] or h[4]) and 1 or 0}
